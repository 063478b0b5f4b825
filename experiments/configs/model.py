"""Model shapes of the DeepSeek-V3 / Kimi-K2 family, by variant.

Used by the other config files (`model.get_config("colab")`), and on its own to inspect a shape:
  python -c "from experiments.configs import model; print(model.get_config('kimi_k2'))"

Variants:
  tiny:    ~50k parameters; for tests and smoke runs (seconds).
  colab:   ~3M parameters; trains on one CPU core in minutes.
  small:   ~60M parameters; a real small MoE for a workstation or one GPU.
  kimi_k2: the published Kimi K2 shape (1.04T total / 32B active). Build it abstractly only (`jax.eval_shape`).
  moonlight_16b: the published Moonlight-16B-A3B shape (~16B total / ~3B active; DeepSeek-V3 architecture),
           the size one 8-GPU node trains; planned by `benchmarks/scale_plan.py --variant moonlight_16b`.

To add a size: a branch below that `c.update(...)`s the shape fields (names follow Hugging Face's
`DeepseekV3Config`; `composer_jax/model/config.py` lists them all) and its name in the error's list; check it with
`composer_jax.model.count_params(configs.from_dict(ModelConfig, get_config("mine")))` (no allocation).
"""
import ml_collections

from experiments.configs import common


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  arg = common.parse_arg(arg, variant="colab")
  c = ml_collections.ConfigDict()
  # Fields common to all variants (names follow HF DeepseekV3Config; see composer_jax/model/config.py).
  c.rope_theta = 10000.0
  c.rope_scaling = None
  c.rms_norm_eps = 1e-6
  c.norm_topk_prob = True
  c.moe_layer_freq = 1
  c.seq_aux_loss_coef = 0.0
  c.moe_impl = "auto"                  # model.moe.MOE_IMPLS: blocked on CPU (decode: dense), ragged elsewhere
  c.capacity_factor = 1.25
  c.tie_word_embeddings = False
  c.initializer_range = 0.02
  c.param_dtype = "float32"
  c.compute_dtype = "float32"
  # None: by platform (unrolled on CPU, where it is faster; scanned elsewhere); a typed reference so that
  # --config.model.scan_layers=True|False still parses.
  c.scan_layers = ml_collections.FieldReference(None, field_type=bool)
  c.remat = False
  c.remat_policy = "full"               # with remat: model.remat.REMAT_POLICIES
  if arg.variant == "tiny":
    c.update(vocab_size=512, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
             num_hidden_layers=2, num_attention_heads=2, q_lora_rank=None, kv_lora_rank=16,
             qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, max_position_embeddings=4096,
             n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1,
             routed_scaling_factor=1.0, first_k_dense_replace=1, num_nextn_predict_layers=1)
  elif arg.variant == "rl_colab":
    # The RL run's policy (experiments/configs/rl.py): ~0.5M parameters, small enough for ~1 s RL steps on a CPU.
    c.update(vocab_size=512, hidden_size=96, intermediate_size=256, moe_intermediate_size=64,
             num_hidden_layers=3, num_attention_heads=4, q_lora_rank=None, kv_lora_rank=32,
             qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, max_position_embeddings=1024,
             n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1,
             routed_scaling_factor=1.0, first_k_dense_replace=1, num_nextn_predict_layers=0)
  elif arg.variant == "colab":
    c.update(vocab_size=4096, hidden_size=128, intermediate_size=384, moe_intermediate_size=96,
             num_hidden_layers=4, num_attention_heads=4, q_lora_rank=None, kv_lora_rank=64,
             qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, max_position_embeddings=4096,
             n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
             routed_scaling_factor=1.0, first_k_dense_replace=1, num_nextn_predict_layers=1)
  elif arg.variant == "small":
    c.update(vocab_size=16384, hidden_size=512, intermediate_size=1536, moe_intermediate_size=256,
             num_hidden_layers=8, num_attention_heads=8, q_lora_rank=256, kv_lora_rank=128,
             qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, max_position_embeddings=16384,
             n_routed_experts=32, n_shared_experts=1, num_experts_per_tok=4, n_group=4, topk_group=2,
             routed_scaling_factor=2.5, first_k_dense_replace=1, num_nextn_predict_layers=1)
  elif arg.variant == "kimi_k2":
    # https://huggingface.co/moonshotai/Kimi-K2-Base config.json (the published shape).
    c.update(vocab_size=163840, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
             num_hidden_layers=61, num_attention_heads=64, q_lora_rank=1536, kv_lora_rank=512,
             qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, max_position_embeddings=131072,
             n_routed_experts=384, n_shared_experts=1, num_experts_per_tok=8, n_group=1, topk_group=1,
             routed_scaling_factor=2.827, first_k_dense_replace=1, num_nextn_predict_layers=0,
             rope_theta=50000.0, param_dtype="bfloat16", compute_dtype="bfloat16", remat=True)
    c.rope_scaling = ml_collections.ConfigDict(dict(
        type="yarn", factor=32.0, original_max_position_embeddings=4096, beta_fast=1.0, beta_slow=1.0,
        mscale=1.0, mscale_all_dim=1.0))
  elif arg.variant == "moonlight_16b":
    # https://huggingface.co/moonshotai/Moonlight-16B-A3B config.json (the published shape; no MTP module).
    c.update(vocab_size=163840, hidden_size=2048, intermediate_size=11264, moe_intermediate_size=1408,
             num_hidden_layers=27, num_attention_heads=16, q_lora_rank=None, kv_lora_rank=512,
             qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, max_position_embeddings=8192,
             n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6, n_group=1, topk_group=1,
             routed_scaling_factor=2.446, first_k_dense_replace=1, num_nextn_predict_layers=0,
             rope_theta=50000.0, rms_norm_eps=1e-5, param_dtype="bfloat16", compute_dtype="bfloat16", remat=True)
  else:
    raise ValueError(f"Unknown model variant {arg.variant!r}; valid: tiny, rl_colab, colab, small, kimi_k2, "
                     "moonlight_16b")
  return c
