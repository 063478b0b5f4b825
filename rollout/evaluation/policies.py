"""Policies the evaluation can run without JAX: scripted oracle / no-op / random baselines and an SGLang endpoint.

Checkpoint policies (the embedded JAX engine) are built in `composer_jax/eval_policies.py`, since `rollout/` never
imports JAX. The oracle needs a scripted trajectory per task: procedural tasks carry one (`metadata['oracle']`);
for the others (mined, SWE-style) `gold_oracle_turns` scripts "ask git for HEAD, write the gold patch, apply it,
finish", which makes the oracle-100% / no-op-0% check meaningful on every source.

The scripted oracle finds its task by the prompt; tasks of one repository may share a prompt (two commits with the
same subject), so for those the oracle keys the task by its commit: HEAD, which its first turn printed. (After a
self-summary the HEAD line is gone from the context and the first task with the prompt is assumed; the oracle's
turns fit one segment whenever its budget is met, see `oracle_turn_tokens`.)
"""

from __future__ import annotations

import collections
import dataclasses
import re
from collections.abc import Callable, Sequence

from rollout.engines import scripted, sglang_client
from rollout.engines.protocol import GenerateRequest, GenerateResult
from rollout.tasks.task import Task

GOLD_PATCH_FILE = ".eval_gold.patch"
BASELINES = ("oracle", "noop", "random")


def gold_oracle_turns(task: Task) -> list[dict]:
  """Assistant turns that apply the task's gold patch through the agent's own tools, then finish (first printing
  HEAD for a repository task, which tells apart tasks sharing a prompt)."""
  apply = (f"(git apply --whitespace=nowarn {GOLD_PATCH_FILE} 2>/dev/null || patch -s -p1 -f < {GOLD_PATCH_FILE});"
           f" s=$?; rm -f {GOLD_PATCH_FILE}; exit $s")
  head = [{"content": "", "tool_calls": [{"name": "shell", "arguments": {"command": "git rev-parse HEAD"}}]}] \
    if task.environment.repo else []
  return head + [{"content": "", "tool_calls": [{"name": "write_file",
                                          "arguments": {"path": GOLD_PATCH_FILE, "content": task.gold_patch}}]},
          {"content": "", "tool_calls": [{"name": "shell", "arguments": {"command": apply}}]},
          {"content": "", "tool_calls": [{"name": "finish", "arguments": {"message": "Applied the fix."}}]}]


def with_oracle(tasks: Sequence[Task]) -> list[Task]:
  """Tasks with a scripted oracle: their own, or `gold_oracle_turns` when they have none."""
  return [t if "oracle" in t.metadata else
          dataclasses.replace(t, metadata={**t.metadata, "oracle": gold_oracle_turns(t)}) for t in tasks]


def oracle_policy(tasks: Sequence[Task]) -> Callable[[str], dict]:
  """The scripted oracle over `tasks` (see the module docstring), keyed by commit where tasks share a prompt."""
  tasks = with_oracle(tasks)
  by_prompt = collections.Counter(t.prompt for t in tasks)
  keyed = [t for t in tasks if by_prompt[t.prompt] > 1 and t.environment.repo and t.environment.commit]
  single = {t.id: scripted.oracle_policy([t]) for t in keyed}
  shared = scripted.oracle_policy(tasks)

  def policy(prompt_text: str) -> dict:
    for t in keyed:  # HEAD (the task's base commit) is in the first tool result
      if t.prompt in prompt_text and re.search(rf"\b{re.escape(t.environment.commit)}", prompt_text):
        return single[t.id](prompt_text)
    return shared(prompt_text)

  return policy


def oracle_turn_tokens(task: Task, tokenizer) -> list[int]:
  """Tokens of each of the oracle's turns; its longest (the gold patch as a write_file call) needs
  max_turn_tokens >= it."""
  (task,) = with_oracle([task])
  return [len(scripted.encode_assistant(tokenizer, turn)) for turn in task.metadata["oracle"]]


def baseline(name: str, tokenizer, tasks: Sequence[Task], seed: int = 0):
  """A scripted baseline engine by name ('oracle', 'noop', 'random'); they run no model, so their cost is 0."""
  if name == "oracle":
    return scripted.ScriptedEngine(tokenizer, oracle_policy(tasks))
  if name == "noop":
    return scripted.ScriptedEngine(tokenizer, scripted.noop_policy)
  if name == "random":
    return scripted.RandomEngine(tokenizer.get_vocab_size(), seed=seed)
  raise ValueError(f"unknown baseline {name!r}; valid: {BASELINES}")


class SGLangEndpointEngine:
  """Engine-protocol adapter for one SGLang server or router (`/generate` with token ids), without routing logs.

  Uses the fleet's client (`rollout/engines/sglang_client.py`), so the policy version is the server's
  `weight_version`.
  """

  def __init__(self, base_url: str, timeout_s: float = 600.0):
    self.base_url, self.timeout_s = base_url.rstrip("/"), timeout_s

  def _one(self, req: GenerateRequest) -> GenerateResult:
    return sglang_client.generate_one(self.base_url, req, None, timeout=self.timeout_s)

  def generate(self, requests: Sequence[GenerateRequest]) -> list[GenerateResult]:
    return [self._one(r) for r in requests]
