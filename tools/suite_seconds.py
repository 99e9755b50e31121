"""Seconds per test file, from pytest's `--durations=0` report.

  .venv/bin/python -m pytest -q -n 2 --dist worksteal --durations=0 tests > /tmp/suite.log
  python tools/suite_seconds.py /tmp/suite.log      # a markdown table, slowest first

Each line of the report ("12.31s call     tests/x_test.py::test_y[...]") is one phase
(setup, call or teardown) of one test, timed in the process that ran it; the table sums
them per file. Under xdist the files' seconds add up to about the workers' busy time,
not to the suite's wall time (pytest's last line, reported beside the total). A
session-scoped fixture's setup is counted in the file of the first test that asked
for it.
"""

from __future__ import annotations

import argparse
import collections
import re
import sys

_PHASE = re.compile(r"^\s*([0-9.]+)s (setup|call|teardown)\s+(\S+?)::")
_WALL = re.compile(r" in ([0-9.]+)s")


def seconds_by_file(lines) -> tuple[dict[str, float], dict[str, int], float | None]:
  """({file: seconds}, {file: tests}, the run's wall seconds or None)."""
  seconds: dict[str, float] = collections.defaultdict(float)
  tests: dict[str, set[str]] = collections.defaultdict(set)
  wall = None
  for line in lines:
    match = _PHASE.match(line)
    if match:
      value, _, path = match.groups()
      seconds[path] += float(value)
      tests[path].add(line.split("::", 1)[1].strip())
    elif ("passed" in line or "failed" in line) and (ended := _WALL.search(line)):
      wall = float(ended.group(1))
  return dict(seconds), {path: len(names) for path, names in tests.items()}, wall


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("report", help="pytest's output with --durations=0 ('-': stdin)")
  args = parser.parse_args()
  with (sys.stdin if args.report == "-" else open(args.report)) as f:
    seconds, tests, wall = seconds_by_file(f)
  if not seconds:
    sys.exit(f"{args.report}: no '--durations=0' lines (e.g. '1.23s call tests/x.py::t')")
  total = sum(seconds.values())
  print("| test file | tests timed | seconds | share |")
  print("| --- | ---: | ---: | ---: |")
  for path in sorted(seconds, key=seconds.get, reverse=True):
    print(f"| `{path}` | {tests[path]} | {seconds[path]:.0f} | {seconds[path] / total:.0%} |")
  print(f"| all | {sum(tests.values())} | {total:.0f} | |")
  if wall is not None:
    print(f"\nWall time {wall:.0f} s; the files' seconds over the wall time: {total / wall:.2f}.")


if __name__ == "__main__":
  main()
