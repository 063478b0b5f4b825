"""rollout/evaluation end to end in sandboxes: oracle 100% and no-op 0% on every valid task of a procedural set and
of a set mined from a real git repository built here; invalid tasks are listed with reasons and excluded; the
contamination guard flags a task whose solution is in the corpus; the set builder freezes a mined set."""

import dataclasses
import json
import subprocess

import pytest

from composer_jax.train import tokenizer as tokenizer_lib
from rollout import harness
from rollout.evaluation import builder, policies, runner, suite
from rollout.tasks import procedural, registry, setfile
from rollout.tasks.environment import EnvironmentCache
from rollout.tasks.task import Task
from tests.tasks_testlib import FAST

CFG = harness.HarnessConfig(context_budget=2048, max_turn_tokens=768, observation_reserve=256, max_turns=8)

UTIL_V1 = "def clamp(x, lo, hi):\n    return max(lo, x)\n"
API_V1 = "from util import clamp\n\n\ndef score(x):\n    return clamp(x, 0, 10)\n"
TEST_V1 = "from api import score\n\n\ndef test_low():\n    assert score(-3) == 0\n"


def _commit(repo, files, message):
  for path, text in files.items():
    (repo / path).parent.mkdir(parents=True, exist_ok=True)
    (repo / path).write_text(text)
  subprocess.run(["git", "-C", str(repo), "add", "-A"], check=True)
  subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", message],
                 check=True)


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
  """Two task commits: a multi-file fix (util.py + api.py) and a one-file fix, plus a docs-only commit."""
  repo = tmp_path_factory.mktemp("repo")
  subprocess.run(["git", "init", "-q", str(repo)], check=True)
  _commit(repo, {"util.py": UTIL_V1, "api.py": API_V1, "tests/test_api.py": TEST_V1}, "Initial")
  util2 = "def clamp(x, lo, hi):\n    return min(hi, max(lo, x))\n"
  api2 = API_V1.replace("clamp(x, 0, 10)", "clamp(x, 0, 100)")
  test2 = TEST_V1 + "\n\ndef test_high():\n    assert score(500) == 100\n"
  _commit(repo, {"util.py": util2, "api.py": api2, "tests/test_api.py": test2}, "score caps at 100")
  _commit(repo, {"README.md": "# r\n"}, "Docs")
  api3 = api2 + "\n\ndef double(x):\n    return 2 * x\n"
  test3 = test2.replace("import score", "import double, score") + "\n\ndef test_double():\n    assert double(4) == 8\n"
  _commit(repo, {"api.py": api3, "tests/test_api.py": test3}, "Add double to the api")
  return str(repo)


@pytest.fixture(scope="module")
def factory():
  sandboxes = pytest.importorskip("sandboxes")
  from rollout.workspace import SandboxFactory
  try:
    f = SandboxFactory()
  except sandboxes.BackendUnavailableError as e:
    pytest.skip(f"no namespaced sandboxes on this machine: {e}")
  yield f
  f.close()


@pytest.fixture(scope="module")
def tok():
  texts = [f for t in procedural.generate(60, level=2) for f in t.environment.files.values()]
  return tokenizer_lib.train_tokenizer(texts + [harness.SYSTEM_PROMPT, UTIL_V1, API_V1, TEST_V1],
                                       tokenizer_lib.TokenizerConfig(600))


def _baselines(tok):
  return {n: suite.Policy(lambda tasks, n=n: policies.baseline(n, tok, tasks), tok) for n in ("oracle", "noop")}


def test_procedural_set_oracle_100_noop_0_invalid_excluded(tmp_path, factory, tok):
  tasks = procedural.generate(5, seed=3, split="heldout", level=2)
  no_gold = dataclasses.replace(tasks[3], id="broken/no_gold", gold_patch="")
  fixed_env = dataclasses.replace(tasks[4], id="broken/already_fixed",  # the environment already holds the fix
                                  environment=dataclasses.replace(tasks[4].environment, files={
                                    p: t for p, t in _apply(tasks[4]).items()}))
  sets = {"proc": tasks + [no_gold, fixed_env]}
  out = suite.evaluate(sets, _baselines(tok), EnvironmentCache(factory), CFG, str(tmp_path),
                       runner.SampleConfig(samples=2, chunk_tasks=3), log=lambda s: None)["proc"]
  assert dict(out["invalid"]) == {"broken/no_gold": "no gold patch",
                                  "broken/already_fixed": "hidden tests already pass without the gold patch"}
  assert out["valid"] == 5
  s = out["summaries"]
  assert s["oracle"]["pass@1"] == 1.0 and s["oracle"]["pass@2"] == 1.0
  assert s["oracle"]["pass@1_lo"] == pytest.approx(5 / (5 + 1.96 ** 2))   # Wilson over the 5 valid tasks
  assert s["noop"]["pass@1"] == 0.0 and s["noop"]["pass@2"] == 0.0
  assert out["validity_failures"] == {"oracle": [], "noop": []}
  assert s["oracle"]["cost"] == 0.0 and s["oracle"]["turns"] >= 2 and s["noop"]["tool_calls"] == 1.0
  recs = [json.loads(x) for x in (tmp_path / "proc" / "oracle" / "results.jsonl").read_text().splitlines()]
  assert sorted(r["task_id"] for r in recs) == sorted(t.id for t in tasks)
  assert all(len(r["samples"]) == 2 for r in recs)
  assert (tmp_path / "proc" / "pareto.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert "proc" in (tmp_path / "set_stats.txt").read_text()


def _apply(task):
  """The task's files after its gold patch (procedural tasks have inline files), applied with `patch`."""
  import os
  import tempfile
  with tempfile.TemporaryDirectory() as d:
    for p, t in task.environment.files.items():
      os.makedirs(os.path.dirname(os.path.join(d, p)) or d, exist_ok=True)
      open(os.path.join(d, p), "w").write(t)
    subprocess.run(["patch", "-s", "-p1"], input=task.gold_patch, text=True, cwd=d, check=True)
    return {p: open(os.path.join(d, p)).read() for p in task.environment.files}


def test_mined_set_builder_contamination_oracle_noop(tmp_path, factory, repo, tok):
  envs = EnvironmentCache(factory)
  built, excluded = builder.build_set([repo], envs, builder.SetFilters(min_files=1, min_lines=1, max_prompt_chars=50),
                                      FAST, name="tiny", version="1", log=lambda s: None)
  assert len(built["tasks"]) == 2 and any("no code file changed" in why for _, why in excluded)
  mined = [Task.from_dict(t) for t in built["tasks"]]
  multi = [t.prompt for t in mined if not builder.filter_reason(t, builder.SetFilters(min_files=2))]
  assert multi == ["score caps at 100"]  # the one multi-file change
  assert builder.filter_reason(mined[0], builder.SetFilters(max_prompt_chars=5)).startswith("prompt has")
  assert "min_lines=99" in builder.filter_reason(mined[0], builder.SetFilters(min_lines=99))
  path = str(tmp_path / "tiny.json")
  setfile.write_set(path, built)
  header, tasks = setfile.read_set(path)
  assert header["version"] == "1" and {t.prompt for t in tasks} == {"score caps at 100", "Add double to the api"}
  _assert_future_unreachable_in_sandbox(envs, repo, next(t for t in tasks if t.prompt == "score caps at 100"))
  corpus = tmp_path / "corpus"
  corpus.mkdir()
  (corpus / "leak.py").write_text("# scraped\ndef clamp(x, lo, hi):\n    return min(hi, max(lo, x))\n")
  out = suite.evaluate({"mined": tasks}, _baselines(tok), envs, CFG, str(tmp_path / "run"), corpus=str(corpus),
                       exclude_contaminated=False, log=lambda s: None)["mined"]
  leaked = next(t.id for t in tasks if t.prompt == "score caps at 100")
  assert out["invalid"] == [] and out["valid"] == 2
  assert set(out["contaminated"]) == {leaked}
  assert out["summaries"]["oracle"]["pass@1"] == 1.0 and out["summaries"]["noop"]["pass@1"] == 0.0
  out2 = suite.evaluate({"mined": tasks}, _baselines(tok), envs, CFG, str(tmp_path / "run2"), corpus=str(corpus),
                        log=lambda s: None)["mined"]
  assert out2["valid"] == 1  # contaminated task excluded by default


def _assert_future_unreachable_in_sandbox(envs, repo, task):
  """From inside the task's sandbox: HEAD is the parent, and neither the gold commit, nor a later commit, nor any
  blob the gold commit added can be read, by any ref, reflog or object id; the host repository is not visible."""
  def git(*a):
    return subprocess.run(["git", "-C", repo, *a], capture_output=True, text=True, check=True).stdout.strip()
  gold, later = task.metadata["commit"], git("rev-parse", "HEAD")
  new_blobs = [line.split()[3] for line in git("diff-tree", "-r", task.metadata["parent"], gold).splitlines()]
  ws = envs.fork(task)
  try:
    assert ws.run("git rev-parse HEAD").output.strip() == task.metadata["parent"]
    for obj in [gold, later, *new_blobs]:
      res = ws.run(f"git cat-file -e {obj}")
      assert res.exit_code != 0, f"{obj} is readable in the sandbox"
    assert gold not in ws.run("git log --all --reflog --format=%H; git for-each-ref; git fsck --unreachable "
                              "--no-reflogs 2>&1; ls .git").output
    assert ws.run(f"ls {repo}").exit_code != 0  # the source repository itself is not mounted
  finally:
    ws.close()


def test_tampered_set_file_is_rejected(tmp_path):
  task_set = {"format": setfile.FORMAT, "name": "x", "version": "1", "tasks": [], "sha256": "0"}
  (tmp_path / "s.json").write_text(json.dumps(task_set))
  with pytest.raises(ValueError, match="sha256"):
    setfile.read_set(str(tmp_path / "s.json"))


def test_swe_jsonl_set_gold_validated_oracle_noop(tmp_path, factory, repo, tok):
  """A SWE-bench-style JSONL set against the local clone: a good instance and one whose FAIL_TO_PASS names a test
  that does not exist (the gold patch cannot make it pass, so gold validation excludes it)."""
  import os

  def git(*a):
    return subprocess.run(["git", "-C", repo, *a], capture_output=True, text=True, check=True).stdout
  base, fix = git("rev-parse", "HEAD~3").strip(), git("rev-parse", "HEAD~2").strip()
  inst = {"instance_id": "local__r-1", "repo": f"local/{os.path.basename(repo)}", "base_commit": base,
          "patch": git("diff", base, fix, "--", "util.py", "api.py"),
          "test_patch": git("diff", base, fix, "--", "tests/test_api.py"),
          "FAIL_TO_PASS": ["tests/test_api.py::test_high"], "PASS_TO_PASS": ["tests/test_api.py::test_low"],
          "problem_statement": "score caps at 100"}
  bad = {**inst, "instance_id": "local__r-2", "FAIL_TO_PASS": json.dumps(["tests/test_api.py::test_missing"])}
  path = tmp_path / "swe.jsonl"
  path.write_text(json.dumps(inst) + "\n" + json.dumps(bad) + "\n")
  envs = EnvironmentCache(factory)
  tasks = registry.load_tasks(registry.SetSpec("swe", jsonl=str(path), repos_dir=os.path.dirname(repo)), envs)
  out = suite.evaluate({"swe": tasks}, _baselines(tok), envs, CFG, str(tmp_path / "run"), log=lambda s: None)["swe"]
  assert [i for i, _ in out["invalid"]] == ["swe/local__r-2"] and "test_missing" in out["invalid"][0][1]
  assert out["summaries"]["oracle"]["pass@1"] == 1.0 and out["summaries"]["noop"]["pass@1"] == 0.0


def test_validity_check_catches_a_broken_oracle(tmp_path, tok):
  """A policy named 'oracle' that does nothing is reported on every task (the check can fail)."""
  from rollout.workspace import LocalFactory
  tasks = procedural.generate(3, seed=1, split="heldout")
  fake = {"oracle": suite.Policy(lambda ts: policies.baseline("noop", tok, ts), tok)}
  out = suite.evaluate({"p": tasks}, fake, EnvironmentCache(LocalFactory(root=str(tmp_path / "ws"))), CFG,
                       str(tmp_path / "out"), log=lambda s: None)["p"]
  assert out["validity_failures"] == {"oracle": [t.id for t in tasks]}
