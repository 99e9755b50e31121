"""Where each test's wall time went: a pytest plugin for finding stalls.

  LINGVO_GPIPE_TEST_CLOCKS=/tmp/clocks .venv/bin/python -m pytest -n 2 ... tests
  .venv/bin/python tests/clocks.py /tmp/clocks        # the tests that waited longest

Per test (setup, call and teardown together), one JSON line in <dir>/<worker>.jsonl:
the wall seconds; the CPU seconds of this process (every thread), of the children it
waited for (subprocess.run) and of the trainers its fork server forked
(tests/trainer_forkserver.py, read from /proc); the whole machine's busy, idle and
stolen CPU seconds over the same interval (/proc/stat); and the seconds spent in
garbage collections. A test whose wall time is far above its CPU time while the
machine sat idle waited on something (a lock, a timer, a thread); one whose CPU was
short while the machine was busy was starved by the other worker.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from pathlib import Path

import pytest

_TICK = os.sysconf("SC_CLK_TCK")


def _machine_seconds() -> tuple[float, float, float]:
  """(busy, idle, stolen) CPU seconds of the whole machine since boot (/proc/stat)."""
  fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
  user, nice, system, idle, iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
  return (user + nice + system + irq + softirq) / _TICK, (idle + iowait) / _TICK, steal / _TICK


def _waited_children_seconds(pid: int | None) -> float:
  """CPU seconds of the children `pid` has waited for (cutime + cstime), 0 if none."""
  if pid is None:
    return 0.0
  try:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
  except OSError:
    return 0.0
  return (int(fields[13]) + int(fields[14])) / _TICK  # fields 16 and 17 of proc(5)


class TestClocks:
  """The plugin: times each test's whole protocol (setup, call, teardown)."""

  def __init__(self, folder: Path, server_pid):
    self._out = open(folder / f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')}.jsonl", "a")  # noqa: SIM115
    self._server_pid = server_pid  # a callable: the fork server's pid, or None
    self._gc_seconds = 0.0
    self._gc_start = None
    gc.callbacks.append(self._on_gc)

  def _on_gc(self, phase: str, _info) -> None:
    if phase == "start":
      self._gc_start = time.perf_counter()
    elif self._gc_start is not None:
      self._gc_seconds += time.perf_counter() - self._gc_start
      self._gc_start = None

  def _snapshot(self) -> dict:
    times = os.times()
    busy, idle, steal = _machine_seconds()
    return {"wall": time.perf_counter(), "cpu": time.process_time(),
            "children": times.children_user + times.children_system,
            "forked": _waited_children_seconds(self._server_pid()),
            "busy": busy, "idle": idle, "steal": steal, "gc": self._gc_seconds}

  @pytest.hookimpl(hookwrapper=True)
  def pytest_runtest_protocol(self, item, nextitem):  # noqa: ARG002
    before = self._snapshot()
    yield
    after = self._snapshot()
    record = {k: round(after[k] - before[k], 3) for k in before}
    record["test"] = item.nodeid
    self._out.write(json.dumps(record) + "\n")
    self._out.flush()



def report(folder: str, top: int = 25) -> None:
  """Prints the `top` tests whose wall time exceeded their CPU time the most."""
  rows = [json.loads(line) for path in sorted(Path(folder).glob("*.jsonl"))
          for line in path.read_text().splitlines()]
  for row in rows:
    row["waited"] = row["wall"] - row["cpu"] - row["children"] - row["forked"]
  print(f"{'wall':>7} {'cpu':>6} {'child':>6} {'forked':>6} {'waited':>7} {'busy':>6} "
        f"{'idle':>6} {'steal':>6} {'gc':>5}  test")
  for row in sorted(rows, key=lambda r: -r["waited"])[:top]:
    print(f"{row['wall']:7.1f} {row['cpu']:6.1f} {row['children']:6.1f} {row['forked']:6.1f} "
          f"{row['waited']:7.1f} {row['busy']:6.1f} {row['idle']:6.1f} {row['steal']:6.1f} "
          f"{row['gc']:5.1f}  {row['test']}")
  total = sum(r["wall"] for r in rows)
  print(f"{len(rows)} tests, {total:.0f} s of wall time, "
        f"{sum(r['waited'] for r in rows):.0f} s waited, {sum(r['gc'] for r in rows):.0f} s in gc")


if __name__ == "__main__":
  report(sys.argv[1])
