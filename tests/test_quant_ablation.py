"""The quantisation ablation's error sweep at a small size (composer_jax/quant_ablation.py)."""
import numpy as np

from composer_jax.quant_ablation import AblationConfig, error_sweep


def test_error_sweep_shows_where_per_tensor_scaling_breaks():
  cfg = AblationConfig(multipliers=(1.0, 1e3, 1e6), tokens=64, hidden=64, ffw=32, experts=4)
  sweep = error_sweep(cfg)
  assert set(sweep) == {"bf16", "mxfp8", "nvfp4/per_token", "nvfp4/per_tensor"}
  # Per-token (and MXFP8's per-block) scales never see the outlier tokens: the error is flat.
  for label in ("bf16", "mxfp8", "nvfp4/per_token"):
    np.testing.assert_allclose(sweep[label], sweep[label][0], rtol=1e-5, err_msg=label)
  assert sweep["bf16"][0] < 0.01 < sweep["mxfp8"][0] < 0.06 < sweep["nvfp4/per_token"][0] < 0.2
  tensor = sweep["nvfp4/per_tensor"]
  assert tensor[1] < 1.1 * tensor[0]            # 1000x outliers: absorbed by the E4M3 block scales
  assert tensor[2] > 0.9                        # 1e6x: ordinary tokens' block scales underflow to zero
