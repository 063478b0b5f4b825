"""rollout/tasks/prompts.py: prompts from commit messages without references the agent cannot follow; reverts and
messages that are no request are recognised; rejection reasons are counted by kind on the progress bar."""

from rollout.tasks import progress, prompts


def test_references_links_and_trailers_are_dropped():
  body = ("The parser crashed on empty input; it now returns [].\n\nSee https://github.com/a/b/issues/9 and GH-12.\n"
          "Fixes #12\nCloses: owner/repo#7\nSigned-off-by: A <a@b>\nCo-authored-by: X <x@y>\nChange-Id: I0123")
  assert prompts.prompt_from_message("Fix crash in parser (#1234)", body) == (
    "Fix crash in parser\n\nThe parser crashed on empty input; it now returns [].")  # "See ... and ." is gone
  assert prompts.prompt_from_message("Fix #387: Handle obj=None in _Base.") == "Handle obj=None in _Base."
  assert prompts.prompt_from_message("Parser #12: keep the word") == "Parser: keep the word"
  assert prompts.prompt_from_message("Use the helper from 1a2b3c4d (see PR 55)") == "Use the helper from 1a2b3c4d"
  assert prompts.prompt_from_message("x" * 50, max_chars=10) == "xxxxxxx..."


def test_self_contained_and_revert_heuristics():
  assert prompts.not_self_contained(prompts.prompt_from_message("Issue: #898"), 3).startswith(
    "prompt not self-contained (0 words")
  assert prompts.not_self_contained("Fix typo", 3) != ""
  assert prompts.not_self_contained("Fix the typo in the greeting", 3) == ""
  sha = "0123456789abcdef0123456789abcdef01234567"
  assert prompts.reverted_commit('Revert "Add foo"', f"This reverts commit {sha}.") == sha
  assert prompts.reverted_commit("Add foo", "") == ""


def test_rejection_reasons_are_counted_by_kind():
  p = progress.Progress("mine", 4, enabled=False)
  p.kept()
  p.rejected("before the fix: tests timed out after 120 s")
  p.rejected("no test goes from failing to passing (2 flaky tests excluded)")
  p.rejected("no test goes from failing to passing")
  p.__exit__()
  assert p.summary() == "kept 1, rejected 3: no test goes from failing to passing x2, before the fix x1"
