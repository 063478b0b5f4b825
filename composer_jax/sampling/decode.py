"""Batched generation in two programs: `prefill` each unique prompt once and copy its cache to its samples, then
`decode` in a `lax.while_loop` that stops when every row has finished (stop token or its own max_tokens). The engine
jits them apart (`engine.py`), so a call's decode time is measured alone and one prefill program serves every draft
depth of a speculative engine (`speculative.decode_speculative` continues the same prefill).

All shapes are fixed per (U, P, B, Lo) bucket, so a new batch of the same bucket reuses the compiled programs.
Row b samples from prompt `row_prompt_B[b]`; the while loop keeps feeding tokens until each row's last output
token has itself been fed through the model, so its routed experts are recorded too.

Letters (composer_jax/model/README.md): U unique prompts, P padded prompt width, B rows (samples), Lo output buffer
length (new tokens a row can hold), Z stop ids per row, V vocab, D hidden, Lm MoE layers, K experts per token.
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from composer_jax.model.config import ModelConfig
from composer_jax.model.experts import with_dense_layout
from composer_jax.sampling import cached_model as cm
from composer_jax.sampling import sampler

EXTRA = 1  # output-buffer slack: a step writes the next token one past the row's pointer


class Batch(NamedTuple):
  """Device inputs of one generation call (all int32/float32 arrays; see the module docstring for letters)."""
  prompts_UxP: jax.Array      # left-padded unique prompts
  pad_U: jax.Array            # padding slots per unique prompt
  row_prompt_B: jax.Array     # which unique prompt row b continues
  temperature_B: jax.Array
  top_k_B: jax.Array
  top_p_B: jax.Array
  max_tokens_B: jax.Array
  stop_BxZ: jax.Array         # stop token ids, -1 padded
  seeds_B: jax.Array          # uint32 per-row seed
  # Prefix reuse (both None: prefill every prompt from scratch): the cached rows of each unique prompt's reused
  # prefix at its prompt slots, laid out like `cached_model.init_cache(.., U, P)` (zeros elsewhere), and their
  # routed experts [Lm, U, P, K].
  prefix_cache: dict | None = None
  prefix_experts_LmxUxPxK: jax.Array | None = None


class Output(NamedTuple):
  """Per-row outputs; entries at index >= length_B are junk."""
  tokens_BxLo: jax.Array
  logprobs_BxLo: jax.Array     # policy logprob of each token (sampler.policy_logprobs)
  experts_BxLoxLmxK: jax.Array
  length_B: jax.Array
  prompt_experts_LmxUxPxK: jax.Array | None   # from the prefill (the decode programs return None here)
  stats: dict                 # decode steps; speculative: drafted, accepted (scalars), accept_hist [k + 1]
  cache: dict                 # the final cache [.., B, S, ..] (split layers): row b's slots up to its last fed
                              # token hold its prompt's and outputs' rows (what the prefix cache keeps)
  entropies_BxLo: jax.Array | None = None   # the policy's entropy over each output token (None: not reported)


def bucket(n: int, minimum: int) -> int:
  """Smallest power of two >= max(n, minimum)."""
  return 1 << max(math.ceil(math.log2(max(n, 1))), math.ceil(math.log2(minimum)))


def program_params(params: dict, cfg: ModelConfig) -> dict:
  """params as a generation program runs them (call inside jit): the dense MoE path's weight layout, made once per
  program rather than once per step."""
  return with_dense_layout(params) if cfg.moe_impl == "dense" else params


def is_stop(tok_B: jax.Array, stop_BxZ: jax.Array) -> jax.Array:
  return (tok_B[:, None] == stop_BxZ).any(-1)


def prefill(params: dict, batch: Batch, cfg: ModelConfig, slots: int, mtp: bool = False, window: int = 0):
  """Prefills the unique prompts and copies each to its rows.

  With `window` = W > 0 the prompts' reused prefixes come from `batch.prefix_cache` and only the last W prompt
  slots are run, attending over the cache with expanded keys and values (`KVCache.expand`); every row's uncached
  tail must fit in them (slots before a row's tail that fall inside the window are recomputed, harmlessly).

  Returns:
    (cache [.., B, slots, ..], last-position logits [B, V], hiddens of the run slots [B, P or W, D], prompt experts
    [Lm, U, P, K]).
  """
  U, P = batch.prompts_UxP.shape
  start_U = jnp.full((U,), P - window if window else 0, jnp.int32)
  run_UxL = batch.prompts_UxP[:, P - window:] if window else batch.prompts_UxP
  if window:
    cache_U = jax.tree.map(lambda a: jnp.pad(a, ((0, 0), (0, 0), (0, slots - P), (0, 0))), batch.prefix_cache)
  else:
    cache_U = cm.init_cache(params, cfg, U, slots)
  logits_Ux1xV, h_UxLxD, experts, cache_U = cm.forward_cached(params, run_UxL, cache_U, start_U, batch.pad_U, cfg,
                                                              fresh=not window, last_logits=True, expand=bool(window))
  if window:
    experts = jax.lax.dynamic_update_slice_in_dim(batch.prefix_experts_LmxUxPxK, experts, P - window, axis=2)
  if mtp:  # module 0 over the run slots; the last slot's next token is not sampled yet (the first step redoes it)
    nxt_UxL = jnp.pad(run_UxL[:, 1:], ((0, 0), (0, 1)))
    _, cache_U = cm.mtp_module(params, 0, h_UxLxD, nxt_UxL, cache_U, start_U, batch.pad_U, cfg, fresh=not window,
                               expand=bool(window))
  rows = batch.row_prompt_B
  cache_B = jax.tree.map(lambda a: a[:, rows], cache_U)
  return cache_B, logits_Ux1xV[rows, -1], h_UxLxD[rows], experts


def greedy_or_sampled(batch: Batch | Rows, cond, body, state):
  """The decode loop with `body(greedy, state)`: one loop specialised to all-greedy batches (argmax only), one for
  the rest, chosen once per call (a `lax.cond` inside every step cost more than a small step's sampling)."""
  def loop(greedy):
    return lambda st: jax.lax.while_loop(cond, functools.partial(body, greedy), st)
  return jax.lax.cond((batch.temperature_B <= 0).all(), loop(True), loop(False), state)


def _first_token(logits_BxV: jax.Array, batch: Batch, keys_B):
  B = logits_BxV.shape[0]
  slp = sampler.sampling_logprobs(logits_BxV, batch.temperature_B, batch.top_k_B, batch.top_p_B)
  tok_B = sampler.draw(sampler.step_keys(keys_B, jnp.zeros((B,), jnp.int32)), slp)
  lp_B = jnp.take_along_axis(sampler.policy_logprobs(logits_BxV, batch.temperature_B), tok_B[:, None], 1)[:, 0]
  return tok_B, lp_B


def _out_buffers(B: int, Lo: int, cfg: ModelConfig, extra: int = EXTRA):
  n_moe = cfg.num_hidden_layers - cfg.first_k_dense_replace
  return (jnp.zeros((B, Lo + extra), jnp.int32), jnp.zeros((B, Lo + extra), jnp.float32),
          jnp.zeros((B, Lo + extra, n_moe, cfg.num_experts_per_tok), jnp.int32))


class Rows(NamedTuple):
  """What the decode loop reads per row: a `Batch`'s per-row fields, each row's prompt padding, its PRNG key."""
  pad_B: jax.Array
  temperature_B: jax.Array
  top_k_B: jax.Array
  top_p_B: jax.Array
  stop_BxZ: jax.Array
  keys_B: jax.Array


class State(NamedTuple):
  """The plain decode loop's state: after `i` steps every row has fed `i` output tokens and sampled its next,
  `tok_B`, at output slot i; a row is live while i < end_B (end_B: its length once it stopped, else max_tokens)."""
  i: jax.Array
  tok_B: jax.Array
  cache: dict                 # split layers, [B, S, ..] per layer
  toks_BxLo: jax.Array        # Lo + EXTRA slots
  lps_BxLo: jax.Array
  ents_BxLo: jax.Array
  routes_BxLoxLmxK: jax.Array
  end_B: jax.Array


def start(batch: Batch, cfg: ModelConfig, max_len: int, cache: dict, logits_BxV: jax.Array) -> tuple[Rows, State]:
  """The loop's rows and first state after `prefill` (its cache of >= P + max_len + EXTRA slots, last logits): the
  first token sampled, nothing fed yet."""
  B, Lo = batch.row_prompt_B.shape[0], max_len
  keys_B = jax.vmap(jax.random.key)(batch.seeds_B)
  rows = Rows(batch.pad_U[batch.row_prompt_B], batch.temperature_B, batch.top_k_B, batch.top_p_B, batch.stop_BxZ,
              keys_B)
  tok_B, lp_B = _first_token(logits_BxV, batch, keys_B)
  toks, lps, routes = _out_buffers(B, Lo, cfg)
  toks, lps = toks.at[:, 0].set(tok_B), lps.at[:, 0].set(lp_B)
  ents = jnp.zeros_like(lps).at[:, 0].set(sampler.policy_entropy(logits_BxV, batch.temperature_B))
  return rows, State(jnp.zeros((), jnp.int32), tok_B, cm.split_layers(cache), toks, lps, ents, routes,
                     batch.max_tokens_B.astype(jnp.int32))


def run(params: dict, rows: Rows, state: State, cfg: ModelConfig, P: int, until_live: int = 0) -> State:
  """Steps every live row until none is left, or (`until_live` > 0) until at most `until_live` are: the caller can
  then gather the live rows into a smaller batch (`take`) and go on with fewer rows a step. P: the prompt width
  (output slot j of a row is cache slot P + j)."""
  params = cm.split_layers(params)
  B = rows.pad_B.shape[0]

  def cond(st: State):
    live_B = st.i < st.end_B
    return live_B.any() & (live_B.sum() > until_live) if until_live else live_B.any()

  def body(greedy: bool, st: State):
    i = st.i
    start_B = jnp.full((B,), P, jnp.int32) + i
    logits, _, experts, cache = cm.forward_cached(params, st.tok_B[:, None], st.cache, start_B, rows.pad_B, cfg)
    routes = jax.lax.dynamic_update_slice_in_dim(st.routes_BxLoxLmxK, jnp.transpose(experts, (1, 2, 0, 3)), i, axis=1)
    end_B = jnp.where(is_stop(st.tok_B, rows.stop_BxZ) & (i < st.end_B), i + 1, st.end_B)
    if greedy:
      nxt_B = jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32)
    else:
      slp = sampler.sampling_logprobs(logits[:, 0], rows.temperature_B, rows.top_k_B, rows.top_p_B)
      nxt_B = sampler.draw_inverse_cdf(sampler.step_keys(rows.keys_B, jnp.full((B,), i + 1)), slp)
    policy_BxV = sampler.policy_logprobs(logits[:, 0], rows.temperature_B)
    lp_B = jnp.take_along_axis(policy_BxV, nxt_B[:, None], 1)[:, 0]
    toks = jax.lax.dynamic_update_slice_in_dim(st.toks_BxLo, nxt_B[:, None], i + 1, axis=1)
    lps = jax.lax.dynamic_update_slice_in_dim(st.lps_BxLo, lp_B[:, None], i + 1, axis=1)
    ents = jax.lax.dynamic_update_slice_in_dim(st.ents_BxLo, sampler.entropy(policy_BxV)[:, None], i + 1, axis=1)
    return State(i + 1, nxt_B, cache, toks, lps, ents, routes, end_B)

  return greedy_or_sampled(rows, cond, body, state)


def take(rows: Rows, state: State, idx_C: jax.Array) -> tuple[Rows, State]:
  """Rows `idx_C` of a batch (C of them, in that order; repeats allowed) and of its state, the step count kept."""
  pick = lambda a: a[idx_C]   # noqa: E731
  return jax.tree.map(pick, rows), state._replace(**{f: jax.tree.map(pick, getattr(state, f))
                                                     for f in State._fields if f != "i"})


def output(state: State, max_len: int) -> Output:
  """The loop's result as an `Output` (`prompt_experts_LmxUxPxK` None: the prefill's)."""
  Lo = max_len
  stats = {"steps": state.i, "drafted": jnp.zeros((), jnp.int32), "accepted": jnp.zeros((), jnp.int32)}
  return Output(state.toks_BxLo[:, :Lo], state.lps_BxLo[:, :Lo], state.routes_BxLoxLmxK[:, :Lo], state.end_B, None,
                stats, state.cache, state.ents_BxLo[:, :Lo])


def decode(params: dict, batch: Batch, cfg: ModelConfig, max_len: int, cache: dict, logits_BxV: jax.Array
           ) -> Output:
  """Plain (non-speculative) decoding of up to `max_len` tokens per row after `prefill` (its cache of >= P + max_len
  + EXTRA slots and last logits; jit with cfg and max_len static). `Output.prompt_experts_LmxUxPxK` is None (the
  prefill's)."""
  rows, state = start(batch, cfg, max_len, cache, logits_BxV)
  return output(run(params, rows, state, cfg, batch.prompts_UxP.shape[1]), max_len)
