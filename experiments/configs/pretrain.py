r"""Continued pretraining on code, long-context extension and SFT (the report's phase 1).

Run (colab: a 2.5M-param MoE (1.8M active), 4 MB of the Python standard library, 300 steps of 8 x 256 tokens;
held-out perplexity 360 at step 50 → 118 at step 300, MTP top-1 agreement 0.71; ~2,050 tokens/s and ~6 min on an
idle 2-core CPU — see experiments/results/pretrain_colab.png):
  python experiments/pretrain_main.py --config=experiments/configs/pretrain.py:colab --workdir=runs/pretrain_colab

Then the chained stages, each starting from the previous stage's exported params:
  python experiments/pretrain_main.py --config=experiments/configs/pretrain.py:colab,stage=long_context \
      --workdir=runs/long_context_colab --config.init.checkpoint=runs/pretrain_colab
  python experiments/pretrain_main.py --config=experiments/configs/pretrain.py:colab,stage=sft \
      --workdir=runs/sft_colab --config.init.checkpoint=runs/long_context_colab \
      --config.sft.train_path=train.jsonl --config.sft.eval_path=eval.jsonl

From a Hugging Face checkpoint (transformers' save_pretrained, DeepSeek-V3 / Kimi K2 layout, block-FP8 or not): its
params (read sliced onto the mesh) and its tokenizer (chat tokens added; see composer_jax/interop/README.md):
  python experiments/pretrain_main.py --config=experiments/configs/pretrain.py:tiny --workdir=runs/from_hf \
      --config.init.hf=/path/to/checkpoint

Multi-process (here: 2 processes on one CPU machine, 4 fake devices each; on a cluster one process per host, the
same flags or JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID, or --distributed_auto under SLURM):
  XLA_FLAGS=--xla_force_host_platform_device_count=4 python experiments/pretrain_main.py \
      --config=experiments/configs/pretrain.py:tiny --workdir=runs/mp --config.mesh.data=-1 \
      --coordinator_address=127.0.0.1:12355 --num_processes=2 --process_id=0   # and --process_id=1 beside it

Arg: `<variant>[,stage=pretrain|long_context|sft]`; variant is tiny (tests), colab or small (configs/model.py).
`mesh`: axis sizes (one may be -1 = the remaining devices; colab/tiny default to one device, which is fastest on a
CPU) and FSDP; `data.batch_size` is the global batch, split between processes.
long_context multiplies the sequence length by 4 and sets YaRN rope scaling (factor 4 over the pretraining length).
"""
import ml_collections

from experiments.configs import common, model


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  arg = common.parse_arg(arg, variant="colab", stage="pretrain")
  c = ml_collections.ConfigDict()
  c.stage = arg.stage
  c.model = model.get_config(arg.variant)
  colab = arg.variant in ("colab", "tiny")

  no_cap = ml_collections.config_dict.placeholder(int)   # None, but typed: `--config.corpus.max_files=100` works
  c.corpus = ml_collections.ConfigDict(dict(
      paths=(),                                  # () = the running Python's standard library
      languages=("python",),
      min_file_bytes=64, max_file_bytes=256 * 1024,
      max_files=no_cap, max_total_bytes=4_000_000 if colab else no_cap,
      heldout_fraction=0.05, min_heldout_files=4))
  base_len = 256 if colab else 1024
  c.data = ml_collections.ConfigDict(dict(seq_len=base_len, batch_size=8 if colab else 32, seed=0,
                                          num_packing_bins=16, split_long_examples=True))
  # model_max_length follows data.seq_len (a reference: a --config.data.seq_len override moves it too).
  c.tokenizer = ml_collections.ConfigDict(dict(vocab_size=c.model.vocab_size, min_frequency=2, max_token_length=24,
                                               model_max_length=c.data.get_ref("seq_len")))
  c.train = ml_collections.ConfigDict(dict(
      steps=300 if colab else 20_000, seed=0, log_every=10, eval_every=50 if colab else 1000, eval_batches=8,
      ckpt_every=50 if colab else 1000, ckpt_keep=3, mtp_loss="self_distill", mtp_weight=0.3,
      bias_update_rate=1e-3, progress_bar=True))
  c.optim = ml_collections.ConfigDict(dict(
      learning_rate=3e-3 if colab else 6e-4, warmup_steps=30 if colab else 1000, decay_steps=270 if colab else 19_000,
      final_lr_fraction=0.1, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, grad_clip=1.0))
  c.mesh = ml_collections.ConfigDict(dict(data=1 if colab else -1, expert=1, context=1, tensor=1, fsdp=True,
                                         zero1=False))
  c.init = ml_collections.ConfigDict(dict(checkpoint="", hf=""))
  c.sft = ml_collections.ConfigDict(dict(train_path="", eval_path=""))

  if arg.stage == "long_context":
    c.data.seq_len = 4 * base_len
    c.data.batch_size = max(1, c.data.batch_size // 4)   # same tokens per step
    c.model.rope_scaling = ml_collections.ConfigDict(dict(
        type="yarn", factor=4.0, original_max_position_embeddings=base_len, beta_fast=32.0, beta_slow=1.0,
        mscale=1.0, mscale_all_dim=0.0))
    c.train.steps, c.optim.warmup_steps, c.optim.decay_steps = (100, 10, 90) if colab else (2000, 100, 1900)
    c.optim.learning_rate /= 3
  elif arg.stage == "sft":
    c.data.split_long_examples = False                   # a transcript is trained whole or not at all
    c.train.steps, c.optim.warmup_steps, c.optim.decay_steps = (200, 20, 180) if colab else (2000, 100, 1900)
    c.optim.learning_rate /= 3
    c.train.mtp_loss = "self_distill"
  return c


def get_sweep():
  """Ablations: MTP loss choice and aux-loss-free balancing rate (run each as its own command)."""
  return [{"train.mtp_loss": m} for m in ("self_distill", "cross_entropy")] + [
      {"train.bias_update_rate": r} for r in (0.0, 1e-3, 1e-2)]
