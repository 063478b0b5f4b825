r"""Wall-clock per RL step, asynchronous (worker processes + queue) vs synchronous (generate → train), same config.

  PYTHONPATH=. python benchmarks/async_rl.py --variant=test --steps=8 --workers=1
  PYTHONPATH=. python benchmarks/async_rl.py --variant=colab --steps=20 --init=runs/rl_colab/sft

Both runs share one SFT warm start: the sync run's (the async run starts from its exported SFT params), or with
`--init` a finished SFT stage (e.g. `make colab`'s `runs/rl_colab/sft`), so no SFT runs at all. Step times
exclude the first `--warmup` steps (compiles). The trainer idle fraction of the async run is the share of its step
time spent waiting for groups. The last line is JSON with `async_speedup` and `trainer_idle_fraction`.
Expect at most ~`workers + 1`× on idle cores: async overlaps rollout with training, it does not remove work, and on
a 2-core machine shared with other jobs the overlap is limited by the cores.
"""
import argparse
import json
import os
import shutil
import tempfile


def _step_stats(workdir: str, warmup: int) -> dict:
  rows = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
  rows = [r for r in rows if r["step"] > warmup] or rows
  n = len(rows)
  step_s = sum(r["step_s"] for r in rows) / n
  idle = sum(r["trainer_idle_s"] for r in rows) / max(sum(r["step_s"] for r in rows), 1e-9)
  return {"step_s": step_s, "idle_fraction": idle, "steps_measured": n}


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--variant", default="test")
  ap.add_argument("--steps", type=int, default=8)
  ap.add_argument("--warmup", type=int, default=2)
  ap.add_argument("--workers", type=int, default=1)
  ap.add_argument("--staleness", type=int, default=2)
  ap.add_argument("--workdir", default="")
  ap.add_argument("--init", default="", help="a finished SFT stage to start both runs from (skips the SFT)")
  a = ap.parse_args()
  from absl import logging

  from composer_jax import configs
  from composer_jax.rl import loop
  from composer_jax.rl.config import RunConfig
  from experiments.configs import rl as rl_configs
  logging.set_verbosity(logging.WARNING)
  root = a.workdir or tempfile.mkdtemp(prefix="async_rl_")
  if a.workdir:
    shutil.rmtree(root, ignore_errors=True)
  out = {}
  sync_dir = os.path.join(root, "sync")
  for mode in ("sync", "async"):
    c = rl_configs.get_config(f"{a.variant},mode={mode},steps={a.steps},workers={a.workers},staleness={a.staleness}")
    c.progress_bar = False
    c.rl.ckpt_every = a.steps
    if a.init or mode == "async":
      c.sft.init_checkpoint, c.sft.steps = a.init or os.path.join(sync_dir, "sft"), 0
    cfg = configs.from_dict(RunConfig, c, workdir=os.path.join(root, mode))
    loop.run_rl(cfg, log_fn=lambda s: None)
    out[mode] = _step_stats(cfg.workdir, a.warmup)
    print(f"{mode}: {out[mode]['step_s']:.2f} s/step, trainer idle {out[mode]['idle_fraction']:.0%}", flush=True)
  load = os.getloadavg()
  print(json.dumps({"async_speedup": out["sync"]["step_s"] / out["async"]["step_s"],
                    "trainer_idle_fraction": out["async"]["idle_fraction"],
                    "sync_step_s": out["sync"]["step_s"], "async_step_s": out["async"]["step_s"],
                    "workers": a.workers, "steps": a.steps, "variant": a.variant, "loadavg_1m": load[0],
                    "cpus": os.cpu_count()}))


if __name__ == "__main__":
  main()
