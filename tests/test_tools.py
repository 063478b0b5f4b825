"""rollout/tools.py and rollout/workspace.py: every tool, its errors, the todo list, path safety, lint findings."""

import pytest

from rollout import lint
from rollout.chat_format import ToolCall
from rollout.tools import ToolBox, ToolConfig
from rollout.workspace import LocalFactory, cap_text, safe_relpath


@pytest.fixture
def box(tmp_path):
  src = tmp_path / "src"
  (src / "pkg").mkdir(parents=True)
  (src / "pkg" / "a.py").write_text("x = 1\ny = 2\nx = 1\n")
  (src / "README").write_text("hello\n")
  factory = LocalFactory(root=str(tmp_path / "store"))
  ws = factory.fork(factory.snapshot_from_dir(str(src)))
  yield ToolBox(ws, ToolConfig(max_output_chars=200))
  ws.close()


def call(box, name, **args):
  return box.call(ToolCall(name, args))


def test_read_list_grep(box):
  assert call(box, "read_file", path="pkg/a.py").text == "x = 1\ny = 2\nx = 1\n"
  assert call(box, "read_file", path="pkg/a.py", start=2, end=2).text == "y = 2\n"
  assert call(box, "list_dir").text == "README\npkg/"
  assert call(box, "grep", pattern="y =").text == "pkg/a.py:2:y = 2\n"
  assert call(box, "grep", pattern="nothing here").text == "(no matches)"
  box.cfg = ToolConfig(number_lines=True)
  assert call(box, "read_file", path="pkg/a.py", start=3).text == "   3 x = 1\n"


def test_edit_exact_and_errors(box):
  r = call(box, "edit", path="pkg/a.py", old="x = 1", new="x = 3")
  assert r.error and "occurs 2 times" in r.text and not r.invalid
  r = call(box, "edit", path="pkg/a.py", old="z = 1", new="z = 3")
  assert r.error and "not found" in r.text
  r = call(box, "edit", path="pkg/a.py", old="y = 2\nx = 1", new="y = 5\nx = 1")
  assert not r.error
  assert box.ws.read_file("pkg/a.py") == "x = 1\ny = 5\nx = 1\n"
  assert box.originals == {"pkg/a.py": "x = 1\ny = 2\nx = 1\n"}
  assert call(box, "edit", path="missing.py", old="a", new="b").error


def test_write_shell_and_timeouts(box):
  assert not call(box, "write_file", path="new/b.py", content="print('hi')\n").error
  r = call(box, "shell", command="python3 new/b.py && exit 3")
  assert r.text == "exit code 3\nhi\n"
  r = call(box, "shell", command="sleep 5", timeout=0.2)
  assert r.text.startswith("timed out after 0.2s") and r.wall_s < 3
  r = call(box, "shell", command="python3 -c \"print('x' * 1000)\"")
  assert len(r.text) <= 200 and "chars cut" in r.text


def test_invalid_calls_are_counted_not_raised(box):
  for name, args, msg in [("nope", {}, "unknown tool"), ("read_file", {}, "missing required arguments ['path']"),
                          ("read_file", {"path": 3}, "'path' must be str"),
                          ("edit", {"path": "a", "old": "b", "new": "c", "extra": 1}, "unknown arguments ['extra']"),
                          ("shell", {"command": "ls", "timeout": True}, "must be int or float")]:
    r = box.call(ToolCall(name, args))
    assert r.error and r.invalid and msg in r.text, (name, r.text)


def test_path_escape_is_an_error(box):
  for path in ("../x", "/etc/passwd", "pkg/../../x"):
    r = call(box, "read_file", path=path)
    assert r.error and "outside the workspace" in r.text
  assert safe_relpath("/workspace/pkg/a.py") == "pkg/a.py"
  with pytest.raises(ValueError):
    safe_relpath("")


def test_todo_write_update_done(box):
  assert call(box, "todo", write=["a", "b"]).text == "1. [ ] a\n2. [ ] b"
  assert call(box, "todo", add=["c"], done=[1], update={"2": "B"}).text == "1. [x] a\n2. [ ] B\n3. [ ] c"
  r = call(box, "todo", done=[7])
  assert r.error and "id 7 does not exist" in r.text
  assert box.todo.unfinished == 2  # the bad call changed nothing
  r = call(box, "todo", add=["d"], done=["x"])
  assert r.error and box.todo.unfinished == 2


def test_finish(box):
  r = call(box, "finish", message="all done")
  assert r.finished and r.final_message == "all done"


def test_cap_text_keeps_head_and_tail():
  text, cut = cap_text("a" * 50 + "b" * 50, 60)
  assert cut and len(text) <= 60 and text.startswith("a") and text.endswith("b")
  assert cap_text("short", 60) == ("short", False)


def test_lint_counts_only_new_findings(box):
  box.ws.write_file("m.py", "import os\n")  # one existing finding (F401), not the agent's
  box.originals["m.py"] = "import os\n"
  box.ws.write_file("m.py", "import os\nimport sys\n\n\ndef f():\n    return undefined_name\n")  # +F401, +F821
  box.originals["n.py"] = None  # a new file with one finding
  box.ws.write_file("n.py", "import json\n")
  assert lint.new_findings(box.ws, box.originals) == 3
  assert not box.ws.exists(lint.BASE_DIR)
