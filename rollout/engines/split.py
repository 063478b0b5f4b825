"""An engine that acts with one policy and writes its self-summaries with another.

The harness asks for a summary with a prompt that ends in the <|summary|> header; `SummariesFrom` sends those
requests to `summarizer` and every other request to `actor`, in one batch each, and returns the results in request
order. It is how "do trained summaries help?" is measured at an equal context budget: the RL policy acting with
the SFT start's summaries, against the RL policy writing its own.
"""

from __future__ import annotations

from collections.abc import Sequence

from rollout.engines.protocol import Engine, GenerateRequest, GenerateResult


class SummariesFrom:
  """`actor` for action turns, `summarizer` for summary requests (prompts ending in `summary_id`)."""

  def __init__(self, actor: Engine, summarizer: Engine, summary_id: int):
    self.actor, self.summarizer, self.summary_id = actor, summarizer, summary_id

  def generate(self, requests: Sequence[GenerateRequest]) -> list[GenerateResult]:
    asks = [bool(r.prompt_ids) and r.prompt_ids[-1] == self.summary_id for r in requests]
    out: list[GenerateResult | None] = [None] * len(requests)
    for engine, want in ((self.actor, False), (self.summarizer, True)):
      idx = [i for i, a in enumerate(asks) if a == want]
      if not idx:
        continue
      results = engine.generate([requests[i] for i in idx])
      if len(results) != len(idx):
        raise RuntimeError(f"{type(engine).__name__} returned {len(results)} results for {len(idx)} requests")
      for i, res in zip(idx, results, strict=True):
        out[i] = res
    return out
