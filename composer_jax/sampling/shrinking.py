"""Plain decoding shrunk to its live rows (`EngineConfig.shrink_rows`): a batched call decodes until its longest row
ends, and a step's time grows with the rows it runs. The shrinking decode stops once at most half its rows are live,
gathers those into a batch of the next power of two >= the floor (filled with a row that ended), and goes on with
them, until a stage would fall below the floor; each row's outputs come from the stage it ended in.

Every stage is one of two programs: `decode_start` (the whole batch after the prefill) and `decode_more` (rows of a
stopped stage). A shrunk row is computed in a batch of another size, so its floats may round differently (~1e-6 in
a logprob); `tests/test_sampling_shrink.py` checks it against decoding the whole batch.
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from composer_jax.model.config import ModelConfig
from composer_jax.sampling import decode as decode_lib
from composer_jax.sampling.decode import Batch, Output


@functools.partial(jax.jit, static_argnames=("cfg", "max_len", "until_live"))
def decode_start(params, batch: Batch, cache: dict, logits_BxV, cfg: ModelConfig, max_len: int, until_live: int):
  """Plain decoding after the prefill until at most `until_live` rows are live (0: to the end) → (rows, state)."""
  rows, state = decode_lib.start(batch, cfg, max_len, cache, logits_BxV)
  return rows, decode_lib.run(decode_lib.program_params(params, cfg), rows, state, cfg, batch.prompts_UxP.shape[1],
                              until_live)


@functools.partial(jax.jit, static_argnames=("cfg", "P", "until_live"))
def decode_more(params, rows: decode_lib.Rows, state: decode_lib.State, idx_C, cfg: ModelConfig, P: int,
                until_live: int):
  """Rows `idx_C` of a stopped plain decode, decoded on until at most `until_live` are live (0: to the end)."""
  rows, state = decode_lib.take(rows, state, idx_C)
  return rows, decode_lib.run(decode_lib.program_params(params, cfg), rows, state, cfg, P, until_live)


def merge_stages(stages: list[tuple[np.ndarray, decode_lib.State]]) -> decode_lib.State:
  """One state of the first stage's rows from a shrinking decode's stages: (for each row of the stage, the first
  stage's row it continues, -1 for a filler row; the stage's final state on the host). Each row's arrays are taken
  from the last stage that holds it, where it ended. A stage without its cache (None) gives a state without one."""
  first = stages[0][1]

  def merge(*leaves):
    out = np.array(leaves[0])
    for (orig, _), leaf in zip(stages[1:], leaves[1:], strict=True):
      real = orig >= 0
      out[orig[real]] = np.asarray(leaf)[real]
    return out
  fields = [f for f in decode_lib.State._fields if f != "i"]
  merged = {f: jax.tree.map(merge, *[getattr(st, f) for _, st in stages]) for f in fields}
  return first._replace(i=stages[-1][1].i, **merged)


def decode(program: Callable, batch: Batch, cache: dict, logits_BxV, Lo: int, floor: int, keep_cache: bool
           ) -> tuple[Output, float, bool]:
  """The shrinking decode of a prefilled batch → (the output of every row in batch order, seconds, whether anything
  compiled). `program(fn, args, **static)` runs a jitted program as the engine runs them (→ (out, seconds, fresh));
  `keep_cache`: fetch each stage's cache too (what the prefix cache keeps; otherwise the output's cache is None)."""
  until = lambda rows: rows // 2 if rows // 2 >= floor else 0   # noqa: E731
  fetch = lambda st: jax.device_get(st if keep_cache else st._replace(cache=None))   # noqa: E731
  B, P = batch.row_prompt_B.shape[0], batch.prompts_UxP.shape[1]
  (rows, state), seconds, fresh = program(decode_start, (batch, cache, logits_BxV), max_len=Lo, until_live=until(B))
  stages = [(np.arange(B), fetch(state))]
  while True:
    orig, st = stages[-1]
    live = np.flatnonzero(st.i < st.end_B)
    if not live.size or not until(len(orig)):
      break
    C = decode_lib.bucket(live.size, floor)
    filler = np.flatnonzero(st.i >= st.end_B)[0]   # a row that ended: stepped along, never read back
    idx = np.concatenate([live, np.full(C - live.size, filler)]).astype(np.int32)
    (rows, state), s, f = program(decode_more, (rows, state, jnp.asarray(idx)), P=P, until_live=until(C))
    seconds, fresh = seconds + s, fresh or f
    stages.append((np.concatenate([orig[live], np.full(C - live.size, -1)]), fetch(state)))
  return decode_lib.output(merge_stages(stages), Lo), seconds, fresh
