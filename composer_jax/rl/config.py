"""The frozen configuration of one RL run (built once from the ConfigDict in `experiments/configs/rl.py`)."""
from __future__ import annotations

import dataclasses

from composer_jax.model.config import ModelConfig
from composer_jax.rl.step import RLConfig

MODES = ("sync", "async")
ENGINES = ("jax", "sglang")   # embedded JAX engine in each worker; or a trainer-owned SGLang fleet (`rl/fleet.py`)
STALENESS_POLICIES = ("drop", "keep")


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """Everything an RL run (trainer + workers) needs; pickled into the workdir so workers read the same one."""
  model: ModelConfig
  workdir: str
  mode: str = "async"               # 'sync': generate → train in one process, staleness 0; 'async': worker processes
  engine: str = "jax"
  sglang_servers: int = 1           # engine='sglang': servers in the fleet (the trainer starts and updates them)
  sglang_device: str = "cpu"        # 'cuda' on GPU machines
  sglang_python: str = ""           # interpreter with sglang installed ('' = this one)
  steps: int = 60
  groups_per_step: int = 4          # prompts per RL step
  samples_per_prompt: int = 8       # G
  max_staleness: int = 2
  staleness_policy: str = "drop"
  publish_every: int = 1            # publish weights every N trainer steps
  ckpt_every: int = 10
  n_workers: int = 1
  level: int = 1                    # procedural difficulty
  pool_size: int = 4096             # training task pool (the workers' streams)
  seed: int = 0
  backend: str = "sandbox"          # workspaces: 'sandbox' (bubblewrap) or 'local'
  vocab_size: int = 512
  context_budget: int = 320
  max_turn_tokens: int = 48
  observation_reserve: int = 128
  max_turns: int = 4
  temperature: float = 1.0
  length_weight: float = 0.0        # λ of the length penalty C(x) (x = generated tokens)
  length_q: float = 0.5             # q of C(x)
  lint_weight: float = 0.0          # per new ruff finding; each graded episode then runs ruff in its sandbox
  learning_rate: float = 3e-4
  rl: RLConfig = RLConfig()
  sft_steps: int = 300
  sft_tasks: int = 1024
  sft_batch: int = 16
  sft_seq_len: int = 256            # packed SFT rows; attention is most of a CPU step, so shorter rows are cheaper
  sft_lr: float = 3e-3
  sft_demo_accuracy: float = 1.0    # share of SFT demonstrations with the right fix; the rest are near misses
  init_checkpoint: str = ""         # a finished pretraining/SFT stage: SFT (or with sft_steps=0, RL) starts there
  eval_tasks: int = 500
  eval_every: int = 0               # held-out greedy eval every N steps in the trainer (0: only by rl_main at the end)
  progress_bar: bool = True

  def __post_init__(self):
    if self.mode not in MODES:
      raise ValueError(f"mode {self.mode!r} not in {MODES}")
    if self.engine not in ENGINES:
      raise ValueError(f"engine {self.engine!r} not in {ENGINES}")
    if self.staleness_policy not in STALENESS_POLICIES:
      raise ValueError(f"staleness_policy {self.staleness_policy!r} not in {STALENESS_POLICIES}")
    if self.mode == "sync" and self.max_staleness != 0:
      raise ValueError(f"mode='sync' trains on the policy that generated: set max_staleness=0 (got "
                       f"{self.max_staleness})")
    if self.max_staleness < 0:
      raise ValueError(f"max_staleness must be >= 0, got {self.max_staleness}")
    if self.samples_per_prompt < 2:
      raise ValueError(f"samples_per_prompt={self.samples_per_prompt}: group-mean advantages need >= 2")
    for name in ("steps", "groups_per_step", "publish_every", "ckpt_every", "n_workers", "pool_size", "sft_batch",
                 "sft_seq_len", "eval_tasks", "sglang_servers"):
      if getattr(self, name) < 1:
        raise ValueError(f"RunConfig.{name} must be >= 1, got {getattr(self, name)}")
    if self.mode == "async" and self.publish_every > self.max_staleness + 1 and self.staleness_policy == "drop":
      raise ValueError(f"publish_every={self.publish_every} > max_staleness + 1 = {self.max_staleness + 1}: "
                       "every group would be dropped as stale before new weights arrive")
    if self.context_budget <= self.max_turn_tokens + self.observation_reserve:
      raise ValueError(f"context_budget={self.context_budget} must exceed max_turn_tokens + observation_reserve")
    if self.sft_steps < 0 or (self.sft_steps == 0 and not self.init_checkpoint):
      raise ValueError(f"sft_steps={self.sft_steps}: RL needs a start — SFT steps >= 1, or 0 with an init_checkpoint")
    if not 0.0 < self.sft_demo_accuracy <= 1.0:
      raise ValueError(f"sft_demo_accuracy must be in (0, 1], got {self.sft_demo_accuracy}")
    if self.vocab_size > self.model.vocab_size:
      raise ValueError(f"tokenizer vocab_size={self.vocab_size} exceeds the model's {self.model.vocab_size}")

  @property
  def batch_rows(self) -> int:
    return self.groups_per_step * self.samples_per_prompt
