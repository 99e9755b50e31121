"""Local devices for cells: logical CPUs, local GPUs, or one GPU split into several.

`configure_devices(spec)` must run before TensorFlow initializes its devices (before
the first op); it returns the device names in order, one per pipeline cell slot.

Specs:
  cpu        the one CPU device
  cpu:N      N logical CPU devices sharing the host (placement and memory tests)
  gpu        every local GPU
  gpu:N      GPU 0 split into N logical GPUs
  gpu:N:MB   GPU 0 split into N logical GPUs of MB megabytes each
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import tensorflow as tf

_SPEC = re.compile(r"^(cpu|gpu)(?::(\d+))?(?::(\d+))?$")
VALID_SPECS = "cpu, cpu:N, gpu, gpu:N or gpu:N:MEMORY_MB (N >= 1)"


class DeviceSpecError(ValueError):
  """A device spec that cannot be parsed or satisfied."""


def parse_device_spec(spec: str) -> tuple[str, int | None, int | None]:
  """'cpu:4' → ('cpu', 4, None); raises DeviceSpecError naming the bad spec."""
  match = _SPEC.match(spec.strip().lower())
  if not match:
    raise DeviceSpecError(f"bad device spec {spec!r}; valid: {VALID_SPECS}")
  kind, count, memory_mb = match.group(1), match.group(2), match.group(3)
  count = int(count) if count is not None else None
  memory_mb = int(memory_mb) if memory_mb is not None else None
  if count is not None and count < 1:
    raise DeviceSpecError(f"bad device spec {spec!r}: N must be >= 1; valid: {VALID_SPECS}")
  if kind == "cpu" and memory_mb is not None:
    raise DeviceSpecError(f"bad device spec {spec!r}: CPU devices take no memory limit")
  return kind, count, memory_mb


_configured: list[str] = []


def default_devices() -> list[str]:
  """The devices of the last `configure_devices`, else all logical GPUs, else CPUs."""
  if _configured:
    return list(_configured)
  gpus = tf.config.list_logical_devices("GPU")
  return [d.name for d in (gpus or tf.config.list_logical_devices("CPU"))]


def configure_devices(spec: str) -> list[str]:
  """Sets up the devices `spec` asks for and returns their names, in order.

  They become `default_devices()`, where pipelines without explicit devices go.
  """
  _configured[:] = _configure(spec)
  return list(_configured)


def _configure(spec: str) -> list[str]:
  kind, count, memory_mb = parse_device_spec(spec)
  physical = tf.config.list_physical_devices(kind.upper())
  if not physical:
    raise DeviceSpecError(f"device spec {spec!r} asks for {kind.upper()} but none is present")
  if kind == "gpu" and count is None:
    return [d.name for d in tf.config.list_logical_devices("GPU")]
  wanted = count or 1
  if kind == "cpu":
    configs = [tf.config.LogicalDeviceConfiguration() for _ in range(wanted)]
  else:
    configs = [tf.config.LogicalDeviceConfiguration(memory_limit=memory_mb)
               for _ in range(wanted)]
  current = tf.config.get_logical_device_configuration(physical[0])
  if current is None or len(current) != wanted:
    try:
      tf.config.set_logical_device_configuration(physical[0], configs)
    except RuntimeError as e:
      have = len(tf.config.list_logical_devices(kind.upper()))
      raise DeviceSpecError(
          f"cannot set up {spec!r}: TensorFlow already initialized {have} {kind.upper()} "
          "device(s); configure devices before running any op") from e
  return [d.name for d in tf.config.list_logical_devices(kind.upper())][:wanted]


# ---------------------------------------------------------------------------
# Clusters of TensorFlow servers (tools/worker.py), one per pipeline stage.
# ---------------------------------------------------------------------------

_ADDRESS = re.compile(r"^[A-Za-z0-9_.\-\[\]:]+:\d+$")
VALID_CLUSTER_SPEC = "JOB=HOST:PORT[,HOST:PORT...][;JOB=...], e.g. worker=h1:2222,h2:2222"


def parse_cluster_spec(text: str) -> dict[str, list[str]]:
  """'worker=h1:2222,h2:2222;ps=h3:2222' → {'worker': [...], 'ps': [...]}."""
  spec: dict[str, list[str]] = {}
  for part in filter(None, (p.strip() for p in text.split(";"))):
    job, _, addresses = part.partition("=")
    job = job.strip()
    hosts = [a.strip() for a in addresses.split(",") if a.strip()]
    if not job or not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", job) or not hosts:
      raise DeviceSpecError(f"bad cluster spec {text!r}; valid: {VALID_CLUSTER_SPEC}")
    for address in hosts:
      if not _ADDRESS.match(address):
        raise DeviceSpecError(f"bad address {address!r} in cluster spec {text!r}; "
                              "expected HOST:PORT")
      port = int(address.rpartition(":")[2])
      if not 1 <= port <= 65535:
        raise DeviceSpecError(f"bad port {port} in address {address!r} of cluster spec "
                              f"{text!r}; valid ports: 1..65535")
    if job in spec:
      raise DeviceSpecError(f"job {job!r} appears twice in cluster spec {text!r}")
    spec[job] = hosts
  if not spec:
    raise DeviceSpecError(f"empty cluster spec; valid: {VALID_CLUSTER_SPEC}")
  return spec


def cluster_spec_from_tf_config() -> dict[str, list[str]]:
  """The 'cluster' of the TF_CONFIG environment variable."""
  raw = os.environ.get("TF_CONFIG")
  if not raw:
    raise DeviceSpecError("no --cluster_spec and no TF_CONFIG environment variable")
  try:
    cluster = json.loads(raw)["cluster"]
    return {job: list(addresses) for job, addresses in cluster.items()}
  except (ValueError, KeyError, TypeError, AttributeError) as e:
    raise DeviceSpecError(f"TF_CONFIG has no valid 'cluster': {e}") from None


def task_address(spec: dict[str, list[str]], job: str, task: int) -> str:
  if job not in spec:
    raise DeviceSpecError(f"job {job!r} is not in the cluster spec (jobs: {sorted(spec)})")
  if not 0 <= task < len(spec[job]):
    raise DeviceSpecError(f"task {task} is out of range for job {job!r} "
                          f"({len(spec[job])} tasks: 0..{len(spec[job]) - 1})")
  return spec[job][task]


def exposure_warning(port: int | str) -> str:
  """The one line a process that serves TensorFlow's gRPC port prints (README: Security)."""
  return (f"warning: port {port} is open on all network interfaces with no "
          "authentication: anyone who reaches it can run any TensorFlow op in this process "
          "(read and write files, start programs); use a private network or a firewall that "
          "admits only the cluster's hosts (README: Security)")


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def connect_to_cluster(spec: dict[str, list[str]], worker_job: str = "worker",
                       client_job: str = "client") -> list[str]:
  """Joins the cluster as `client_job` (added on a free local port if absent).

  Returns one device per task of `worker_job`, in task order:
  /job:worker/task:k/device:CPU:0, or its first GPU if it has one. They become
  `default_devices()`, so pipeline cell k goes to task k.
  """
  if worker_job not in spec:
    raise DeviceSpecError(f"the cluster spec has no {worker_job!r} job (jobs: {sorted(spec)})")
  spec = dict(spec)
  spec.setdefault(client_job, [f"localhost:{free_port()}"])
  resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
      tf.train.ClusterSpec(spec), task_type=client_job, task_id=0, rpc_layer="grpc")
  tf.config.experimental_connect_to_cluster(resolver, job_name=client_job,
                                            make_master_device_default=False)
  devices = []
  for task in range(len(spec[worker_job])):
    prefix = f"/job:{worker_job}/replica:0/task:{task}"
    names = [d.name for d in tf.config.list_logical_devices() if d.name.startswith(prefix)]
    gpus = [n for n in names if "/device:GPU:" in n]
    devices.append(gpus[0] if gpus else f"{prefix}/device:CPU:0")
  _configured[:] = devices
  return devices


def worker_status(address: str, timeout_s: float = 2.0) -> str | None:
  """None if the TensorFlow server at HOST:PORT answers a status call within
  `timeout_s`; else why not: 'does not reply within 2 s (frozen or overloaded)' for a
  process that is stopped or stuck, 'cannot be reached (unavailable)' for one that is
  gone or whose host or network is.

  The call is the worker service's own GetStatus RPC (an empty request; TensorFlow's
  gRPC server answers it on its own threads, also while the worker computes). A TCP
  connect is not enough: a stopped process's kernel still accepts connections.
  """
  import grpc  # TensorFlow's own dependency

  with grpc.insecure_channel(address) as channel:
    get_status = channel.unary_unary("/tensorflow.WorkerService/GetStatus")
    try:
      get_status(b"", timeout=timeout_s, wait_for_ready=False)
      return None
    except grpc.RpcError as e:
      if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
        return f"does not reply within {timeout_s:g} s (frozen or overloaded)"
      return f"cannot be reached ({e.code().name.lower()})"


def wait_for_servers(addresses: list[str], timeout_s: float = 60.0,
                     log: Callable[[str], None] | None = None) -> None:
  """Waits until every TensorFlow server at HOST:PORT answers a status call; raises
  naming the first that does not within `timeout_s` (a worker that failed to start, a
  wrong address, a frozen process). `log` hears once which ones it waits for."""
  deadline = time.monotonic() + timeout_s
  announced = False
  for address in addresses:
    while (why := worker_status(address, timeout_s=1.0)) is not None:
      if time.monotonic() > deadline:
        raise DeviceSpecError(f"no TensorFlow server answers at {address} after "
                              f"{timeout_s:.0f} s (it {why}); is tools/worker.py running "
                              "there?")
      if log is not None and not announced:
        log(f"Waiting up to {timeout_s:.0f} s for the workers at {', '.join(addresses)} "
            f"({address} {why}) ...")
        announced = True
      time.sleep(0.2)


class WorkerWatchdog:
  """Notices, within a bounded time, a worker that dies, freezes or becomes unreachable.

  A training step whose worker has died or stopped can wait on it forever: the
  client's remote calls have no deadline, and TensorFlow's own liveness check blocks
  on a stopped worker too. This thread asks every worker for its status (gRPC, with a
  deadline: `worker_status`) every `interval_s`; once one has failed `max_failures`
  calls in a row it calls `on_failure(task, address, why)` (once). Time to notice: at
  most about max_failures · (interval_s + probe_timeout_s) (12 s with the defaults;
  measured on loopback: docs in README, *When a worker fails*).
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
  spec = "worker=" + ",".join(f"localhost:{free_port()}" for _ in range(num_workers))
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


# -- device memory of a worker ------------------------------------------------------

def memory_log_path(directory: str, task: int) -> str:
  return str(Path(directory) / f"worker_{task}_memory.jsonl")


def log_device_memory(path: str, device: str, interval_s: float = 0.5,
                      stop: threading.Event | None = None) -> None:
  """Appends `device`'s allocator counts to `path`, one JSON line per change:
  {"time": unix seconds, "device": ..., "bytes_in_use": ..., "peak_bytes_in_use": ...}.

  The peak is since the process started: every tensor this worker ever held at once
  (weights, optimizer slots, activations, gradients, transfer buffers), not the
  program or runtime. CPU devices keep these counts only with TensorFlow's BFC
  allocator (TF_CPU_ALLOCATOR_USE_BFC=true before TensorFlow starts; the allocator
  GPUs use); GPUs always do. Runs until `stop` is set.
  """
  stop = stop or threading.Event()
  last = None
  while True:
    info = tf.config.experimental.get_memory_info(device)
    counts = (info["current"], info["peak"])
    if counts != last:
      record = {"time": round(time.time(), 3), "device": device,
                "bytes_in_use": counts[0], "peak_bytes_in_use": counts[1]}
      with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
      last = counts
    if stop.wait(interval_s):
      return


def read_memory_log(path: str) -> dict:
  """The last record `log_device_memory` wrote to `path`."""
  lines = Path(path).read_text().splitlines()
  if not lines:
    raise ValueError(f"{path} holds no memory record yet")
  return json.loads(lines[-1])
