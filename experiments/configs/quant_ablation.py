r"""Per-token vs per-tensor second-level scaling for MXFP8/NVFP4 MoE matmuls (issue 5 ablation).

Run (colab: ~5 min of CPU, 20+ min on 2 busy shared cores; writes quant_ablation.{png,md,json} to the workdir):
  python experiments/quant_ablation_main.py --config=experiments/configs/quant_ablation.py:colab \
      --workdir=runs/quant_ablation
Smoke run (~3 min): `--config=experiments/configs/quant_ablation.py:quick`.

Expected result (measured on this CPU, seed 0; see kernels_pallas/README.md):
  * grouped-matmul error on ordinary tokens: bf16 0.2%, MXFP8 4.1%, NVFP4 13%, all flat in the outlier
    multiplier, except NVFP4 per-tensor: unchanged up to 1e4x, 17% at 1e5x, 100% (ordinary tokens zeroed) at 1e6x;
  * tiny MoE LM: every mode tracks bf16 at BOS 1x and 1e3x; at 1e6x NVFP4 per-tensor does not learn (loss stays
    at log V), per-token does.
So the report's finding reproduces only for outliers far beyond 100-1000x: the E4M3 block scales absorb ~1e4x.

Arg: `colab` (default) or `quick`.
"""
import ml_collections

from experiments.configs import common


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  arg = common.parse_arg(arg, variant="colab")
  if arg.variant not in ("colab", "quick"):
    raise ValueError(f"Unknown variant {arg.variant!r}; valid: 'colab', 'quick'")
  quick = arg.variant == "quick"
  c = ml_collections.ConfigDict()
  c.ablation = ml_collections.ConfigDict(dict(
      multipliers=(1.0, 1e1, 1e2, 1e3, 1e4, 1e5, 1e6), n_outliers=4, tokens=256, hidden=256, ffw=128, experts=4,
      train_multipliers=(1e6,) if quick else (1.0, 1e3, 1e6), train_steps=30 if quick else 150,
      vocab=64, batch=16, length=32, top_k=2, learning_rate=3e-3, seed=0))
  return c


def get_sweep():
  """Seeds, to see how much of a gap between modes is noise."""
  return [{"ablation.seed": s} for s in (0, 1, 2)]
