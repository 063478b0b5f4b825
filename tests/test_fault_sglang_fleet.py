"""Fault: an SGLang server dies in the middle of a request, and a replacement comes up later.

The fleet's own client and fail-over code runs against real server processes (`fake_sglang_server.py`: the few
endpoints the fleet speaks, started in ~0.1 s where a real CPU SGLang server takes 16-30 s and 2.4 GB). A worker rolls
out groups through the fleet into the queue: the dead server's requests are retried on the other one, the fleet
shrinks, a replacement starts on the current weights and serves, and every group reaches the queue whole, once."""
import json
import os
import sys
import time

import pytest

from composer_jax import configs
from composer_jax.rl import fleet as fleet_lib
from composer_jax.rl import setup
from composer_jax.rl.config import RunConfig
from experiments.configs import rl as rl_configs
from rollout import harness, workers
from rollout.engines.protocol import GenerateRequest, SamplingParams
from rollout.engines.sglang_client import post_json
from rollout.engines.sglang_fleet import FleetConfig, RemoteServer, SGLangFleet
from rollout.engines.sglang_launcher import Process, ServerConfig, free_port
from rollout.queue import QueueConsumer, QueueProducer
from rollout.tasks import procedural
from rollout.tasks.environment import EnvironmentCache
from rollout.workspace import make_factory

SERVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fake_sglang_server.py")


def _launcher(log_dir, vocab, die_on):
  """`SGLangFleet(launch=...)` starting fake servers; `die_on[name]` = the /generate request that server dies on."""
  def launch(scfg: ServerConfig, name: str) -> Process:
    port = free_port()
    cmd = [sys.executable, SERVER, str(port), str(scfg.weight_version), str(vocab), str(die_on.get(name, 0))]
    return Process(f"{name}:{port}", cmd, dict(os.environ), port, os.path.join(log_dir, f"{name}.log"))
  return launch


def _hits(url):
  return post_json(url + "/hits", None, timeout=5)["generate"]


@pytest.fixture
def setting(tmp_path):
  pool = procedural.generate(3, seed=7, level=1)
  tok = setup.fit_tokenizer(pool, harness.SHORT_SYSTEM_PROMPT, 512)
  hcfg = harness.HarnessConfig(system_prompt=harness.SHORT_SYSTEM_PROMPT, context_budget=512, max_turn_tokens=32,
                               observation_reserve=128, max_turns=2, max_segments=1)
  (tmp_path / "ckpt").mkdir()
  (tmp_path / "ckpt" / "config.json").write_text("{}")
  envs = EnvironmentCache(make_factory("local"))
  yield pool, tok, hcfg, envs
  envs.factory.close()


def test_a_server_dying_mid_request_is_retried_elsewhere_and_the_fleet_regrows(setting, tmp_path):
  pool, tok, hcfg, envs = setting
  scfg = ServerConfig(str(tmp_path / "ckpt"), return_routed_experts=False)
  fleet = SGLangFleet(FleetConfig(scfg, n_servers=2, max_attempts=3, request_timeout_s=30, regrow_backoff_s=0),
                      launch=_launcher(str(tmp_path), tok.get_vocab_size(), {"sglang-0": 2}))
  url0, url1 = (s.url for s in fleet.servers)
  url = f"file://{tmp_path}/q"

  def run(n):
    return workers.run_worker(fleet, tok, pool, envs, hcfg, QueueProducer(url, "worker0"),
                              workers.WorkerConfig(samples_per_prompt=2, max_groups=n), str(tmp_path / "w.json"))

  try:
    for s in fleet.servers:
      s.wait_ready(30)
    # 1. sglang-0 dies on its second request (the second group's), mid-request: it is retried on sglang-1, the
    # worker's groups complete, nothing is aborted.
    assert run(2) == 2
    assert fleet.counts["retried_requests"] >= 1
    assert url0 not in [s.url for s in fleet.live_servers()]                        # the fleet shrank ...
    # 2. ... and regrows: the next publish drops the dead server and starts a replacement on the served weights;
    # the publish reaches the replacement too, which starts on version 0 and loads version 1 before serving.
    fleet.update_weights(str(tmp_path / "ckpt"), version=1)
    assert fleet.counts["servers_lost"] == 1 and [s.url for s in fleet.servers] == [url1]
    deadline = time.monotonic() + 60
    while fleet.counts["servers_regrown"] < 1:
      assert time.monotonic() < deadline, "no replacement came up"
      time.sleep(0.2)
      fleet.heal()
    urls = [s.url for s in fleet.live_servers()]
    assert len(urls) == 2 and url1 in urls and url0 not in urls
    new = next(u for u in urls if u != url1)
    reqs = [GenerateRequest((5, 6, 7, i), SamplingParams(max_tokens=4), request_id=f"r{i}") for i in range(6)]
    assert {r.policy_version for r in fleet.generate(reqs)} == {1}                   # every server on version 1
    assert _hits(new) >= 1                                                            # the replacement serves
    # 3. The run goes on through the regrown fleet.
    assert run(1) == 1
  finally:
    fleet.close()
  assert not any(p.alive() for p in fleet.processes())
  got = QueueConsumer(url).poll(trainer_version=1)
  assert [g.tree()["meta"]["stream_index"] for g in got] == [0, 1, 2]                # every group once, in order
  for g in got:
    trajs = g.trajectories()
    assert len(trajs) == 2 and all(t["stop_reason"] != "abort" for t in trajs)


def test_a_worker_follows_the_trainers_server_list(tmp_path):
  """Workers attach to the trainer's fleet through fleet.json and re-read it before each group (`load_newer`)."""
  (tmp_path / "ckpt").mkdir()
  (tmp_path / "ckpt" / "config.json").write_text(json.dumps({"num_hidden_layers": 2, "num_experts_per_tok": 2,
                                                              "n_routed_experts": 4}))
  cfg = configs.from_dict(RunConfig, rl_configs.get_config("test,mode=async,engine=sglang"), workdir=str(tmp_path))

  def write(urls, version):
    fleet_lib._write_state(str(tmp_path), {"urls": urls, "version": version, "model_path": str(tmp_path / "ckpt"),
                                           "pgids": []})

  write(["http://127.0.0.1:1", "http://127.0.0.1:2"], 0)
  follower = fleet_lib.FleetPublisher.follow(cfg)
  first = follower.engine.servers[1]
  assert [s.url for s in follower.engine.servers] == ["http://127.0.0.1:1", "http://127.0.0.1:2"]
  write(["http://127.0.0.1:2", "http://127.0.0.1:3"], 1)                     # :1 died, :3 replaced it
  follower.load_newer()
  assert [s.url for s in follower.engine.servers] == ["http://127.0.0.1:2", "http://127.0.0.1:3"]
  assert follower.engine.servers[0] is first and isinstance(follower.engine.servers[1], RemoteServer)
  assert follower.version() == 1
