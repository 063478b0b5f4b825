"""`sources.take_groups`, the trainer's step assembly, while workers append to the queue during its polls."""
import numpy as np

from composer_jax import configs
from composer_jax.rl import sources
from composer_jax.rl.config import RunConfig
from experiments.configs import rl as rl_configs
from rollout.queue import QueueConsumer, QueueProducer


class _AppendAfterSecondPoll(QueueConsumer):
  """A worker's append lands just after the second poll listed the queue (and found it empty)."""

  def __init__(self, url, append):
    super().__init__(url)
    self.append, self.polls = append, 0

  def poll(self, *args, **kwargs):
    got = super().poll(*args, **kwargs)
    self.polls += 1
    if self.polls == 2:
      self.append(1)
    return got


def test_a_group_appended_right_after_an_empty_poll_joins_the_step(tmp_path):
  """The step waits for its second group instead of ending short because a group arrived during the poll: a depth
  check after the empty poll would see that group and take it for one that does not fit."""
  cfg = configs.from_dict(RunConfig, rl_configs.get_config("test,mode=async"), workdir=str(tmp_path))
  assert cfg.rl.groups_per_step == 2
  url = f"file://{tmp_path}/queue"
  producer = QueueProducer(url, "worker0")

  def append(n):
    producer.append({"x": np.zeros(2)}, {"n": n}, policy_version=0, n_rows=cfg.rollout.samples_per_prompt)
  append(0)
  consumer, waits = _AppendAfterSecondPoll(url, append), []
  step = sources.take_groups(consumer, cfg, 0, wait=lambda: waits.append(consumer.polls))
  assert [g.meta["n"] for g in step] == [0, 1]
  assert waits == [1, 2] and consumer.polls == 3      # [0], then [] (1 lands), then [1]
  assert consumer.depth() == (0, 0) and consumer.stats()["consumed_groups"] == 2
