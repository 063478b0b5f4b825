"""Engines that need no model: the scripted oracle, a no-op policy and a random-token policy.

They implement `Engine` on token ids like a real engine: the oracle decodes the prompt to find its task and how far it
got, then emits the oracle's next assistant turn as tokens; the random policy samples uniformly over the vocabulary
(what a randomly initialised model does, which exercises malformed-call handling).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence

import numpy as np

from rollout import chat_format as cf
from rollout.engines.protocol import GenerateRequest, GenerateResult
from rollout.tasks.task import Task

SUMMARY_STEP_RE = re.compile(r"completed steps: (\d+)")


def encode_assistant(tokenizer, message: dict) -> list[int]:
  """Ids of an assistant turn's body (content, tool calls, <|end_of_turn|>), without the role header."""
  ids, _ = cf.encode_messages(tokenizer, [{"role": "assistant", **message}])
  return ids[2:]  # drop <|begin_of_text|><|assistant|>


def _finish(ids: list[int], req: GenerateRequest) -> GenerateResult:
  """Applies max_tokens and stop ids like a real engine would."""
  p = req.params
  out, reason = [], "length"
  for i in ids[:p.max_tokens]:
    out.append(i)
    if i in p.stop_token_ids:
      reason = "stop"
      break
  if reason == "length" and len(out) < p.max_tokens:
    reason = "stop"  # the script ended without a stop token (cannot happen for encode_assistant output)
  return GenerateResult(np.asarray(out, np.int32), np.zeros(len(out), np.float32), None, 0, reason)


class ScriptedEngine:
  """Answers each prompt with `policy(prompt_text) -> assistant message dict` (role header excluded).

  The prompt text is decoded with special tokens kept, so the policy can see turn structure. Summary requests
  (prompt ending in <|summary|>) get `{"content": policy's summary}` through the same callable.
  """

  def __init__(self, tokenizer, policy: Callable[[str], dict], policy_version: int = 0):
    self.tok = tokenizer
    self.policy = policy
    self.policy_version = policy_version

  def generate(self, requests: Sequence[GenerateRequest]) -> list[GenerateResult]:
    results = []
    for req in requests:
      text = self.tok.decode(list(req.prompt_ids), skip_special_tokens=False)
      ids = encode_assistant(self.tok, self.policy(text))
      res = _finish(ids, req)
      results.append(GenerateResult(res.output_ids, res.logprobs, None, self.policy_version, res.finish_reason))
    return results


def _current_context(prompt_text: str) -> tuple[str, int, bool]:
  """(user task prompt, assistant turns completed in this context, whether a summary is being asked for)."""
  user = prompt_text.split(cf.USER, 1)[1].split(cf.END_OF_TURN, 1)[0] if cf.USER in prompt_text else ""
  summarizing = prompt_text.endswith(cf.SUMMARY)
  n = prompt_text.count(cf.ASSISTANT)
  return user, n if summarizing else n - 1, summarizing  # a generation prompt ends in an open <|assistant|>


def _consistent(task: Task, observations: list[str]) -> bool:
  """Whether every content-bearing tool result seen so far could come from this task's files.

  Tasks may share a prompt (same function and file names, different bug); their oracles then diverge only after a
  read or grep shows the file, so a file-content or grep observation (anything with ':') must appear in the task's
  files or in their grep-style `path:line:text` view. Only the head of each result is checked (results are cut
  head + tail).
  """
  files = task.environment.files
  corpus = "\n".join([*files.values(), *(f"{p}:{i}:{line}" for p, text in files.items()
                                          for i, line in enumerate(text.splitlines(), 1))])
  return all(o[:200].strip() in corpus for o in observations if ":" in o and not o.startswith("error"))


def oracle_policy(tasks: Sequence[Task]) -> Callable[[str], dict]:
  """The scripted oracle for tasks that carry `metadata['oracle']` (a list of assistant turns).

  It finds the task by its prompt (and, when several tasks share a prompt, by the file contents its tool results
  have shown), and its position by the number of assistant turns in the context; after a self-summary it resumes
  from the step count it wrote into the summary. Its summaries are the task's `metadata['oracle_summaries'][k]`
  (what the next segment needs after k turns; procedural tasks carry them), else a generic step-count note.
  """
  by_prompt: dict[str, list[Task]] = {}
  for t in tasks:
    if "oracle" not in t.metadata:
      raise ValueError(f"task {t.id} has no metadata['oracle'] trajectory")
    by_prompt.setdefault(t.prompt, []).append(t)

  def policy(prompt_text: str) -> dict:
    user, done, summarizing = _current_context(prompt_text)
    m = SUMMARY_STEP_RE.findall(prompt_text)
    done += int(m[-1]) if m else 0
    candidates = by_prompt.get(user, [])
    if len(candidates) > 1:
      observations = [r.split(cf.END_OF_TURN, 1)[0] for r in prompt_text.split(cf.TOOL_RESULT)[1:]]
      candidates = [t for t in candidates if _consistent(t, observations)]
    if summarizing:
      summaries = candidates[0].metadata.get("oracle_summaries") if candidates else None
      if summaries:
        return {"content": summaries[min(done, len(summaries) - 1)]}
      return {"content": f"Working on: {user} completed steps: {done}"}
    if not candidates:
      return {"content": "I do not know this task."}
    turns = candidates[0].metadata["oracle"]
    return turns[min(done, len(turns) - 1)]

  return policy


def noop_policy(prompt_text: str) -> dict:
  """Finishes at once without touching anything (its tasks must score 0)."""
  del prompt_text
  return {"content": "", "tool_calls": [{"name": "finish", "arguments": {"message": "Done."}}]}


class RandomEngine:
  """Uniform random tokens over the vocabulary (a randomly initialised model's behaviour), seeded per request."""

  def __init__(self, vocab_size: int, seed: int = 0, policy_version: int = 0):
    if vocab_size < 2:
      raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
    self.vocab_size, self.seed, self.policy_version = vocab_size, seed, policy_version

  def generate(self, requests: Sequence[GenerateRequest]) -> list[GenerateResult]:
    results = []
    for req in requests:
      rng = np.random.default_rng([self.seed, req.params.seed or 0])
      ids = rng.integers(0, self.vocab_size, req.params.max_tokens).tolist()
      res = _finish(ids, req)
      results.append(GenerateResult(res.output_ids, np.full(len(res.output_ids), -math.log(self.vocab_size),
                                                            np.float32), None, self.policy_version,
                                    res.finish_reason))
    return results
