"""The LM training step on a tiny model: MTP self-distillation isolation, packing, bias update, learning."""
import dataclasses

import compile_testlib
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from composer_jax import configs, model
from composer_jax.train import optim, step
from composer_jax.train.config import OptimConfig, TrainConfig
from experiments.configs import model as model_configs

CFG = configs.from_dict(model.ModelConfig, model_configs.get_config("tiny").to_dict())


def _batch(B=2, L=32, seed=0):
  rng = np.random.default_rng(seed)
  seg = np.ones((B, L), np.int32)
  seg[:, L // 2:] = 2                                     # two packed documents per row
  pos = np.concatenate([np.arange(L // 2), np.arange(L - L // 2)])[None].repeat(B, 0).astype(np.int32)
  return {"tokens": jnp.asarray(rng.integers(3, CFG.vocab_size, (B, L)), jnp.int32), "segment_ids": jnp.asarray(seg),
          "positions": jnp.asarray(pos), "loss_mask": jnp.ones((B, L), jnp.float32)}


@pytest.fixture(scope="module")
def params():
  return model.init(jax.random.key(0), CFG)


def _grads(params, batch, mtp_loss, mtp_weight):
  tcfg = TrainConfig(mtp_loss=mtp_loss, mtp_weight=mtp_weight)
  return jax.jit(jax.grad(lambda p: step.loss_fn(p, batch, CFG, tcfg)[0]))(params)


def _split(tree):
  trunk = {k: v for k, v in tree.items() if k != "mtp"}
  return trunk, tree["mtp"]


def test_mtp_self_distillation_sends_no_gradient_into_the_trunk(params):
  batch = _batch()
  g0_trunk, _ = _split(_grads(params, batch, "self_distill", 0.0))
  g1_trunk, g1_mtp = _split(_grads(params, batch, "self_distill", 1.0))
  for a, b in zip(jax.tree.leaves(g0_trunk), jax.tree.leaves(g1_trunk)):
    np.testing.assert_array_equal(a, b)                   # the MTP loss changes no trunk gradient at all
  assert float(optim.optax.tree.norm(g1_mtp)) > 0       # ... and does train the MTP module
  # The data-token MTP loss without detaching is the other option: there the trunk does feel it.
  gce_trunk, _ = _split(_grads(params, batch, "cross_entropy", 1.0))
  diffs = [float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(g0_trunk), jax.tree.leaves(gce_trunk))]
  assert max(diffs) > 1e-6


def test_packed_document_logits_do_not_depend_on_its_neighbour(params):
  batch = _batch(B=1, L=32)
  other = _batch(B=1, L=32, seed=1)
  swapped = dict(batch, tokens=batch["tokens"].at[:, 16:].set(other["tokens"][:, 16:]))
  forward = jax.jit(lambda p, tokens, **kw: model.forward(p, tokens, CFG, **kw)[0])
  la = forward(params, batch["tokens"], segment_ids=batch["segment_ids"], positions=batch["positions"])
  lb = forward(params, swapped["tokens"], segment_ids=batch["segment_ids"], positions=batch["positions"])
  np.testing.assert_allclose(la[:, :16], lb[:, :16], atol=1e-5)   # document 1 untouched by document 2's tokens
  alone = forward(params, batch["tokens"][:, :16])
  np.testing.assert_allclose(la[:, :16], alone, atol=1e-5)        # and equal to running it alone
  assert float(jnp.max(jnp.abs(la[:, 16:] - lb[:, 16:]))) > 1e-3


def test_step_updates_router_bias_from_load_and_learns(params):
  """Also: `jax.jit(train_step)` without shardings, on model.init params and an eager init_state, compiles once."""
  tcfg = TrainConfig(bias_update_rate=0.01)
  opt = optim.make_optimizer(OptimConfig(learning_rate=1e-2, warmup_steps=0), params)
  state = step.init_state(params, opt)
  batch = _batch()
  fn = jax.jit(lambda s, b: step.train_step(s, b, model_cfg=CFG, train_cfg=tcfg, optimizer=opt))
  bias0 = np.asarray(params["moe_layers"]["moe"]["bias"])
  _, aux = model.forward(params, batch["tokens"], CFG, segment_ids=batch["segment_ids"],
                         positions=batch["positions"], mtp_detach_trunk=True)
  with compile_testlib.lowerings() as first:
    new, m0 = fn(state, batch)
  load = np.asarray(aux["expert_load"])
  expected = bias0 + 0.01 * np.sign(load.mean(-1, keepdims=True) - load)
  np.testing.assert_allclose(new.params["moe_layers"]["moe"]["bias"], expected, atol=1e-7)
  mtp_load = np.asarray(aux["mtp_expert_load"])
  mtp_bias0 = np.asarray(params["mtp"]["block"]["moe"]["bias"])
  np.testing.assert_allclose(new.params["mtp"]["block"]["moe"]["bias"],
                             mtp_bias0 + 0.01 * np.sign(mtp_load.mean(-1, keepdims=True) - mtp_load), atol=1e-7)
  # The state init_state made is sharded as the step returns it, so the second call hits jit's cache.
  with compile_testlib.lowerings() as second:
    new, m = jax.block_until_ready(fn(new, batch))
  assert first.count >= 1 and second.count == 0, (first.count, second.count)
  for _ in range(14):
    new, m = fn(new, batch)
  assert int(new.step) == 16
  assert float(m["ce"]) < float(m0["ce"]) - 0.5           # memorises a fixed batch
  assert np.isfinite(float(m["grad_norm"])) and float(m["update_norm"]) > 0


def test_train_config_rejects_unknown_mtp_loss():
  with pytest.raises(ValueError, match="Unknown mtp_loss 'kl'"):
    TrainConfig(mtp_loss="kl")
  with pytest.raises(ValueError, match="steps must be positive"):
    dataclasses.replace(TrainConfig(), steps=0)
