"""rollout/tasks/diffkey.py against hand-written diffs: a revert is the inverse change wherever its lines sit, a
whitespace difference is another change, and the split key keeps a change and its revert on one side."""

from rollout.tasks import diffkey, registry
from rollout.tasks.task import Environment, HiddenTests, Task

FIX = """diff --git a/calc.py b/calc.py
index 1111111..2222222 100644
--- a/calc.py
+++ b/calc.py
@@ -4,3 +4,3 @@ def add(a, b):
 # subtraction
 def sub(a, b):
-    return b - a
+    return a - b
@@ -9,2 +9,4 @@ def mul(a, b):
     return a * b
+
+SIGN = -1
"""
# The revert, made later: other line numbers, other context, other index lines, no message needed.
REVERT = """diff --git a/calc.py b/calc.py
index 3333333..4444444 100644
--- a/calc.py
+++ b/calc.py
@@ -7,3 +7,3 @@ import os
 # helpers
 def sub(a, b):
-    return a - b
+    return b - a
@@ -12,4 +12,2 @@ def mul(a, b):
     return a * b
-
-SIGN = -1
"""
MODE_ONLY = "diff --git a/run.sh b/run.sh\nold mode 100644\nnew mode 100755\n"


def test_change_blocks_by_hand():
  assert diffkey.change_of(FIX) == {"calc.py": [(("    return b - a",), ("    return a - b",)),
                                                ((), ("", "SIGN = -1"))]}
  assert diffkey.change_of(REVERT) == {"calc.py": [(("    return a - b",), ("    return b - a",)),
                                                   (("", "SIGN = -1"), ())]}


def test_a_revert_is_the_inverse_change_byte_for_byte():
  fix, revert = diffkey.change_of(FIX), diffkey.change_of(REVERT)
  assert diffkey.fingerprint(diffkey.inverse(fix)) == diffkey.fingerprint(revert)
  assert diffkey.fingerprint(fix) != diffkey.fingerprint(revert)
  assert diffkey.family_key(FIX) == diffkey.family_key(REVERT) != ""
  # One space more in a removed line: not the inverse any more (whitespace is code).
  near = REVERT.replace("-    return a - b", "-    return a -  b")
  assert diffkey.fingerprint(diffkey.change_of(near)) != diffkey.fingerprint(diffkey.inverse(fix))
  # A file with the same lines under another name is another change.
  assert diffkey.family_key(FIX.replace("calc.py", "calc2.py")) != diffkey.family_key(FIX)
  assert diffkey.family_key(MODE_ONLY) == ""  # changes no line: matches nothing


def test_no_newline_marker_stays_with_its_line():
  a = "diff --git a/x b/x\n--- a/x\n+++ b/x\n@@ -1 +1 @@\n-old\n\\ No newline at end of file\n+old\n"
  assert diffkey.change_of(a) == {"x": [(("old\n\\",), ("old",))]}
  assert diffkey.fingerprint(diffkey.change_of(a)) != diffkey.fingerprint(diffkey.inverse(diffkey.change_of(a)))


def _task(tid: str, gold: str) -> Task:
  return Task(id=tid, language="python", prompt="p", environment=Environment(),
              tests=HiddenTests(command="true", fail_to_pass=("t",)), gold_patch=gold)


def test_a_change_and_its_revert_never_straddle_the_split():
  fix, revert = _task("miner/r/aaaaaaaaaaaa", FIX), _task("miner/r/bbbbbbbbbbbb", REVERT)
  for pct in range(1, 100):
    assert registry.split_of(fix, pct) == registry.split_of(revert, pct), pct
  # Ids alone would have split them at some share (what the key prevents).
  by_id = [registry.split_of(_task(t.id, MODE_ONLY), pct) for t in (fix, revert) for pct in range(1, 100)]
  assert by_id[:99] != by_id[99:]
