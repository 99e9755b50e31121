"""Clusters of TensorFlow servers (tools/worker.py), one per pipeline stage: cluster
specs, joining as the client, and asking a worker whether it answers.

A TensorFlow server listens on every network interface and authenticates nobody
(docs/distributed.md: Security); `exposure_warning` is the line each process that serves
one prints.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import socket
import time
from collections.abc import Callable

import tensorflow as tf

from lingvo_gpipe.runtime.devices import (
  DeviceSpecError,
  set_default_devices,
  set_device_incarnations,
)

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
  """The one line a process that serves TensorFlow's gRPC port prints
  (docs/distributed.md: Security)."""
  return (f"warning: port {port} is open on all network interfaces with no "
          "authentication: anyone who reaches it can run any TensorFlow op in this process "
          "(read and write files, start programs); use a private network or a firewall that "
          "admits only the cluster's hosts (docs/distributed.md: Security)")


def port_in_use(port: int) -> str | None:
  """None if a server could listen on `port` of every interface (as TensorFlow's does);
  else why not ('in use by another process')."""
  with socket.socket() as s:
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC: TIME_WAIT is fine
    try:
      s.bind(("0.0.0.0", port))
    except OSError as e:
      return "in use by another process" if e.errno == errno.EADDRINUSE else e.strerror
  return None


def free_port() -> int:
  """A loopback port no socket holds now (free until someone binds it)."""
  return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
  """`count` distinct loopback ports no socket holds now: each probe stays bound until
  all are chosen (a probe closed before the next may be handed out again)."""
  with contextlib.ExitStack() as probes:
    sockets = [probes.enter_context(socket.socket()) for _ in range(count)]
    for s in sockets:
      s.bind(("localhost", 0))
    return [s.getsockname()[1] for s in sockets]


def connect_to_cluster(spec: dict[str, list[str]], worker_job: str = "worker",
                       client_job: str = "client") -> list[str]:
  """Joins the cluster as `client_job` (added on a free local port if absent).

  Returns one device per task of `worker_job`, in task order:
  /job:worker/task:k/device:CPU:0, or its first GPU if it has one. They become
  `default_devices()`, so pipeline cell k goes to task k. The workers' device
  incarnations are recorded for the pipeline's hand-offs (`pipeline/channels.py`).
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
  set_default_devices(devices)
  for address in spec[worker_job]:
    set_device_incarnations(device_incarnations(address))
  return devices


def device_incarnations(address: str) -> dict[str, int]:
  """{full device name: incarnation} of the TensorFlow server at HOST:PORT (a session's
  device listing: the one public API that reports incarnations)."""
  with tf.compat.v1.Session(f"grpc://{address}") as session:
    return {d.name: d.incarnation for d in session.list_devices()}


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
      # Announced at the first failed call, even one that took the whole timeout: what
      # is said does not depend on how loaded the machine is.
      if log is not None and not announced:
        log(f"Waiting up to {timeout_s:.0f} s for the workers at {', '.join(addresses)} "
            f"({address} {why}) ...")
        announced = True
      if time.monotonic() > deadline:
        raise DeviceSpecError(f"no TensorFlow server answers at {address} after "
                              f"{timeout_s:.0f} s (it {why}); is tools/worker.py running "
                              "there?")
      time.sleep(0.2)
