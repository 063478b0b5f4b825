"""What every `experiments/*_main.py` shares: its flags and config checked before any work, each problem printed as
one line `error: ...` on stderr (exit 2), and Ctrl-C as one line (exit 130), never a traceback.

  def main(argv):
    cfg = cli.convert(RunConfig, _CONFIG.value, workdir=_WORKDIR.value)   # a bad field: one line, exit 2
    ...
  if __name__ == "__main__":
    cli.run(main, example="experiments/configs/rl.py:colab", input_errors=(RunInputError,))
"""
from __future__ import annotations

import importlib.util
import re
import sys
from typing import NoReturn

from absl import app, flags
from ml_collections import config_dict, config_flags

from experiments.configs import common

CONFIG_FLAG = "config"
_default: list[str | None] = [None]   # the --config default `define_config` was given


def fail(*problems: str) -> NoReturn:
  """Prints each problem as one line and exits with status 2 (bad input)."""
  for p in problems:
    print(f"error: {' '.join(str(p).split())}", file=sys.stderr)
  sys.exit(2)


def convert(cls, config, path: str = "", **extra):
  """`composer_jax.configs.from_dict(cls, config, path, **extra)`; a bad key or value fails as one line."""
  from composer_jax import configs
  try:
    return configs.from_dict(cls, config, path, **extra)
  except (ValueError, TypeError) as e:
    fail(e)


def define_config(default: str | None = None):
  """`--config` (`config_flags.DEFINE_config_file`, locked so a typo fails); an override of a key the config does
  not have fails as one line even when ml_collections applies it while defining the flag (it does with a default)."""
  _default[0] = default
  try:
    return config_flags.DEFINE_config_file(CONFIG_FLAG, default, "Config file (get_config(arg)).", lock_config=True)
  except (AttributeError, KeyError, TypeError, ValueError) as e:
    fail(_unknown_override(sys.argv) or str(e).splitlines()[0])


def _config_spec(argv) -> str | None:
  return next((a.split("=", 1)[1] for a in argv[1:] if a.startswith(f"--{CONFIG_FLAG}=")), _default[0])


def _load_config(argv):
  """The ConfigDict the `--config` of `argv` names (`file.py:arg`) and the file's `RENAMED_KEYS` (old dotted key
  prefix → new), or (None, {}) when it cannot load."""
  spec = _config_spec(argv)
  if not spec:
    return None, {}
  path, _, arg = spec.partition(":")
  try:
    module_spec = importlib.util.spec_from_file_location("_cli_config", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return (module.get_config(arg) if arg else module.get_config()), getattr(module, "RENAMED_KEYS", {})
  except Exception:  # noqa: BLE001 - then the caller reports ml_collections' own message
    return None, {}


def _overrides(argv) -> list[str]:
  """The dotted paths of the `--config.<path>=value` flags in `argv`."""
  prefix = f"--{CONFIG_FLAG}."
  return [a[len(prefix):].split("=", 1)[0] for a in argv[1:] if a.startswith(prefix)]


def _unknown_override(argv) -> str | None:
  """A line naming the first `--config.<path>` whose path the loaded config does not have, with its new name when
  it was renamed, else the valid keys where it goes wrong; None when the config itself is not loaded."""
  config, renames = _load_config(argv)
  if not isinstance(config, config_dict.ConfigDict):
    return None
  for path in _overrides(argv):
    if (moved := common.renamed(path, renames)) is not None:
      return f"--{CONFIG_FLAG}.{moved}"
    node, seen = config, []
    for part in path.split("."):
      if not isinstance(node, config_dict.ConfigDict) or part not in node:
        where = f"{CONFIG_FLAG}.{'.'.join(seen)}" if seen else CONFIG_FLAG
        valid = sorted(node.keys()) if isinstance(node, config_dict.ConfigDict) else []
        what = f"valid keys of {where}: {', '.join(valid)}" if valid else f"{where} is a value, not a section"
        return f"--{CONFIG_FLAG}.{path}: the config has no key {part!r} ({what})"
      node, seen = node[part], seen + [part]
  return None


def _flag_error(e: flags.Error, argv, example: str) -> str:
  """`e` in the user's terms: an override of a config that was never given says to give it."""
  m = re.search(r"Unknown command line flag '(config\.[^']*)'", str(e))
  if m and not any(a.startswith(f"--{CONFIG_FLAG}=") for a in argv[1:]):
    return (f"--{m.group(1)} overrides a field of a config file, but no --{CONFIG_FLAG} was given: add "
            f"--{CONFIG_FLAG}={example}")
  lines = [x.strip() for x in str(e).splitlines() if x.strip()]
  if "Traceback (most recent call last):" in lines:   # the config file's get_config raised: its last line says why
    return f"{lines[0]} {lines[-1]}"
  return str(e)


def _check_config_loaded(argv) -> None:
  """A config file that failed to load (missing, or its get_config raised) is one line naming it."""
  flag = flags.FLAGS[CONFIG_FLAG] if CONFIG_FLAG in flags.FLAGS else None
  if flag is None or flag.value is None:
    return
  try:
    flag.value.keys()
  except Exception as e:  # noqa: BLE001 - ml_collections re-raises the loader's error, of any type, on first use
    given = _config_spec(argv)
    cause = e.__cause__ or e
    lines = [x.strip() for x in str(cause).splitlines() if x.strip()]
    fail(f"--{CONFIG_FLAG}={given}: cannot load it: {lines[-1] if lines else type(cause).__name__}")


def _parser(example: str):
  def parse(argv):
    try:
      rest = flags.FLAGS(argv)
    except flags.Error as e:
      fail(_flag_error(e, argv, example))
    except (AttributeError, KeyError, TypeError, ValueError) as e:   # an override ml_collections cannot apply
      fail(_unknown_override(argv) or str(e).splitlines()[0])
    _check_config_loaded(argv)
    return rest
  return parse


def run(main, *, example: str, input_errors: tuple[type[BaseException], ...] = ()) -> None:
  """`absl.app.run(main)` with one-line errors: flags and config overrides (`example` is a `--config` value to
  suggest), `input_errors` raised by the run (the user's to fix), and Ctrl-C (what the run kept, exit 130)."""
  def guarded(argv):
    try:
      return main(argv)
    except input_errors as e:
      fail(e)
    except KeyboardInterrupt as e:
      print(f"\ninterrupted: {e or 'rerun the same command to resume from what finished'}", file=sys.stderr)
      sys.exit(130)
  app.run(guarded, flags_parser=_parser(example))


def define_distributed():
  """The multi-process flags every training main shares; returns `start()`, which joins the run they describe
  (`composer_jax.parallel.distributed`; a no-op for one process) and must run before anything touches a device.

  Each of the N processes gets --coordinator_address=HOST:PORT --num_processes=N --process_id=I (or
  JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID, or --distributed_auto on SLURM/Open MPI)."""
  coordinator = flags.DEFINE_string("coordinator_address", None, "host:port of process 0 (multi-process runs).")
  num_processes = flags.DEFINE_integer("num_processes", None, "Number of processes in a multi-process run.")
  process_id = flags.DEFINE_integer("process_id", None, "This process's rank in [0, num_processes).")
  auto = flags.DEFINE_bool("distributed_auto", False, "Let jax.distributed.initialize() read the cluster environment.")

  def start() -> None:
    from composer_jax.parallel import distributed
    try:
      cfg = distributed.DistributedConfig.from_env(coordinator_address=coordinator.value,
                                                   num_processes=num_processes.value, process_id=process_id.value,
                                                   auto=auto.value or None)
    except ValueError as e:
      fail(e)
    distributed.initialize(cfg)
  return start
