"""rollout/evaluation metrics, set statistics, Pareto front and contamination index, against hand-computed values and
brute-force references."""

import itertools

import numpy as np
import pytest

from rollout.evaluation import contamination, metrics, report, stats
from rollout.tasks.task import Environment, HiddenTests, Task


def _pass_at_k_bruteforce(n, c, k):
  """Fraction of k-subsets of n samples (c correct) that contain a correct one."""
  outcomes = [1] * c + [0] * (n - c)
  subsets = list(itertools.combinations(range(n), k))
  return sum(any(outcomes[i] for i in s) for s in subsets) / len(subsets)


def test_pass_at_k_matches_bruteforce_and_hand_values():
  assert metrics.pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3,2)/C(5,2)
  assert metrics.pass_at_k(4, 0, 3) == 0.0
  assert metrics.pass_at_k(4, 2, 3) == 1.0  # only 2 wrong samples: every 3-subset has a correct one
  for n in range(1, 7):
    for c in range(n + 1):
      for k in range(1, n + 1):
        assert metrics.pass_at_k(n, c, k) == pytest.approx(_pass_at_k_bruteforce(n, c, k))
  with pytest.raises(ValueError, match="c <= n"):
    metrics.pass_at_k(2, 3, 1)


def test_pass1_ci_is_clustered_over_tasks():
  mean, lo, hi = metrics.pass1_ci([1.0, 0.5, 0.0, 0.5])
  se = np.std([1.0, 0.5, 0.0, 0.5], ddof=1) / 2  # sqrt(1/6)/2
  assert mean == 0.5 and lo == pytest.approx(0.5 - 1.96 * se) and hi == pytest.approx(0.5 + 1.96 * se)
  assert metrics.pass1_ci([0.0, 1.0]) == (0.5, 0.0, 1.0)  # clipped to [0, 1]


def test_pass1_ci_is_not_a_point_at_0_or_100_percent():
  """The standard error is 0 there; the Wilson bound over tasks takes over (hand values: z = 1.96)."""
  mean, lo, hi = metrics.pass1_ci([0.0] * 50)
  assert (mean, lo) == (0.0, 0.0) and hi == pytest.approx(1.96 ** 2 / (50 + 1.96 ** 2))   # 0.0713
  mean, lo, hi = metrics.pass1_ci([1.0] * 3)
  assert (mean, hi) == (1.0, 1.0) and lo == pytest.approx(3 / (3 + 1.96 ** 2))              # 0.438


def _rec(solved, tokens):
  return {"samples": [{"solved": s, "output_tokens": t, "turns": 2, "tool_calls": 1, "wall_s": 0.5, "cost": 10.0 * t}
                      for s, t in zip(solved, tokens, strict=True)]}


def test_summarize_hand_values():
  recs = [_rec([1, 0], [10, 20]), _rec([0, 0], [30, 40]), _rec([1, 1], [5, 5])]
  s = metrics.summarize(recs, ks=(2,))
  assert s["pass@1"] == pytest.approx(0.5)  # task rates 0.5, 0, 1
  assert s["pass@2"] == pytest.approx((1 + 0 + 1) / 3)
  assert s["output_tokens"] == pytest.approx(110 / 6) and s["cost"] == pytest.approx(1100 / 6)
  assert s["samples_per_task"] == 2 and s["n_tasks"] == 3 and s["grade_timeouts"] == 0
  recs[1]["samples"][0]["grade_timed_out"] = True  # a grading timeout is counted, not folded into failures only
  assert metrics.summarize(recs)["grade_timeouts"] == 1
  with pytest.raises(ValueError, match="different sample counts"):
    metrics.summarize([_rec([1], [1]), _rec([1, 0], [1, 1])])


PATCH = """diff --git a/a.py b/a.py
--- a/a.py
+++ b/a.py
@@ -1,2 +1,2 @@
 def f():
-    return 1
+    return 2
diff --git a/b.py b/b.py
new file mode 100644
--- /dev/null
+++ b/b.py
@@ -0,0 +1,2 @@
+def g():
+    return 3
"""


def _task(tid, prompt, patch):
  return Task(tid, "python", prompt, Environment(), HiddenTests("true", ("t",)), gold_patch=patch)


def test_diff_size_and_set_statistics():
  assert stats.diff_size(PATCH) == (4, 2)  # -1 +1 in a.py, +2 in the new b.py
  tasks = [_task("a", "x" * 10, PATCH), _task("b", "x" * 30, ""), _task("c", "x" * 20, PATCH)]
  s = stats.set_statistics(tasks)
  assert s["prompt_chars"] == {"q25": 15.0, "median": 20.0, "q75": 25.0}
  assert s["diff_lines"]["median"] == 4.0 and s["diff_files"]["q25"] == 1.0  # (0, 2, 2) -> q25 = 1
  table = stats.compare_table({"small": tasks, "one": tasks[:1]})
  assert "small" in table and "20 [15-25]" in table and "10 [10-10]" in table


def test_pareto_front():
  pts = {"oracle": (0.0, 1.0), "noop": (0.0, 0.0), "big": (100.0, 0.6), "small": (10.0, 0.6), "mid": (50.0, 0.7)}
  assert report.pareto_front(pts) == ["oracle"]
  pts.pop("oracle")
  assert report.pareto_front(pts) == ["noop", "small", "mid"]


def test_pareto_plot_axis_and_front_are_readable(tmp_path):
  """All-zero costs get a plain axis around 0 (not symlog's +-0.05), the front is drawn even with one point, and
  the title is what the caller names (the set)."""
  import matplotlib
  matplotlib.use("Agg")
  from matplotlib import pyplot as plt

  def summ(p, cost=0.0):
    return {"pass@1": p, "pass@1_lo": max(0, p - 0.1), "pass@1_hi": min(1, p + 0.1), "cost": cost}
  drawn = {}
  orig = plt.Figure.savefig

  def spy(fig, path, *a, **k):
    ax = fig.axes[0]
    drawn.update(xlim=ax.get_xlim(), title=ax.get_title(), lines=[ln.get_label() for ln in ax.get_lines()])
    return orig(fig, path, *a, **k)
  plt.Figure.savefig = spy
  try:
    front = report.pareto_plot({"oracle": summ(1.0), "noop": summ(0.0), "random": summ(0.0)},
                               str(tmp_path / "a.png"), title="attrs_v1: pass@1 vs cost")
    assert front == ["noop", "random"]  # equal points: neither beats the other
    assert drawn["xlim"] == (-1.0, 1.0) and drawn["title"] == "attrs_v1: pass@1 vs cost"
    assert "Pareto front" in drawn["lines"]
    report.pareto_plot({"noop": summ(0.0), "ckpt": summ(0.5, 1e9)}, str(tmp_path / "b.png"))
    assert drawn["xlim"][1] >= 1e9 and "Pareto front" in drawn["lines"]
  finally:
    plt.Figure.savefig = orig
  assert (tmp_path / "a.png").read_bytes()[:4] == b"\x89PNG"


def test_contamination_flags_copied_solutions_only():
  solution = "def g():\n    return 3\n"
  corpus = ["unrelated text\n" * 3, "# some file\nimport os\n\ndef g():\n  return   3\nprint(g())\n"]
  index = contamination.CorpusIndex(corpus, contamination.ContaminationConfig(window=4, threshold=0.5))
  tasks = [_task("copied", "p", PATCH), _task("clean", "p", PATCH.replace("return 3", "return 4"))]
  post = {"copied": {"b.py": solution}, "clean": {"b.py": solution.replace("3", "4")}}
  flagged = contamination.check(tasks, post, index)
  assert flagged == {"copied": 1.0}  # whitespace differences do not hide a copy
  with pytest.raises(ValueError, match="threshold"):
    contamination.ContaminationConfig(threshold=0)


def test_contamination_reads_jsonl_and_names_bad_lines(tmp_path):
  p = tmp_path / "c.jsonl"
  p.write_text('{"text": "a"}\n{"nope": 1}\n')
  with pytest.raises(ValueError, match="c.jsonl:2"):
    list(contamination.read_corpus(str(p)))
  assert len(list(contamination.read_corpus(str(tmp_path)))) == 1  # a directory: one document per file


def test_directory_corpus_skips_git_and_binary_files(tmp_path):
  (tmp_path / "a.py").write_text("def f():\n    return 1\n")
  (tmp_path / ".git" / "objects").mkdir(parents=True)
  (tmp_path / ".git" / "COMMIT_EDITMSG").write_text("def leaked():\n    return 2\n")
  (tmp_path / "__pycache__").mkdir()
  (tmp_path / "__pycache__" / "a.txt").write_text("cached")
  (tmp_path / "blob.bin").write_bytes(b"\x00\x01def f")
  assert list(contamination.read_corpus(str(tmp_path))) == ["def f():\n    return 1\n"]
