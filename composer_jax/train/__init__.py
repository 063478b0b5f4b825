"""Language-model training: corpus, tokenizer, data, the step and loop, checkpoints, stages."""
