"""Harness budgets from a set's measured patch sizes, so the oracle (gold-patch replay) can act in the loop it is
evaluated in.

Budgets are in tokens of the policy's own tokenizer, so they scale with it: a patch of C characters costs about
C / r tokens, where r is the tokenizer's characters per token on code, plus ~5-10% for the JSON escaping of the
write_file call. r is ~1.3 for the 1,024-token BPE fitted on the colab corpus (real repositories' code is far from
its training text) and ~3-4 for a 100k-vocabulary BPE, so one set needs 2-3x the budget under the small tokenizer.
`fit_budget` measures instead of guessing: it encodes every task's oracle turns with the tokenizer it is given.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from rollout import chat_format as cf
from rollout.evaluation.policies import oracle_turn_tokens
from rollout.harness import HarnessConfig
from rollout.tasks.task import Task

TOOL_RESULT_TOKENS = 64  # room per oracle tool result (short: "wrote ...", "exit code 0", a sha)


def _round_up(n: float, multiple: int) -> int:
  return int(math.ceil(n / multiple) * multiple)


def fit_budget(tasks: Sequence[Task], tokenizer, cfg: HarnessConfig, headroom: float = 1.1) -> HarnessConfig:
  """`cfg` with max_turn_tokens and context_budget raised (never lowered) so every task's oracle fits one segment:
  max_turn_tokens >= headroom x the longest oracle turn, and context_budget >= system prompt + task prompt + all
  oracle turns + their tool results + one more turn + the observation reserve (the harness's summarisation rule)."""
  if not tasks:
    return cfg
  longest, context = 0, 0
  for t in tasks:
    turns = oracle_turn_tokens(t, tokenizer)
    longest = max(longest, max(turns))
    prompt = len(cf.encode_messages(tokenizer, [{"role": "system", "content": cfg.system_prompt},
                                                {"role": "user", "content": t.prompt}])[0])
    context = max(context, prompt + sum(turns) + TOOL_RESULT_TOKENS * len(turns))
  max_turn = max(cfg.max_turn_tokens, _round_up(headroom * longest, 64))
  budget = max(cfg.context_budget, _round_up(context + max_turn + cfg.observation_reserve, 256))
  return dataclasses.replace(cfg, max_turn_tokens=max_turn, context_budget=budget)
