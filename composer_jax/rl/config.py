"""The frozen configuration of one RL run, nested as `experiments/configs/rl.py` is (`composer_jax.configs.from_dict`).

  RunConfig
    model      ModelConfig                    the policy's shape
    tasks      rollout.tasks.registry.SetSpec the training task source (split "train"); held-out = its "heldout" side
    tokenizer  TokenizerConfig                the BPE fitted to training tasks (unless `sft.init_checkpoint` has one)
    harness    rollout.harness.HarnessConfig  the agent loop the policy runs in (prompt, budgets, rewards)
    sft        SFTConfig                      the warm start
    rl         RLConfig                       the RL trainer: steps, groups per step, checkpoints, optimizer, and what
                                              one step computes: loss (k1 KL, IS), router replay
    rollout    RolloutConfig                  who generates: sync/async, engine, workers, staleness, publishing
    mesh       parallel.mesh.MeshConfig       the trainer's devices and their axes (pretraining's, same rules)
    eval       EvalConfig                     held-out evaluation and the SFT control
"""
from __future__ import annotations

import dataclasses

import jax

from composer_jax.model.config import ModelConfig
from composer_jax.parallel import layout
from composer_jax.parallel.mesh import MeshConfig
from composer_jax.rl import losses
from composer_jax.sampling.placement import PLACEMENTS as ENGINE_PLACEMENTS
from composer_jax.train.config import OptimConfig
from composer_jax.train.tokenizer import TokenizerConfig
from rollout.harness import HarnessConfig
from rollout.staleness import StalenessConfig
from rollout.tasks.registry import SetSpec
from rollout.tree_harness import TreeConfig

MODES = ("sync", "async")
# The engine registry: name -> rollout mode -> the publisher (`rl/publishers.py`) that keeps its weights current.
ENGINES = {"jax": {"sync": "in_place", "async": "files"},       # the embedded JAX engine (composer_jax.sampling)
           "sglang": {"sync": "fleet", "async": "fleet"}}       # a trainer-owned SGLang fleet (`rl/fleet.py`)
STALENESS_POLICIES = ("drop", "keep")


class RunInputError(ValueError):
  """Bad input to a run that is the user's to fix (a task set that cannot load, a workdir in use, budgets the
  oracle does not fit): the entry point prints its message as one line, not a traceback."""


def _positive(obj, *names: str) -> None:
  for name in names:
    if getattr(obj, name) < 1:
      raise ValueError(f"{type(obj).__name__}.{name} must be >= 1, got {getattr(obj, name)}")


def _rl_optimizer() -> OptimConfig:
  # Constant learning rate after one warm-up step, no weight decay (RL updates are small moves from the start).
  return OptimConfig(learning_rate=3e-4, warmup_steps=1, decay_steps=1000, final_lr_fraction=1.0,
                     weight_decay=0.0, grad_clip=1.0)


@dataclasses.dataclass(frozen=True)
class RLConfig:
  """The RL trainer: `steps` steps of up to `groups_per_step` whole groups each (fewer when the next group's rows
  do not fit in `rows_per_step`), checkpointed every `ckpt_every`; and what one step computes (loss, replay)."""
  steps: int = 60
  groups_per_step: int = 4          # prompts per RL step
  # Segments a step holds (a row of context_budget tokens each, unless packed). 0: groups_per_step x
  # samples_per_prompt, one per trajectory; a self-summarising chain has a segment per context, so multi-segment
  # runs set it higher.
  rows_per_step: int = 0
  # > 0: pack the step's segments end to end into this many rows of context_budget tokens (`rl.batch.Packer`), so
  # short segments do not pay a whole row of padding; a step takes fewer groups when the next does not pack. 0: a
  # row per segment.
  pack_rows: int = 0
  # Tree groups (`rollout.tree_fanouts`): store a tree's shared prefix once per row and pack its branches after it
  # under a tree attention mask (`rl.batch.BatchConfig.share_prefix`); the loss and gradients equal the duplicated
  # rows'. Needs the "whole" or "tiled" attention kernel and a mesh without context parallelism.
  share_prefix: bool = False
  ckpt_every: int = 10
  optim: OptimConfig = dataclasses.field(default_factory=_rl_optimizer)
  loss: losses.LossConfig = losses.LossConfig()
  router_replay: bool = True        # policy (and reference) forwards use the engine's experts
  ref_router_replay: bool = True    # the reference forward replays them too (same routing on both sides of k1)
  # > 0: train the MTP modules by self-distillation on the rollout tokens (`losses.mtp_self_distill`); a model with
  # MTP modules reports the drafter's agreement with the policy (`mtp_*` metrics) whatever the weight.
  mtp_weight: float = 0.0
  # The MTP loss's gradient also reaches the trunk, the embedding and the LM head (False: only the MTP modules
  # learn, and the policy's update is the one without MTP; experiments/results/mtp_rl.md measured both).
  mtp_trunk_grad: bool = False
  # Also measure the drafter frozen at the start (the reference params' MTP modules) against the current policy:
  # `mtp_start_agreement` / `mtp_start_acceptance`, at the cost of one more forward without gradient.
  mtp_start_metrics: bool = False
  bias_update_rate: float = 0.0     # aux-loss-free router-bias update from the (replayed) expert load
  # Run the unreplayed forward (pass 2) for its `logprob_gap_no_replay` metric on every N-th step even when the
  # engine recorded all the routing (0: only when some is missing). It costs one forward of the policy.
  unreplayed_every: int = 10
  # The temperature the rollouts were sampled at. The engines record each token's logprob under the tempered
  # distribution (softmax(logits / T), as SGLang's `logprobs`), so the policy and the reference are scored at the
  # same T: the importance ratio and the KL then compare one policy with itself, not π_T with π_1. In a run,
  # `RunConfig` sets it from `harness.sampling.temperature`.
  temperature: float = 1.0

  def __post_init__(self):
    _positive(self, "steps", "groups_per_step", "ckpt_every")
    if self.rows_per_step < 0:
      raise ValueError(f"rl.rows_per_step={self.rows_per_step} must be >= 0 (0: one row per trajectory)")
    if self.pack_rows < 0:
      raise ValueError(f"rl.pack_rows={self.pack_rows} must be >= 0 (0: a row per segment)")
    if self.mtp_weight < 0 or self.bias_update_rate < 0 or self.unreplayed_every < 0:
      raise ValueError(f"need mtp_weight, bias_update_rate, unreplayed_every >= 0, got {self.mtp_weight=} "
                       f"{self.bias_update_rate=} {self.unreplayed_every=}")
    if not self.temperature > 0:
      raise ValueError(f"rl.temperature={self.temperature} must be > 0 (the rollouts' sampling temperature; greedy "
                       "rollouts give a group nothing to compare)")

  @property
  def frozen_subtrees(self) -> tuple[str, ...]:
    """The top-level param subtrees the step's optimizer freezes: the MTP heads unless `mtp_weight` trains them (they
    get no gradient then, and AdamW's decay would still shrink them)."""
    return () if self.mtp_weight > 0 else ("mtp",)


@dataclasses.dataclass(frozen=True)
class SFTConfig:
  """The warm start: SFT on oracle transcripts, from random init or from `init_checkpoint`."""
  steps: int = 300
  tasks: int = 1024
  batch: int = 16
  seq_len: int = 256                # packed SFT rows; attention is most of a CPU step, so shorter rows are cheaper
  learning_rate: float = 3e-3
  demo_accuracy: float = 1.0        # share of SFT demonstrations with the right fix; the rest are near misses
  init_checkpoint: str = ""         # a finished pretraining/SFT stage: SFT (or with steps=0, RL) starts there
  curriculum_levels: tuple[int, ...] = ()   # a curriculum: first `curriculum_steps` steps on these procedural
  curriculum_steps: int = 0                 # levels' demonstrations only, then `steps` on every level's

  def __post_init__(self):
    _positive(self, "batch", "seq_len")
    if not 0.0 < self.demo_accuracy <= 1.0:
      raise ValueError(f"sft.demo_accuracy must be in (0, 1], got {self.demo_accuracy}")
    if self.steps < 0 or (self.steps == 0 and not self.init_checkpoint):
      raise ValueError(f"sft.steps={self.steps}: RL needs a start — SFT steps >= 1, or 0 with an init_checkpoint")
    if bool(self.curriculum_levels) != (self.curriculum_steps > 0) or self.curriculum_steps < 0:
      raise ValueError(f"a curriculum needs both sft.curriculum_levels and sft.curriculum_steps >= 1 (or neither), "
                       f"got {self.curriculum_levels} and {self.curriculum_steps}")


@dataclasses.dataclass(frozen=True)
class SFTPlan:
  """What SFT of the run's model reads from its config (`RunConfig.sft_plan`): the `sft` section, the model, the
  harness the oracle's demonstrations run through, the run's seed (it picks the near-miss demonstrations) and the
  mesh SFT trains on (the run's: the warm start is RL's reference, placed as the trainer places it)."""
  sft: SFTConfig
  model: ModelConfig
  harness: HarnessConfig
  seed: int
  mesh: MeshConfig = MeshConfig()


@dataclasses.dataclass(frozen=True)
class SGLangConfig:
  """engine='sglang': the fleet the trainer starts and updates (`rl/fleet.py`)."""
  servers: int = 1
  device: str = "cpu"               # 'cuda' on GPU machines
  python: str = ""                  # interpreter with sglang installed ('' = this one)

  def __post_init__(self):
    _positive(self, "servers")


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
  """Who generates the groups and how fresh they must be."""
  mode: str = "async"               # 'sync': generate → train in one process, staleness 0; 'async': worker processes
  engine: str = "jax"               # a name in `ENGINES`
  # The in-process (sync) JAX engine on the trainer's mesh: 'trainer' (the weights as trained, no copy) or
  # 'replicas' (a copy per device, the rows split); `composer_jax/sampling/placement.py`.
  engine_placement: str = "trainer"
  workers: int = 1
  samples_per_prompt: int = 8       # G
  max_staleness: int = 2
  staleness_policy: str = "drop"
  publish_every: int = 1            # publish weights every N trainer steps
  workspaces: str = "sandbox"       # workspaces: 'sandbox' (bubblewrap) or 'local'
  sglang: SGLangConfig = SGLangConfig()
  stall_timeout_s: float = 1800.0   # async: a worker that starts no group for this long is hung, killed, restarted
  # Groups as trees (`rollout.tree_harness`): fork after these action turns (0 = the prompt) into this many branches
  # each; the product of the fanouts is samples_per_prompt. Both empty: flat groups (G samples from the prompt).
  tree_branch_turns: tuple[int, ...] = ()
  tree_fanouts: tuple[int, ...] = ()
  # Branch before a branch turn where the policy is uncertain (entropy >= this many nats; None: by turn only).
  tree_branch_entropy: float | None = None
  # The embedded engine's MTP speculative decoding (in rollouts and the evaluations): at most this many drafts per
  # step (0: plain decoding); `adaptive_draft`: each engine picks k in 0..draft_tokens from its measured acceptance
  # and step cost (`sampling/draft_depth.py`), else always draft_tokens. Needs a model with MTP modules.
  draft_tokens: int = 0
  adaptive_draft: bool = True

  def __post_init__(self):
    if self.mode not in MODES:
      raise ValueError(f"rollout.mode {self.mode!r} not in {MODES}")
    if self.engine not in ENGINES:
      raise ValueError(f"unknown rollout.engine {self.engine!r}; valid: {sorted(ENGINES)}")
    if self.engine_placement not in ENGINE_PLACEMENTS:
      raise ValueError(f"unknown rollout.engine_placement {self.engine_placement!r}; valid: {list(ENGINE_PLACEMENTS)}")
    if self.mode == "sync" and self.publish_every != 1:
      raise ValueError(f"mode='sync' rolls out with the newest policy each step: publish_every must be 1, got "
                       f"{self.publish_every}")
    if self.staleness_policy not in STALENESS_POLICIES:
      raise ValueError(f"rollout.staleness_policy {self.staleness_policy!r} not in {STALENESS_POLICIES}")
    if self.mode == "sync" and self.max_staleness != 0:
      raise ValueError(f"mode='sync' trains on the policy that generated: set max_staleness=0 (got "
                       f"{self.max_staleness})")
    if self.max_staleness < 0:
      raise ValueError(f"max_staleness must be >= 0, got {self.max_staleness}")
    if self.samples_per_prompt < 2:
      raise ValueError(f"samples_per_prompt={self.samples_per_prompt}: group-mean advantages need >= 2")
    _positive(self, "workers", "publish_every", "stall_timeout_s")
    if self.draft_tokens < 0:
      raise ValueError(f"rollout.draft_tokens={self.draft_tokens} must be >= 0 (0: no speculative decoding)")
    if self.draft_tokens and self.engine != "jax":
      raise ValueError(f"rollout.draft_tokens is the embedded JAX engine's speculative decoding; rollout.engine="
                       f"{self.engine!r} (SGLang's MTP runs on GPU fleets: rollout/engines/sglang_launcher.py)")
    if self.tree is not None and self.tree.size != self.samples_per_prompt:
      raise ValueError(f"rollout.tree_fanouts={self.tree.fanouts} give {self.tree.size} leaves per group, but "
                       f"rollout.samples_per_prompt={self.samples_per_prompt}")
    if self.mode == "async" and self.publish_every > self.max_staleness + 1 and self.staleness_policy == "drop":
      raise ValueError(f"publish_every={self.publish_every} > max_staleness + 1 = {self.max_staleness + 1}: "
                       "every group would be dropped as stale before new weights arrive")

  @property
  def tree(self) -> TreeConfig | None:
    """The groups' tree (None: flat groups); a malformed one is refused by `TreeConfig`."""
    if not self.tree_branch_turns and not self.tree_fanouts:
      return None
    return TreeConfig(tuple(self.tree_branch_turns), tuple(self.tree_fanouts), self.tree_branch_entropy)

  @property
  def staleness(self) -> StalenessConfig:
    """The trainer's filter on the groups it takes from the queue."""
    return StalenessConfig(self.max_staleness, self.staleness_policy)


@dataclasses.dataclass(frozen=True)
class EvalConfig:
  """Held-out evaluation after RL: `tasks` tasks at each temperature; `control`: also an equal-time SFT control;
  `summaries_from_start`: also the RL policy with the SFT start writing its self-summaries; `drop_oldest`: also
  the RL policy without summaries, its oldest turns dropped (`HarnessConfig.without_summaries`). The last two
  answer "do trained summaries help?" at the same context budget, on the held-out tasks of `summary_levels` (the
  procedural levels whose episodes need a summary; empty: every task). `start_only`: calibrate the start before
  a long run: the warm start and its evaluation only (no RL, no control)."""
  tasks: int = 500
  temperatures: tuple[float, ...] = (0.0, 1.0)
  control: bool = True
  summaries_from_start: bool = False
  drop_oldest: bool = False
  summary_levels: tuple[int, ...] = ()
  start_only: bool = False

  def __post_init__(self):
    _positive(self, "tasks")


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """Everything an RL run (trainer + workers) needs; pickled into the workdir so workers read the same one."""
  model: ModelConfig
  workdir: str
  seed: int = 0
  progress_bar: bool = True
  tasks: SetSpec = SetSpec(kind="procedural", n=4096, seed=1, split="train")
  tokenizer: TokenizerConfig = TokenizerConfig(vocab_size=512)
  harness: HarnessConfig = HarnessConfig()
  sft: SFTConfig = SFTConfig()
  rl: RLConfig = RLConfig()
  rollout: RolloutConfig = RolloutConfig()
  eval: EvalConfig = EvalConfig()
  mesh: MeshConfig = MeshConfig()   # default: one device

  def __post_init__(self):
    if self.tasks.split != "train":
      raise ValueError(f"tasks.split must be 'train' (RL trains on it; held-out tasks are its 'heldout' side), got "
                       f"{self.tasks.split!r}")
    if self.sft.demo_accuracy < 1.0 and self.tasks.kind != "procedural":
      raise ValueError(f"sft.demo_accuracy < 1 makes near-miss demonstrations of procedural tasks; the "
                       f"{self.tasks.kind!r} source has none (set it to 1.0)")
    group_rows = self.rollout.samples_per_prompt * self.harness.max_segments   # the largest group: a row a segment
    if self.batch_rows < group_rows:
      raise ValueError(f"a step's {self.batch_rows} rows cannot hold a group of {self.rollout.samples_per_prompt} "
                       f"trajectories of up to harness.max_segments={self.harness.max_segments} segments (a row "
                       f"each): set rl.rows_per_step >= {group_rows}")
    if self.rl.pack_rows > self.batch_rows:
      raise ValueError(f"rl.pack_rows={self.rl.pack_rows} packs a step's {self.batch_rows} segments into "
                       f"more rows than unpacked; set it <= {self.batch_rows} (or 0)")
    if self.rl.share_prefix and self.rollout.tree is None:
      raise ValueError("rl.share_prefix stores a tree group's shared prefix once, but the groups are flat: set "
                       "rollout.tree_branch_turns and rollout.tree_fanouts, or rl.share_prefix=False")
    if self.eval.summary_levels and (self.tasks.kind != "procedural"
                                     or not set(self.eval.summary_levels) <= set(self.tasks.levels)):
      raise ValueError(f"eval.summary_levels={self.eval.summary_levels} names procedural levels the task source "
                       f"({self.tasks.kind!r}, levels {self.tasks.levels}) does not have; use a subset of "
                       "tasks.levels, or () for every held-out task")
    if self.sft.curriculum_levels and (self.tasks.kind != "procedural" or self.sft.steps == 0
                                       or not set(self.sft.curriculum_levels) < set(self.tasks.levels)):
      raise ValueError(f"sft.curriculum_levels={self.sft.curriculum_levels} must be some, not all, of the procedural "
                       f"levels the SFT then continues on (tasks: {self.tasks.kind!r}, levels {self.tasks.levels}; "
                       f"sft.steps={self.sft.steps})")
    # The trainer scores the policy at the rollouts' temperature, as the engines recorded its logprobs (greedy
    # rollouts: the engines record T = 1 logprobs); derived here, so no config can set the two apart.
    rollout_t = self.harness.sampling.temperature or 1.0
    object.__setattr__(self, "rl", dataclasses.replace(self.rl, temperature=rollout_t))
    if self.harness.context_budget > self.model.max_position_embeddings:
      raise ValueError(f"harness.context_budget={self.harness.context_budget} exceeds the model's positions "
                       f"(model.max_position_embeddings={self.model.max_position_embeddings}): lower the one or "
                       "raise the other")
    if self.rollout.draft_tokens and self.model.num_nextn_predict_layers < 1:
      raise ValueError(f"rollout.draft_tokens={self.rollout.draft_tokens} drafts with the model's MTP module, but "
                       "model.num_nextn_predict_layers=0: set it to 1 (or draft_tokens=0)")
    if self.tokenizer.vocab_size > self.model.vocab_size:
      raise ValueError(f"tokenizer vocab_size={self.tokenizer.vocab_size} exceeds the model's "
                       f"{self.model.vocab_size}")
    # A mesh that cannot hold the model or a step fails here, before any work (an axis at -1 is known only on the
    # devices).
    sizes = self.mesh.axis_sizes()
    if -1 not in sizes.values():
      layout.check_mesh(self.model, jax.sharding.AbstractMesh(tuple(sizes.values()), tuple(sizes)), self.mesh.rules(),
                        self.step_rows, self.harness.context_budget)

  @property
  def sft_plan(self) -> SFTPlan:
    return SFTPlan(self.sft, self.model, self.harness, self.seed, self.mesh)

  @property
  def batch_rows(self) -> int:
    """Rows in a step's batch: `rl.rows_per_step`, or one per trajectory of `groups_per_step` groups."""
    return self.rl.rows_per_step or self.rl.groups_per_step * self.rollout.samples_per_prompt

  @property
  def step_rows(self) -> tuple[int, ...]:
    """The row counts a step's batch can have: packed, and unpacked for a group that packs alone (`rl.batch`)."""
    return tuple(sorted({self.rl.pack_rows or self.batch_rows, self.batch_rows}))
