"""One evaluation: print the sets' statistics side by side, gold-validate (and optionally contamination-check) every
task, flag tasks whose oracle does not fit the harness budget, run each policy with k samples resumably (the one
runner, `runner.run_policy`), then write summaries and the Pareto plot of every policy evaluated on the set.

Output layout under `out_dir`:
  set_stats.txt / set_stats.json          statistics of every set loaded (before validation)
  <set>/gold.jsonl                        every task's gold check (valid, reason); checks are stored by content
                                          (`gold_cache.py`) and reused by any later evaluation, resumed or not
  <set>/contamination.json                flagged task ids -> fraction found (when a corpus is given)
  <set>/<policy>/results.jsonl, run.json  per-task results and the settings that define them (see `runner`)
  <set>/summary.json, summary.txt         metrics of every policy present in <set>/ (not only this run's)
  <set>/pareto.png                        pass@1 vs cost across those policies
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
from collections.abc import Callable, Mapping, Sequence

from rollout import harness
from rollout.evaluation import contamination, gold, metrics, report, runner, stats
from rollout.evaluation.gold_cache import GoldCache
from rollout.evaluation.policies import oracle_turn_tokens
from rollout.tasks.environment import EnvironmentCache
from rollout.tasks.progress import reason_kind
from rollout.tasks.task import Task

VALIDITY = {"oracle": 1.0, "noop": 0.0}  # policy -> the score it must get on every sample of every valid task
Log = Callable[[str], None]


@dataclasses.dataclass(frozen=True)
class Policy:
  """A policy to evaluate: `make(tasks) -> engine` (the oracle needs the tasks), its tokenizer and its active
  parameter count (0 for scripted baselines)."""
  make: Callable[[Sequence[Task]], object]
  tokenizer: object
  active_params: int = 0


def _gold_checks(name: str, tasks: Sequence[Task], envs: EnvironmentCache, path: str, runs: int,
                 cache: GoldCache | None, log: Log) -> list[gold.GoldCheck]:
  """Every task's gold check (stored ones reused from `cache`), also written to `path`."""
  hits = cache.hits if cache else 0
  _, checks = gold.validate(tasks, envs, runs, cache=cache)
  if cache:
    log(f"[{name}] gold validation: {cache.hits - hits}/{len(tasks)} checks reused from {cache.directory} "
        "(task, environment and grader unchanged)")
  with open(path, "w", encoding="utf-8") as f:
    f.write(json.dumps({"set": runner.set_fingerprint(tasks), "runs": runs}) + "\n")
    f.writelines(json.dumps(dataclasses.asdict(c)) + "\n" for c in checks)
  for c in checks:
    if not c.valid:
      log(f"[{name}] INVALID {c.task_id}: {c.reason}")
  return checks


def _write_json(path: str, obj) -> None:
  with open(path, "w", encoding="utf-8") as f:
    json.dump(obj, f, indent=1)


def _write_set_stats(sets: Mapping[str, Sequence[Task]], out_dir: str, log: Log) -> None:
  table = stats.compare_table(sets)
  log("set statistics (median [q25-q75]):\n" + table)
  with open(os.path.join(out_dir, "set_stats.txt"), "w", encoding="utf-8") as f:
    f.write(table + "\n")
  _write_json(os.path.join(out_dir, "set_stats.json"), {n: stats.set_statistics(t) for n, t in sets.items()})


def _valid_tasks(name: str, tasks: Sequence[Task], envs: EnvironmentCache, sdir: str, index, exclude: bool,
                 gold_runs: int, cache: GoldCache | None,
                 log: Log) -> tuple[list[Task], list[gold.GoldCheck], dict[str, float]]:
  """(tasks to evaluate, every gold check, contaminated id -> fraction)."""
  checks = _gold_checks(name, tasks, envs, os.path.join(sdir, "gold.jsonl"), gold_runs, cache, log)
  valid = [t for t, c in zip(tasks, checks, strict=True) if c.valid]
  flagged = {}
  if index is not None:
    flagged = contamination.check(valid, {c.task_id: c.post_files for c in checks}, index)
    _write_json(os.path.join(sdir, "contamination.json"), flagged)
    for tid, frac in flagged.items():
      log(f"[{name}] CONTAMINATED {tid}: {frac:.0%} of solution windows in the corpus")
    if exclude:
      valid = [t for t in valid if t.id not in flagged]
  log(f"[{name}] {len(valid)}/{len(tasks)} tasks valid for evaluation")
  if not valid:
    kinds = collections.Counter(reason_kind(c.reason) for c in checks if not c.valid)
    raise ValueError(f"set {name!r} has no valid tasks ({'; '.join(f'{k} x{n}' for k, n in kinds.most_common(3))}"
                     f"); every task's reason is in {sdir}/gold.jsonl")
  return valid, checks, flagged


def oracle_over_budget(tasks: Sequence[Task], tokenizer, harness_cfg: harness.HarnessConfig) -> dict[str, int]:
  """Task id -> oracle turn tokens for the tasks whose oracle cannot act within `max_turn_tokens` (they are
  flagged: the oracle's failure there says the budget is too small, not that the task is broken)."""
  need = {t.id: max(oracle_turn_tokens(t, tokenizer)) for t in tasks}
  return {tid: n for tid, n in need.items() if n > harness_cfg.max_turn_tokens}


def collect_summaries(sdir: str, tasks: Sequence[Task], settings: dict, log: Log) -> tuple[dict, list[str]]:
  """Summaries of every policy evaluated on exactly `tasks` under `sdir`, and notes on those whose settings differ
  from `settings` (this run's harness and k) or whose run is unfinished; runs on another task set are left out,
  with a note."""
  fp, ids = runner.set_fingerprint(tasks), [t.id for t in tasks]
  summaries, notes = {}, []
  for pname in sorted(os.listdir(sdir)):
    pdir = os.path.join(sdir, pname)
    info = runner.read_run_info(pdir) if os.path.isdir(pdir) else None
    if info is None:
      continue
    if info["set"] != fp:
      notes.append(f"{pname}: left out, evaluated on another task set")
      continue
    done = runner.read_records(pdir)
    recs = [done[i] for i in ids if i in done]
    if not recs:
      continue
    summaries[pname] = metrics.summarize(recs, ks=(info["samples"],))
    if len(recs) < len(ids):
      notes.append(f"{pname}: unfinished, {len(recs)}/{len(ids)} tasks")
    diff = runner.settings_diff({k: settings[k] for k in ("samples", "harness")},
                                {k: info[k] for k in ("samples", "harness")})
    if diff:
      notes.append(f"{pname}: made with other settings (this run -> that one): {'; '.join(diff[:4])}")
  for n in notes:
    log(f"note: {n}")
  return summaries, notes


def _run_policies(name: str, valid: Sequence[Task], pols: Mapping[str, Policy], envs: EnvironmentCache,
                  harness_cfg: harness.HarnessConfig, run_cfg: runner.SampleConfig, sdir: str, over_budget: set[str],
                  log: Log) -> dict[str, list[str]]:
  """Runs every policy (results land in sdir/<policy>/); returns the validity failures of oracle / no-op."""
  validity = {}
  for pname, pol in pols.items():
    cfg = dataclasses.replace(run_cfg, active_params=pol.active_params)
    recs = runner.run_policy(pname, pol.make(valid), pol.tokenizer, valid, envs, harness_cfg,
                             os.path.join(sdir, pname), cfg, log)
    if pname in VALIDITY:  # the harness's own check: the oracle solves every valid task, the no-op none
      want = VALIDITY[pname]
      validity[pname] = [r["task_id"] for r in recs if r["task_id"] not in over_budget and
                         any(x["solved"] != want for x in r["samples"])]
      log(f"[{name}] validity: {pname} " + (f"OK ({want:.0%} on every task)" if not validity[pname] else
                                           f"FAILED on {validity[pname][:10]}"))
  return validity


def evaluate(sets: Mapping[str, Sequence[Task]], policies: Mapping[str, Policy], envs: EnvironmentCache,
             harness_cfg: harness.HarnessConfig, out_dir: str, run_cfg: runner.SampleConfig | None = None,
             corpus: str = "", exclude_contaminated: bool = True, contamination_cfg=None, gold_runs: int = 2,
             gold_cache: GoldCache | None = None, log: Log = print) -> dict[str, dict]:
  """Runs every policy on every set (see the module docstring).

  Args:
    sets: set name -> tasks.
    policies: policy name -> Policy.
    envs: environment cache (its factory decides sandbox vs local).
    harness_cfg: harness limits and sampling.
    out_dir: output directory (re-running with the same arguments resumes; other settings are refused).
    run_cfg: samples per task and chunking (active_params is taken from each Policy).
    corpus: optional pretraining corpus (dir or JSONL) for the contamination guard.
    exclude_contaminated: drop flagged tasks from evaluation (they are always reported).
    contamination_cfg: `contamination.ContaminationConfig` (default when None).
    gold_runs: gold validation runs of each side (>= 2: flaky tests make a task invalid).
    gold_cache: stored gold checks, reused while task, environment and grader are unchanged (None: a cache in the
      default directory, `gold_cache.default_dir()`).
    log: progress lines.

  Returns:
    set name -> {"valid": n, "invalid": [(id, reason)], "contaminated": {id: frac}, "oracle_over_budget":
    {id: tokens}, "summaries": {policy: metrics} (every policy present), "notes": [...], "pareto_front": [names],
    "validity_failures": {"oracle"/"noop": [task ids scoring other than 1 / 0, over-budget ones left out]}}.
  """
  run_cfg = run_cfg or runner.SampleConfig()
  gold_cache = gold_cache or GoldCache()
  os.makedirs(out_dir, exist_ok=True)
  _write_set_stats(sets, out_dir, log)
  index = contamination.CorpusIndex(contamination.read_corpus(corpus),
                                    contamination_cfg or contamination.ContaminationConfig()) if corpus else None
  out = {}
  for name, tasks in sets.items():
    sdir = os.path.join(out_dir, name)
    os.makedirs(sdir, exist_ok=True)
    valid, checks, flagged = _valid_tasks(name, tasks, envs, sdir, index, exclude_contaminated, gold_runs,
                                          gold_cache, log)
    tok = (policies.get("oracle") or next(iter(policies.values()))).tokenizer
    over = oracle_over_budget(valid, tok, harness_cfg) if tok is not None else {}
    for tid, n in over.items():
      log(f"[{name}] ORACLE OVER BUDGET {tid}: its patch turn is {n} tokens > max_turn_tokens="
          f"{harness_cfg.max_turn_tokens}")
    validity = _run_policies(name, valid, policies, envs, harness_cfg, run_cfg, sdir, set(over), log)
    settings = runner.run_settings("", valid, harness_cfg, run_cfg)
    summaries, notes = collect_summaries(sdir, valid, settings, log)
    text = report.summary_table(summaries) + "".join(f"\nnote: {n}" for n in notes)
    log(f"[{name}]\n" + text)
    with open(os.path.join(sdir, "summary.txt"), "w", encoding="utf-8") as f:
      f.write(text + "\n")
    _write_json(os.path.join(sdir, "summary.json"), summaries)
    front = report.pareto_plot(summaries, os.path.join(sdir, "pareto.png"), title=f"{name}: pass@1 vs cost")
    out[name] = {"valid": len(valid), "invalid": [(c.task_id, c.reason) for c in checks if not c.valid],
                 "contaminated": flagged, "oracle_over_budget": over, "summaries": summaries, "notes": notes,
                 "pareto_front": front, "validity_failures": validity}
  return out
