"""Local ports and processes for tests that start servers, coordinators or several processes of their own."""
import socket
import subprocess


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def communicate_all(procs: list[subprocess.Popen], timeout: float) -> list[tuple[int, str, str | None]]:
  """(returncode, stdout, stderr) of each process, in order; any still running afterwards (e.g. stuck waiting for a
  peer in a collective) is killed, not left behind."""
  outs = []
  try:
    for p in procs:
      out, err = p.communicate(timeout=timeout)
      outs.append((p.returncode, out, err))
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  return outs
