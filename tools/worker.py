"""A TensorFlow server for one task of a cluster: the process a pipeline cell runs in.

  python tools/worker.py --cluster_spec=worker=localhost:2222,localhost:2223 --task=0

On one host, run one worker per device; to make a CPU worker behave like one
sequential accelerator, start it with one inter-op and one intra-op thread:

  TF_NUM_INTEROP_THREADS=1 TF_NUM_INTRAOP_THREADS=1 python tools/worker.py ...

(a ConfigProto passed to the server does not govern eager remote execution; the
environment does). The trainer joins with --cluster_spec and places cell k on
/job:worker/task:k. The server runs until killed.

TensorFlow's server listens on every network interface and authenticates nobody (it
has no bind-address or TLS option); the worker says so in one warning line at start.
Run it on a private network (docs/distributed.md: Security).
"""

from __future__ import annotations

import os
import sys
import threading

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("cluster_spec", None, "JOB=HOST:PORT,HOST:PORT[;JOB=...]; or use TF_CONFIG.")
flags.DEFINE_string("job", "worker", "This task's job name.")
flags.DEFINE_integer("task", 0, "This task's index in its job.")
flags.DEFINE_string("memory_log", None,
                    "Append this worker's device memory (bytes of tensors in use, and the "
                    "peak since start) to this file as JSON lines, each time it changes. On "
                    "CPU this switches TensorFlow to its BFC allocator (the one GPUs use), "
                    "which keeps those counts.")


def main(argv: list[str]) -> None:
  del argv
  if FLAGS.memory_log:
    os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")  # before TensorFlow starts
  import tensorflow as tf

  from lingvo_gpipe.runtime import cluster
  from lingvo_gpipe.runtime.devices import DeviceSpecError
  from lingvo_gpipe.runtime.memory_log import log_device_memory

  try:
    spec = cluster.parse_cluster_spec(FLAGS.cluster_spec) if FLAGS.cluster_spec \
        else cluster.cluster_spec_from_tf_config()
    address = cluster.task_address(spec, FLAGS.job, FLAGS.task)
  except DeviceSpecError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  if FLAGS.memory_log:
    try:
      open(FLAGS.memory_log, "a").close()
    except OSError as e:
      print(f"error: --memory_log={FLAGS.memory_log} cannot be written: {e.strerror}",
            file=sys.stderr)
      sys.exit(2)
  port = address.rpartition(":")[2]
  busy = cluster.port_in_use(int(port))
  if busy:
    print(f"error: port {port} of {address} (/job:{FLAGS.job}/task:{FLAGS.task} in the "
          f"cluster spec) cannot be served: {busy}; stop what uses it or give this task "
          "another port in the cluster spec", file=sys.stderr)
    sys.exit(2)
  try:
    server = tf.distribute.Server(tf.train.ClusterSpec(spec), job_name=FLAGS.job,
                                  task_index=FLAGS.task, protocol="grpc", start=True)
  except tf.errors.OpError as e:
    print(f"error: the TensorFlow server for /job:{FLAGS.job}/task:{FLAGS.task} on port "
          f"{port} did not start: {e.message}", file=sys.stderr)
    sys.exit(1)
  print(f"worker /job:{FLAGS.job}/task:{FLAGS.task} ({address} in the cluster spec) serving "
        f"on port {port} of every network interface", flush=True)
  print(cluster.exposure_warning(port), file=sys.stderr, flush=True)
  if FLAGS.memory_log:
    device = "GPU:0" if tf.config.list_physical_devices("GPU") else "CPU:0"
    threading.Thread(target=log_device_memory, args=(FLAGS.memory_log, device),
                     name="memory-log", daemon=True).start()
  server.join()


if __name__ == "__main__":
  app.run(main)
