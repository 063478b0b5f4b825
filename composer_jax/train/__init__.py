"""Continued pretraining / SFT: data, tokenizer and (on the lead's branch) the training step and loop."""
