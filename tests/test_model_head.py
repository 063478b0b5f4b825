"""The chunked LM head (model/head.py) against its plain full-logits references: values and gradients."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from composer_jax.model import head

B, L, D, V = 2, 7, 16, 37      # 14 tokens: chunk sizes below divide it, do not, or exceed it


def _inputs(seed=0, dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  h = jnp.asarray(rng.normal(size=(B, L, D)), dtype)
  w = jnp.asarray(rng.normal(size=(D, V)) * 0.5, dtype)
  t = jnp.asarray(rng.integers(0, V, size=(B, L)), jnp.int32)
  return h, w, t


def test_token_logprobs_hand_computed():
  # One token, D = V = 2, w = identity: logits are h itself.
  h = jnp.array([[[np.log(3.0), 0.0]]])
  logp, ent = head.token_logprobs(h, jnp.eye(2), jnp.array([[0]]), with_entropy=True)
  np.testing.assert_allclose(logp, [[np.log(0.75)]], rtol=1e-6)
  np.testing.assert_allclose(ent, [[-(0.75 * np.log(0.75) + 0.25 * np.log(0.25))]], rtol=1e-6)


@pytest.mark.parametrize("chunk", [1, 3, 5, 14, 100])
def test_token_logprobs_and_entropy_match_reference(chunk):
  h, w, t = _inputs()
  rng = np.random.default_rng(1)
  a, b = jnp.asarray(rng.normal(size=(B, L)), jnp.float32), jnp.asarray(rng.normal(size=(B, L)), jnp.float32)

  def obj(fn, h, w):
    logp, ent = fn(h, w)
    return jnp.sum(a * logp + b * ent)

  fast = lambda h, w: head.token_logprobs(h, w, t, chunk_size=chunk, with_entropy=True)
  ref = lambda h, w: head.token_logprobs_reference(h, w, t, with_entropy=True)
  for got, want in zip(jax.jit(fast)(h, w), ref(h, w)):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  g_fast = jax.jit(jax.grad(lambda h, w: obj(fast, h, w), argnums=(0, 1)))(h, w)
  g_ref = jax.grad(lambda h, w: obj(ref, h, w), argnums=(0, 1))(h, w)
  for got, want in zip(g_fast, g_ref):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_cross_entropy_masking_and_gradients():
  h, w, t = _inputs(2)
  mask = jnp.asarray(np.random.default_rng(3).integers(0, 2, size=(B, L)), jnp.float32)
  ce, n = head.cross_entropy(h, w, t, mask, chunk_size=4)
  ce_ref, n_ref = head.cross_entropy_reference(h, w, t, mask)
  np.testing.assert_allclose(ce, ce_ref, rtol=1e-6)
  assert float(n) == float(n_ref) == float(mask.sum())
  g = jax.grad(lambda h, w: head.cross_entropy(h, w, t, mask, chunk_size=4)[0], argnums=(0, 1))(h, w)
  g_ref = jax.grad(lambda h, w: head.cross_entropy_reference(h, w, t, mask)[0], argnums=(0, 1))(h, w)
  for got, want in zip(g, g_ref):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  # Masked tokens get exactly zero gradient; an all-masked batch gives loss 0 and n 0.
  np.testing.assert_array_equal(np.asarray(g[0])[np.asarray(mask) == 0], 0.0)
  ce0, n0 = head.cross_entropy(h, w, t, jnp.zeros((B, L)))
  assert float(ce0) == 0.0 and float(n0) == 0.0


def test_bf16_inputs_accumulate_in_float32():
  h, w, t = _inputs(4, jnp.bfloat16)
  logp = head.token_logprobs(h, w, t, chunk_size=3)
  assert logp.dtype == jnp.float32
  want = head.token_logprobs_reference(h.astype(jnp.float32), w.astype(jnp.float32), t)
  np.testing.assert_allclose(logp, want, rtol=1e-5, atol=1e-5)     # same bf16 inputs, f32 accumulation
  gh, gw = jax.grad(lambda h, w: head.token_logprobs(h, w, t, chunk_size=3).sum(), argnums=(0, 1))(h, w)
  assert gh.dtype == jnp.bfloat16 and gw.dtype == jnp.bfloat16


@pytest.mark.parametrize("chunk", [4, 14])
def test_distill_cross_entropy_matches_reference(chunk):
  h, w, _ = _inputs(5)
  th, _, _ = _inputs(6)
  ce, agree = head.distill_cross_entropy(h, w, th, chunk_size=chunk)
  ce_ref, agree_ref = head.distill_cross_entropy_reference(h, w, th)
  np.testing.assert_allclose(ce, ce_ref, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(agree, agree_ref)
  # Student h and w get the gradient; the teacher none (it is a fixed target).
  wt = jnp.asarray(np.random.default_rng(7).normal(size=(B, L)), jnp.float32)
  fn = lambda h, w, th: jnp.sum(wt * head.distill_cross_entropy(h, w, th, chunk_size=chunk)[0])
  fr = lambda h, w, th: jnp.sum(wt * head.distill_cross_entropy_reference(h, w, th)[0])
  g = jax.grad(fn, argnums=(0, 1, 2))(h, w, th)
  g_ref = jax.grad(fr, argnums=(0, 1, 2))(h, w, th)
  for got, want in zip(g, g_ref):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(g[2], 0.0)


def test_distill_of_itself_is_the_entropy():
  h, w, _ = _inputs(8)
  ce, agree = head.distill_cross_entropy(h, w, h)
  _, ent = head.token_logprobs_reference(h, w, jnp.zeros((B, L), jnp.int32), with_entropy=True)
  np.testing.assert_allclose(ce, ent, rtol=1e-5)
  np.testing.assert_array_equal(agree, 1.0)


def test_backward_never_builds_full_logits():
  # The jitted gradient's largest intermediate is one [chunk, V] block, not [B·L, V].
  h, w, t = jnp.zeros((4, 256, 8)), jnp.zeros((8, 1000)), jnp.zeros((4, 256), jnp.int32)
  f = jax.jit(jax.grad(lambda h, w: head.token_logprobs(h, w, t, chunk_size=64).sum(), argnums=(0, 1)))
  hlo = f.lower(h, w).as_text()
  assert "1024x1000" not in hlo and "4x256x1000" not in hlo
  assert "64x1000" in hlo


def test_bad_shapes_are_named():
  h, w, t = _inputs()
  with pytest.raises(ValueError, match="targets have shape"):
    head.token_logprobs(h, w, t[:, :3])
  with pytest.raises(ValueError, match="w has shape"):
    head.token_logprobs(h, w.T, t)
  with pytest.raises(ValueError, match="chunk_size=0"):
    head.token_logprobs(h, w, t, chunk_size=0)


def test_lowers_for_cuda():
  h, w, t = _inputs()
  f = jax.jit(jax.value_and_grad(lambda h, w: head.token_logprobs(h, w, t, with_entropy=True)[1].sum(),
                                 argnums=(0, 1)))
  f.trace(h, w).lower(lowering_platforms=("cuda",))
  g = jax.jit(jax.grad(lambda h, w: head.distill_cross_entropy(h, w, h)[0].sum()))
  g.trace(h, w).lower(lowering_platforms=("cuda",))


def test_hidden_states_through_the_head_equal_forward_logits():
  from composer_jax import model
  cfg = model.ModelConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_nextn_predict_layers=1)
  params = model.init(jax.random.key(0), cfg)
  tok = jax.random.randint(jax.random.key(1), (2, 9), 0, 64)
  logits, aux = jax.jit(model.forward, static_argnums=2)(params, tok, cfg)
  h, haux = jax.jit(model.hidden_states, static_argnums=2)(params, tok, cfg)
  w = model.lm_head(params, cfg)
  targets = jnp.roll(tok, -1, axis=1)
  want = jnp.take_along_axis(jax.nn.log_softmax(logits, -1), targets[..., None], -1)[..., 0]
  np.testing.assert_allclose(head.token_logprobs(h, w, targets, chunk_size=5), want, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(head.logits(haux["mtp_hidden"][0], w), aux["mtp_logits"][0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("scan", [True, False])
def test_lm_loss_and_cached_decode_lower_for_cuda(scan):
  """The GPU configuration (ragged experts, scanned or unrolled stacks) of the loss path and one decode step."""
  from composer_jax import model
  from composer_jax.sampling import cached_model as cm
  cfg = model.ModelConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_nextn_predict_layers=1,
                          moe_impl="ragged", scan_layers=scan)
  params = model.abstract_params(cfg)
  tok = jax.ShapeDtypeStruct((2, 8), jnp.int32)

  def loss(p, tok):
    h, aux = model.hidden_states(p, tok, cfg)
    ce, _ = head.cross_entropy(h, model.lm_head(p, cfg), tok, jnp.ones(tok.shape))
    dce, _ = head.distill_cross_entropy(aux["mtp_hidden"][0], model.lm_head(p, cfg, detach=True), h)
    return ce + dce.mean()

  jax.jit(jax.grad(loss)).trace(params, tok).lower(lowering_platforms=("cuda",))
  cache = jax.eval_shape(lambda p: cm.init_cache(p, cfg, 2, 16), params)
  step = jax.jit(lambda p, t, c: cm.forward_cached(p, t, c, jnp.full((2,), 8, jnp.int32), jnp.zeros(2, jnp.int32),
                                                   cfg))
  step.trace(params, jax.ShapeDtypeStruct((2, 1), jnp.int32), cache).lower(lowering_platforms=("cuda",))


def test_an_undifferentiated_entropy_adds_nothing_to_the_gradient():
  """The RL step reads the entropy as a stop-gradient metric: the gradient through logp alone equals the logp-only
  path's (the backward then skips the entropy term), and a differentiated entropy still changes it."""
  h, w, t = _inputs(4)
  a = jnp.asarray(np.random.default_rng(5).normal(size=(B, L)), jnp.float32)

  def with_metric(h, w):
    logp, ent = head.token_logprobs(h, w, t, chunk_size=3, with_entropy=True)
    return jnp.sum(a * logp) + 0.0 * jnp.sum(jax.lax.stop_gradient(ent))
  g = jax.jit(jax.grad(with_metric, argnums=(0, 1)))(h, w)
  g_plain = jax.grad(lambda h, w: jnp.sum(a * head.token_logprobs(h, w, t, chunk_size=3)), argnums=(0, 1))(h, w)
  for got, want in zip(g, g_plain, strict=True):
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
  g_ent = jax.grad(lambda h: jnp.sum(head.token_logprobs(h, w, t, chunk_size=3, with_entropy=True)[1]))(h)
  assert float(jnp.abs(g_ent).max()) > 1e-3
