"""Another process holding an RL workdir's run lock (`composer_jax.rl.workdir.lock`), for the lock's tests."""
import contextlib
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@contextlib.contextmanager
def live_lock_holder(workdir):
  """Yields a process holding `workdir`'s lock; at the end it is SIGKILLed (no clean-up runs: the lock file stays)."""
  holder = subprocess.Popen([sys.executable, "-c", "import time\nfrom composer_jax.rl import workdir\n"
                             f"with workdir.lock({str(workdir)!r}):\n  print('held', flush=True)\n  time.sleep(600)"],
                            cwd=ROOT, stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=ROOT))
  try:
    assert holder.stdout.readline().strip() == "held"
    yield holder
  finally:
    holder.kill()
    holder.wait()
