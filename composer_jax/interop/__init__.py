"""Interop with other ecosystems' checkpoints (Hugging Face `DeepseekV3ForCausalLM`)."""
