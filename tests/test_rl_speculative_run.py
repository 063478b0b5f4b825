"""MTP through an RL run (tiny model, sync): the SFT start trains the drafter, rollouts decode speculatively with
the current MTP weights, the RL step trains the drafter, and each policy version's acceptance reaches metrics.jsonl."""
import json

import pytest

from composer_jax import configs
from composer_jax.rl import loop
from composer_jax.rl.config import RunConfig
from experiments.configs import rl as rl_configs


def _cfg(workdir, **kw):
  cfg = configs.from_dict(RunConfig, rl_configs.get_config("test,mode=sync"), workdir=str(workdir))
  return configs.replace(cfg, **{"model.num_nextn_predict_layers": 1, **kw})


@pytest.mark.slow   # ~3 min on 2 idle cores: SFT, and the plain and speculative programs of an adaptive engine
def test_speculative_rollouts_log_acceptance_per_version_and_train_the_drafter(tmp_path):
  cfg = _cfg(tmp_path, **{"rl.steps": 3, "rollout.draft_tokens": 2, "rl.mtp_weight": 0.3,
                          "rl.mtp_start_metrics": True})
  logged = []
  loop.run_rl(cfg, log_fn=logged.append)
  m = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  assert [r["step"] for r in m] == [1, 2, 3]
  for r in m:
    assert r["mtp_loss"] > 0 and 0 <= r["mtp_agreement"] <= 1 and 0 < r["mtp_acceptance"] <= 1
    assert 0 < r["mtp_start_acceptance"] <= 1
    # Speculative rollouts record the policy's own logprobs: on-policy, the trainer reproduces them.
    assert r["logprob_gap_replay"] < 1e-3
  # Step s publishes version s, which closes version s - 1 (the one step s's groups were sampled from).
  assert [r["spec/version"] for r in m] == [0, 1, 2]
  for r in m:
    assert 0 <= r["spec/acceptance_sampled"] <= 1 and 1 <= r["spec/tokens_per_forward_sampled"] <= 3
    assert 0 <= r["spec/draft_tokens_mean"] <= 2
  lines = [json.loads(x) for x in open(tmp_path / "engines" / "trainer.jsonl")]
  assert [x["version"] for x in lines] == [0, 1, 2]             # version 3 is published after the last rollout
  assert all(x["engine"] == "trainer" and x["calls"] > 0 for x in lines)
  assert any(s.startswith("engine trainer v0:") for s in logged)


def test_draft_tokens_need_an_mtp_module_and_the_jax_engine(tmp_path):
  with pytest.raises(ValueError, match="num_nextn_predict_layers=0"):
    _cfg(tmp_path, **{"model.num_nextn_predict_layers": 0, "rollout.draft_tokens": 1})
  with pytest.raises(ValueError, match="embedded JAX engine"):
    _cfg(tmp_path, **{"rollout.draft_tokens": 1, "rollout.engine": "sglang", "rollout.mode": "async",
                      "rollout.max_staleness": 1})
  with pytest.raises(ValueError, match="draft_tokens=-1"):
    _cfg(tmp_path, **{"rollout.draft_tokens": -1})
