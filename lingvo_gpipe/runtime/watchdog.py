"""The trainer's watch over its workers: a worker that dies, freezes or becomes
unreachable is named within a bounded time (docs/distributed.md: When a worker fails)."""

from __future__ import annotations

import threading
from collections.abc import Callable

from lingvo_gpipe.runtime.cluster import worker_status


class WorkerWatchdog:
  """Notices, within a bounded time, a worker that dies, freezes or becomes unreachable.

  A training step whose worker has died or stopped can wait on it forever: the
  client's remote calls have no deadline, and TensorFlow's own liveness check blocks
  on a stopped worker too. This thread asks every worker for its status (gRPC, with a
  deadline: `worker_status`) every `interval_s`; once one has failed `max_failures`
  calls in a row it calls `on_failure(task, address, why)` (once). Time to notice: at
  most about max_failures · (interval_s + probe_timeout_s) (12 s with the defaults;
  measured on loopback: docs/distributed.md, *When a worker fails*).
  """

  def __init__(self, addresses: list[str], on_failure: Callable[[int, str, str], None],
               interval_s: float = 2.0, max_failures: int = 3,
               probe_timeout_s: float = 2.0):
    self.addresses = list(addresses)
    self.on_failure = on_failure
    self.interval_s, self.max_failures = interval_s, max_failures
    self.probe_timeout_s = probe_timeout_s
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._watch, name="worker-watchdog", daemon=True)

  def start(self) -> WorkerWatchdog:
    self._thread.start()
    return self

  def stop(self) -> None:
    self._stop.set()

  def unreachable(self) -> list[tuple[int, str, str]]:
    """(task, address, why) of each worker that does not answer now."""
    found = []
    for task, address in enumerate(self.addresses):
      why = worker_status(address, self.probe_timeout_s)
      if why is not None:
        found.append((task, address, why))
    return found

  def _watch(self) -> None:
    failures = [0] * len(self.addresses)
    while not self._stop.wait(self.interval_s):
      for task, address in enumerate(self.addresses):
        why = worker_status(address, self.probe_timeout_s)
        failures[task] = 0 if why is None else failures[task] + 1
        if failures[task] >= self.max_failures and not self._stop.is_set():
          self._stop.set()
          self.on_failure(task, address, why)
          return
