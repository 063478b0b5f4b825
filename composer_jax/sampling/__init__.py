"""The embedded JAX rollout engine: MLA latent KV cache, batched prefill + decode, MTP speculative decoding."""
