"""The machine-readable test report that grading reads (never the command's console output, which is capped and
can be forged by the code under test).

A test command writes JSON lines `{"id": <test id>, "outcome": passed|failed|error|skipped, "nonce": <nonce>}` to
the file named by `$GRADE_REPORT`, each line carrying the per-run `$GRADE_NONCE`. Two kinds of command
(`HiddenTests.report`):

  pytest  a `python -m pytest` command run in the workspace root: the grader writes `PYTEST_PLUGIN` there (a file with
          a random name, on sys.path through `-m`) and loads it through `PYTEST_ADDOPTS`, so the stored command needs
          no change (and may set its own PYTHONPATH). A run that wrote no report is an error. It writes one line per
          pytest report as it happens (a timed-out run keeps what finished): a failed subtest fails its test, a
          setup/teardown failure is an error, a file that fails to import is an error for that file (its tests are
          then missing), and the other files still run (`--continue-on-collection-errors`: one file that cannot import
          before the fix must not make every other test look failing before it).
  script  a runner we write ourselves (procedural tasks, the auto-install check) that writes the lines directly,
          e.g. with `SCRIPT_REPORTER`.

Both take the report path and the nonce out of the environment before any code under test is imported, so printed
or written fake results do not count; code that deliberately reads the runner's memory or /proc/self/environ could
still forge them (a separate reporting process would close that).

Several lines for one id combine to the worst outcome (error > failed > skipped > passed), so a unittest test whose
own call passed but one of whose subtests failed is FAILED.
"""

from __future__ import annotations

import json

REPORT_KINDS = ("pytest", "script")
PLUGIN_MODULE = "composer_grade_report"
PYTEST_ADDOPTS = "--continue-on-collection-errors"  # beside "-p <the plugin's module>"
STATUS = {"passed": "PASSED", "skipped": "SKIPPED", "failed": "FAILED", "error": "ERROR"}
_RANK = {"PASSED": 0, "SKIPPED": 1, "FAILED": 2, "ERROR": 3}

_TAKE_ENV = """import json as _json
import os as _os

_path = _os.environ.pop("GRADE_REPORT", "")
_nonce = _os.environ.pop("GRADE_NONCE", "")
_out = open(_path, "a", encoding="utf-8") if _path else None


def _write(test_id, outcome):
    if _out is not None:
        _out.write(_json.dumps({"id": test_id, "outcome": outcome, "nonce": _nonce}) + "\\n")
        _out.flush()
"""

PYTEST_PLUGIN = '"""Grading report for composer_jax (see rollout/tasks/grade_report.py)."""\n' + _TAKE_ENV + """

def pytest_collectreport(report):
    if report.failed:
        _write(report.nodeid, "error")


def pytest_runtest_logreport(report):
    if report.failed:
        _write(report.nodeid, "failed" if report.when == "call" else "error")
    elif hasattr(report, "context"):  # a subtest's report: only its failure matters to the test
        return
    elif report.when == "call" or report.skipped:
        _write(report.nodeid, "skipped" if report.skipped else "passed")
"""

# Prepended to a script runner: defines `_write(test_id, outcome)`.
SCRIPT_REPORTER = _TAKE_ENV


def parse_report(text: str, nonce: str) -> dict[str, str]:
  """Test id -> PASSED | FAILED | ERROR | SKIPPED from a report's JSON lines; lines without this run's nonce, and
  torn or foreign lines, are ignored; several lines for one id combine to the worst."""
  out: dict[str, str] = {}
  for line in text.splitlines():
    try:
      rec = json.loads(line)
    except json.JSONDecodeError:
      continue
    if not isinstance(rec, dict) or rec.get("nonce") != nonce or rec.get("outcome") not in STATUS:
      continue
    tid, status = str(rec.get("id", "")), STATUS[rec["outcome"]]
    if tid and _RANK[status] >= _RANK.get(out.get(tid, "PASSED"), 0):
      out[tid] = status
  return out
