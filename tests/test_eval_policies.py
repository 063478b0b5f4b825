"""rollout/evaluation/policies.py: the gold-patch oracle script and the interim SGLang endpoint adapter against a
local HTTP server that answers like SGLang's /generate."""

import http.server
import json
import threading

import numpy as np
import pytest

from rollout.engines.protocol import GenerateRequest, SamplingParams
from rollout.evaluation import policies
from rollout.tasks.task import Environment, HiddenTests, Task


def test_with_oracle_keeps_procedural_oracles_and_scripts_gold_for_others():
  t = Task("miner/x/1", "python", "fix it", Environment(), HiddenTests("true", ("a",)), gold_patch="--- a/x\n+++ b/x\n")
  own = Task("proc/1", "python", "p", Environment(), HiddenTests("true", ("a",)),
             metadata={"oracle": [{"content": ""}]})
  scripted, kept = policies.with_oracle([t, own])
  assert kept is own
  turns = scripted.metadata["oracle"]
  assert [c["name"] for turn in turns for c in turn["tool_calls"]] == ["write_file", "shell", "finish"]  # no repo
  assert turns[0]["tool_calls"][0]["arguments"]["content"] == t.gold_patch
  with pytest.raises(ValueError, match="valid"):
    policies.baseline("gpt", None, [])


class _Fake(http.server.BaseHTTPRequestHandler):
  seen = []

  def do_POST(self):
    body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
    _Fake.seen.append((self.path, body))
    n = body["sampling_params"]["max_new_tokens"]
    out = {"output_ids": list(range(7, 7 + n)), "meta_info": {
      "output_token_logprobs": [[-0.5, 7 + i, None] for i in range(n)], "finish_reason": {"type": "length"},
      "weight_version": "3"}}
    data = json.dumps(out).encode()
    self.send_response(200)
    self.send_header("Content-Type", "application/json")
    self.send_header("Content-Length", str(len(data)))
    self.end_headers()
    self.wfile.write(data)

  def log_message(self, *args):
    pass


def test_sglang_adapter_round_trip():
  server = http.server.HTTPServer(("127.0.0.1", 0), _Fake)
  threading.Thread(target=server.serve_forever, daemon=True).start()
  try:
    engine = policies.SGLangEndpointEngine(f"http://127.0.0.1:{server.server_port}/")
    req = GenerateRequest((1, 2, 3), SamplingParams(temperature=0.5, max_tokens=4, stop_token_ids=(9,), seed=11))
    (res,) = engine.generate([req])
  finally:
    server.shutdown()
  path, body = _Fake.seen[-1]
  assert path == "/generate" and body["input_ids"] == [1, 2, 3]
  assert body["sampling_params"]["stop_token_ids"] == [9] and body["sampling_params"]["max_new_tokens"] == 4
  np.testing.assert_array_equal(res.output_ids, [7, 8, 9, 10])
  np.testing.assert_allclose(res.logprobs, [-0.5] * 4)
  assert res.policy_version == 3 and res.finish_reason == "length" and res.routed_experts is None
