"""A real S3-compatible server for tests: moto's server (pinned in the test extras), on 127.0.0.1, started here.

`queue_store(backend, tmp_path)` gives the queue tests a store on "memory", "file" or "s3"; the s3 one is a fresh
bucket on the session's moto server (`s3_endpoint` fixture: one server process per test session, killed at exit).
Credentials are dummies in the environment, which the test's subprocesses inherit.
"""
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import uuid

import net_testlib
import pytest

from rollout.queue import open_store

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}
BACKENDS = ("memory", "file", "s3")


@contextlib.contextmanager
def moto_server(timeout_s: float = 60.0):
  """Runs `python -m moto.server` on 127.0.0.1 and yields its endpoint URL once it accepts connections."""
  port = net_testlib.free_port()
  proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  try:
    deadline = time.time() + timeout_s
    while True:
      if proc.poll() is not None:
        raise RuntimeError(f"moto server exited with {proc.returncode}: {proc.stderr.read()[-2000:]}")
      with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
        break
      if time.time() > deadline:
        raise TimeoutError(f"moto server did not listen on 127.0.0.1:{port} within {timeout_s} s")
      time.sleep(0.1)
    yield f"http://127.0.0.1:{port}"
  finally:
    proc.kill()
    proc.wait()


@pytest.fixture(scope="session")
def s3_endpoint():
  old = {k: os.environ.get(k) for k in CREDENTIALS}
  os.environ.update(CREDENTIALS)
  try:
    with moto_server() as endpoint:
      yield endpoint
  finally:
    for k, v in old.items():
      if v is None:
        os.environ.pop(k, None)
      else:
        os.environ[k] = v


def new_bucket_spec(endpoint: str) -> dict:
  """Creates a fresh bucket and returns the tensorstore s3 kvstore spec of a queue prefix inside it."""
  import boto3
  bucket = f"queue-{uuid.uuid4().hex[:12]}"
  boto3.client("s3", endpoint_url=endpoint, region_name=CREDENTIALS["AWS_DEFAULT_REGION"]).create_bucket(
      Bucket=bucket)
  return {"driver": "s3", "bucket": bucket, "path": "q/", "endpoint": endpoint,
          "aws_region": CREDENTIALS["AWS_DEFAULT_REGION"]}


def queue_store(backend: str, tmp_path, request) -> tuple:
  """(open KvStore, a string another process can open the same store with, or None for memory)."""
  if backend == "memory":
    return open_store("memory://"), None
  if backend == "file":
    url = f"file://{tmp_path}/q"
    return open_store(url), url
  if backend == "s3":
    spec = json.dumps(new_bucket_spec(request.getfixturevalue("s3_endpoint")))
    return open_store(spec), spec
  raise ValueError(f"unknown queue backend {backend!r}; valid: {BACKENDS}")
