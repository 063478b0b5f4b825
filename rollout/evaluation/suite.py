"""One evaluation: load sets, print their statistics side by side, gold-validate (and optionally contamination-
check) every task, run each policy with k samples resumably, then write summaries and the Pareto plot.

Output layout under `out_dir`:
  set_stats.txt / set_stats.json          statistics of every set loaded (before validation)
  <set>/gold.jsonl                        every task's gold check (valid, reason); reused on resume
  <set>/contamination.json                flagged task ids -> fraction found (when a corpus is given)
  <set>/<policy>/results.jsonl, run.json  per-task results (see `runner`)
  <set>/summary.json, summary.txt         per-policy metrics
  <set>/pareto.png                        pass@1 vs cost across policies
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Mapping, Sequence

from rollout import harness
from rollout.evaluation import contamination, gold, metrics, report, runner, stats
from rollout.tasks.environment import EnvironmentCache
from rollout.tasks.task import Task

VALIDITY = {"oracle": 1.0, "noop": 0.0}  # policy -> the score it must get on every sample of every valid task


@dataclasses.dataclass(frozen=True)
class Policy:
  """A policy to evaluate: `make(tasks) -> engine` (the oracle needs the tasks), its tokenizer and its active
  parameter count (0 for scripted baselines)."""
  make: Callable[[Sequence[Task]], object]
  tokenizer: object
  active_params: int = 0


def _gold_cached(name: str, tasks: Sequence[Task], envs: EnvironmentCache, path: str, log) -> list[gold.GoldCheck]:
  fp = runner.set_fingerprint(tasks)
  if os.path.exists(path):
    with open(path, encoding="utf-8") as f:
      rows = [json.loads(line) for line in f if line.strip()]
    if rows and rows[0].get("set") == fp:
      return [gold.GoldCheck(r["task_id"], r["valid"], r["reason"], r["post_files"]) for r in rows[1:]]
  _, checks = gold.validate(tasks, envs)
  with open(path, "w", encoding="utf-8") as f:
    f.write(json.dumps({"set": fp}) + "\n")
    f.writelines(json.dumps(dataclasses.asdict(c)) + "\n" for c in checks)
  for c in checks:
    if not c.valid:
      log(f"[{name}] INVALID {c.task_id}: {c.reason}")
  return checks


def evaluate(sets: Mapping[str, Sequence[Task]], policies: Mapping[str, Policy], envs: EnvironmentCache,
             harness_cfg: harness.HarnessConfig, out_dir: str, run_cfg: runner.RunConfig | None = None,
             corpus: str = "", exclude_contaminated: bool = True, contamination_cfg=None,
             log: Callable[[str], None] = print) -> dict[str, dict]:
  """Runs every policy on every set (see the module docstring).

  Args:
    sets: set name -> tasks.
    policies: policy name -> Policy.
    envs: environment cache (its factory decides sandbox vs local).
    harness_cfg: harness limits and sampling.
    out_dir: output directory (re-running with the same arguments resumes).
    run_cfg: samples per task and chunking (active_params is taken from each Policy).
    corpus: optional pretraining corpus (dir or JSONL) for the contamination guard.
    exclude_contaminated: drop flagged tasks from evaluation (they are always reported).
    contamination_cfg: `contamination.ContaminationConfig` (default when None).
    log: progress lines.

  Returns:
    set name -> {"valid": n, "invalid": [(id, reason)], "contaminated": {id: frac}, "summaries": {policy: metrics},
    "pareto_front": [policy names], "validity_failures": {"oracle"/"noop": [task ids scoring other than 1 / 0]}}.
  """
  run_cfg = run_cfg or runner.RunConfig()
  os.makedirs(out_dir, exist_ok=True)
  table = stats.compare_table(sets)
  log("set statistics (median [q25-q75]):\n" + table)
  with open(os.path.join(out_dir, "set_stats.txt"), "w") as f:
    f.write(table + "\n")
  with open(os.path.join(out_dir, "set_stats.json"), "w") as f:
    json.dump({n: stats.set_statistics(t) for n, t in sets.items()}, f, indent=1)
  index = contamination.CorpusIndex(contamination.read_corpus(corpus),
                                    contamination_cfg or contamination.ContaminationConfig()) if corpus else None
  out = {}
  for set_name, tasks in sets.items():
    sdir = os.path.join(out_dir, set_name)
    os.makedirs(sdir, exist_ok=True)
    checks = _gold_cached(set_name, tasks, envs, os.path.join(sdir, "gold.jsonl"), log)
    valid = [t for t, c in zip(tasks, checks, strict=True) if c.valid]
    flagged = {}
    if index is not None:
      flagged = contamination.check(valid, {c.task_id: c.post_files for c in checks}, index)
      with open(os.path.join(sdir, "contamination.json"), "w") as f:
        json.dump(flagged, f, indent=1)
      for tid, frac in flagged.items():
        log(f"[{set_name}] CONTAMINATED {tid}: {frac:.0%} of solution windows in the corpus")
      if exclude_contaminated:
        valid = [t for t in valid if t.id not in flagged]
    log(f"[{set_name}] {len(valid)}/{len(tasks)} tasks valid for evaluation")
    if not valid:
      raise ValueError(f"set {set_name!r} has no valid tasks; see {sdir}/gold.jsonl")
    summaries, validity = {}, {}
    for pname, pol in policies.items():
      cfg = dataclasses.replace(run_cfg, active_params=pol.active_params)
      recs = runner.run_policy(pname, pol.make(valid), pol.tokenizer, valid, envs, harness_cfg,
                               os.path.join(sdir, pname), cfg, log)
      summaries[pname] = metrics.summarize(recs, ks=(cfg.samples,))
      if pname in VALIDITY:  # the harness's own check: the oracle solves every valid task, the no-op none
        want = VALIDITY[pname]
        validity[pname] = [r["task_id"] for r in recs if any(x["solved"] != want for x in r["samples"])]
        log(f"[{set_name}] validity: {pname} " + (f"OK ({want:.0%} on every task)" if not validity[pname] else
                                                 f"FAILED on {validity[pname][:10]}"))
    text = report.summary_table(summaries)
    log(f"[{set_name}]\n" + text)
    with open(os.path.join(sdir, "summary.txt"), "w") as f:
      f.write(text + "\n")
    with open(os.path.join(sdir, "summary.json"), "w") as f:
      json.dump(summaries, f, indent=1)
    front = report.pareto_plot(summaries, os.path.join(sdir, "pareto.png"), title=f"{set_name}: pass@1 vs cost")
    out[set_name] = {"valid": len(valid), "invalid": [(c.task_id, c.reason) for c in checks if not c.valid],
                     "contaminated": flagged, "summaries": summaries, "pareto_front": front,
                     "validity_failures": validity}
  return out
