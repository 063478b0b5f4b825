"""A tokenizer.json with more ids than the model has embedding rows is refused naming the file and the model
field (`tokenizer.check_fits`), here where a checkpoint is evaluated with a model config that does not match it."""
import glob
import os
import sysconfig

import pytest

from composer_jax import configs, eval_policies
from composer_jax.model.config import ModelConfig
from composer_jax.train import tokenizer as tokenizer_lib
from experiments.configs import model as model_configs

CFG = configs.from_dict(ModelConfig, model_configs.get_config("tiny").to_dict())  # vocab_size 512


@pytest.fixture(scope="module")
def tok():
  texts = [open(f, encoding="utf-8").read() for f in sorted(glob.glob(
    os.path.join(sysconfig.get_paths()["stdlib"], "email", "*.py")))]
  return tokenizer_lib.train_tokenizer(texts, tokenizer_lib.TokenizerConfig(vocab_size=600))


def test_check_fits_by_hand(tok):
  n = tokenizer_lib.id_space(tok)
  assert n == 600
  tokenizer_lib.check_fits(tok, 600, "t/tokenizer.json", "model.vocab_size")  # every id has a row
  with pytest.raises(ValueError, match=r"^t/tokenizer.json has 600 token ids \(the largest 599\), but the model's "
                                       r"embedding has 599 rows \(model.vocab_size=599\)"):
    tokenizer_lib.check_fits(tok, 599, "t/tokenizer.json", "model.vocab_size")


def test_a_checkpoint_evaluated_with_a_smaller_vocab(tok, tmp_path):
  tokenizer_lib.save_tokenizer(tok, str(tmp_path / "tokenizer"))
  assert CFG.vocab_size == 512
  with pytest.raises(ValueError, match=rf"^{tmp_path}/tokenizer/tokenizer.json has 600 token ids .* 512 rows "
                                       r"\(model.vocab_size=512\)"):
    eval_policies.checkpoint_policy(str(tmp_path), CFG)  # refused before any params are read
