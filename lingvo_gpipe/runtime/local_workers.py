"""Loopback workers on this host, for tests, benchmarks and trying a cluster out."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from lingvo_gpipe.runtime.cluster import (
  connect_to_cluster,
  free_ports,
  parse_cluster_spec,
  wait_for_servers,
)
from lingvo_gpipe.runtime.memory_log import memory_log_path


def start_local_worker(spec: str, task: int, single_thread: bool = True,
                       memory_log: str | None = None,
                       capture_output: bool = False) -> subprocess.Popen:
  """Starts task `task` of the cluster `spec` as a tools/worker.py process on this host.

  single_thread gives it one inter-op and one intra-op thread (a sequential device);
  memory_log: a file it appends its device memory to (tools/worker.py --memory_log);
  capture_output: its stdout and stderr are pipes (text) instead of discarded.
  """
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
  if single_thread:
    env.update(TF_NUM_INTEROP_THREADS="1", TF_NUM_INTRAOP_THREADS="1")
  # The installed module (tools/ ships as lingvo_gpipe.tools), not a path next to this
  # file: that exists only in a source checkout.
  command = [sys.executable, "-m", "lingvo_gpipe.tools.worker", f"--cluster_spec={spec}",
             f"--task={task}"]
  if memory_log:
    command.append(f"--memory_log={memory_log}")
  output = subprocess.PIPE if capture_output else subprocess.DEVNULL
  return subprocess.Popen(command, env=env, stdout=output, stderr=output, text=capture_output)


def start_local_workers(num_workers: int, single_thread: bool = True,
                        memory_log_dir: str | None = None
                        ) -> tuple[str, list[subprocess.Popen]]:
  """Starts tools/worker.py servers on free loopback ports (for tests and benchmarks).

  Returns the cluster spec text ('worker=localhost:P0,...') and the processes; the
  caller kills them. With memory_log_dir, task k logs its device memory to
  `memory_log_path(memory_log_dir, k)`.
  """
  spec = "worker=" + ",".join(f"localhost:{port}" for port in free_ports(num_workers))
  return spec, [start_local_worker(spec, task, single_thread,
                                   memory_log_path(memory_log_dir, task) if memory_log_dir
                                   else None)
                for task in range(num_workers)]


@contextmanager
def local_cluster(num_workers: int, single_thread: bool = True,
                  memory_log_dir: str | None = None
                  ) -> Iterator[tuple[list[str], list[subprocess.Popen]]]:
  """Starts `num_workers` loopback workers, joins them as the client, and yields
  (one device per worker, the worker processes); kills the workers on exit.

  Joining changes TensorFlow's context for the rest of the process: use one process
  per cluster (benchmarks and loopback tests run this in a subprocess).
  """
  spec, procs = start_local_workers(num_workers, single_thread, memory_log_dir)
  try:
    workers_spec = parse_cluster_spec(spec)
    wait_for_servers(workers_spec["worker"])
    yield connect_to_cluster(workers_spec), procs
  finally:
    for proc in procs:
      proc.kill()
    for proc in procs:
      proc.wait()
