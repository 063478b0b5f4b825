"""rollout/engines/protocol.py and the scripted engines: validation, stop/length handling, seeding."""

import numpy as np
import pytest

from composer_jax.train import tokenizer as tokenizer_lib
from rollout import chat_format as cf
from rollout.engines import scripted
from rollout.engines.protocol import Engine, GenerateRequest, GenerateResult, SamplingParams


@pytest.fixture(scope="module")
def tok():
  return tokenizer_lib.train_tokenizer(["def f(x):\n    return x\n" * 10], tokenizer_lib.TokenizerConfig(300))


def test_params_and_results_are_validated():
  with pytest.raises(ValueError, match="temperature"):
    SamplingParams(temperature=-1)
  with pytest.raises(ValueError, match="top_p"):
    SamplingParams(top_p=0)
  with pytest.raises(ValueError, match="max_tokens"):
    SamplingParams(max_tokens=0)
  ids = np.zeros(3, np.int32)
  with pytest.raises(ValueError, match="logprobs shape"):
    GenerateResult(ids, np.zeros(2, np.float32), None, 0, "stop")
  with pytest.raises(ValueError, match="routed_experts"):
    GenerateResult(ids, np.zeros(3, np.float32), np.zeros((3, 2)), 0, "stop")
  with pytest.raises(ValueError, match="finish_reason"):
    GenerateResult(ids, np.zeros(3, np.float32), None, 0, "eos")


def test_engines_follow_the_protocol(tok):
  stop = (cf.special_id(tok, cf.END_OF_TURN),)
  assert isinstance(scripted.RandomEngine(10), Engine)
  assert isinstance(scripted.ScriptedEngine(tok, scripted.noop_policy), Engine)
  noop = scripted.ScriptedEngine(tok, scripted.noop_policy)
  (full,) = noop.generate([GenerateRequest((1, 2), SamplingParams(max_tokens=500, stop_token_ids=stop))])
  assert full.finish_reason == "stop" and full.output_ids[-1] == stop[0]
  assert cf.parse_generated_ids(tok, full.output_ids).tool_calls == [cf.ToolCall("finish", {"message": "Done."})]
  (cut,) = noop.generate([GenerateRequest((1, 2), SamplingParams(max_tokens=5, stop_token_ids=stop))])
  assert cut.finish_reason == "length" and len(cut.output_ids) == 5
  rnd = scripted.RandomEngine(tok.get_vocab_size(), seed=3)
  reqs = [GenerateRequest((1,), SamplingParams(max_tokens=50, seed=s)) for s in (1, 1, 2)]
  a, b, c = rnd.generate(reqs)
  np.testing.assert_array_equal(a.output_ids, b.output_ids)  # same seed, same tokens
  assert not np.array_equal(a.output_ids, c.output_ids)
  assert a.output_ids.max() < tok.get_vocab_size()


def test_oracle_policy_needs_oracle_metadata(tok):
  from rollout.tasks import procedural
  task = procedural.generate(1)[0]
  bare = type(task)(task.id, task.language, task.prompt, task.environment, task.tests)
  with pytest.raises(ValueError, match="no metadata"):
    scripted.oracle_policy([bare])


def test_rollout_imports_neither_jax_nor_composer_jax():
  """Layering: the rollout side runs without JAX (a separate rollout fleet imports no model code)."""
  import subprocess
  import sys
  code = ("import sys, rollout.harness, rollout.evaluation.suite, rollout.tasks.registry, rollout.tasks.swe, "
          "rollout.tasks.autoinstall, rollout.engines.scripted, rollout.workspace\n"
          "bad = [m for m in sys.modules if m == 'jax' or m.startswith(('jax.', 'composer_jax'))]\n"
          "assert not bad, bad")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
  assert out.returncode == 0, out.stderr
