"""The RL step: router replay wiring, mismatch/gap metrics, and one sharded optimizer step that learns."""
import dataclasses
import functools

import compile_testlib
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from composer_jax import model
from composer_jax.parallel import mesh as mesh_lib
from composer_jax.rl import losses, placement
from composer_jax.rl import step as rl_step_lib
from composer_jax.rl.batch import BatchConfig, from_consumed
from composer_jax.sampling import sampler
from composer_jax.train import optim
from composer_jax.train import step as train_step_lib
from composer_jax.train.config import OptimConfig, TrainConfig
from rollout.queue import QueueConsumer, QueueProducer, open_store
from rollout.staleness import StalenessConfig

CFG = model.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                        num_hidden_layers=2, num_attention_heads=2, kv_lora_rank=16, qk_nope_head_dim=8,
                        qk_rope_head_dim=8, v_head_dim=8, n_routed_experts=8, num_experts_per_tok=2,
                        first_k_dense_replace=0, moe_impl="dense")
LM = CFG.num_hidden_layers - CFG.first_k_dense_replace
B, L, PROMPT = 4, 10, 3


def _tokens():
  return jax.random.randint(jax.random.key(1), (B, L), 0, CFG.vocab_size)


def _batch(tokens, inf_logprobs, routing, reward=(1.0, 0.0, 0.5, 0.0), group=(0, 0, 1, 1)):
  gen = (jnp.arange(L) >= PROMPT).astype(jnp.float32)
  return {"tokens": tokens, "segment_ids": jnp.ones((B, L), jnp.int32),
          "positions": jnp.broadcast_to(jnp.arange(L), (B, L)), "seq": jnp.broadcast_to(jnp.arange(B)[:, None], (B, L)),
          "gen_mask": jnp.broadcast_to(gen, (B, L)),
          "inf_logprobs": inf_logprobs, "routing": routing, "reward": jnp.asarray(reward, jnp.float32),
          "passed": jnp.asarray(reward, jnp.float32) == 1.0, "group": jnp.asarray(group, jnp.int32),
          "first": jnp.ones(B), "valid": jnp.ones(B), "is_cap": jnp.full(B, 2.0), "staleness": jnp.zeros(B, jnp.int32),
          "traj_gen_tokens": jnp.full(B, L - PROMPT, jnp.float32)}


def _logp(params, tokens, routing=None):
  """The reference: full logits from `model.forward` and a plain log-softmax (the step runs the chunked head)."""
  logits, aux = model.forward(params, tokens, CFG, routing=routing)
  lp = jnp.take_along_axis(jax.nn.log_softmax(logits[:, :-1], -1), tokens[:, 1:, None], -1)[..., 0]
  return jnp.pad(lp, ((0, 0), (1, 0))), aux["experts"]


@pytest.fixture(scope="module")
def setup():
  params = model.init(jax.random.key(0), CFG)
  ref_params = model.init(jax.random.key(7), CFG)
  tokens = _tokens()
  lp_own, own = jax.jit(_logp)(params, tokens)
  # An "engine" that routed differently: every recorded expert shifted by one (still distinct within the top-k).
  engine = (own + 1) % CFG.n_routed_experts
  lp_engine, _ = jax.jit(_logp)(params, tokens, engine)
  return params, ref_params, tokens, lp_own, own, engine, lp_engine


loss_fn = jax.jit(lambda p, b, r, cfg: rl_step_lib.rl_loss_fn(p, b, r, model_cfg=CFG, rl_cfg=cfg)[1][0],
                  static_argnums=3)


def test_replaying_own_routing_has_no_mismatch_and_no_gap(setup):
  params, ref_params, tokens, lp_own, own, _, _ = setup
  m = loss_fn(params, _batch(tokens, lp_own, own), ref_params, rl_step_lib.RLConfig())
  assert float(m["routing_mismatch_rate"]) == 0.0 and float(m["routing_mismatch_token_rate"]) == 0.0
  assert float(m["logprob_gap_replay"]) < 1e-5 and float(m["logprob_gap_no_replay"]) < 1e-5
  np.testing.assert_allclose(m["importance_ratio_mean"], 1.0, rtol=1e-5)


def test_replay_closes_the_gap_of_a_differently_routing_engine(setup):
  params, ref_params, tokens, _, _, engine, lp_engine = setup
  batch = _batch(tokens, lp_engine, engine)
  m = loss_fn(params, batch, ref_params, rl_step_lib.RLConfig())
  assert float(m["routing_mismatch_rate"]) > 0.5                 # the first MoE layer differs everywhere
  assert float(m["routing_mismatch_token_rate"]) == 1.0
  assert float(m["logprob_gap_replay"]) < 1e-5                   # replay reproduces the engine's logprobs
  assert float(m["logprob_gap_no_replay"]) > 1e-3                # its own routing does not
  m_off = loss_fn(params, batch, ref_params, rl_step_lib.RLConfig(router_replay=False))
  np.testing.assert_allclose(m_off["logprob_gap_no_replay"], m["logprob_gap_no_replay"], rtol=1e-5)
  assert "logprob_gap_replay" not in m_off
  assert float(m_off["routing_mismatch_rate"]) > 0.5              # measured against the engine's record


def test_rollouts_at_a_temperature_are_scored_at_it(setup):
  """The engine records log softmax(logits / T) (`sampler.policy_logprobs`); the step scores π and π_ref at the
  same T, so a rollout of the policy itself has ratio 1 and no gap, where scoring it at T = 1 would not."""
  params, _, tokens, _, own, _, _ = setup
  t = 0.7

  @jax.jit
  def engine_logp(params, tokens, routing):
    logits, _ = model.forward(params, tokens, CFG, routing=routing)
    lp = sampler.policy_logprobs(logits[:, :-1].reshape(-1, CFG.vocab_size), jnp.full(B * (L - 1), t))
    return jnp.pad(jnp.take_along_axis(lp, tokens[:, 1:].reshape(-1, 1), -1).reshape(B, L - 1), ((0, 0), (1, 0)))

  batch = _batch(tokens, engine_logp(params, tokens, own), own)
  m = loss_fn(params, batch, params, rl_step_lib.RLConfig(temperature=t))
  assert float(m["logprob_gap_replay"]) < 1e-5 and float(m["logprob_gap_no_replay"]) < 1e-5
  np.testing.assert_allclose(m["importance_ratio_mean"], 1.0, rtol=1e-5)
  assert abs(float(m["kl"])) < 1e-6                             # the reference scored at T too
  m1 = loss_fn(params, batch, params, rl_step_lib.RLConfig())
  assert float(m1["logprob_gap_replay"]) > 1e-2                  # π_1 against the engine's π_0.7
  with pytest.raises(ValueError, match="rl.temperature=0"):
    rl_step_lib.RLConfig(temperature=0.0)


def test_step_differentiates_through_the_replayed_routing(setup):
  """Partially recorded routing: the step must replay it and fill the rest with the model's own choice."""
  params, ref_params, tokens, _, own, engine, _ = setup
  recorded = jnp.where((jnp.arange(L) >= PROMPT)[None, None, :, None], engine, -1)   # decode tokens only
  filled = jnp.where(recorded >= 0, recorded, own)
  inf = jax.jit(_logp)(params, tokens, filled)[0] + 0.3 * jax.random.normal(jax.random.key(3), (B, L))
  batch = _batch(tokens, inf, recorded)
  cfg = rl_step_lib.RLConfig(loss=losses.LossConfig(kl_coef=0.1, is_cap=1.2))

  def reference(p):   # the loss written out with the filled routing passed explicitly
    lp = _logp(p, tokens, filled)[0]
    ref_lp = _logp(ref_params, tokens, filled)[0]
    adv = jnp.array([0.5, -0.5, 0.25, -0.25])
    return losses.policy_loss(lp, inf, ref_lp, adv, batch["gen_mask"], batch["is_cap"], cfg.loss)[0]

  got_loss, got_grads = jax.jit(jax.value_and_grad(
      lambda p: rl_step_lib.rl_loss_fn(p, batch, ref_params, model_cfg=CFG, rl_cfg=cfg)[0]))(params)
  want_loss, want_grads = jax.jit(jax.value_and_grad(reference))(params)
  np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
  # Routers get gradients through the recomputed gate weights; tolerance: float32 sums over a few hundred terms.
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), got_grads, want_grads)


def test_sharded_rl_step_raises_the_logprob_of_rewarded_samples(setup):
  params, _, tokens, lp_own, own, _, _ = setup
  mesh = mesh_lib.make_mesh({"data": -1})
  optimizer = optim.make_optimizer(OptimConfig(learning_rate=3e-3, warmup_steps=0, weight_decay=0.0), params)
  abstract = jax.eval_shape(lambda: params)
  p_shard = model.shardings(CFG, mesh)
  shardings = train_step_lib.state_shardings(optimizer, abstract, p_shard)
  state = train_step_lib.init_state(jax.device_put(params, p_shard), optimizer)   # eager, as in a notebook
  rows = 8                                   # the 8 fake devices each take one row
  tok = jnp.concatenate([tokens, tokens])
  own8 = jnp.concatenate([own, own], axis=1)
  lp8 = jnp.concatenate([lp_own, lp_own])
  batch = _batch(tokens, lp_own, own)
  batch = {k: (jnp.concatenate([v, v], axis=1) if k == "routing" else jnp.concatenate([v, v])) for k, v in
           batch.items()}
  batch.update(tokens=tok, routing=own8, inf_logprobs=lp8, group=jnp.arange(rows) // 2,
               seq=jnp.broadcast_to(jnp.arange(rows)[:, None], (rows, L)),
               reward=jnp.array([1.0, 0.0] * 4), passed=jnp.array([1.0, 0.0] * 4))
  bsh = placement.batch_shardings(mesh)
  batch = jax.device_put(batch, bsh)
  ref = jax.device_put(params, p_shard)      # the reference is the starting policy
  step = rl_step_lib.make_rl_step(CFG, rl_step_lib.RLConfig(), optimizer, shardings, bsh, p_shard)
  gen = np.asarray(batch["gen_mask"])
  before = (np.asarray(lp8) * gen).sum(1)
  with compile_testlib.lowerings() as first:
    state, m = step(state, batch, ref)
  assert int(state.step) == 1
  for k in ("loss", "kl", "entropy", "reward", "pass_rate", "length", "clip_fraction", "importance_ratio_mean",
            "routing_mismatch_rate", "logprob_gap_replay", "logprob_gap_no_replay", "grad_norm",
            "expert_load_max_over_mean"):
    assert np.isfinite(float(m[k])), k
  np.testing.assert_allclose([m["reward"], m["pass_rate"], m["length"]], [0.5, 0.5, L - PROMPT], rtol=1e-6)
  np.testing.assert_allclose(m["kl"], 0.0, atol=1e-6)             # policy == reference at step 0
  after = (np.asarray(jax.jit(_logp)(jax.device_get(state.params), np.asarray(tok))[0]) * gen).sum(1)
  delta = after - before
  assert (delta[0::2] > 0).all() and (delta[1::2] < 0).all(), delta   # rewarded up, unrewarded down
  with compile_testlib.lowerings() as second:
    jax.block_until_ready(step(state, batch, ref))
  assert first.count >= 1 and second.count == 0, (first.count, second.count)


def test_routing_needed_stops_before_each_rows_last_generated_token():
  gen = np.zeros((3, 6), np.float32)
  gen[0, [2, 4]] = 1          # last generated token at 4: positions 0..3 feed it
  gen[1, 1] = 1
  seg = np.ones((3, 6), np.int32)
  seg[0, 5] = 0
  got = rl_step_lib.routing_needed({"tokens": jnp.zeros((3, 6), jnp.int32), "gen_mask": jnp.asarray(gen),
                                    "segment_ids": jnp.asarray(seg)})
  want = np.zeros((3, 6), bool)
  want[0, :4] = True
  want[1, :1] = True          # row 2 generated nothing: no position matters
  np.testing.assert_array_equal(got, want)


measured_loss_fn = jax.jit(lambda p, b, r, measure: rl_step_lib.rl_loss_fn(
    p, b, r, model_cfg=CFG, rl_cfg=rl_step_lib.RLConfig(), measure_unreplayed=measure)[1][0])


def test_unreplayed_pass_runs_only_when_routing_is_missing_or_its_metric_is_due(setup):
  params, ref_params, tokens, _, own, engine, lp_engine = setup
  # Everything recorded except the last position, which no trained token depends on (SGLang never feeds it).
  tail_unrecorded = engine.at[:, :, L - 1].set(-1)
  full = _batch(tokens, lp_engine, tail_unrecorded)
  skipped = measured_loss_fn(params, full, ref_params, False)
  measured = measured_loss_fn(params, full, ref_params, True)
  assert np.isnan(float(skipped["logprob_gap_no_replay"]))           # pass 2 did not run
  assert float(measured["logprob_gap_no_replay"]) > 1e-3              # it did, and saw the engine's other routing
  for k in ("loss", "kl", "logprob_gap_replay", "routing_mismatch_rate", "entropy"):
    np.testing.assert_allclose(skipped[k], measured[k], rtol=1e-6, err_msg=k)   # the same replay either way
  assert float(skipped["logprob_gap_replay"]) < 1e-5
  # A needed position unrecorded (the prompt, as from an engine that logs decode routing only): pass 2 must run.
  prompt_unrecorded = _batch(tokens, lp_engine, engine.at[:, :, :PROMPT].set(-1))
  assert float(measured_loss_fn(params, prompt_unrecorded, ref_params, False)["logprob_gap_no_replay"]) > 1e-3


def _routing_load(routing_LmxBxLxK):
  return np.stack([np.bincount(np.asarray(r).ravel(), minlength=CFG.n_routed_experts) for r in routing_LmxBxLxK])


def test_rl_step_updates_router_bias_from_the_replayed_load_and_compiles_once(setup):
  params, ref_params, tokens, lp_own, own, _, _ = setup
  skewed = own.at[0].set(jnp.broadcast_to(jnp.array([0, 1]), (B, L, 2)))   # layer 0: every token to experts 0, 1
  rate = 0.01
  cfg = rl_step_lib.RLConfig(bias_update_rate=rate)
  opt = optim.make_optimizer(OptimConfig(learning_rate=1e-3, warmup_steps=0), params)
  fn = jax.jit(functools.partial(rl_step_lib.rl_step, model_cfg=CFG, rl_cfg=cfg, optimizer=opt))
  batch = _batch(tokens, lp_own, skewed)
  state = train_step_lib.init_state(params, opt)
  with compile_testlib.lowerings() as first:
    new, _ = fn(state, batch, ref_params)
  bias0, bias1 = np.asarray(params["moe_layers"]["moe"]["bias"]), np.asarray(new.params["moe_layers"]["moe"]["bias"])
  load = _routing_load(skewed)                                               # [Lm, E]
  np.testing.assert_allclose(bias1, bias0 + rate * np.sign(load.mean(-1, keepdims=True) - load), atol=1e-7)
  assert (bias1[0, :2] < bias0[0, :2]).all() and (bias1[0, 2:] > bias0[0, 2:]).all()   # overloaded pushed down
  with compile_testlib.lowerings() as second:
    jax.block_until_ready(fn(new, batch, ref_params))
  assert first.count >= 1 and second.count == 0, (first.count, second.count)


def test_queue_to_batch_to_step(setup):
  """Trajectory dicts → queue → from_consumed → rl_loss_fn: the recorded routing survives the trip per token."""
  params, ref_params, tokens, lp_own, own, _, _ = setup
  trajs = []
  for i in range(B):
    routed = np.asarray(own[:, i]).transpose(1, 0, 2).copy()           # [T, Lm, K]
    routed[:PROMPT] = -1
    trajs.append({"task_id": "t", "reward": float(i % 2), "segments": [{
        "tokens_T": np.asarray(tokens[i]), "gen_mask_T": (np.arange(L) >= PROMPT).astype(np.int8),
        "logprobs_T": np.asarray(lp_own[i]), "routed_TxNxK": routed}]})
  kv = open_store("memory://")
  producer = QueueProducer(kv, "w0")
  producer.append_group(trajs[:2], policy_version=3)
  producer.append_group(trajs[2:], policy_version=4)
  consumed = QueueConsumer(kv, StalenessConfig(max_staleness=1)).poll(4, max_rows=B)
  batch = from_consumed(consumed, BatchConfig(rows=B, length=L + 2, n_moe_layers=LM, top_k=2))
  np.testing.assert_array_equal(batch["staleness"], [1, 1, 0, 0])
  m = loss_fn(params, {k: jnp.asarray(v) for k, v in batch.items()}, ref_params, rl_step_lib.RLConfig())
  assert float(m["routing_mismatch_rate"]) == 0.0 and float(m["logprob_gap_replay"]) < 1e-5
  np.testing.assert_allclose(m["generated_tokens"], B * (L - PROMPT))


def test_freeze_subtrees_stops_weight_decay_on_mtp():
  params = {"mtp": {"w": jnp.ones((2, 2))}, "moe_layers": {"moe": {"bias": jnp.ones((1, 4)),
                                                                   "router": jnp.ones((1, 2, 4))}}}
  opt = optim.make_optimizer(OptimConfig(warmup_steps=0, weight_decay=0.5), params, frozen=("mtp",))
  zero_grads = jax.tree.map(jnp.zeros_like, params)
  updates, _ = opt.update(zero_grads, opt.init(params), params)
  assert float(jnp.abs(updates["mtp"]["w"]).max()) == 0.0                    # frozen: no decay
  assert float(jnp.abs(updates["moe_layers"]["moe"]["bias"]).max()) == 0.0    # the router bias stays frozen
  assert float(jnp.abs(updates["moe_layers"]["moe"]["router"]).max()) > 0.0   # trained leaves still decay


def test_rl_and_lm_steps_lower_for_cuda(setup):
  """The GPU path (moe_impl='ragged', the pass-2 `lax.cond`, the chunked head) still lowers for cuda on a CPU host."""
  params, ref_params, tokens, lp_own, own, _, _ = setup
  gpu_cfg = dataclasses.replace(CFG, moe_impl="ragged")
  opt = optim.make_optimizer(OptimConfig(), params)
  state = train_step_lib.init_state(params, opt)
  rl = jax.jit(functools.partial(rl_step_lib.rl_step, model_cfg=gpu_cfg, rl_cfg=rl_step_lib.RLConfig(),
                                 optimizer=opt))
  rl.trace(state, _batch(tokens, lp_own, own), ref_params).lower(lowering_platforms=("cuda",))
  lm_batch = {"tokens": tokens, "segment_ids": jnp.ones((B, L), jnp.int32),
              "positions": jnp.broadcast_to(jnp.arange(L), (B, L)), "loss_mask": jnp.ones((B, L))}
  lm = jax.jit(functools.partial(train_step_lib.train_step, model_cfg=gpu_cfg, train_cfg=TrainConfig(),
                                 optimizer=opt))
  lm.trace(state, lm_batch).lower(lowering_platforms=("cuda",))
