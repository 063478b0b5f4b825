"""A stand-in SGLang server for fault tests: the endpoints `rollout.engines.sglang_fleet` uses, in one process.

`python fake_sglang_server.py PORT VERSION VOCAB DIE_ON` serves on 127.0.0.1:PORT. /generate answers with
deterministic token ids below VOCAB (a function of the prompt), logprobs and the served weight version, honouring
max_new_tokens and stop ids; /update_weights_from_disk changes the version; /pause_generation and
/continue_generation succeed; GET /health answers 200 and GET /hits the number of /generate requests served. With
DIE_ON = n > 0 the process exits (os._exit) after reading its n-th /generate request, before answering: a server
that dies mid-request. A real SGLang server takes 16-30 s and 2.4 GB to start; this one ~0.1 s.
"""
import http.server
import json
import os
import sys
import threading

PORT, VERSION, VOCAB, DIE_ON = (int(a) for a in sys.argv[1:5])
state = {"version": VERSION, "generate": 0}
lock = threading.Lock()


def _generate(body: dict) -> dict:
  ids, sp = body["input_ids"], body["sampling_params"]
  stops, out, reason = set(sp.get("stop_token_ids") or ()), [], "length"
  for i in range(sp["max_new_tokens"]):
    t = (sum(ids) * 31 + 7 * i + len(ids)) % VOCAB
    out.append(t)
    if t in stops:
      reason = "stop"
      break
  return {"output_ids": out, "meta_info": {"output_token_logprobs": [[-1.0, t, None] for t in out],
                                           "weight_version": str(state["version"]),
                                           "finish_reason": {"type": reason}}}


class Handler(http.server.BaseHTTPRequestHandler):
  def log_message(self, *args):
    pass

  def _answer(self, out) -> None:
    data = json.dumps(out).encode()
    self.send_response(200)
    self.send_header("Content-Length", str(len(data)))
    self.end_headers()
    self.wfile.write(data)

  def do_GET(self):
    self._answer({"generate": state["generate"]} if self.path == "/hits" else {})

  def do_POST(self):
    body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"null")
    if self.path == "/generate":
      with lock:
        state["generate"] += 1
        if state["generate"] == DIE_ON:
          os._exit(1)
      self._answer(_generate(body))
    elif self.path == "/update_weights_from_disk":
      state["version"] = int(body["weight_version"])
      self._answer({"success": True})
    else:
      self._answer({"success": True})


if __name__ == "__main__":
  http.server.ThreadingHTTPServer(("127.0.0.1", PORT), Handler).serve_forever()
