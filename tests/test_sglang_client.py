"""SGLang client/launcher logic without a server: payloads, answer decoding, routing alignment, configs, errors."""
import base64
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from rollout.engines import sglang_client as sc
from rollout.engines.protocol import GenerateRequest, SamplingParams
from rollout.engines.sglang_fleet import FleetConfig
from rollout.engines.sglang_launcher import PATCH_DIR, ServerConfig, SpeculativeConfig

LAYOUT = sc.RoutingLayout(n_layers=3, moe_layers=(1, 2), top_k=2)


def _body(prompt_len, out, routed_SxLxK, versions=("4",), reason="length"):
  meta = {"finish_reason": {"type": reason}, "weight_version": versions[-1],
          "weight_versions": [{"version": v, "start": 0, "end": 1} for v in versions],
          "output_token_logprobs": [[-0.5 * (i + 1), t, None] for i, t in enumerate(out)],
          "routed_experts": base64.b64encode(np.asarray(routed_SxLxK, "<i4").tobytes()).decode()}
  return {"output_ids": list(out), "meta_info": meta}


def test_payload_maps_protocol_fields():
  req = GenerateRequest((5, 6, 7), SamplingParams(temperature=0.7, top_p=0.9, top_k=0, max_tokens=12,
                                                  stop_token_ids=(2, 9), seed=11), request_id="r1")
  p = sc.to_payload(req)
  assert p["input_ids"] == [5, 6, 7] and p["return_logprob"] and p["return_routed_experts"] and p["rid"] == "r1"
  assert p["sampling_params"] == {"temperature": 0.7, "top_p": 0.9, "top_k": -1, "max_new_tokens": 12,
                                  "stop_token_ids": [2, 9], "ignore_eos": False, "sampling_seed": 11}
  p = sc.to_payload(GenerateRequest((1,), SamplingParams(top_k=4)), return_routed_experts=False)
  assert p["sampling_params"]["top_k"] == 4 and "sampling_seed" not in p["sampling_params"]
  assert p["sampling_params"]["ignore_eos"]  # no stop ids: only max_tokens ends the sample
  assert "return_routed_experts" not in p
  with pytest.raises(ValueError, match="empty prompt"):
    sc.to_payload(GenerateRequest((), SamplingParams()))


def test_routing_rows_align_with_logprob_positions():
  """P=4 prompt, T=3 outputs: SGLang logs S-1=6 positions x 3 layers; output t is input at position P+t, so we keep
  positions 4, 5, the last output (never fed back) is -1, and layers 1, 2; positions 0..3 are the prompt's."""
  P, out = 4, [10, 11, 12]
  # value = 100*position + 10*layer + slot, so every kept entry says where it came from
  routed = np.array([[[100 * s + 10 * l + k for k in range(2)] for l in range(3)] for s in range(P + 2)])
  r = sc.from_response(_body(P, out, routed), P, LAYOUT)
  assert r.routed_experts.shape == (3, 2, 2) and r.routed_experts.dtype == np.int32
  np.testing.assert_array_equal(r.routed_experts[:2, :, 0] // 100, [[4, 4], [5, 5]])
  np.testing.assert_array_equal(r.routed_experts[0], [[410, 411], [420, 421]])
  np.testing.assert_array_equal(r.routed_experts[2], -1)
  assert r.prompt_routed_experts.shape == (P, 2, 2)          # positions 0..P-1 are the prompt's prefill
  np.testing.assert_array_equal(r.prompt_routed_experts[:, :, 0] // 100, np.arange(P)[:, None].repeat(2, 1))
  np.testing.assert_array_equal(r.prompt_routed_experts[0], [[10, 11], [20, 21]])
  np.testing.assert_array_equal(r.output_ids, out)
  np.testing.assert_allclose(r.logprobs, [-0.5, -1.0, -1.5])
  assert r.policy_version == 4 and r.finish_reason == "length"


def test_version_is_the_oldest_span_and_reasons_map():
  routed = np.zeros((3, 3, 2))
  r = sc.from_response(_body(2, [1, 2], routed, versions=("7", "8"), reason="stop"), 2, LAYOUT)
  assert r.policy_version == 7 and r.finish_reason == "stop"
  r = sc.from_response(_body(2, [1, 2], routed, reason="abort"), 2, None)
  assert r.finish_reason == "abort" and r.routed_experts is None
  with pytest.raises(sc.SGLangError, match="not an integer policy version"):
    sc.from_response(_body(2, [1, 2], routed, versions=("default",)), 2, LAYOUT)


def test_malformed_answers_name_the_problem():
  with pytest.raises(sc.SGLangError, match="expected 3 positions x 3 layers x 2 experts = 18"):
    sc.from_response(_body(2, [1, 2], np.zeros((4, 3, 2))), 2, LAYOUT)
  body = _body(2, [1, 2], np.zeros((3, 3, 2)))
  body["meta_info"]["output_token_logprobs"][1][1] = 99
  with pytest.raises(sc.SGLangError, match="token ids differ"):
    sc.from_response(body, 2, LAYOUT)
  with pytest.raises(sc.SGLangError, match="skip-tokenizer-init"):
    sc.from_response({"text": "hi", "meta_info": {}}, 2, LAYOUT)


def test_layout_from_config(tmp_path):
  cfg = {"num_hidden_layers": 6, "first_k_dense_replace": 1, "moe_layer_freq": 2, "num_experts_per_tok": 8,
         "n_routed_experts": 64}
  (tmp_path / "config.json").write_text(json.dumps(cfg))
  assert sc.RoutingLayout.from_hf_config(str(tmp_path)) == sc.RoutingLayout(6, (2, 4), 8)
  with pytest.raises(ValueError, match="num_experts_per_tok"):
    sc.RoutingLayout.from_hf_config({"num_hidden_layers": 2})


def test_unreachable_endpoint_is_retryable():
  with pytest.raises(sc.SGLangUnavailable):
    sc.post_json("http://127.0.0.1:9/health", None, timeout=2.0)  # port 9 (discard): nothing listens


def test_server_config_command_and_checks(tmp_path):
  (tmp_path / "config.json").write_text("{}")
  cfg = ServerConfig(str(tmp_path), weight_version=3)
  cmd = cfg.command(1234)
  for flag in ("--skip-tokenizer-init", "--enable-return-routed-experts", "--disable-cuda-graph"):
    assert flag in cmd
  assert cmd[cmd.index("--attention-backend") + 1] == "torch_native" and cmd[cmd.index("--host") + 1] == "127.0.0.1"
  assert cmd[cmd.index("--weight-version") + 1] == "3" and cmd[cmd.index("--dtype") + 1] == "float32"
  env = cfg.env()
  assert env["SGLANG_USE_CPU_ENGINE"] == "1" and env["PYTHONPATH"].split(os.pathsep)[0] == PATCH_DIR
  gpu = ServerConfig(str(tmp_path), device="cuda", dtype="bfloat16", speculative=SpeculativeConfig("NEXTN", 2))
  gcmd = gpu.command(1)
  assert "--attention-backend" not in gcmd and gcmd[gcmd.index("--speculative-algorithm") + 1] == "NEXTN"
  assert gcmd[gcmd.index("--speculative-num-steps") + 1] == "2" and "SGLANG_USE_CPU_ENGINE" not in gpu.env()
  with pytest.raises(ValueError, match="GPU-only"):
    ServerConfig(str(tmp_path), speculative=SpeculativeConfig())
  assert "--enable-deterministic-inference" in ServerConfig(str(tmp_path), device="cuda", deterministic=True).command(1)
  with pytest.raises(ValueError, match="seeds are sent but not honoured"):
    ServerConfig(str(tmp_path), deterministic=True)
  with pytest.raises(ValueError, match="no config.json"):
    ServerConfig(str(tmp_path / "missing"))
  with pytest.raises(ValueError, match="not in"):
    SpeculativeConfig("MEDUSA").args()
  with pytest.raises(ValueError, match="drops return_routed_experts"):
    FleetConfig(cfg, use_router=True)


def test_cpu_kernel_stand_in_matches_triton_semantics():
  """The sgl_kernel stand-in writes each request's slots after the previous requests' slots in out_cache_loc."""
  torch = pytest.importorskip("torch", reason="torch is what SGLang runs on")
  sys.path.insert(0, PATCH_DIR)
  try:
    from sgl_kernel import assign_req_to_token_pool_cpu, some_gpu_op
  finally:
    sys.path.remove(PATCH_DIR)
  req_to_token = torch.zeros((3, 6), dtype=torch.int32)
  assign_req_to_token_pool_cpu(torch.tensor([2, 0]), req_to_token, torch.tensor([1, 0]), torch.tensor([3, 2]),
                               torch.tensor([7, 8, 9, 10], dtype=torch.int64), 6)
  np.testing.assert_array_equal(req_to_token.numpy(), [[9, 10, 0, 0, 0, 0], [0] * 6, [0, 7, 8, 0, 0, 0]])
  with pytest.raises(NotImplementedError, match="some_gpu_op"):
    some_gpu_op()
  sys.modules.pop("sgl_kernel")


def test_rollout_sglang_modules_import_neither_jax_nor_composer_jax():
  code = ("import sys; import rollout.engines.sglang_fleet, rollout.engines.sglang_client; "
          "bad = [m for m in sys.modules if m.split('.')[0] in ('jax', 'composer_jax', 'torch')]; print(bad)")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  assert out.stdout.strip() == "[]"


class _FakeServer:
  """A stdlib HTTP server answering /generate like SGLang (echoing the prompt), or a dead endpoint."""

  def __init__(self, version: str, dead: bool = False):
    import http.server
    import threading

    hits = self.hits = []

    class Handler(http.server.BaseHTTPRequestHandler):
      def log_message(self, *args):
        pass

      def do_GET(self):
        self.send_response(200)
        self.end_headers()

      def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        hits.append(self.path)
        if self.path != "/generate":
          out = {"success": True}
        else:
          P, T = len(body["input_ids"]), body["sampling_params"]["max_new_tokens"]
          out = _body(P, body["input_ids"][:T], np.arange((P + T - 1) * 6).reshape(P + T - 1, 3, 2), (version,))
        data = json.dumps(out).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
    if dead:  # the port is closed but the fleet has not noticed yet (alive() still says True)
      self.httpd.server_close()
    else:
      threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
    self.dead, self.stopped = dead, False

  def alive(self):
    return True

  def stop(self):
    if not (self.dead or self.stopped):
      self.httpd.shutdown()
    self.stopped = True


def test_fleet_retries_a_dead_servers_requests_elsewhere(tmp_path):
  from rollout.engines.sglang_fleet import SGLangFleet

  ckpt = tmp_path / "ckpt"
  ckpt.mkdir()
  (ckpt / "config.json").write_text(json.dumps({"num_hidden_layers": 3, "first_k_dense_replace": 1,
                                                "num_experts_per_tok": 2, "n_routed_experts": 8}))
  dead, live = _FakeServer("0", dead=True), _FakeServer("0")
  fleet = SGLangFleet(FleetConfig(ServerConfig(str(ckpt)), max_attempts=2), servers=[dead, live])
  reqs = [GenerateRequest((5, 6, 7, i), SamplingParams(max_tokens=2), request_id=f"r{i}") for i in range(6)]
  out = fleet.generate(reqs)
  assert [r.output_ids.tolist() for r in out] == [[5, 6]] * 6  # all completed, in order
  assert out[0].routed_experts.shape == (2, 2, 2)
  assert live.hits.count("/generate") == 6
  assert fleet.update_weights(str(ckpt), version=2) >= 0
  assert dead.stopped and fleet.live_servers() == [live]  # unreachable during the update: retired
  assert live.hits[-3:] == ["/pause_generation", "/update_weights_from_disk", "/continue_generation"]
  assert fleet.policy_version == 2
  fleet.close()
  assert live.stopped
