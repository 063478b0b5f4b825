"""Every `python experiments/<x>_main.py ...` command in a README's code block parses as written: its config file
and variant load, each `--config.<path>` override names a field the config has, the whole converts to the frozen
dataclass its main runs, and the result files `report_main.py` names exist. (A command whose run then fails is
tested where its run is: test_rl_tasks, test_eval_main, test_harness_main.)"""
import ast
import glob
import importlib.util
import os
import re
import shlex

import pytest

from composer_jax import configs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_DEFAULT_CONFIG = {"rl_main.py": "experiments/configs/rl.py"}   # the mains whose --config has a default


def _converters():
  from composer_jax import agent_demo, eval_run
  from composer_jax.quant_ablation import AblationConfig
  from composer_jax.rl.config import RunConfig
  from composer_jax.train.stages import StageConfig
  return {"rl_main.py": lambda c: configs.from_dict(RunConfig, c, workdir="runs/x"),
          "pretrain_main.py": lambda c: configs.from_dict(StageConfig, c),
          "eval_main.py": lambda c: configs.from_dict(eval_run.EvalRunConfig, c),
          "agent_main.py": lambda c: configs.from_dict(agent_demo.DemoConfig, c),
          "quant_ablation_main.py": lambda c: configs.from_dict(AblationConfig, c.ablation, "ablation.")}


def readme_commands() -> list[tuple[str, str]]:
  """(where, command) of each `python experiments/*_main.py` line of a fenced code block in a tracked README (or
  other Markdown), continuation lines joined; commands that use shell variables are left out (their values are
  set on other lines)."""
  out = []
  for path in sorted(glob.glob(os.path.join(ROOT, "**", "*.md"), recursive=True)):
    if "/.venv/" in path or "/runs/" in path:
      continue
    text = open(path).read()
    for block in re.findall(r"```(?:bash|sh)?\n(.*?)```", text, flags=re.S):
      joined = re.sub(r"\\\n\s*", "", block)
      for i, line in enumerate(joined.splitlines()):
        m = re.search(r"python (experiments/\w+_main\.py.*)", line)
        if m and "$" not in line:
          out.append((f"{os.path.relpath(path, ROOT)} block line {i + 1}", m.group(1).split("#")[0].strip()))
  return out


COMMANDS = readme_commands()


def test_the_readmes_have_commands_to_check():
  mains = {shlex.split(c)[0] for _, c in COMMANDS}
  assert {"experiments/rl_main.py", "experiments/eval_main.py", "experiments/pretrain_main.py",
          "experiments/agent_main.py", "experiments/report_main.py"} <= mains


@pytest.mark.parametrize("where,command", COMMANDS, ids=[w for w, _ in COMMANDS])
def test_a_readme_command_parses_as_written(where, command):
  del where
  main, *args = shlex.split(command)
  name = os.path.basename(main)
  assert os.path.isfile(os.path.join(ROOT, main))
  if name == "report_main.py":   # no config: the runs it renders must exist (or be a run's workdir to come)
    runs = next((a.split("=", 1)[1] for a in args if a.startswith("--runs=")), "")
    for item in filter(None, runs.split(",")):
      label, _, path = item.partition("=")
      assert label and (path.startswith("runs/") or os.path.exists(os.path.join(ROOT, path))), item
    return
  spec = next((a.split("=", 1)[1] for a in args if a.startswith("--config=")), _DEFAULT_CONFIG.get(name))
  assert spec, f"{command}: no --config"
  path, _, arg = spec.partition(":")
  module = _load(os.path.join(ROOT, path))
  config = module.get_config(arg) if arg else module.get_config()
  for a in args:
    if a.startswith("--config."):
      key, _, value = a[len("--config."):].partition("=")
      _override(config, key, value)
  _converters()[name](config)


def _load(path: str):
  spec = importlib.util.spec_from_file_location("_readme_config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _override(config, key: str, value: str) -> None:
  """`--config.<key>=<value>` as ml_collections applies it to a locked config: the key must exist; the value is
  parsed as a Python literal where it is one."""
  *parents, leaf = key.split(".")
  node = config
  for p in parents:
    assert p in node, f"--config.{key}: no {p!r}"
    node = node[p]
  assert leaf in node, f"--config.{key}: no {leaf!r} (valid: {sorted(node.keys())})"
  try:
    parsed = ast.literal_eval(value)
  except (ValueError, SyntaxError):
    parsed = value
  node[leaf] = tuple(parsed) if isinstance(node[leaf], tuple) and isinstance(parsed, list) else parsed
