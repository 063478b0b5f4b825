"""`JaxEngine`: the embedded engine behind rollout's `Engine` protocol, plus a notebook-friendly `sample`.

Requests are grouped into fixed-shape buckets (powers of two for the unique-prompt count, prompt width, row count
and output length) so a rollout loop compiles a handful of programs and then reuses them. Identical prompts in a
call are prefilled once and their cache copied to every sample. Weights are swapped in place (`update_weights`),
each set tagged with the policy version that `GenerateResult.policy_version` reports.

Prefix reuse: every finished row's prompt + output is kept in a `PrefixCache` (KV rows and routed experts); a later
prompt sharing a prefix with a kept sequence (the next turn of a multi-turn episode) gets those rows copied in and
only its last `window` prompt slots run (a power of two >= its longest uncached tail), instead of the whole prompt.

Speculative decoding (`EngineConfig.speculative`) drafts with the engine's own MTP weights, swapped with the trunk's;
with `adaptive_draft` every call runs the draft depth k in 0..draft_tokens that the engine's measurements favour
(`draft_depth.py`), and each policy version's acceptance is logged (`spec_log.py`).

A call runs as two programs, `_prefill` then `_decode`: the decode program is timed alone (what the draft-depth
choice needs), and a speculative engine's prefill does not depend on k (its cache and kept hiddens fit the largest),
so every k shares it. Every program is compiled ahead the first time its shapes are met, so the times the engine
records never include a compile (`compiles` / `compile_s` count those).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from composer_jax.model import moe
from composer_jax.model.config import ModelConfig
from composer_jax.sampling import cached_model as cm
from composer_jax.sampling import decode as decode_lib
from composer_jax.sampling import placement as placement_lib
from composer_jax.sampling import shrinking
from composer_jax.sampling.decode import EXTRA, Batch, Output, bucket, decode, prefill
from composer_jax.sampling.draft_depth import DraftDepth
from composer_jax.sampling.prefix_cache import Entry, PrefixCache
from composer_jax.sampling.spec_log import VersionLog
from composer_jax.sampling.speculative import decode_speculative, slack
from rollout.engines.protocol import GenerateRequest, GenerateResult, SamplingParams
from rollout.evaluation.result_cache import code_fingerprint


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """Engine knobs.

  Attributes:
    speculative: draft with MTP module 0 and verify (needs a model with MTP modules).
    draft_tokens: drafts per speculative step (module 0 chained on its own output after the first); with
      `adaptive_draft` the most the engine may choose.
    adaptive_draft: the engine runs the k in 0..draft_tokens (0: plain decoding) whose decode programs emitted the
      most tokens per second on the same calls, chosen after its first `draft_explore_calls` calls (each decodes
      with every k) and changed only when another k is clearly faster (`draft_depth.py`); logged when it changes.
    draft_probe_every: with `adaptive_draft`, every this many calls whose shapes have other depths compiled also
      decode with one of those, so the rates keep being measured as the policy moves, without compiles.
    draft_explore_calls: with `adaptive_draft`, how many first calls decode with every k before the choice.
    max_batch: most rows per compiled call (larger requests are split).
    min_batch_bucket: smallest row count (and unique-prompt count) a call is padded to; set it to the usual
      batch so every call reuses one compiled program.
    min_prompt_bucket: smallest padded prompt width (prompts are left-padded to a power of two >= this).
    min_len_bucket: smallest output buffer length.
    moe_impl: how generation runs the routed experts: 'auto' (on CPU 'dense', every expert as two plain GEMMs:
      at a few tokens per decode step that beats sorting them into blocks, and XLA:CPU runs a grouped matmul as a
      masked dense dot anyway; elsewhere the model's own), 'model' (the model's `moe_impl`), or a name in
      `model.moe.MOE_IMPLS`. 'capacity' is always
      replaced by 'ragged', since dropping depends on the batch and would break equality with the trainer's
      forward. With 'dense' the expert weights are laid out for it once per call, not once per step.
    seed: seed of the engine's own stream for requests without a seed.
    prefix_cache_bytes: most host memory the prefix cache keeps (0: off, every prompt is prefilled in full); see
      `prefix_cache.py` for the bytes per token. The default holds ~540k tokens of `rl_colab`, ~165k of `colab`:
      every in-flight episode of a 256-task evaluation chunk at a 496-token context.
    min_window_bucket: smallest number of prompt slots run when a prompt's prefix is reused (the window is a power
      of two >= the longest uncached tail; when that reaches the prompt width, the call prefills from scratch).
    shrink_rows: > 0: plain decoding on one device stops each time at most half its rows are still live and goes
      on with only those, gathered into the smallest power of two >= max(live rows, shrink_rows): a call no longer
      runs every row until its longest one ends (a decode step's time grows with its rows), for more programs to
      compile (one per stage shape). A row's floats may round differently in a batch of another size (~1e-6 in a
      logprob, as between batch buckets), so a draw that close to a boundary can differ. 0 (the default: on the
      evaluation's calls it saved less decode time than its extra compiles cost a fresh process, see the sampling
      README): the whole batch steps to the end, as speculative decoding always does.
  """
  speculative: bool = False
  draft_tokens: int = 1
  adaptive_draft: bool = False
  draft_probe_every: int = 32
  draft_explore_calls: int = 8
  max_batch: int = 64
  min_batch_bucket: int = 1
  min_prompt_bucket: int = 16
  min_len_bucket: int = 16
  moe_impl: str = "auto"
  seed: int = 0
  prefix_cache_bytes: int = 256 << 20
  min_window_bucket: int = 32
  shrink_rows: int = 0


def generation_moe_impl(cfg: ModelConfig, choice: str, platform: str | None = None) -> str:
  """The `MOE_IMPLS` name generation runs for `EngineConfig.moe_impl=choice` (see there) on `platform`."""
  valid = ("auto", "model", *moe.MOE_IMPLS)
  if choice not in valid:
    raise ValueError(f"EngineConfig.moe_impl={choice!r}; valid: {list(valid)}")
  platform = platform or jax.default_backend()
  if choice == "auto":
    choice = "dense" if platform == "cpu" and cfg.moe_matmul == "bf16" else "model"
  impl = moe.resolve_moe_impl(dataclasses.replace(cfg, moe_impl=cfg.moe_impl if choice == "model" else choice),
                              platform)
  return "ragged" if impl == "capacity" else impl


@functools.partial(jax.jit, static_argnames=("cfg", "slots", "window", "hidden"))
def _prefill(params, batch: Batch, cfg: ModelConfig, slots: int, window: int, hidden: int):
  """The prefill program → (cache of `slots` slots, last logits [B, V], the trunk hiddens of the last `hidden` prompt
  slots [B, hidden, D] (hidden = 0: plain decoding only, no MTP module run, None), prompt experts); window = 0:
  from scratch (see `decode.prefill`). It does not depend on the draft depth, so it serves every k."""
  if hidden and 0 < window < hidden:
    raise ValueError(f"a prefill window of {window} slots is narrower than the {hidden} hiddens speculation reads")
  params = decode_lib.program_params(params, cfg)
  cache, logits_BxV, h_BxLxD, experts = prefill(params, batch, cfg, slots, mtp=hidden > 0, window=window)
  return cache, logits_BxV, h_BxLxD[:, -hidden:] if hidden else None, experts


@functools.partial(jax.jit, static_argnames=("cfg", "max_len", "draft_tokens"))
def _decode(params, batch: Batch, cache: dict, logits_BxV, h_BxHxD, cfg: ModelConfig, max_len: int,
            draft_tokens: int) -> Output:
  """The decode program after `_prefill` (draft_tokens = 0: plain decoding)."""
  params = decode_lib.program_params(params, cfg)
  if draft_tokens:
    return decode_speculative(params, batch, cfg, max_len, draft_tokens, cache, logits_BxV, h_BxHxD)
  return decode(params, batch, cfg, max_len, cache, logits_BxV)


def _shapes(tree) -> tuple:
  """What a program's arguments contribute to its compile key: their tree structure, shapes and dtypes."""
  return jax.tree.structure(tree), tuple((np.shape(x), str(x.dtype)) for x in jax.tree.leaves(tree))


def _key(fn, args: tuple, **static) -> tuple:
  """A program's compile key within one engine (its params and cfg are fixed): the function, its static
  arguments and the shapes of the others."""
  return fn.__name__, tuple(static.items()), _shapes(args)


class JaxEngine:
  """Batched, jitted generation with an MLA latent KV cache; implements `rollout.engines.protocol.Engine`."""

  def __init__(self, params: dict, cfg: ModelConfig, engine_cfg: EngineConfig = EngineConfig(),
               policy_version: int = 0, *, stats_path: str = "", name: str = "",
               log_fn: Callable[[str], None] | None = None, mesh: Mesh | None = None, placement: str = "trainer"):
    """`stats_path`: where the speculative counts of each policy version served are appended (`spec_log.py`;
    '' keeps them in memory, `version_log`); `name` names this engine there; `log_fn` gets a line per finished
    version and per change of the adaptive draft depth. `mesh` and `placement` ('trainer' | 'replicas',
    `sampling.placement`): where weights and rows live."""
    self.cfg = dataclasses.replace(cfg, moe_impl=generation_moe_impl(cfg, engine_cfg.moe_impl))
    self.engine_cfg = engine_cfg
    if engine_cfg.speculative and cfg.num_nextn_predict_layers < 1:
      raise ValueError("EngineConfig(speculative=True) needs a model with MTP modules (num_nextn_predict_layers >= 1)")
    if engine_cfg.draft_tokens < 1:
      raise ValueError(f"EngineConfig.draft_tokens must be >= 1, got {engine_cfg.draft_tokens}")
    placement_lib.check(placement)
    self.mesh, self.placement = mesh, placement
    self.params = placement_lib.weights(params, mesh, placement)
    self.policy_version = policy_version
    self.prefix_cache = PrefixCache(engine_cfg.prefix_cache_bytes)
    self._result_key: str | None = None
    self._calls = 0
    self.last_stats: dict[str, int] = {}
    self.log_fn = log_fn
    self.version_log = VersionLog(stats_path, name, log_fn)
    self.depth = (DraftDepth(engine_cfg.draft_tokens, engine_cfg.draft_probe_every, engine_cfg.draft_explore_calls)
                  if engine_cfg.speculative and engine_cfg.adaptive_draft else None)
    self._programs: set[tuple] = set()
    # programs this engine met first, and the seconds compiling them took (jax's in-process cache may already hold
    # one that another engine of the same model compiled: then it costs ~0 s)
    self.compiles, self.compile_s = 0, 0.0

  def update_weights(self, params: dict, policy_version: int) -> None:
    """Swaps in new weights (same structure and shapes; placed on the current weights' devices)."""
    old_struct = jax.tree.structure(self.params)
    if jax.tree.structure(params) != old_struct:
      raise ValueError("update_weights: the new params have a different tree structure than the current ones")
    for a, b in zip(jax.tree.leaves(self.params), jax.tree.leaves(params)):
      if a.shape != b.shape:
        raise ValueError(f"update_weights: a leaf changed shape {a.shape} -> {b.shape}")
    shardings = jax.tree.map(lambda a: a.sharding, self.params)
    self.params = jax.device_put(params, shardings)
    if policy_version != self.policy_version:
      self.version_log.flush()
      if self.depth is not None:
        self.depth.new_policy()
    self.policy_version = policy_version
    self.prefix_cache.clear()  # the kept rows were computed by the old weights
    self._result_key = None

  def result_key(self) -> str:
    """A hash of what fixes this engine's outputs for seeded requests: the weights, the model and engine configs,
    the jax version and backend, and the model's and engine's code (an evaluation's result cache keys on it)."""
    if self._result_key is None:
      digest = hashlib.sha256()
      for path, leaf in jax.tree_util.tree_leaves_with_path(jax.device_get(self.params)):
        digest.update(f"{jax.tree_util.keystr(path)}:{leaf.dtype}:{leaf.shape}".encode())
        digest.update(np.ascontiguousarray(leaf).tobytes())
      digest.update(repr((self.cfg, self.engine_cfg, jax.__version__, jax.default_backend())).encode())
      digest.update(code_fingerprint("composer_jax/model", "composer_jax/sampling").encode())
      self._result_key = digest.hexdigest()[:32]
    return self._result_key

  def generate(self, requests: Sequence[GenerateRequest]) -> list[GenerateResult]:
    """Completes every request; results are in request order."""
    results: list[GenerateResult] = []
    n = self.engine_cfg.max_batch
    for i in range(0, len(requests), n):
      results.extend(self._generate_chunk(list(requests[i:i + n])))
    return results

  def close(self) -> None:
    """Writes the served version's speculative counts (`version_log`)."""
    self.version_log.flush()

  def _program(self, fn, args: tuple, **static):
    """Runs the jitted `fn(self.params, *args, cfg=self.cfg, **static)` → (its outputs, ready, the seconds they
    took, whether it was compiled for this run). A program met for the first time is compiled ahead
    (`lower().compile()`, which fills jit's own cache) and counted in `compiles` / `compile_s`, so the seconds
    returned never include a compile."""
    key = _key(fn, args, **static)
    fresh = key not in self._programs
    with jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext():
      if fresh:
        t0 = time.perf_counter()
        fn.lower(self.params, *args, cfg=self.cfg, **static).compile()
        self.compile_s += time.perf_counter() - t0
        self.compiles += 1
        self._programs.add(key)
      t0 = time.perf_counter()
      out = jax.block_until_ready(fn(self.params, *args, cfg=self.cfg, **static))
    return out, time.perf_counter() - t0, fresh

  def prefill_static(self, P: int, Lo: int, window: int) -> dict:
    """`_prefill`'s static arguments for a call of prompt width P, output bucket Lo and prefill window: the
    cache's slots and the hiddens kept fit the largest k, so any k can decode after it."""
    K = self._draft_tokens
    return dict(slots=P + Lo + (slack(K) if K else EXTRA), window=window, hidden=K + 1 if K else 0)

  @property
  def _draft_tokens(self) -> int:
    """The configured drafts per step (0: plain); an adaptive engine picks each call's k up to it."""
    return self.engine_cfg.draft_tokens if self.engine_cfg.speculative else 0

  def _batch(self, requests: list[GenerateRequest]) -> tuple[Batch, int, int]:
    """(device batch, output bucket, prefill window (0: from scratch)). The window and the reused rows are those
    of the configured (largest) draft depth whatever k the call then runs, so every k shares the prefill."""
    cfg, ecfg = self.cfg, self.engine_cfg
    for r in requests:
      if not r.prompt_ids:
        raise ValueError(f"request {r.request_id!r} has an empty prompt")
      if max(r.prompt_ids) >= cfg.vocab_size or min(r.prompt_ids) < 0:
        raise ValueError(f"request {r.request_id!r} has token ids outside [0, vocab_size={cfg.vocab_size})")
    uniq: dict[tuple[int, ...], int] = {}
    rows = [uniq.setdefault(tuple(r.prompt_ids), len(uniq)) for r in requests]
    B = bucket(len(requests), ecfg.min_batch_bucket)
    U = min(bucket(len(uniq), ecfg.min_batch_bucket), B)
    P = bucket(max(len(p) for p in uniq), ecfg.min_prompt_bucket)
    Lo = bucket(max(r.params.max_tokens for r in requests), ecfg.min_len_bucket)
    if P + Lo > cfg.max_position_embeddings:
      raise ValueError(f"prompt bucket {P} + output bucket {Lo} exceed max_position_embeddings="
                       f"{cfg.max_position_embeddings}")
    prompts = np.zeros((U, P), np.int32)
    pad = np.full((U,), P - 1, np.int32)  # filler prompts: one token
    for p, u in uniq.items():
      prompts[u, P - len(p):] = p
      pad[u] = P - len(p)
    n_stop = max([1] + [len(r.params.stop_token_ids) for r in requests])
    stop = np.full((B, n_stop), -1, np.int32)
    params = [r.params for r in requests] + [SamplingParams(max_tokens=1)] * (B - len(requests))
    for b, sp in enumerate(params):
      stop[b, :len(sp.stop_token_ids)] = sp.stop_token_ids
    self._calls += 1
    own = np.random.default_rng([self.engine_cfg.seed, self._calls]).integers(0, 2**32, size=B, dtype=np.uint64)
    seeds = np.array([own[b] if sp.seed is None else sp.seed % 2**32 for b, sp in enumerate(params)], np.uint32)
    window, prefix_cache, prefix_experts = self._reuse(list(uniq), prompts, pad, self._draft_tokens)
    batch = Batch(prompts_UxP=jnp.asarray(prompts), pad_U=jnp.asarray(pad),
                  row_prompt_B=jnp.asarray(rows + [0] * (B - len(requests)), jnp.int32),
                  temperature_B=jnp.asarray([sp.temperature for sp in params], jnp.float32),
                  top_k_B=jnp.asarray([sp.top_k for sp in params], jnp.int32),
                  top_p_B=jnp.asarray([sp.top_p for sp in params], jnp.float32),
                  max_tokens_B=jnp.asarray([sp.max_tokens for sp in params], jnp.int32),
                  stop_BxZ=jnp.asarray(stop), seeds_B=jnp.asarray(seeds),
                  prefix_cache=prefix_cache, prefix_experts_LmxUxPxK=prefix_experts)
    return batch, Lo, window

  def _reuse(self, uniq: list[tuple[int, ...]], prompts_UxP: np.ndarray, pad_U: np.ndarray, draft_tokens: int):
    """Looks the unique prompts up in the prefix cache → (window, cached rows at their prompt slots, their experts);
    (0, None, None) — a prefill from scratch, as without a cache — when nothing is reused or the window would not
    be narrower than the prompt width."""
    U, P = prompts_UxP.shape
    reused, entries = [0] * len(uniq), [None] * len(uniq)
    if self.engine_cfg.prefix_cache_bytes:
      for u, p in enumerate(uniq):
        entries[u], n = self.prefix_cache.lookup(np.asarray(p, np.int32))
        # The last prompt token always runs (its logits are sampled); with MTP only rows module 0 computed from the
        # true next token are reused.
        reused[u] = min(n, len(p) - 1, entries[u].mtp_len if draft_tokens and entries[u] else n)
    tail = max(len(p) - r for p, r in zip(uniq, reused))
    window = bucket(max(tail, draft_tokens + 1), self.engine_cfg.min_window_bucket)
    self.last_stats = {"prompt_tokens": sum(map(len, uniq)), "prefix_reused_tokens": sum(reused),
                       "prefill_window": window if window < P and any(reused) else P}
    if window >= P or not any(reused):
      return 0, None, None
    layout = jax.eval_shape(lambda: cm.init_cache(self.params, self.cfg, U, P))
    cache = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), layout)
    n_moe = self.cfg.num_hidden_layers - self.cfg.first_k_dense_replace
    experts = np.zeros((n_moe, U, P, self.cfg.num_experts_per_tok), np.int32)
    for u, (e, r) in enumerate(zip(entries, reused)):
      if r:
        at = slice(pad_U[u], pad_U[u] + r)
        for name, kv in e.rows.items():
          for key, rows_LsxTxX in kv.items():
            cache[name][key][:, u, at] = rows_LsxTxX[:, :r]
        experts[:, u, at] = e.experts_TxLmxK[:r].transpose(1, 0, 2)
    return window, cache, experts

  def _keep(self, requests: list[GenerateRequest], out: Output, rows_B: np.ndarray, P: int, draft_tokens: int
            ) -> None:
    """Puts each row's prompt + output (rows of its final cache) into the prefix cache."""
    W = draft_tokens + 1
    for b, r in enumerate(requests):
      m, n = len(r.prompt_ids), int(out.length_B[b])
      at = slice(P - m, P + n)
      rows = {name: {key: np.stack([layer[key][b, at] for layer in stack]) for key in ("c", "kr")}
              for name, stack in out.cache.items() if name != "mtp" or W > 1}
      experts = np.concatenate([out.prompt_experts_LmxUxPxK[:, rows_B[b], P - m:].transpose(1, 0, 2),
                                out.experts_BxLoxLmxK[b, :n]])
      # MTP rows within W of the end may come from rejected drafts or lack their next token (speculative.py).
      self.prefix_cache.insert(Entry(np.concatenate([np.asarray(r.prompt_ids, np.int32), out.tokens_BxLo[b, :n]]),
                                     rows, experts.astype(np.int32), max(0, m + n - W) if W > 1 else 0))

  def _generate_chunk(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
    batch, Lo, window = self._batch(requests)
    per_row = {f: v for f, v in batch._asdict().items() if not f.startswith("prefix")}
    batch = batch._replace(**placement_lib.rows(per_row, self.mesh, self.placement))
    P = batch.prompts_UxP.shape[1]
    compiles, compile_s = self.compiles, self.compile_s
    (cache, logits_BxV, h_BxHxD, prompt_experts), prefill_s, _ = self._program(
        _prefill, (batch,), **self.prefill_static(P, Lo, window))
    args = (batch._replace(prefix_cache=None, prefix_experts_LmxUxPxK=None), cache, logits_BxV, h_BxHxD)
    ks, why = self._pick_draft_tokens(args, Lo)
    if self._shrinks:
      runs = [(0, *shrinking.decode(self._program, batch, cache, logits_BxV, Lo, self.engine_cfg.shrink_rows,
                                    keep_cache=bool(self.engine_cfg.prefix_cache_bytes)))]
    else:
      runs = [(k, *self._program(_decode, args, max_len=Lo, draft_tokens=k)) for k in ks]
    (k, out, _, _), decode_s = runs[0], sum(s for _, _, s, _ in runs)
    out = jax.device_get(out._replace(prompt_experts_LmxUxPxK=prompt_experts,
                                      cache=out.cache if self.engine_cfg.prefix_cache_bytes else None))
    self.last_stats.update(prefill_s=prefill_s, decode_s=decode_s, compiles=self.compiles - compiles,
                           compile_s=self.compile_s - compile_s)
    self._record(requests, out, k, prefill_s + decode_s)
    if self.depth is not None:
      n = len(requests)
      self.depth.record([(kk, jax.device_get(o.stats.get("accept_hist")), int(np.asarray(o.length_B)[:n].sum()),
                          None if fresh else seconds) for kk, o, seconds, fresh in runs])
      if self.depth.settle() and self.log_fn is not None:
        self.log_fn(f"engine {self.version_log.engine}: draft depth k={self.depth.chosen} after {why} "
                    f"({self.depth.describe()})")
    rows_B = np.asarray(batch.row_prompt_B)
    if self.engine_cfg.prefix_cache_bytes:
      self._keep(requests, out, rows_B, P, k)
    results = []
    for b, r in enumerate(requests):
      n = int(out.length_B[b])
      toks = np.asarray(out.tokens_BxLo[b, :n], np.int32)
      stopped = n > 0 and int(toks[-1]) in r.params.stop_token_ids
      # Prompts are left-padded: the request's own P tokens are the last P slots of its unique prompt's row.
      prompt_PxLmxK = out.prompt_experts_LmxUxPxK[:, rows_B[b], -len(r.prompt_ids):].transpose(1, 0, 2)
      results.append(GenerateResult(output_ids=toks, logprobs=np.asarray(out.logprobs_BxLo[b, :n], np.float32),
                                    routed_experts=np.asarray(out.experts_BxLoxLmxK[b, :n], np.int32),
                                    policy_version=self.policy_version,
                                    finish_reason="stop" if stopped else "length",
                                    prompt_routed_experts=np.asarray(prompt_PxLmxK, np.int32),
                                    entropies=None if out.entropies_BxLo is None
                                    else np.asarray(out.entropies_BxLo[b, :n], np.float32)))
    return results

  @property
  def _shrinks(self) -> bool:
    """Whether plain decoding shrinks to its live rows (`EngineConfig.shrink_rows`; on one device)."""
    return bool(self.engine_cfg.shrink_rows) and not self._draft_tokens and (self.mesh is None or self.mesh.size == 1)

  def _pick_draft_tokens(self, args: tuple, Lo: int) -> tuple[list[int], str]:
    """The depths this call decodes with (the first one's output is returned) and why: the configured k, or
    `depth`'s choice, exploring or probing only where `depth` says (`draft_depth.py`)."""
    if self.depth is None:
      return [self._draft_tokens], "fixed"
    return self.depth.pick(lambda k: _key(_decode, args, max_len=Lo, draft_tokens=k) in self._programs)

  def _record(self, requests: list[GenerateRequest], out: Output, k: int, seconds: float) -> None:
    """`last_stats` and the version log of a finished call (`seconds`: its programs' run time, compiles
    excluded)."""
    hist = out.stats.get("accept_hist")
    self.last_stats.update({n: int(v) for n, v in out.stats.items() if n != "accept_hist"}, draft_tokens=k)
    tokens = int(np.asarray(out.length_B)[:len(requests)].sum())
    self.version_log.add(self.policy_version, all(r.params.temperature <= 0 for r in requests), k,
                         self.last_stats["drafted"], self.last_stats["accepted"],
                         int(hist.sum()) if hist is not None else 0, tokens, seconds)


def sample(params: dict, prompts: Sequence[Sequence[int]], cfg: ModelConfig, *, max_tokens: int = 64,
           temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, stop_token_ids: Sequence[int] = (),
           seed: int | None = 0, speculative: bool = False,
           engine_cfg: EngineConfig | None = None) -> list[GenerateResult]:
  """Samples one completion per prompt (notebook entry point; same sampling params for every prompt).

  Args:
    params: model params.
    prompts: token-id lists.
    cfg: model config.
    max_tokens, temperature, top_p, top_k, stop_token_ids: as `SamplingParams`.
    seed: base seed; prompt i uses seed + i (None: the engine's own stream).
    speculative: use MTP speculative decoding.
    engine_cfg: bucket sizes etc. (its `speculative` is overridden by the argument).

  Returns:
    One `GenerateResult` per prompt (output_ids, logprobs, routed_experts, finish_reason).
  """
  engine_cfg = dataclasses.replace(engine_cfg or EngineConfig(), speculative=speculative)
  engine = JaxEngine(params, cfg, engine_cfg)
  reqs = [GenerateRequest(tuple(int(t) for t in p),
                          SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_tokens,
                                         stop_token_ids=tuple(stop_token_ids),
                                         seed=None if seed is None else seed + i))
          for i, p in enumerate(prompts)]
  return engine.generate(reqs)
