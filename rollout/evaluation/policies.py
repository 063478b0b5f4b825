"""Policies the evaluation can run without JAX: scripted oracle / no-op / random baselines and an SGLang endpoint.

Checkpoint policies (the embedded JAX engine) are built in `composer_jax/eval_policies.py`, since `rollout/` never
imports JAX. The oracle needs a scripted trajectory per task: procedural tasks carry one (`metadata['oracle']`);
for the others (mined, SWE-style) `gold_oracle_turns` scripts "write the gold patch, apply it, finish", which makes
the oracle-100% / no-op-0% check meaningful on every source.
"""

from __future__ import annotations

import dataclasses
import json
import urllib.request
from collections.abc import Sequence

import numpy as np

from rollout.engines import scripted
from rollout.engines.protocol import GenerateRequest, GenerateResult
from rollout.tasks.task import Task

GOLD_PATCH_FILE = ".eval_gold.patch"
BASELINES = ("oracle", "noop", "random")


def gold_oracle_turns(task: Task) -> list[dict]:
  """Assistant turns that apply the task's gold patch through the agent's own tools, then finish."""
  apply = (f"(git apply --whitespace=nowarn {GOLD_PATCH_FILE} 2>/dev/null || patch -s -p1 -f < {GOLD_PATCH_FILE});"
           f" s=$?; rm -f {GOLD_PATCH_FILE}; exit $s")
  return [{"content": "", "tool_calls": [{"name": "write_file",
                                          "arguments": {"path": GOLD_PATCH_FILE, "content": task.gold_patch}}]},
          {"content": "", "tool_calls": [{"name": "shell", "arguments": {"command": apply}}]},
          {"content": "", "tool_calls": [{"name": "finish", "arguments": {"message": "Applied the fix."}}]}]


def with_oracle(tasks: Sequence[Task]) -> list[Task]:
  """Tasks with a scripted oracle: their own, or `gold_oracle_turns` when they have none."""
  return [t if "oracle" in t.metadata else
          dataclasses.replace(t, metadata={**t.metadata, "oracle": gold_oracle_turns(t)}) for t in tasks]


def baseline(name: str, tokenizer, tasks: Sequence[Task], seed: int = 0):
  """A scripted baseline engine by name ('oracle', 'noop', 'random'); they run no model, so their cost is 0."""
  if name == "oracle":
    return scripted.ScriptedEngine(tokenizer, scripted.oracle_policy(with_oracle(tasks)))
  if name == "noop":
    return scripted.ScriptedEngine(tokenizer, scripted.noop_policy)
  if name == "random":
    return scripted.RandomEngine(tokenizer.get_vocab_size(), seed=seed)
  raise ValueError(f"unknown baseline {name!r}; valid: {BASELINES}")


class SGLangEndpointEngine:
  """Engine-protocol adapter for one SGLang server or router (`/generate` with token ids), without routing logs.

  An interim adapter until the `sglang` branch's fleet client (`rollout/engines/sglang_client.py`) lands; when that
  module is importable it is used instead of the minimal HTTP call below.
  """

  def __init__(self, base_url: str, policy_version: int = 0, timeout_s: float = 600.0):
    self.base_url, self.policy_version, self.timeout_s = base_url.rstrip("/"), policy_version, timeout_s

  def _one(self, req: GenerateRequest) -> GenerateResult:
    try:
      from rollout.engines import sglang_client  # the fleet client, once merged
      return sglang_client.generate_one(self.base_url, req, None, timeout=self.timeout_s)
    except ImportError:
      pass
    p = req.params
    payload = {"input_ids": list(req.prompt_ids), "return_logprob": True,
               "sampling_params": {"temperature": p.temperature, "top_p": p.top_p, "top_k": p.top_k or -1,
                                   "max_new_tokens": p.max_tokens, "stop_token_ids": list(p.stop_token_ids),
                                   "ignore_eos": False, **({"sampling_seed": p.seed} if p.seed is not None else {})}}
    http = urllib.request.Request(f"{self.base_url}/generate", json.dumps(payload).encode(),
                                  {"Content-Type": "application/json"})
    with urllib.request.urlopen(http, timeout=self.timeout_s) as r:
      body = json.loads(r.read())
    meta = body.get("meta_info", {})
    ids = np.asarray(body.get("output_ids", []), np.int32)
    lps = np.asarray([x[0] for x in meta.get("output_token_logprobs", [])] or np.zeros(len(ids)), np.float32)
    reason = (meta.get("finish_reason") or {}).get("type", "stop")
    return GenerateResult(ids, lps[:len(ids)], None, self.policy_version, "length" if reason == "length" else "stop")

  def generate(self, requests: Sequence[GenerateRequest]) -> list[GenerateResult]:
    return [self._one(r) for r in requests]
