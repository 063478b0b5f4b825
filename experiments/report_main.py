r"""Tables and plots of rl_main runs from their results.json (composer_jax/rl/report.py): writes
`<out>/<name>.md` with the plots beside it and, with --readme, the README's short table between its
`<!-- results:<name> -->` marker lines.

  python experiments/report_main.py --name=recipe --runs=seed0=runs/recipe_s0,seed1=runs/recipe_s1 \
      --length_runs=seed0 --out=experiments/results --readme=README.md
"""
import os

from absl import flags

from experiments import cli

_NAME = flags.DEFINE_string("name", "recipe", "Name of the report (file stem and README block).")
_RUNS = flags.DEFINE_list("runs", [], "label=path pairs: a run's workdir or results.json, in table order.")
_LENGTH = flags.DEFINE_list("length_runs", [], "Labels of the runs that go in the tokens-per-solved plot.")
_OUT = flags.DEFINE_string("out", "experiments/results", "Directory for <name>.md and its plots.")
_README = flags.DEFINE_string("readme", "", "README whose results:<name> block gets the first run's table.")


def main(argv):
  del argv
  from composer_jax.rl import report
  runs = []
  for item in _RUNS.value:
    label, sep, path = item.partition("=")
    if not sep or not label or not path:
      cli.fail(f"--runs item {item!r} is not label=path")
    if not os.path.exists(path):
      cli.fail(f"--runs {label}: {path} does not exist")
    runs.append((label, path))
  if not runs:
    cli.fail("--runs is required: label=path pairs (a run's workdir or its results.json)")
  unknown = set(_LENGTH.value) - {label for label, _ in runs}
  if unknown:
    cli.fail(f"--length_runs {sorted(unknown)} are not labels of --runs")
  table = report.render(_NAME.value, runs, _OUT.value, length_runs=_LENGTH.value)
  if _README.value:
    report.replace_block(_README.value, _NAME.value, table)
  print(table)


if __name__ == "__main__":
  cli.run(main, example="")
