"""HTTP client for one SGLang `/generate` endpoint (a server or a router), speaking token ids.

Turns a protocol `GenerateRequest` into SGLang's JSON and SGLang's answer into a `GenerateResult`: output ids, the
per-token logprobs (`meta_info.output_token_logprobs`, `[logprob, token_id, null]` rows) and the routing log
(`meta_info.routed_experts`, base64 int32 [S - 1, n_layers, K] over every position the model ran).

Routing alignment (the protocol's): `routed_experts[t]` is the routing of output token t as an input, at its own
sequence position P + t (P prompt tokens) — the layout the trainer replays. SGLang logs positions 0..S-2, so the
last output token (never fed back) gets a row of -1 ("not recorded"; no trained token depends on it), and rows
0..P-1 are the prompt's prefill routing (`GenerateResult.prompt_routed_experts`). Dense layers are dropped: N
counts MoE layers only.

Shapes: P prompt tokens, T output tokens, S = P + T, L all hidden layers, N MoE layers, K experts per token.
Only the standard library and numpy: `rollout/` must run without JAX or torch.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import urllib.error
import urllib.request
from typing import Any

import numpy as np

from rollout.engines.protocol import GenerateRequest, GenerateResult


class SGLangError(RuntimeError):
  """SGLang answered, but with an error (HTTP status >= 400 or a malformed body)."""

  def __init__(self, message: str, status: int | None = None):
    super().__init__(message)
    self.status = status


class SGLangUnavailable(SGLangError):
  """The endpoint could not be reached or failed on the server side (connection refused, reset, 5xx): retryable."""


@dataclasses.dataclass(frozen=True)
class RoutingLayout:
  """Which rows of SGLang's per-layer routing log are MoE layers.

  Attributes:
    n_layers: L, layers in SGLang's routing log (all hidden layers; dense ones carry no routing).
    moe_layers: indices of the MoE layers among them (N of them).
    top_k: K experts per token.
  """
  n_layers: int
  moe_layers: tuple[int, ...]
  top_k: int

  @classmethod
  def from_hf_config(cls, config: dict[str, Any] | str) -> RoutingLayout:
    """From a DeepSeek-V3-style config.json (a dict, the file, or the checkpoint directory holding it)."""
    if isinstance(config, str):
      path = os.path.join(config, "config.json") if os.path.isdir(config) else config
      with open(path) as f:
        config = json.load(f)
    try:
      n_layers, top_k = int(config["num_hidden_layers"]), int(config["num_experts_per_tok"])
    except KeyError as e:
      raise ValueError(f"config.json lacks {e.args[0]!r}: not a MoE checkpoint SGLang can log routing for") from e
    first_dense = int(config.get("first_k_dense_replace", 0))
    freq = int(config.get("moe_layer_freq", 1))
    experts = int(config.get("n_routed_experts") or 0)
    moe = tuple(i for i in range(n_layers) if experts and i >= first_dense and i % freq == 0)
    return cls(n_layers, moe, top_k)


def to_payload(request: GenerateRequest, *, return_routed_experts: bool = True) -> dict[str, Any]:
  """SGLang `/generate` JSON for one protocol request.

  Stopping: without `stop_token_ids` only max_tokens ends a sample (`ignore_eos`), as the protocol says. SGLang
  cannot honour stop ids while ignoring EOS, so with `stop_token_ids` the checkpoint's `eos_token_id` (config.json)
  also ends a sample: export checkpoints whose eos_token_id is one of the harness's stop tokens.
  """
  p = request.params
  if not request.prompt_ids:
    raise ValueError(f"request {request.request_id!r} has an empty prompt")
  sampling = {
    "temperature": float(p.temperature),  # SGLang samples greedily at temperature 0
    "top_p": float(p.top_p),
    "top_k": int(p.top_k) if p.top_k > 0 else -1,  # SGLang's "off" is -1
    "max_new_tokens": int(p.max_tokens),
    "stop_token_ids": [int(t) for t in p.stop_token_ids],
    "ignore_eos": not p.stop_token_ids,  # SGLang skips *all* token stops (stop ids too) when ignore_eos is set
  }
  if p.seed is not None:
    sampling["sampling_seed"] = int(p.seed)
  payload = {"input_ids": [int(t) for t in request.prompt_ids], "sampling_params": sampling, "return_logprob": True}
  if return_routed_experts:
    payload["return_routed_experts"] = True
  if request.request_id:
    payload["rid"] = request.request_id
  return payload


def decode_routed_experts(b64: str, n_positions: int, layout: RoutingLayout) -> np.ndarray:
  """base64 int32 [n_positions, L, K] -> int32 array of that shape, with a clear error on a size mismatch."""
  flat = np.frombuffer(base64.b64decode(b64), dtype="<i4")
  per_row = layout.n_layers * layout.top_k
  if flat.size != n_positions * per_row:
    raise SGLangError(f"routed_experts has {flat.size} int32 values, expected {n_positions} positions x "
                      f"{layout.n_layers} layers x {layout.top_k} experts = {n_positions * per_row} (wrong layout?)")
  return flat.reshape(n_positions, layout.n_layers, layout.top_k).astype(np.int32)


def _version(meta: dict[str, Any]) -> int:
  """The policy version that produced the sample: the earliest of SGLang's per-span weight versions.

  A request that straddles a weight update (paused and retracted, then continued) has several spans; reporting the
  oldest keeps staleness bounds conservative.
  """
  spans = meta.get("weight_versions") or []
  versions = [s["version"] for s in spans] or [meta.get("weight_version")]
  try:
    return min(int(v) for v in versions)
  except (TypeError, ValueError) as e:
    raise SGLangError(f"weight_version {versions!r} is not an integer policy version (launch with --weight-version "
                      "<int> and update with weight_version=str(int))") from e


def from_response(body: dict[str, Any], prompt_len: int, layout: RoutingLayout | None) -> GenerateResult:
  """Protocol result from one SGLang `/generate` answer.

  Args:
    body: the decoded JSON of one answer (`output_ids`, `meta_info`).
    prompt_len: P, the request's prompt length (to align the routing log).
    layout: routing layout, or None to ignore routing.

  Returns:
    The `GenerateResult`, with routed_experts int32 [T, N, K] and prompt_routed_experts [P, N, K] when `layout` is
    given and the server logged routing.
  """
  if "output_ids" not in body or "meta_info" not in body:
    raise SGLangError(f"unexpected /generate answer (keys {sorted(body)}); was the server started with "
                      "--skip-tokenizer-init?")
  meta = body["meta_info"]
  out_T = np.asarray(body["output_ids"], np.int32)
  T = len(out_T)
  rows = meta.get("output_token_logprobs") or []
  if len(rows) != T:
    raise SGLangError(f"{len(rows)} output_token_logprobs for {T} output tokens (request return_logprob=true)")
  logprobs_T = np.asarray([r[0] for r in rows], np.float32)
  if T and not np.array_equal(np.asarray([r[1] for r in rows], np.int32), out_T):
    raise SGLangError("output_token_logprobs token ids differ from output_ids")
  reason = (meta.get("finish_reason") or {}).get("type", "abort")
  if reason not in ("stop", "length"):
    reason = "abort"
  routed = prompt_routed = None
  if layout is not None and meta.get("routed_experts") is not None and T:
    n_positions = prompt_len + T - 1  # every position the model ran; the last output token is never fed back
    moe_SxNxK = decode_routed_experts(meta["routed_experts"], n_positions, layout)[:, list(layout.moe_layers)]
    routed = np.full((T, len(layout.moe_layers), layout.top_k), -1, np.int32)
    routed[:T - 1] = moe_SxNxK[prompt_len:]
    prompt_routed = moe_SxNxK[:prompt_len]
  elif layout is not None and T == 0:
    routed = np.zeros((0, len(layout.moe_layers), layout.top_k), np.int32)
  return GenerateResult(out_T, logprobs_T, routed, _version(meta), reason, prompt_routed_experts=prompt_routed)


def post_json(url: str, payload: dict[str, Any] | None = None, timeout: float = 600.0) -> Any:
  """POSTs JSON (GET when payload is None) and decodes the JSON answer.

  Raises:
    SGLangUnavailable: unreachable, reset, or a 5xx answer (worth retrying elsewhere).
    SGLangError: a 4xx answer or a body that is not JSON.
  """
  data = None if payload is None else json.dumps(payload).encode()
  req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"},
                               method="GET" if payload is None else "POST")
  try:
    with urllib.request.urlopen(req, timeout=timeout) as resp:
      text = resp.read()
  except urllib.error.HTTPError as e:
    detail = e.read()[:500].decode(errors="replace")
    cls = SGLangUnavailable if e.code >= 500 else SGLangError
    raise cls(f"{url}: HTTP {e.code}: {detail}", status=e.code) from e
  except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as e:
    raise SGLangUnavailable(f"{url}: {e}") from e
  try:
    return json.loads(text) if text else None
  except json.JSONDecodeError as e:
    raise SGLangError(f"{url}: answer is not JSON: {text[:200]!r}") from e


def generate_one(base_url: str, request: GenerateRequest, layout: RoutingLayout | None,
                 timeout: float = 600.0) -> GenerateResult:
  """Sends one request to `base_url` (a server or router) and decodes the answer."""
  body = post_json(f"{base_url}/generate", to_payload(request, return_routed_experts=layout is not None), timeout)
  return from_response(body, len(request.prompt_ids), layout)
