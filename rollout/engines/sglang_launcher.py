"""Start and stop SGLang servers and `sglang-router` as local processes (127.0.0.1, free ports, own process groups).

Each process runs in a new session, so `stop()` ends it and every scheduler/detokenizer child with one signal to
the group, also when a test fails half-way. On CPU the server gets the test-time patches in `sglang_patches/` on
its PYTHONPATH (see that folder's `sitecustomize.py`) and `TORCHDYNAMO_DISABLE=1` (SGLang's `torch.compile`d
routing would otherwise spend minutes in g++ on the first request, for no gain at these sizes).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

from rollout.engines.sglang_client import SGLangError, post_json

PATCH_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sglang_patches")
SPECULATIVE_ALGORITHMS = ("EAGLE", "EAGLE3", "NEXTN")


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
  """SGLang's MTP/EAGLE speculative decoding (GPU fleets only; SGLang's CPU backend has no EAGLE support).

  For DeepSeek-V3/Kimi checkpoints with MTP layers (`num_nextn_predict_layers` > 0, MTP stored as layer index
  num_hidden_layers), `algorithm="NEXTN"` drafts with the checkpoint's own MTP head.
  """
  algorithm: str = "NEXTN"
  num_steps: int = 1
  eagle_topk: int = 1
  num_draft_tokens: int = 2
  draft_model_path: str | None = None

  def args(self) -> list[str]:
    if self.algorithm not in SPECULATIVE_ALGORITHMS:
      raise ValueError(f"speculative algorithm {self.algorithm!r} not in {SPECULATIVE_ALGORITHMS}")
    out = ["--speculative-algorithm", self.algorithm, "--speculative-num-steps", str(self.num_steps),
           "--speculative-eagle-topk", str(self.eagle_topk),
           "--speculative-num-draft-tokens", str(self.num_draft_tokens)]
    if self.draft_model_path:
      out += ["--speculative-draft-model-path", self.draft_model_path]
    return out


@dataclasses.dataclass(frozen=True)
class ServerConfig:
  """How to launch one SGLang server for a token-id rollout fleet.

  Attributes:
    model_path: Hugging Face checkpoint directory (config.json + safetensors).
    device: "cpu" (tests, Colab) or "cuda".
    dtype: "float32" on CPU (bf16 flips greedy near-ties and ~5% of routing decisions on tiny random models).
    attention_backend: None picks torch_native on CPU and SGLang's default on GPU.
    max_total_tokens: KV-cache size in tokens.
    max_running_requests: largest decode batch.
    return_routed_experts: log routing (`--enable-return-routed-experts`) for router replay.
    weight_version: initial policy version reported with every sample.
    random_seed: server seed (sampling without a per-request seed).
    speculative: MTP/EAGLE speculative decoding (GPU only).
    deterministic: `--enable-deterministic-inference`, which SGLang needs to honour per-request seeds
      (`SamplingParams.seed`); GPU attention backends only (fa3, flashinfer, triton, ...), refused on CPU.
    torch_compile: keep SGLang's `torch.compile` decorators (off on CPU: slow compiles, no gain for tiny models).
    extra_args: appended verbatim to the command line.
    python: interpreter that has sglang installed.
  """
  model_path: str
  device: str = "cpu"
  dtype: str = "float32"
  attention_backend: str | None = None
  max_total_tokens: int = 8192
  max_running_requests: int = 32
  return_routed_experts: bool = True
  weight_version: int = 0
  random_seed: int = 0
  speculative: SpeculativeConfig | None = None
  deterministic: bool = False
  torch_compile: bool = False
  extra_args: tuple[str, ...] = ()
  python: str = sys.executable

  def __post_init__(self):
    if self.device not in ("cpu", "cuda"):
      raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
    if self.speculative is not None and self.device == "cpu":
      raise ValueError("SGLang's MTP/EAGLE speculative decoding is GPU-only (on CPU: 'EAGLE is not supported in "
                       "attention backend torch_native'); test speculative decoding in the JAX engine instead")
    if self.deterministic and self.device == "cpu":
      raise ValueError("SGLang's deterministic inference (needed for per-request seeds) has no CPU attention "
                       "backend (torch_native is not among its choices); on CPU, seeds are sent but not honoured")
    if not os.path.isfile(os.path.join(self.model_path, "config.json")):
      raise ValueError(f"model_path {self.model_path!r} has no config.json (expected a Hugging Face checkpoint dir)")

  def command(self, port: int) -> list[str]:
    """The server's command line on 127.0.0.1:port."""
    backend = self.attention_backend or ("torch_native" if self.device == "cpu" else None)
    cmd = [self.python, "-m", "sglang.launch_server", "--model-path", self.model_path, "--host", "127.0.0.1",
           "--port", str(port), "--device", self.device, "--dtype", self.dtype,
           "--skip-tokenizer-init",  # the fleet speaks token ids; no tokenizer round trip
           "--max-total-tokens", str(self.max_total_tokens),
           "--max-running-requests", str(self.max_running_requests),
           "--weight-version", str(self.weight_version), "--random-seed", str(self.random_seed)]
    if backend:
      cmd += ["--attention-backend", backend]
    if self.device == "cpu":
      cmd += ["--disable-cuda-graph"]
    if self.return_routed_experts:
      cmd += ["--enable-return-routed-experts"]
    if self.speculative is not None:
      cmd += self.speculative.args()
    if self.deterministic:
      cmd += ["--enable-deterministic-inference"]
    return cmd + list(self.extra_args)

  def env(self) -> dict[str, str]:
    """Process environment: CPU engine switch, test-time patches on PYTHONPATH, dynamo off unless asked."""
    env = dict(os.environ)
    if self.device == "cpu":
      env["SGLANG_USE_CPU_ENGINE"] = "1"
      env["PYTHONPATH"] = os.pathsep.join(p for p in (PATCH_DIR, env.get("PYTHONPATH")) if p)
    if not self.torch_compile:
      env["TORCHDYNAMO_DISABLE"] = "1"
    return env


def free_port() -> int:
  """A TCP port on 127.0.0.1 that was free a moment ago."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class Process:
  """A started server or router: its URL, its process group, and its log file."""

  def __init__(self, name: str, cmd: list[str], env: dict[str, str], port: int, log_path: str):
    self.name, self.port, self.log_path = name, port, log_path
    self.url = f"http://127.0.0.1:{port}"
    with open(log_path, "ab") as log:
      self.popen = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)

  def alive(self) -> bool:
    return self.popen.poll() is None

  def log_tail(self, n_chars: int = 3000) -> str:
    with contextlib.suppress(OSError), open(self.log_path, errors="replace") as f:
      return f.read()[-n_chars:]
    return ""

  def wait_ready(self, timeout_s: float, path: str = "/health") -> None:
    """Polls `path` until it answers 200 (SGLang's /health is 503 until its warm-up request is done)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
      if not self.alive():
        raise RuntimeError(f"{self.name} exited with code {self.popen.returncode} during start-up; log "
                           f"{self.log_path} ends with:\n{self.log_tail()}")
      with contextlib.suppress(SGLangError):
        post_json(self.url + path, None, timeout=5.0)
        return
      time.sleep(0.5)
    raise TimeoutError(f"{self.name} not ready after {timeout_s:.0f} s; log {self.log_path} ends with:\n"
                       f"{self.log_tail()}")

  def stop(self, grace_s: float = 10.0) -> None:
    """SIGTERM to the whole process group, SIGKILL after `grace_s`; safe to call twice."""
    if self.popen.poll() is not None and not _group_alive(self.popen.pid):
      return
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
      with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(self.popen.pid, sig)
      deadline = time.monotonic() + wait
      while time.monotonic() < deadline and _group_alive(self.popen.pid):
        with contextlib.suppress(subprocess.TimeoutExpired):
          self.popen.wait(timeout=0.2)
      if not _group_alive(self.popen.pid):
        break
    with contextlib.suppress(subprocess.TimeoutExpired):
      self.popen.wait(timeout=1.0)


def _group_alive(pgid: int) -> bool:
  try:
    os.killpg(pgid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


def _log_path(log_dir: str | None, name: str) -> str:
  log_dir = log_dir or tempfile.mkdtemp(prefix="sglang_logs_")
  os.makedirs(log_dir, exist_ok=True)
  return os.path.join(log_dir, f"{name}.log")


def launch_server(cfg: ServerConfig, *, port: int | None = None, log_dir: str | None = None,
                  name: str = "sglang-server") -> Process:
  """Starts one server (returns at once; call `wait_ready`)."""
  port = port or free_port()
  return Process(f"{name}:{port}", cfg.command(port), cfg.env(), port, _log_path(log_dir, f"{name}-{port}"))


def launch_router(worker_urls: list[str], *, port: int | None = None, log_dir: str | None = None,
                  policy: str = "round_robin", max_retries: int = 3, health_interval_s: int = 1,
                  python: str = sys.executable) -> Process:
  """Starts `sglang-router` in front of running workers (returns at once; call `wait_ready`).

  The router retries a failed request on another worker and drops workers that fail health checks.
  """
  if not worker_urls:
    raise ValueError("launch_router needs at least one worker URL")
  port = port or free_port()
  cmd = [python, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
         "--worker-urls", *worker_urls, "--policy", policy, "--retry-max-retries", str(max_retries),
         "--health-check-interval-secs", str(health_interval_s), "--health-failure-threshold", "1",
         "--log-level", "warn"]
  return Process(f"sglang-router:{port}", cmd, dict(os.environ), port, _log_path(log_dir, f"router-{port}"))
