"""Frozen training configuration (built once from the ConfigDict in `experiments/`)."""
from __future__ import annotations

import dataclasses

MTP_LOSSES = ("self_distill", "cross_entropy", "none")


@dataclasses.dataclass(frozen=True)
class OptimConfig:
  """AdamW with linear warmup + cosine decay and global-norm clipping."""
  learning_rate: float = 3e-3
  warmup_steps: int = 50
  decay_steps: int = 1000          # cosine decay length after warmup
  final_lr_fraction: float = 0.1
  b1: float = 0.9
  b2: float = 0.95
  eps: float = 1e-8
  weight_decay: float = 0.1
  grad_clip: float = 1.0


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """What a pretraining / long-context / SFT stage does each step and when it logs, evaluates and saves."""
  steps: int = 300
  seed: int = 0
  log_every: int = 10
  eval_every: int = 100
  eval_batches: int = 8
  ckpt_every: int = 100
  ckpt_keep: int = 3
  mtp_loss: str = "self_distill"   # one of MTP_LOSSES
  mtp_weight: float = 0.3
  bias_update_rate: float = 1e-3   # DeepSeek-V3 aux-loss-free balancing step γ (0 disables)
  progress_bar: bool = True

  def __post_init__(self):
    if self.mtp_loss not in MTP_LOSSES:
      raise ValueError(f"Unknown mtp_loss {self.mtp_loss!r}; valid: {MTP_LOSSES}")
    for name in ("steps", "log_every", "eval_every", "ckpt_every"):
      if getattr(self, name) <= 0:
        raise ValueError(f"TrainConfig.{name} must be positive, got {getattr(self, name)}")

