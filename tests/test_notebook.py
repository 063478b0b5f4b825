"""experiments/colab.ipynb runs top to bottom (seconds-scale sizes) on the public API, so it cannot rot."""
import json
import os
import re

import nbformat
from nbclient import NotebookClient

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(ROOT, "experiments", "colab.ipynb")


def _code(nb) -> str:
  return "\n".join(c.source for c in nb.cells if c.cell_type == "code")


def test_notebook_uses_only_the_public_api():
  code = _code(nbformat.read(NOTEBOOK, as_version=4))
  modules = re.findall(r"^(?:from|import) ([\w.]+)", code, flags=re.M)
  ours = [m for m in modules if m.split(".")[0] in ("composer_jax", "experiments", "rollout", "sandboxes")]
  assert ours and all(m.startswith(("composer_jax", "experiments.configs")) for m in ours), ours
  assert not re.search(r"\._\w", code), "the notebook reaches into private names"


def test_notebook_runs_pretrain_sft_rl_evaluate_plot(tmp_path, monkeypatch):
  # ~50 s of CPU (2.5 min wall on the loaded shared 2-core machine): compiles dominate at these sizes.
  monkeypatch.setenv("COMPOSER_JAX_NOTEBOOK_QUICK", "1")
  monkeypatch.setenv("COMPOSER_JAX_NOTEBOOK_WORKDIR", str(tmp_path))
  monkeypatch.setenv("MPLBACKEND", "Agg")
  nb = nbformat.read(NOTEBOOK, as_version=4)
  NotebookClient(nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": ROOT}}).execute()
  text = "\n".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
  assert "pretraining: step 10" in text
  results = json.loads(text[text.index('{\n "sft"'):text.rindex("}") + 1])
  for policy in ("sft", "rl"):
    for t in ("T0", "T1"):
      r = results[policy][t]
      assert r["n"] == 8 and 0.0 <= r["ci_low"] <= r["success"] <= r["ci_high"] <= 1.0
  assert (tmp_path / "notebook.png").read_bytes()[:4] == b"\x89PNG"
  assert [json.loads(line)["step"] for line in open(tmp_path / "rl" / "metrics.jsonl")] == [1, 2]
