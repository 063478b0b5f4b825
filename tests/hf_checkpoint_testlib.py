"""Checkpoint directories as users get them: a tokenizer in DeepSeek-V3's layout, weights from transformers.

`deepseek_tokenizer(dir, texts, vocab_size)` writes tokenizer.json + tokenizer_config.json shaped like DeepSeek-V3's
(byte-level BPE, its <｜begin▁of▁sentence｜> / <｜end▁of▁sentence｜> / <｜▁pad▁｜> specials at ids 0-2, its
`LlamaTokenizerFast` config with a chat template), fitted to `texts`: the published one is 7 MB and cannot be
downloaded here.
"""
import json
import os

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

BOS, EOS, PAD = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"
EXTRA = ("<｜User｜>", "<｜Assistant｜>", "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>")
DEEPSEEK_TEMPLATE = ("{% for message in messages %}{% if message['role'] == 'user' %}{{'<｜User｜>' + "
                     "message['content']}}{% else %}{{'<｜Assistant｜>' + message['content'] + "
                     "'<｜end▁of▁sentence｜>'}}{% endif %}{% endfor %}")


def deepseek_tokenizer(directory: str, texts, vocab_size: int) -> tokenizers.Tokenizer:
  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(EXTRA), special_tokens=[BOS, EOS, PAD],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
  tok.train_from_iterator(texts, trainer=trainer)
  tok.add_special_tokens(list(EXTRA))
  os.makedirs(directory, exist_ok=True)
  tok.save(os.path.join(directory, "tokenizer.json"))
  config = {"add_bos_token": True, "add_eos_token": False, "clean_up_tokenization_spaces": False, "legacy": True,
            "model_max_length": 16384, "tokenizer_class": "LlamaTokenizerFast", "unk_token": None,
            "bos_token": {"__type": "AddedToken", "content": BOS, "lstrip": False, "normalized": True,
                          "rstrip": False, "single_word": False},
            "eos_token": {"__type": "AddedToken", "content": EOS, "lstrip": False, "normalized": True,
                          "rstrip": False, "single_word": False},
            "pad_token": {"__type": "AddedToken", "content": EOS, "lstrip": False, "normalized": True,
                          "rstrip": False, "single_word": False},
            "chat_template": DEEPSEEK_TEMPLATE}
  with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
    json.dump(config, f, ensure_ascii=False, indent=2)
  return tok
