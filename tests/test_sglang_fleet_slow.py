"""Two real SGLang servers: a dead server's requests go elsewhere, weight updates reach the survivors, a replacement
regrows the fleet on the current weights, and sglang-router balances (and, in 0.3.2, drops the routing log — a canary
for lifting `FleetConfig`'s refusal).

Slow: three server starts (two, then a replacement) plus the router; before the replacement, 164 s on a loaded
2-core machine (426 s when it was overloaded).
"""
import os
import signal
import time

import numpy as np
import pytest
import sglang_testlib as lib

from rollout.engines.protocol import GenerateRequest, SamplingParams
from rollout.engines.sglang_client import generate_one
from rollout.engines.sglang_fleet import FleetConfig, SGLangFleet
from rollout.engines.sglang_launcher import ServerConfig, launch_router

pytestmark = pytest.mark.slow


def _requests(n, seed):
  rng = np.random.default_rng(seed)
  return [GenerateRequest(tuple(int(t) for t in rng.integers(2, lib.CFG.vocab_size, 6)),
                          SamplingParams(temperature=0, max_tokens=6), request_id=f"r{seed}-{i}") for i in range(n)]


def test_two_servers_fail_over_update_and_router(tmp_path):
  lib.require_sglang()
  ckpt = lib.save_checkpoint(str(tmp_path / "v0"), seed=0)
  with SGLangFleet(FleetConfig(ServerConfig(ckpt, max_total_tokens=4096), n_servers=2, max_attempts=3),
                   log_dir=str(tmp_path / "logs")) as fleet:
    reqs = _requests(8, seed=0)
    before = fleet.generate(reqs)
    for req, r in zip(reqs, before, strict=True):
      np.testing.assert_array_equal(r.output_ids, lib.reference(0, req.prompt_ids, r.output_ids)[0])

    router = launch_router([s.url for s in fleet.servers], log_dir=str(tmp_path / "logs"))
    try:
      router.wait_ready(300, path="/readiness")
      via_router = generate_one(router.url, reqs[0], fleet.layout)
      np.testing.assert_array_equal(via_router.output_ids, before[0].output_ids)
      # Canary: sglang-router 0.3.2 forwards no routing log. When this fails, routing survives the router and
      # FleetConfig may allow use_router=True with return_routed_experts.
      assert via_router.routed_experts is None

      dead = fleet.servers[0]
      os.killpg(dead.popen.pid, signal.SIGKILL)
      dead.popen.wait(timeout=30)
      assert fleet.health() == {dead.url: False, fleet.servers[1].url: True}
      # Round-robin sends every other request to the dead server first: all must still complete, identically.
      after = fleet.generate(reqs)
      for a, b in zip(after, before, strict=True):
        np.testing.assert_array_equal(a.output_ids, b.output_ids)
        np.testing.assert_array_equal(a.routed_experts, b.routed_experts)
      # The router, too, retries on the live worker.
      np.testing.assert_array_equal(generate_one(router.url, reqs[1], None).output_ids, before[1].output_ids)
    finally:
      router.stop()

    ckpt1 = lib.save_checkpoint(str(tmp_path / "v1"), seed=1)
    fleet.update_weights(ckpt1, version=1)  # only the live server is updated; a replacement starts on version 0
    assert fleet.counts["servers_lost"] == 1 and len(fleet.servers) == 1
    r = fleet.generate(reqs[:2])
    assert {x.policy_version for x in r} == {1}
    for req, x in zip(reqs[:2], r, strict=True):
      np.testing.assert_array_equal(x.output_ids, lib.reference(1, req.prompt_ids, x.output_ids)[0])
    # The fleet regrows: the replacement loads version 1 before it serves, and answers like the reference.
    deadline = time.monotonic() + 600
    while fleet.counts["servers_regrown"] < 1:
      assert time.monotonic() < deadline, "the replacement server never came up"
      time.sleep(1.0)
      fleet.heal()
    new = fleet.servers[-1]
    assert len(fleet.live_servers()) == 2 and new.url != dead.url
    for req in reqs[:2]:
      x = generate_one(new.url, req, fleet.layout)
      assert x.policy_version == 1
      np.testing.assert_array_equal(x.output_ids, lib.reference(1, req.prompt_ids, x.output_ids)[0])
  assert not any(p.alive() for p in fleet.processes())
