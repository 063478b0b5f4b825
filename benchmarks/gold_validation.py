r"""Gold validation of a frozen set: first evaluation (every task graded 2 x 2 times) vs a later one that reuses the
stored checks (`rollout/evaluation/gold_cache.py`), in one process on the same tasks.

  PYTHONPATH=. python benchmarks/gold_validation.py                      # a generated 6-commit repository
  PYTHONPATH=. python benchmarks/gold_validation.py --repo=/src/attrs --max_commits=80 --backend=sandbox

The tasks are mined first (not timed), then validated with an empty cache ("cold", the baseline: what every
evaluation paid before) and again with the filled one ("warm"), `--rounds` times each, alternating, each cold round
with a fresh cache directory; medians are reported. The last line is JSON with `cold_s`, `warm_s`, `speedup`,
`tasks` and the load average.
"""
import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time

from rollout.evaluation import gold
from rollout.evaluation.gold_cache import GoldCache
from rollout.tasks import environment, miner
from rollout.workspace import make_factory


def _git(repo: str, *args: str) -> None:
  subprocess.run(["git", "-C", repo, "-c", "user.name=b", "-c", "user.email=b@b", *args], check=True,
                 capture_output=True)


def generated_repo(path: str, n: int) -> str:
  """A repository whose n commits each fix one function of `ops.py` and add its test."""
  os.makedirs(os.path.join(path, "tests"))
  _git(path, "init", "-q", "-b", "main")
  bodies = {i: f"    return x - {i + 1}" for i in range(n)}  # every function starts wrong

  def write(tests):
    with open(os.path.join(path, "ops.py"), "w") as f:
      f.write("\n\n".join(f"def add_{i}(x):\n{bodies[i]}\n" for i in range(n)))
    with open(os.path.join(path, "tests", "test_ops.py"), "w") as f:
      f.write("import ops\n" + "".join(f"\n\ndef test_add_{i}():\n    assert ops.add_{i}(1) == {1 + i}\n"
                                        for i in tests))
  write([])
  _git(path, "add", "-A")
  _git(path, "commit", "-qm", "Start the ops module")
  for i in range(n):
    bodies[i] = f"    return x + {i}"
    write(range(i + 1))
    _git(path, "add", "-A")
    _git(path, "commit", "-qm", f"add_{i} subtracts instead of adding {i}")
  return path


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--repo", default="", help="a local git repository (default: a generated one)")
  ap.add_argument("--commits", type=int, default=6, help="commits of the generated repository")
  ap.add_argument("--max_commits", type=int, default=50)
  ap.add_argument("--backend", default="local", choices=("local", "sandbox"))
  ap.add_argument("--rounds", type=int, default=3)
  args = ap.parse_args()
  with tempfile.TemporaryDirectory() as tmp:
    repo = args.repo or generated_repo(os.path.join(tmp, "repo"), args.commits)
    factory = make_factory(args.backend, **({"root": os.path.join(tmp, "ws")} if args.backend == "local" else {}))
    envs = environment.EnvironmentCache(factory)
    cfg = miner.MinerConfig(max_commits=args.max_commits, progress=False,
                            test_command="PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 " + miner.MinerConfig().test_command)
    tasks, _ = miner.mine(repo, envs, cfg, log=lambda s: None)
    cold, warm = [], []
    for r in range(args.rounds):
      cache_dir = os.path.join(tmp, f"cache{r}")
      for times, cache in ((cold, GoldCache(cache_dir)), (warm, GoldCache(cache_dir))):
        t = time.perf_counter()
        _, checks = gold.validate(tasks, envs, cache=cache, progress=False)
        times.append(time.perf_counter() - t)
        assert all(c.valid for c in checks), [c.reason for c in checks if not c.valid]
      print(f"round {r}: cold {cold[-1]:.2f} s, warm {warm[-1]:.4f} s", flush=True)
    factory.close()
  out = {"tasks": len(tasks), "backend": args.backend, "cold_s": round(statistics.median(cold), 3),
         "warm_s": round(statistics.median(warm), 4), "speedup": round(statistics.median(cold) /
                                                                       max(statistics.median(warm), 1e-6), 1),
         "load_avg_1m": round(os.getloadavg()[0], 1)}
  print(json.dumps(out))


if __name__ == "__main__":
  main()
