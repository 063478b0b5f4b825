"""Per-token vs per-tensor second-level scaling for low-precision MoE matmuls: error sweep and short training runs.

The Composer 2 report says per-token (rather than per-tensor) scaling was critical for stability of its MXFP8/NVFP4
MoE layers. This module measures both sides on CPU:

1. `error_sweep`: a grouped matmul whose activations hold a few "massive" tokens (norm x `multiplier`); the output
   error on the *ordinary* tokens, vs exact f32, for each format and second-level scaling.
2. `train_curves`: a tiny MoE bigram LM (embedding -> router -> top-k experts -> head; no norm before the experts,
   so the outlier token reaches the quantiser unchanged) whose BOS embedding is scaled by `multiplier`, trained
   with each matmul mode on the same data.

`run(...)` writes `quant_ablation.png`, `quant_ablation.md` (tables) and `quant_ablation.json` to a directory.

Letters: T tokens, D hidden, F expert ffw, E experts, K top-k, V vocab, B batch, L length.
"""
from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax

from kernels_pallas.moe_matmul import moe_matmul

# (label, matmul, second-level scale); MXFP8 has no second level, so it appears once.
MODES = (("bf16", "bf16", "per_token"), ("mxfp8", "mxfp8", "per_token"),
         ("nvfp4/per_token", "nvfp4", "per_token"), ("nvfp4/per_tensor", "nvfp4", "per_tensor"))


@dataclasses.dataclass(frozen=True)
class AblationConfig:
  """Sizes of both experiments (defaults run in ~3 min on 2 CPU cores)."""
  multipliers: tuple[float, ...] = (1.0, 1e1, 1e2, 1e3, 1e4, 1e5, 1e6)
  n_outliers: int = 4
  tokens: int = 256
  hidden: int = 256
  ffw: int = 128
  experts: int = 4
  train_multipliers: tuple[float, ...] = (1.0, 1e3, 1e6)
  train_steps: int = 150
  vocab: int = 64
  batch: int = 16
  length: int = 32
  top_k: int = 2
  learning_rate: float = 3e-3
  seed: int = 0


def _sorted_groups(key, t: int, e: int) -> jax.Array:
  """Random group sizes [E] summing to T."""
  cuts = jnp.sort(jax.random.randint(key, (e - 1,), 0, t + 1))
  return jnp.diff(jnp.concatenate([jnp.zeros(1, jnp.int32), cuts.astype(jnp.int32), jnp.full(1, t, jnp.int32)]))


def error_sweep(cfg: AblationConfig) -> dict[str, list[float]]:
  """Relative output error on ordinary tokens vs outlier multiplier, per mode (forward grouped matmul)."""
  kx, kw, kg, ko = jax.random.split(jax.random.key(cfg.seed), 4)
  x_TxD = jax.random.normal(kx, (cfg.tokens, cfg.hidden))
  w_ExDxF = jax.random.normal(kw, (cfg.experts, cfg.hidden, cfg.ffw)) / np.sqrt(cfg.hidden)
  gs = _sorted_groups(kg, cfg.tokens, cfg.experts)
  outliers = jax.random.choice(ko, cfg.tokens, (cfg.n_outliers,), replace=False)
  ordinary_T = jnp.ones(cfg.tokens, bool).at[outliers].set(False)
  # Weights and sizes are arguments, not closed-over constants, so XLA does not constant-fold their quantisation.
  exact = jax.jit(lambda x, w, g: jax.lax.ragged_dot(x, w, g, precision=jax.lax.Precision.HIGHEST))
  out: dict[str, list[float]] = {}
  for label, matmul, scale in MODES:
    f = jax.jit(lambda x, w, g, matmul=matmul, scale=scale: moe_matmul(x, w, g, matmul=matmul, scale=scale))
    errs = []
    for m in cfg.multipliers:
      x = x_TxD.at[outliers].multiply(m)
      ref = exact(x, w_ExDxF, gs) * ordinary_T[:, None]
      d = f(x, w_ExDxF, gs) * ordinary_T[:, None] - ref
      errs.append(float(jnp.linalg.norm(d) / jnp.linalg.norm(ref)))
    out[label] = errs
  return out


def _init(key, cfg: AblationConfig) -> dict[str, jax.Array]:
  ks = jax.random.split(key, 5)
  d, f, e, v = cfg.hidden, cfg.ffw, cfg.experts, cfg.vocab
  return {"embed": jax.random.normal(ks[0], (v, d)), "router": jax.random.normal(ks[1], (d, e)) / np.sqrt(d),
          "w_in": jax.random.normal(ks[2], (e, d, f)) / np.sqrt(d),
          "w_out": jax.random.normal(ks[3], (e, f, d)) / np.sqrt(f), "head": jax.random.normal(ks[4], (d, v)) / d}


def tiny_moe_logits(params, tokens_BxL, cfg: AblationConfig, matmul: str, scale: str, multiplier: float):
  """Bigram MoE LM; token 0 (BOS) gets a `multiplier`-times larger embedding (a massive-activation token)."""
  x_TxD = params["embed"][tokens_BxL.reshape(-1)]
  x_TxD = x_TxD * jnp.where(tokens_BxL.reshape(-1) == 0, multiplier, 1.0)[:, None]
  t = x_TxD.shape[0]
  probs_TxE = jax.nn.softmax(x_TxD / jnp.linalg.norm(x_TxD, axis=-1, keepdims=True) @ params["router"] * 8)
  gate_TxK, idx_TxK = jax.lax.top_k(probs_TxE, cfg.top_k)
  expert_M = idx_TxK.reshape(-1)
  order_M = jnp.argsort(expert_M, stable=True)
  token_M = order_M // cfg.top_k
  sizes_E = jnp.bincount(expert_M, length=cfg.experts).astype(jnp.int32)
  mm = lambda a, w: moe_matmul(a, w, sizes_E, matmul=matmul, scale=scale)
  h_MxF = jax.nn.gelu(mm(x_TxD[token_M], params["w_in"]))
  y_MxD = mm(h_MxF, params["w_out"]) * gate_TxK.reshape(-1)[order_M][:, None]
  y_TxD = jnp.zeros((t, x_TxD.shape[1])).at[token_M].add(y_MxD)
  # RMS norm with eps inside the root: finite gradients even when quantisation zeroes a token's output.
  h_TxD = y_TxD * jax.lax.rsqrt(jnp.mean(y_TxD * y_TxD, axis=-1, keepdims=True) + 1e-12)
  return (h_TxD @ params["head"]).reshape(*tokens_BxL.shape, -1)


def markov_batch(key, cfg: AblationConfig) -> jax.Array:
  """Sequences starting with BOS (0), then a fixed random permutation chain followed 80% of the time."""
  perm = jax.random.permutation(jax.random.key(1234), cfg.vocab - 1) + 1
  k0, ks = jax.random.split(key)

  def step(tok, k):
    ka, kb = jax.random.split(k)
    nxt = jnp.where(jax.random.uniform(ka, tok.shape) < 0.8, perm[tok - 1],
                    jax.random.randint(kb, tok.shape, 1, cfg.vocab))
    return nxt, nxt

  t1 = jax.random.randint(k0, (cfg.batch,), 1, cfg.vocab)
  _, seq = jax.lax.scan(step, t1, jax.random.split(ks, cfg.length - 2))
  return jnp.concatenate([jnp.zeros((1, cfg.batch), jnp.int32), t1[None], seq], 0).T.astype(jnp.int32)


def train_curve(cfg: AblationConfig, matmul: str, scale: str, multiplier: float) -> np.ndarray:
  """Per-step training loss of the tiny MoE (same init and data for every mode)."""
  params = _init(jax.random.key(cfg.seed), cfg)
  opt = optax.adam(cfg.learning_rate)
  state = opt.init(params)

  @jax.jit
  def step(params, state, key):
    tok = markov_batch(key, cfg)

    def loss(p):
      logits = tiny_moe_logits(p, tok, cfg, matmul, scale, multiplier)
      return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tok[:, 1:]).mean()

    l, g = jax.value_and_grad(loss)(params)
    u, state = opt.update(g, state, params)
    return optax.apply_updates(params, u), state, l

  losses = []
  for i in range(cfg.train_steps):
    params, state, l = step(params, state, jax.random.fold_in(jax.random.key(cfg.seed + 1), i))
    losses.append(float(l))
  return np.array(losses)


def _tables(cfg: AblationConfig, sweep: dict, curves: dict) -> str:
  lines = ["## Output relative error on ordinary tokens vs outlier-token multiplier", "",
           "| mode | " + " | ".join(f"{m:g}x" for m in cfg.multipliers) + " |",
           "|---|" + "---|" * len(cfg.multipliers)]
  lines += [f"| {label} | " + " | ".join(f"{e:.3g}" for e in errs) + " |" for label, errs in sweep.items()]
  lines += ["", f"## Tiny MoE LM, mean loss over the last 20 of {cfg.train_steps} steps (nats; NaN = diverged)", "",
            "| mode | " + " | ".join(f"BOS {m:g}x" for m in cfg.train_multipliers) + " |",
            "|---|" + "---|" * len(cfg.train_multipliers)]
  for label, _, _ in MODES:
    row = [float(np.mean(curves[(label, m)][-20:])) for m in cfg.train_multipliers]
    lines.append(f"| {label} | " + " | ".join(f"{v:.4f}" for v in row) + " |")
  return "\n".join(lines) + "\n"


def run(cfg: AblationConfig, workdir: str) -> dict:
  """Runs both experiments and writes the PNG, the markdown table and a JSON of all numbers to `workdir`."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  os.makedirs(workdir, exist_ok=True)
  sweep = error_sweep(cfg)
  curves = {}
  for label, matmul, scale in MODES:
    for m in cfg.train_multipliers:
      curves[(label, m)] = train_curve(cfg, matmul, scale, m)
      print(f"{label} BOS x{m:g}: final loss {np.mean(curves[(label, m)][-20:]):.4f}", flush=True)
  fig, axes = plt.subplots(1, 1 + len(cfg.train_multipliers), figsize=(5 * (1 + len(cfg.train_multipliers)), 4))
  for label, errs in sweep.items():
    axes[0].loglog(cfg.multipliers, errs, marker="o", label=label)
  axes[0].set(xlabel="outlier token norm multiplier", ylabel="rel. error (ordinary tokens)", title="grouped matmul")
  axes[0].legend()
  for ax, m in zip(axes[1:], cfg.train_multipliers):
    for label, _, _ in MODES:
      ax.plot(curves[(label, m)], label=label)
    ax.set(xlabel="step", ylabel="loss", title=f"tiny MoE, BOS x{m:g}")
    ax.legend()
  fig.tight_layout()
  fig.savefig(os.path.join(workdir, "quant_ablation.png"), dpi=100)
  table = _tables(cfg, sweep, curves)
  with open(os.path.join(workdir, "quant_ablation.md"), "w") as fh:
    fh.write(table)
  result = {"config": dataclasses.asdict(cfg), "error_sweep": sweep,
            "final_loss": {f"{label}@{m:g}": float(np.mean(c[-20:])) for (label, m), c in curves.items()}}
  with open(os.path.join(workdir, "quant_ablation.json"), "w") as fh:
    json.dump(result, fh, indent=1)
  print(table)
  return result
