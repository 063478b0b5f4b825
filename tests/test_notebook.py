"""experiments/colab.ipynb runs top to bottom on the public API, and at its own sizes RL visibly learns."""
import json
import os
import re

import nbformat
import pytest
from nbclient import NotebookClient

from experiments.configs import notebook as notebook_configs
from experiments.configs import rl as rl_configs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(ROOT, "experiments", "colab.ipynb")


def _cells(kind: str) -> str:
  nb = nbformat.read(NOTEBOOK, as_version=4)
  return "\n".join(c.source for c in nb.cells if c.cell_type == kind)


def _execute(workdir, monkeypatch, quick: bool) -> tuple[str, dict]:
  """Runs the notebook as a user would (its kernel in the repository root); returns its printed text and the
  held-out results it wrote."""
  if quick:
    monkeypatch.setenv("COMPOSER_JAX_NOTEBOOK_QUICK", "1")
  else:
    monkeypatch.delenv("COMPOSER_JAX_NOTEBOOK_QUICK", raising=False)
  monkeypatch.setenv("COMPOSER_JAX_NOTEBOOK_WORKDIR", str(workdir))
  monkeypatch.setenv("MPLBACKEND", "Agg")
  nb = nbformat.read(NOTEBOOK, as_version=4)
  NotebookClient(nb, timeout=3600, kernel_name="python3", resources={"metadata": {"path": ROOT}}).execute()
  text = "\n".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
  return text, json.loads((workdir / "results.json").read_text())


def test_notebook_uses_only_the_public_api():
  code = _cells("code")
  modules = re.findall(r"^(?:from|import) ([\w.]+)", code, flags=re.M)
  ours = [m for m in modules if m.split(".")[0] in ("composer_jax", "experiments", "rollout", "sandboxes")]
  assert ours and all(m.startswith(("composer_jax", "experiments.configs")) for m in ours), ours
  assert not re.search(r"\._\w", code), "the notebook reaches into private names"


def test_notebook_text_has_no_placeholders_and_states_what_to_expect():
  """Its set-up cell once said `<this repository>`, and its results were 0 with nothing saying to expect that."""
  text = _cells("markdown")
  assert not re.search(r"<[a-z][^>]*>", text), re.findall(r"<[a-z][^>]*>", text)
  assert re.search(r"SFT start \| ~\d+%", text) and re.search(r"RL, 40 steps \| ~\d+%", text)


def test_the_notebooks_run_is_colab_trimmed_only_where_its_docstring_says():
  """configs/notebook.py follows rl.py:colab (its model, tokenizer, harness, rewards, SFT start and RL loss) and
  differs only in what the notebook runtime and its minutes need."""
  def flat(c, prefix=""):
    return {k: v for key, val in c.items()
            for k, v in (flat(val, f"{prefix}{key}.") if hasattr(val, "items") else {f"{prefix}{key}": val}).items()}
  colab, nb = flat(rl_configs.get_config("colab").to_dict()), flat(notebook_configs.get_config().to_dict())
  assert {k for k in colab if colab[k] != nb[k]} == {
      "rollout.mode", "rollout.max_staleness", "rollout.workspaces", "rl.steps", "eval.tasks", "eval.temperatures",
      "eval.control"}
  assert (nb["rollout.mode"], nb["rollout.workspaces"], nb["rl.steps"], nb["eval.tasks"]) == ("sync", "local", 40,
                                                                                             200)
  with pytest.raises(ValueError, match="unknown notebook variant 'fast'; valid: learn, quick"):
    notebook_configs.get_config("fast")


def test_notebook_runs_pretrain_sft_rl_evaluate_plot(tmp_path, monkeypatch):
  # Seconds-scale sizes (QUICK): every piece runs; ~2.5 min wall on the loaded shared 2-core machine (compiles).
  text, results = _execute(tmp_path, monkeypatch, quick=True)
  assert "pretraining: step 10" in text and "a held-out task:" in text
  # Each phase shows a bar (the silent phases: the demonstrations, SFT and the evaluations said nothing).
  for bar in ("oracle demonstrations: 100%", "train: 100%", "rl: 100%", "eval sft T=1: 100%", "eval rl T=1: 100%"):
    assert bar in text, bar
  for policy in ("sft", "rl"):
    r = results[policy]["T1"]
    assert r["n"] == 8 and 0.0 <= r["ci_low"] <= r["success"] <= r["ci_high"] <= 1.0
  assert f"rl: {100 * results['rl']['T1']['success']:.1f}%" in text
  assert (tmp_path / "notebook.png").read_bytes()[:4] == b"\x89PNG"
  assert [json.loads(line)["step"] for line in open(tmp_path / "rl" / "metrics.jsonl")] == [1, 2]


@pytest.mark.slow   # the notebook at its own sizes: ~9 min on an idle 2-core CPU, 30+ under load
def test_notebook_learns(tmp_path, monkeypatch):
  """At its own sizes RL lifts held-out success at T=1 clear of its start, from a start clearly above zero. The
  start is make colab's (configs/notebook.py), measured at 51.6% / 48.2% at T=1 (seeds 0 / 1, n = 500,
  experiments/results/colab.md): >= 25% leaves room for another seed and still gives groups of 8 successes. RL:
  colab's training pass rate rose from 0.61-0.70 (steps 1-25) to 0.79-0.85 (steps 26-50); +10 points is more
  than either 95% interval's half-width (~7 at n = 200 from ~50%)."""
  _, results = _execute(tmp_path, monkeypatch, quick=False)
  start, rl = results["sft"]["T1"], results["rl"]["T1"]
  assert start["n"] == rl["n"] == 200
  assert start["success"] >= 0.25, results
  assert rl["success"] >= start["success"] + 0.10, results
