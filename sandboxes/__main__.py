"""Command line: `python -m sandboxes cleanup` after a crash, `python -m sandboxes run DIR -- CMD` to try a command.

  sudo python -m sandboxes cleanup [--state-root DIR]
  sudo python -m sandboxes run path/to/repo --timeout 30 -- python -m pytest -q
"""

from __future__ import annotations

import argparse
import json
import sys

from sandboxes import BwrapBackend, cleanup


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(prog="python -m sandboxes", description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  sub = ap.add_subparsers(dest="command", required=True)
  c = sub.add_parser("cleanup", help="remove state left by dead processes (mounts, cgroups, processes, files)")
  c.add_argument("--state-root", default=None)
  r = sub.add_parser("run", help="run one command in a fresh sandbox of DIR and print the result as JSON")
  r.add_argument("dir")
  r.add_argument("--timeout", type=float, default=60.0)
  r.add_argument("--state-root", default=None)
  argv = list(sys.argv[1:] if argv is None else argv)
  cmd = argv[argv.index("--") + 1:] if "--" in argv else []  # everything after -- is the command, verbatim
  args = ap.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
  if args.command == "cleanup":
    for path in cleanup(args.state_root):
      print(f"removed {path}")
    return 0
  if not cmd:
    ap.error("run: no command given (put it after --)")
  with BwrapBackend(state_root=args.state_root) as backend, backend.create(args.dir) as sb:
    res = sb.run(cmd, timeout=args.timeout)
  sys.stdout.write(res.stdout_text)
  sys.stderr.write(res.stderr_text)
  summary = {k: getattr(res, k) for k in ("exit_code", "wall_s", "timed_out", "limit_hit", "stdout_truncated",
                                          "stderr_truncated")}
  print(json.dumps(summary), file=sys.stderr)
  return res.exit_code if res.exit_code is not None else 124


if __name__ == "__main__":
  sys.exit(main())
