"""The SGLang rollout fleet of an RL run (`rollout.engine='sglang'`): the trainer owns the servers, workers attach.

Weight sync: at every publish the trainer writes the policy as a Hugging Face checkpoint (`interop.hf.save`, in
`workdir/hf/v<version>`) and the fleet loads it with `/update_weights_from_disk`, one server at a time so the others
keep serving. Every sample carries the weight version of the server that produced it, so staleness is exact.
`workdir/fleet.json` holds the server URLs and the served version and checkpoint; worker processes attach to those
servers (`attach`) and never start or stop them. A server that dies is replaced by the trainer's fleet
(`SGLangFleet.heal`, at every publish); the next publish lists the replacement in `fleet.json`, and workers re-read
the list before each group (`Follower.load_newer`), so the fleet shrinks and regrows under them. The servers run in
their own process groups and are stopped by `FleetPublisher.close()` (and at the trainer's exit).
"""
from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import signal
import sys
import time

from composer_jax.interop import hf
from composer_jax.parallel import distributed
from composer_jax.rl import processes
from composer_jax.rl.config import RunConfig
from composer_jax.rl.follower import Follower
from rollout.engines.sglang_fleet import FleetConfig, RemoteServer, SGLangFleet
from rollout.engines.sglang_launcher import ServerConfig

FLEET_FILE = "fleet.json"
KEEP_CHECKPOINTS = 2   # the served one and the one before (a server still loading it)


def server_config(cfg: RunConfig, model_path: str, version: int) -> ServerConfig:
  """One server of the run's fleet: float32 on CPU, routing logged for router replay, KV cache for a few groups."""
  r = cfg.rollout
  return ServerConfig(model_path=model_path, device=r.sglang.device, weight_version=version, random_seed=cfg.seed,
                      max_total_tokens=max(4096, 2 * r.samples_per_prompt * cfg.harness.context_budget),
                      max_running_requests=max(8, 2 * r.samples_per_prompt),
                      python=r.sglang.python or sys.executable)


def _hf_dir(cfg: RunConfig) -> str:
  return os.path.join(os.path.abspath(cfg.workdir), "hf")


def export(cfg: RunConfig, params, version: int) -> str:
  """Writes `params` as a Hugging Face checkpoint `workdir/hf/v<version>` (complete before it appears).

  From the params as the trainer holds them: each process writes the tensors its own devices hold (`hf.save`), so
  nothing is gathered to one host; in a multi-process run every process calls this, and process 0 renames.
  """
  path = os.path.join(_hf_dir(cfg), f"v{version}")
  tmp = path + ".tmp"
  if distributed.is_primary():
    for p in (tmp, path):
      shutil.rmtree(p, ignore_errors=True)
  distributed.barrier(f"hf_export_v{version}_start")
  hf.save(tmp, cfg.model, params)
  distributed.barrier(f"hf_export_v{version}_written")
  if distributed.is_primary():
    os.replace(tmp, path)
  return path


def _prune(cfg: RunConfig, keep: int, current: int) -> None:
  """Deletes all exports but the newest `keep` and the served `current` one (as `weight_files.publish` prunes)."""
  versions = sorted(int(n[1:]) for n in os.listdir(_hf_dir(cfg)) if n.startswith("v") and n[1:].isdigit())
  for v in versions[:-keep]:
    if v == current:
      continue
    shutil.rmtree(os.path.join(_hf_dir(cfg), f"v{v}"), ignore_errors=True)


def _read_state(workdir: str) -> dict | None:
  """The contents of `fleet.json` (None before a trainer started its fleet)."""
  try:
    with open(os.path.join(workdir, FLEET_FILE)) as f:
      return json.load(f)
  except FileNotFoundError:
    return None


def _stop_orphans(workdir: str) -> None:
  """Stops the servers a killed trainer of this run left behind (its `fleet.json` lists their process groups)."""
  state = _read_state(workdir)
  if state is None:
    return
  os.remove(os.path.join(workdir, FLEET_FILE))   # workers must not attach to the old servers
  for pgid in state.get("pgids", []):
    with contextlib.suppress(OSError), open(f"/proc/{pgid}/cmdline", "rb") as f:
      if b"sglang" in f.read():   # still that server, not a reused pid
        os.killpg(pgid, signal.SIGKILL)


def _write_state(workdir: str, state: dict) -> None:
  path = os.path.join(workdir, FLEET_FILE)
  with open(path + ".tmp", "w") as f:
    json.dump(state, f)
  os.replace(path + ".tmp", path)


class FleetPublisher:
  """The `fleet` publisher: starts the fleet on the starting policy and pushes each published policy to it."""

  def __init__(self, cfg: RunConfig, params, version: int, log_fn=print):
    """Across processes, every process writes its tensors of each export; process 0 alone runs the fleet (the
    others' `fleet` and `engine` are None)."""
    self.cfg, self.version = cfg, version

    def clean():
      python = cfg.rollout.sglang.python or sys.executable
      if python == sys.executable and importlib.util.find_spec("sglang") is None:
        raise RuntimeError("engine='sglang' needs SGLang in this interpreter (CPU: `bash "
                           "rollout/engines/install_sglang_cpu.sh .venv/bin/python`, or `make test` installs it), or "
                           "rollout.sglang.python= pointing at one that has it")
      _stop_orphans(cfg.workdir)
      shutil.rmtree(_hf_dir(cfg), ignore_errors=True)   # a killed trainer's exports: its servers are gone
    processes.on_primary("fleet_clean", clean)
    path = export(cfg, params, version)
    self.fleet = processes.on_primary("fleet_start", lambda: self._start(path, version, log_fn))
    self.engine = self.fleet   # what an in-process (sync) rollout source generates with

  def _start(self, path: str, version: int, log_fn) -> SGLangFleet:
    t0 = time.perf_counter()
    self.fleet = SGLangFleet(FleetConfig(server_config(self.cfg, path, version),
                                         n_servers=self.cfg.rollout.sglang.servers),
                             log_dir=os.path.join(self.cfg.workdir, "sglang_logs"))
    log_fn(f"SGLang fleet: {self.cfg.rollout.sglang.servers} server(s) up in {time.perf_counter() - t0:.0f} s at "
           f"{[s.url for s in self.fleet.servers]}")
    self._write(version, path)
    return self.fleet

  def _write(self, version: int, path: str) -> None:
    _write_state(self.cfg.workdir, {"urls": [s.url for s in self.fleet.live_servers()], "version": version,
                                    "model_path": path, "pgids": [s.popen.pid for s in self.fleet.processes()]})

  def publish(self, params, version: int) -> float:
    """Exports `params` and loads them on every server as `version`; returns the seconds the servers took."""
    if self.version == version:
      return 0.0
    path = export(self.cfg, params, version)
    self.version = version

    def push() -> float:
      seconds = self.fleet.update_weights(path, version)
      self._write(version, path)
      _prune(self.cfg, KEEP_CHECKPOINTS, version)
      return seconds
    return processes.on_primary("fleet_publish", push) or 0.0

  def close(self) -> None:
    if self.fleet is not None:
      self.fleet.close()

  @staticmethod
  def follow(cfg: RunConfig):
    """A worker's client of the fleet; it follows the version the trainer last pushed (for its throttle) and the
    trainer's list of servers (which shrinks and regrows)."""
    engine = attach(cfg)

    def version() -> int:
      v = served_version(cfg.workdir)
      return engine.policy_version if v is None else v

    def load_newer() -> None:
      state = _read_state(cfg.workdir)
      if state is not None and state["urls"]:
        engine.use_servers(state["urls"])

    return Follower(engine, version, load_newer)


def served_version(workdir: str) -> int | None:
  """The policy version the fleet serves (None before the trainer started it)."""
  state = _read_state(workdir)
  return None if state is None else int(state["version"])


def attach(cfg: RunConfig, timeout_s: float = 1800.0) -> SGLangFleet:
  """A client of the trainer's fleet (for a worker process): waits for `fleet.json`, then uses its servers."""
  deadline = time.monotonic() + timeout_s
  while (state := _read_state(cfg.workdir)) is None:
    if time.monotonic() > deadline:
      raise TimeoutError(f"no {os.path.join(cfg.workdir, FLEET_FILE)} after {timeout_s:.0f} s: the trainer did "
                         "not start its SGLang fleet")
    time.sleep(0.2)
  scfg = server_config(cfg, state["model_path"], int(state["version"]))
  return SGLangFleet(FleetConfig(scfg, n_servers=len(state["urls"])),
                     servers=[RemoteServer(u) for u in state["urls"]])
