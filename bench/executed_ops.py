"""What a training step executes, kernel by kernel: the plain step against the engine's.

`bench/graph_census.py` counts what a step traces (function bodies once). This counts
what one step runs: every kernel the executors ran, read from TensorFlow's profiler
(the XPlane of one profiled step, its `tf_Compute` lines), by op type. The executors' own
events on those lines (StartRegion, Process, Record, ...) and the allocator's are
counted apart. Counts are deterministic, unlike milliseconds on these machines: the
loop's cost per action is measured by them.

For each configuration (the tiny model of `pipeline_speedup`, 8 × Linear 64, whose
layers compute next to nothing, and the Transformer), one warmed-up step:

  kernels                 kernels the step ran
  beyond_plain            kernels − M × the plain step's (the same layers, GradientTape,
                          SGD, no pipeline code): each micro-batch runs the layers once
                          each way; the update's kernels, which run once, are taken M
                          times, so this is a lower bound of the engine's own
  actions                 F, B (and W) actions of all workers (action_cost)
  beyond_plain_per_action beyond_plain ÷ actions: the loop's own kernels per action
  ops                     {op type: count}, the 12 most run

  python bench/executed_ops.py [--models tiny,transformer]

Prints one JSON line: {config: figures}.
"""

import argparse
import collections
import glob
import json
import os
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# The executors' own events on a tf_Compute line, and the allocator's: not kernels.
EXECUTOR_EVENTS = frozenset({"StartRegion", "StopRegion", "Process", "Record",
                             "ExecutorDoneCallback", "Start", "Done", "FunctionRun",
                             "MemoryAllocation", "MemoryDeallocation"})
# (K, M, schedule) per model beside the plain step: the grid.
CONFIGS = ((1, 1, "1f1b"), (2, 2, "1f1b"), (2, 4, "1f1b"), (2, 8, "1f1b"))


def executed(run) -> tuple[collections.Counter, int]:
  """(kernels by op type, executor events) of one call of `run`, profiled."""
  import tensorflow as tf

  try:
    from tsl.profiler.protobuf import xplane_pb2
  except ImportError:  # (where TensorFlow vendors it)
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

  with tempfile.TemporaryDirectory() as logdir:
    tf.profiler.experimental.start(logdir)
    run()
    tf.profiler.experimental.stop()
    path = sorted(glob.glob(f"{logdir}/plugins/profile/*/*.xplane.pb"))[-1]
    space = xplane_pb2.XSpace()
    with open(path, "rb") as f:
      space.ParseFromString(f.read())
  kernels, events = collections.Counter(), 0
  for plane in space.planes:
    names = {key: meta.name for key, meta in plane.event_metadata.items()}
    for line in plane.lines:
      if not line.name.startswith("tf_Compute"):
        continue
      for event in line.events:
        op = names.get(event.metadata_id, "?").split(":")[-1]
        if op in EXECUTOR_EVENTS:
          events += 1
        else:
          kernels[op] += 1
  return kernels, events


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--models", default="tiny,transformer")
  args = parser.parse_args()
  from lingvo_gpipe.runtime.devices import configure_devices

  devices = configure_devices("cpu:2")
  import action_cost
  import pipeline_speedup

  out = {}
  for model in args.models.split(","):
    plain, plain_events = executed(pipeline_speedup.make_plain_step(model, devices[0]))
    out[f"{model}_plain"] = {"kernels": sum(plain.values()), "executor_events": plain_events,
                             "ops": dict(plain.most_common(12))}
    for k, m, schedule in CONFIGS:
      run = pipeline_speedup.make_step(model, k, m, devices, schedule=schedule,
                                       recompute="never")
      kernels, events = executed(run)
      actions = k * action_cost.actions_per_worker(schedule, m)
      beyond = sum(kernels.values()) - m * sum(plain.values())
      out[f"{model}_k{k}_m{m}_{schedule}"] = {
          "kernels": sum(kernels.values()), "executor_events": events,
          "beyond_plain": beyond, "actions": actions,
          "beyond_plain_per_action": round(beyond / actions, 1),
          "ops": dict(kernels.most_common(12))}
  print(json.dumps(out))


if __name__ == "__main__":
  main()
