"""The engine protocol: what the harness needs from anything that samples tokens (SGLang fleet, embedded JAX engine,
scripted policies).

Shapes: T output tokens, N MoE layers, K experts per token (top-k).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal, Protocol, runtime_checkable

import numpy as np

FinishReason = Literal["stop", "length", "abort"]
FINISH_REASONS = ("stop", "length", "abort")


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """How to sample one completion.

  Attributes:
    temperature: softmax temperature; 0 means greedy.
    top_p: nucleus mass (1.0 = off).
    top_k: keep the k most likely tokens (0 = off).
    max_tokens: most tokens to generate.
    stop_token_ids: generation ends after emitting any of these (the stop token is part of the output).
    seed: per-request seed, or None for the engine's own stream.
  """
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0
  max_tokens: int = 256
  stop_token_ids: tuple[int, ...] = ()
  seed: int | None = None

  def __post_init__(self):
    if self.temperature < 0:
      raise ValueError(f"temperature must be >= 0, got {self.temperature}")
    if not 0 < self.top_p <= 1:
      raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
    if self.top_k < 0 or self.max_tokens < 1:
      raise ValueError(f"need top_k >= 0 and max_tokens >= 1, got {self.top_k=} {self.max_tokens=}")


@dataclasses.dataclass(frozen=True)
class GenerateRequest:
  """One prompt to complete. `request_id` is for logs and engines that track requests (never for policy logic)."""
  prompt_ids: tuple[int, ...]
  params: SamplingParams
  request_id: str = ""


@dataclasses.dataclass(frozen=True)
class GenerateResult:
  """One completion.

  Attributes:
    output_ids: int32 [T] generated tokens (including the stop token when finish_reason == 'stop').
    logprobs: float32 [T] log-probability of each generated token under the sampling policy.
    routed_experts: int32 [T, N, K] experts each output token was routed to when it was fed back as input, at its
      own position (the layout the trainer replays, `model.forward(routing=...)`); rows of -1 where the engine never
      fed that token (SGLang: the last one); None for dense/scripted engines.
    policy_version: version of the weights that produced the tokens.
    finish_reason: 'stop' (stop token), 'length' (max_tokens) or 'abort'.
    prompt_routed_experts: int32 [P, N, K] experts each prompt token was routed to in this call's prefill, at its
      own position (same layout); with it the trainer replays the whole context as the engine ran it. None when
      the engine does not report prefill routing.
    entropies: float32 [T] the policy's entropy (nats; at the request's temperature, T = 0 scored at T = 1) over
      each output token's distribution: how uncertain it was at each step (tree rollouts may branch where a turn
      was uncertain, `rollout.tree_harness`). None when the engine does not report it (SGLang, scripted, the
      embedded engine's speculative path).
  """
  output_ids: np.ndarray
  logprobs: np.ndarray
  routed_experts: np.ndarray | None
  policy_version: int
  finish_reason: FinishReason
  prompt_routed_experts: np.ndarray | None = None
  entropies: np.ndarray | None = None

  def __post_init__(self):
    t = len(self.output_ids)
    if self.logprobs.shape != (t,):
      raise ValueError(f"logprobs shape {self.logprobs.shape} != ({t},) output tokens")
    if self.routed_experts is not None and (self.routed_experts.ndim != 3 or self.routed_experts.shape[0] != t):
      raise ValueError(f"routed_experts must be [T={t}, layers, top_k], got {self.routed_experts.shape}")
    pr = self.prompt_routed_experts
    if pr is not None and (pr.ndim != 3 or (self.routed_experts is not None
                                            and pr.shape[1:] != self.routed_experts.shape[1:])):
      raise ValueError(f"prompt_routed_experts must be [P, layers, top_k] like routed_experts, got {pr.shape}")
    if self.entropies is not None and self.entropies.shape != (t,):
      raise ValueError(f"entropies shape {self.entropies.shape} != ({t},) output tokens")
    if self.finish_reason not in FINISH_REASONS:
      raise ValueError(f"finish_reason {self.finish_reason!r} not in {FINISH_REASONS}")


@runtime_checkable
class Engine(Protocol):
  """Anything that completes a batch of token prompts."""

  def generate(self, requests: Sequence[GenerateRequest]) -> list[GenerateResult]:
    """Completes every request; results are in request order."""
    ...
