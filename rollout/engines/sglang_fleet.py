"""A rollout fleet of N SGLang servers (optionally behind `sglang-router`) that implements the engine protocol.

    fleet = SGLangFleet(FleetConfig(ServerConfig(model_path=ckpt_dir), n_servers=2))  # client-side balancing
    results = fleet.generate([GenerateRequest(prompt_ids, SamplingParams(temperature=1.0, max_tokens=64))])
    fleet.update_weights(new_ckpt_dir, version=1)   # pause, /update_weights_from_disk, continue
    fleet.close()

Weight sync is "the trainer writes a Hugging Face checkpoint directory, the fleet loads that path"; every sample
carries the policy version that produced it. Requests whose server dies are retried on another server (by the
router, and again by this client when the router itself gives up).

Shrink and regrow: a fleet that started its servers (and has no router) notices at each `generate` and
`update_weights` (`heal`) that one died or was retired, drops it, and starts a replacement on the current checkpoint
and version; the replacement serves once it answers /health (loading newer weights first if an update happened while
it started). A fleet attached to another process's servers (`servers=`) is regrown by its owner and follows its list
(`use_servers`).
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence

from rollout.engines.protocol import GenerateRequest, GenerateResult
from rollout.engines.sglang_client import RoutingLayout, SGLangError, SGLangUnavailable, generate_one, post_json
from rollout.engines.sglang_launcher import Process, ServerConfig, launch_router, launch_server

log = logging.getLogger(__name__)
_SUSPECT_S = 10.0  # after a failure, send new requests elsewhere for this long


@dataclasses.dataclass(frozen=True)
class FleetConfig:
  """A fleet of identical servers.

  Attributes:
    server: how to launch each server.
    n_servers: number of servers.
    use_router: put `sglang-router` in front (else this client round-robins over servers itself, with the same
      fail-over). sglang-router 0.3.2 drops `return_routed_experts` from the requests it forwards, so a fleet that
      logs routing (for router replay) must balance client-side: `use_router=True` with routing logs is refused.
    max_attempts: tries per request before giving up (each retry goes to the next live endpoint).
    request_timeout_s: per HTTP request.
    startup_timeout_s: per server start (CPU: 16-30 s on an idle machine, minutes on a loaded one).
    max_concurrency: requests in flight at once from `generate`.
    pause_mode: SGLang `/pause_generation` mode during a weight update: "retract" puts running requests back in
      the queue and recomputes them with the new weights ("abort" ends them with finish_reason 'abort').
    regrow: replace servers that died or were retired (a fleet that started its own servers, without a router).
    regrow_backoff_s: at most one replacement is started per this many seconds (a server that keeps crashing at
      start-up costs one start per interval, not a loop).
  """
  server: ServerConfig
  n_servers: int = 1
  use_router: bool = False
  max_attempts: int = 3
  request_timeout_s: float = 600.0
  startup_timeout_s: float = 600.0
  max_concurrency: int = 64
  pause_mode: str = "retract"
  regrow: bool = True
  regrow_backoff_s: float = 30.0

  def __post_init__(self):
    if self.n_servers < 1 or self.max_attempts < 1:
      raise ValueError(f"need n_servers >= 1 and max_attempts >= 1, got {self.n_servers=} {self.max_attempts=}")
    if self.use_router and self.server.return_routed_experts:
      raise ValueError("sglang-router 0.3.2 drops return_routed_experts from forwarded requests (no routing log "
                       "comes back); use use_router=False (client-side balancing and fail-over) for RL rollouts, or "
                       "ServerConfig(return_routed_experts=False)")
    if self.pause_mode not in ("retract", "abort", "in_place"):
      raise ValueError(f"pause_mode must be retract|abort|in_place, got {self.pause_mode!r}")


class RemoteServer:
  """A server another process started and owns (e.g. the RL trainer's fleet, seen from a rollout worker).

  `alive()` is always True — a server that stopped answering is skipped by the fleet's per-request fail-over and
  suspect list instead — and `stop()` leaves it running: its owner stops it.
  """

  def __init__(self, url: str):
    self.url = url.rstrip("/")
    self.name = self.url

  def alive(self) -> bool:
    return True

  def stop(self, grace_s: float = 0.0) -> None:
    del grace_s


class SGLangFleet:
  """Owns N servers (+ router): health, generation with fail-over, weight updates. Use as a context manager."""

  def __init__(self, cfg: FleetConfig, *, log_dir: str | None = None, servers: Sequence[Process] | None = None,
               launch: Callable[[ServerConfig, str], Process] | None = None):
    """Launches `cfg.n_servers` servers (and the router), or attaches to already running `servers` instead.

    Args:
      cfg: fleet configuration.
      log_dir: where server and router logs go (default: a new temp dir).
      servers: running servers to use (anything with `url`, `alive()` and `stop()`); `close()` stops them too.
      launch: starts one server from its config and a name, returning at once (default: `launch_server`); also
        starts the replacements of a regrowing fleet.
    """
    self.cfg = cfg
    self.layout = RoutingLayout.from_hf_config(cfg.server.model_path) if cfg.server.return_routed_experts else None
    self.policy_version = cfg.server.weight_version
    self.model_path = cfg.server.model_path
    self.servers: list[Process] = []
    self.router: Process | None = None
    self._rr = itertools.count()
    self._lock = threading.Lock()
    self._heal_lock = threading.Lock()
    self._failed_at: dict[str, float] = {}
    self._retired: set[str] = set()
    self._launch = launch or (lambda scfg, name: launch_server(scfg, log_dir=log_dir, name=name))
    self._owned = servers is None
    self._starting: dict[str, tuple[Process, int]] = {}   # replacements not serving yet, with their start version
    self._names = itertools.count(cfg.n_servers)
    self._last_launch = -1e9
    self.counts = {"retried_requests": 0, "servers_lost": 0, "servers_regrown": 0}
    atexit.register(self.close)  # servers run in their own sessions: never leave them behind a crashed caller
    try:
      if servers is not None:
        self.servers = list(servers)
      else:
        self.servers = [self._launch(cfg.server, f"sglang-{i}") for i in range(cfg.n_servers)]
        for s in self.servers:
          s.wait_ready(cfg.startup_timeout_s)
      if cfg.use_router:
        self.router = launch_router([s.url for s in self.servers], log_dir=log_dir, python=cfg.server.python)
        self.router.wait_ready(cfg.startup_timeout_s, path="/readiness")
    except BaseException:
      self.close()
      raise

  # -- lifecycle ---------------------------------------------------------------------------------------------------
  def close(self) -> None:
    """Stops the router and every server (process groups), replacements still starting included; idempotent."""
    for p in ([self.router] if self.router else []) + self.processes():
      p.stop()
    atexit.unregister(self.close)

  def processes(self) -> list[Process]:
    """Every server process this fleet holds: serving, retired or still starting."""
    return self.servers + [p for p, _ in self._starting.values()]

  def heal(self) -> None:
    """Shrinks the fleet by the servers that died or were retired and regrows it to `n_servers` (see the module
    docstring); a no-op for a fleet attached to another process's servers, or with a router."""
    if not (self._owned and self.cfg.regrow and self.router is None):
      return
    with self._heal_lock:
      for s in [s for s in self.servers if s.url in self._retired or not s.alive()]:
        log.warning("server %s is gone: the fleet shrinks to %d", s.url, len(self.servers) - 1)
        self.servers.remove(s)
        s.stop(grace_s=0.0)
        self.counts["servers_lost"] += 1
      for url, (p, version) in list(self._starting.items()):
        if not p.alive():
          log.warning("replacement %s exited during start-up (log %s)", url, getattr(p, "log_path", "?"))
          del self._starting[url]
          p.stop(grace_s=0.0)
        elif self._ready(p, version):
          del self._starting[url]
          self.servers.append(p)
          self.counts["servers_regrown"] += 1
          log.warning("replacement %s serves version %d: the fleet is back to %d", url, self.policy_version,
                      len(self.servers))
      now = time.monotonic()
      if len(self.servers) + len(self._starting) < self.cfg.n_servers and \
          now - self._last_launch >= self.cfg.regrow_backoff_s:
        self._last_launch = now
        scfg = dataclasses.replace(self.cfg.server, model_path=self.model_path, weight_version=self.policy_version)
        p = self._launch(scfg, f"sglang-{next(self._names)}")
        self._starting[p.url] = (p, self.policy_version)

  def _ready(self, p: Process, version: int) -> bool:
    """Whether a starting replacement answers /health, after loading the current weights if it started on older
    ones (a replacement that cannot load them is stopped: the next `heal` starts another)."""
    try:
      post_json(p.url + "/health", None, timeout=2.0)
    except SGLangError:
      return False
    if version == self.policy_version:
      return True
    try:
      out = post_json(p.url + "/update_weights_from_disk", {"model_path": self.model_path,
                                                            "weight_version": str(self.policy_version)},
                      timeout=self.cfg.request_timeout_s)
      if out and out.get("success"):
        return True
    except SGLangError as e:
      out = str(e)
    log.warning("replacement %s could not load version %d: %s", p.url, self.policy_version, out)
    p.stop(grace_s=0.0)
    return False

  def use_servers(self, urls: Sequence[str]) -> None:
    """An attached fleet follows its owner's server list (e.g. after the owner regrew one)."""
    known = {s.url: s for s in self.servers}
    self.servers = [known.get(u.rstrip("/")) or RemoteServer(u) for u in urls]

  def __enter__(self) -> SGLangFleet:
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def health(self) -> dict[str, bool]:
    """URL -> whether the server process is alive and answers /health with 200."""
    out = {}
    for s in self.servers:
      ok = s.alive()
      if ok:
        try:
          post_json(s.url + "/health", None, timeout=5.0)
        except SGLangError:
          ok = False
      out[s.url] = ok
    return out

  def live_servers(self) -> list[Process]:
    """Servers whose process runs and that were not retired (unreachable during a weight update)."""
    return [s for s in self.servers if s.url not in self._retired and s.alive()]

  # -- generation --------------------------------------------------------------------------------------------------
  def _pick(self, tried: set[str]) -> str | None:
    """Next endpoint for a request: the router if it runs, else live servers in round-robin order; skips endpoints
    this request already failed on, and prefers ones that did not fail in the last `_SUSPECT_S` seconds."""
    live = [s.url for s in self.live_servers()]
    if live:
      k = next(self._rr) % len(live)
      live = live[k:] + live[:k]
    order = ([self.router.url] if self.router is not None and self.router.alive() else []) + live
    order = [u for u in order if u not in tried]
    now = time.monotonic()
    fresh = [u for u in order if now - self._failed_at.get(u, -1e9) > _SUSPECT_S]
    return (fresh or order or [None])[0]

  def _generate_one(self, request: GenerateRequest) -> GenerateResult:
    errors, tried = [], set()
    for attempt in range(self.cfg.max_attempts):
      url = self._pick(tried)
      if url is None:
        break
      try:
        return generate_one(url, request, self.layout, timeout=self.cfg.request_timeout_s)
      except SGLangUnavailable as e:  # dead or failing endpoint: try another one
        log.warning("request %r failed on %s (attempt %d): %s", request.request_id, url, attempt + 1, e)
        self.counts["retried_requests"] += 1
        tried.add(url)
        self._failed_at[url] = time.monotonic()
        errors.append(str(e))
        time.sleep(min(0.1 * 2**attempt, 2.0))
    raise SGLangUnavailable(f"request {request.request_id!r} failed after {len(errors)} attempts on "
                            f"{sorted(tried)} (no other live endpoint): {errors}")

  def generate(self, requests: Sequence[GenerateRequest]) -> list[GenerateResult]:
    """Completes every request (concurrently, so the servers batch them); results are in request order."""
    if not requests:
      return []
    self.heal()
    workers = min(self.cfg.max_concurrency, len(requests))
    with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="sglang-fleet") as pool:
      return list(pool.map(self._generate_one, requests))

  # -- weights -----------------------------------------------------------------------------------------------------
  def update_weights(self, model_path: str, version: int) -> float:
    """Loads a new checkpoint directory on every live server as policy `version`; returns the seconds it took.

    Each server in turn is paused (`pause_mode`), loads the path with `/update_weights_from_disk` (which also
    flushes the prefix cache), and continues, so the others keep serving meanwhile. A server that cannot be reached
    is retired (stopped and never used again) rather than left to come back with stale weights. The new checkpoint
    must have the same architecture as the served one.
    """
    if version < self.policy_version:
      raise ValueError(f"policy version must not go back: serving {self.policy_version}, asked for {version}")
    self.heal()
    t0 = time.perf_counter()
    with self._lock:
      updated = []
      for s in self.live_servers():
        try:
          post_json(s.url + "/pause_generation", {"mode": self.cfg.pause_mode}, timeout=60.0)
          try:
            out = post_json(s.url + "/update_weights_from_disk",
                            {"model_path": model_path, "weight_version": str(version)},
                            timeout=self.cfg.request_timeout_s)
          finally:
            with contextlib.suppress(SGLangError):
              post_json(s.url + "/continue_generation", {}, timeout=60.0)
        except SGLangUnavailable as e:
          # It would come back with stale weights: take it out of the fleet for good.
          log.warning("retiring %s: unreachable during the update to version %d: %s", s.url, version, e)
          self._retired.add(s.url)
          s.stop()
          continue
        if not out or not out.get("success"):
          raise SGLangError(f"{s.url} failed to load {model_path}: {out}")
        updated.append(s.url)
      if not updated:
        raise SGLangUnavailable(f"no server could load {model_path}")
      self.policy_version, self.model_path = version, model_path
    return time.perf_counter() - t0
