"""Where splitting a batch into micro-batches costs time: one device, M=1 against M=M.

Runs the training step of `bench/pipeline_speedup.py` (forward, recomputed forward,
backward, summed gradients, SGD) with every cell on one device (K=1) in this process,
with one inter-op and one intra-op thread (a stand-in for one sequential accelerator,
like the benchmark's one-thread workers), at M=1 and at each M of --micro_batches. It
times --steps steps (median), profiles --profile_steps more with TensorFlow's profiler,
and attributes every op the executor ran to a phase of the step and to its op type:

  forward            ops of the cells' forward calls (name scope `forward/`)
  recompute          the forward recomputed inside the backward call (`recompute/`)
  input gradient     gradient ops whose results reach the backward call's input
                     gradients (`gradient_tape/...`, found from the traced body's graph)
  weight gradient    gradient ops whose results only reach the variables' gradients,
                     and the deferred weight-gradient calls (`weight_gradient/`)
  accumulation       adding a micro-batch's variable gradients to the sums (`accumulate/`)
  hand-off and timing  the step's identities, control gates, timestamps and their stacks
  split              cutting the batch into micro-batches
  update and other   the rest of the step graph (loss mean, gradient scale, norm, SGD)
  executor overhead  the profiled steps' wall time (median) minus all op time:
                     scheduling ops, calling functions, the client's dispatch

The op time comes from the profiler's per-op events (TraceMe "name:type" on the
executor's thread), so it includes what each kernel allocates and writes.

  python bench/micro_batch_profile.py                       # MLP 8×1024, M ∈ {1, 8}
  python bench/micro_batch_profile.py --models mlp,transformer --micro_batches 8,16
  python bench/micro_batch_profile.py --models transformer --micro_batches 2 \
      --schedule zbv --recompute never --groups 1 --baseline plain
                         # the engine's own cost against plain TensorFlow, per op type

Each M runs twice by default (--groups 1,M): weight gradients per micro-batch
(weight_gradient_group G=1, the default) and over all M micro-batches at once (G=M,
`PipeliningLayer`'s weight_gradient_group). --baseline plain compares with the plain
TensorFlow step of `bench/pipeline_speedup.py` (GradientTape and SGD on one device)
instead of the engine at M=1.

The last line printed is one JSON object: per model, M and G, the step time, the ratio
to M=1 (`ratio_m8_over_m1` and `ratio_m8_g8_over_m1` for the MLP at M=8), and the
milliseconds per phase and per op type, with their differences from M=1.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import platform
import re
import shutil
import statistics
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")  # as bench/pipeline_speedup.py says why

PHASES = ("forward", "recompute", "input gradient", "weight gradient", "accumulation",
          "hand-off and timing", "split", "update and other", "executor overhead")
_OP_EVENT = re.compile(r"^([^:\s]+):([A-Za-z_0-9]+)$")  # "node name:OpType"
_HAND_OFF_TYPES = {"Identity", "Timestamp", "NoOp", "Pack", "_Send", "_Recv", "_HostSend",
                   "_HostRecv"}


def _node_name(tensor_name: str) -> str:
  """'^a/b', 'a/b:output:0' or 'a/b:0' → 'a/b'."""
  return tensor_name.lstrip("^").split(":")[0]


def weight_gradient_ops(graph_def) -> set[str]:
  """Names of the gradient ops in the cells' backward bodies that make one variable's
  gradient: each reaches exactly one `accumulate/` op and none of the body's returned
  input gradients. The rest of the gradient ops (the chain of layer-input gradients,
  which every earlier layer waits for) count as the input gradient."""
  from lingvo_gpipe.pipeline.cell_function import ACCUMULATE_SCOPE

  result: set[str] = set()
  for function in graph_def.library.function:
    inputs = {node.name: [_node_name(i) for i in node.input] for node in function.node_def}
    accumulate = {n for n in inputs if n.startswith(ACCUMULATE_SCOPE + "/")}

    def ancestors(start, inputs=inputs, accumulate=accumulate) -> set[str]:
      """Ops `start` is made from, not looking through other accumulate ops."""
      seen, stack = set(), list(start)
      while stack:
        name = stack.pop()
        if name in seen or name not in inputs:
          continue
        seen.add(name)
        stack.extend(i for i in inputs[name] if i not in accumulate)
      return seen

    reaches: dict[str, int] = collections.Counter()
    for op in accumulate:
      reaches.update(ancestors([op]) - {op})
    feeds_outputs = ancestors([_node_name(t) for t in function.ret.values()])
    result |= {n for n, count in reaches.items()
               if count == 1 and n not in feeds_outputs and n.startswith("gradient_tape/")}
  return result


def phase_of(name: str, op_type: str, weight_ops: set[str]) -> str:
  from lingvo_gpipe.pipeline.cell_function import (
    ACCUMULATE_SCOPE,
    FORWARD_SCOPE,
    RECOMPUTE_SCOPE,
    WEIGHT_SCOPE,
  )

  if name.startswith(FORWARD_SCOPE + "/"):
    return "forward"
  if name.startswith(RECOMPUTE_SCOPE + "/"):
    return "recompute"
  if name.startswith("gradient_tape/"):
    return "weight gradient" if name in weight_ops else "input gradient"
  if name.startswith(WEIGHT_SCOPE + "/"):
    return "weight gradient"
  if name.startswith(ACCUMULATE_SCOPE + "/"):
    return "accumulation"
  if op_type in _HAND_OFF_TYPES:
    return "hand-off and timing"
  if op_type in ("Split", "SplitV"):
    return "split"
  return "update and other"


def op_times(run, steps: int) -> tuple[dict[tuple[str, str], float], float]:
  """Profiles `steps` runs: ({(node name, op type): ms per step}, profiled ms per step)."""
  import tensorflow as tf
  from tensorflow.tsl.profiler.protobuf import xplane_pb2

  logdir = tempfile.mkdtemp(prefix="micro_batch_profile_")
  try:
    options = tf.profiler.experimental.ProfilerOptions(host_tracer_level=3)
    tf.profiler.experimental.start(logdir, options=options)
    walls = [run()[0] for _ in range(steps)]
    tf.profiler.experimental.stop()
    space = xplane_pb2.XSpace()
    with open(glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True)[0],
              "rb") as f:
      space.ParseFromString(f.read())
  finally:
    shutil.rmtree(logdir, ignore_errors=True)
  times: dict[tuple[str, str], float] = collections.defaultdict(float)
  for plane in space.planes:
    for line in plane.lines:
      for event in line.events:
        match = _OP_EVENT.match(plane.event_metadata[event.metadata_id].name)
        if match and not match.group(2).endswith("PartitionedCall"):
          times[match.groups()] += event.duration_ps / 1e9 / steps
  return dict(times), 1e3 * statistics.median(walls)


def profile(model_name: str, num_micro_batches: int, steps: int, profile_steps: int,
            weight_gradient_group: int = 1, schedule: str = "gpipe",
            recompute: str = "always") -> dict:
  """The engine's step at K=1 (num_micro_batches=0: the plain TensorFlow step of
  `pipeline_speedup.make_plain_step` instead), timed and profiled."""
  import pipeline_speedup

  if num_micro_batches == 0:
    run = pipeline_speedup.make_plain_step(model_name, "/device:CPU:0")
  else:
    run = pipeline_speedup.make_step(model_name, 1, num_micro_batches, ["/device:CPU:0"],
                                     schedule=schedule, recompute=recompute,
                                     weight_gradient_group=weight_gradient_group)
  wall_ms = 1e3 * statistics.median(run()[0] for _ in range(steps))
  times, profiled_wall_ms = op_times(run, profile_steps)
  weight_ops = weight_gradient_ops(run.graph_def) if num_micro_batches else set()
  phases = dict.fromkeys(PHASES, 0.0)
  by_type: dict[str, float] = collections.defaultdict(float)
  for (name, op_type), ms in times.items():
    phases[phase_of(name, op_type, weight_ops)] += ms
    by_type[op_type] += ms
  phases["executor overhead"] = profiled_wall_ms - sum(times.values())
  return {"step_ms": wall_ms, "phases_ms": phases, "op_types_ms": dict(by_type)}


def _rounded(d: dict) -> dict:
  return {k: round(v, 2) for k, v in d.items()}


def _print_table(model_name: str, columns: dict[str, dict]) -> None:
  """Milliseconds per step by phase and by op type, one column per configuration."""
  names = list(columns)
  print(f"{model_name}: step " + ", ".join(f"{n} {c['step_ms']:.1f} ms" for n, c in
                                           columns.items()))
  header = "".join(f"{n:>12s}" for n in names)
  print(f"  {'phase':22s}{header}")
  for p in PHASES:
    print(f"  {p:22s}" + "".join(f"{c['phases_ms'][p]:12.1f}" for c in columns.values()))
  types = sorted({t for c in columns.values() for t in c["op_types_ms"]},
                 key=lambda t: -max(c["op_types_ms"].get(t, 0.0) for c in columns.values()))
  print(f"  {'op type':22s}{header}")
  for t in types[:12]:
    print(f"  {t[:22]:22s}" + "".join(f"{c['op_types_ms'].get(t, 0.0):12.1f}"
                                      for c in columns.values()), flush=True)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--models", default="mlp")
  parser.add_argument("--micro_batches", default="8", help="M to compare with M=1")
  parser.add_argument("--steps", type=int, default=9, help="timed steps (median)")
  parser.add_argument("--profile_steps", type=int, default=5)
  parser.add_argument("--schedule", default="gpipe",
                      help="the engine's schedule (zbv, interleaved_*: two cells on the device)")
  parser.add_argument("--recompute", default="always", choices=["always", "never"])
  parser.add_argument("--groups", default="1,M",
                      help="weight_gradient_group values run at each M (M: all at once)")
  parser.add_argument("--baseline", default="m1", choices=["m1", "plain"],
                      help="the column the others are compared with: the engine at M=1, "
                      "or plain TensorFlow's step of the same layers (no engine at all)")
  args = parser.parse_args()
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

  import pipeline_speedup
  import tensorflow as tf

  tf.config.threading.set_inter_op_parallelism_threads(1)
  tf.config.threading.set_intra_op_parallelism_threads(1)
  engine = {"schedule": args.schedule, "recompute": args.recompute}
  results: dict = {}
  for model_name in args.models.split(","):
    plain = args.baseline == "plain"
    base = profile(model_name, 0 if plain else 1, args.steps, args.profile_steps, **engine)
    base_name = "plain" if plain else "M=1"
    results[f"{model_name}_{'plain' if plain else 'm1'}"] = {
        "step_ms": round(base["step_ms"], 1), "phases_ms": _rounded(base["phases_ms"]),
        "op_types_ms": _rounded(base["op_types_ms"])}
    for m in [int(m) for m in args.micro_batches.split(",")]:
      columns = {base_name: base}
      for group in pipeline_speedup.weight_gradient_groups(args.groups, m):
        split = profile(model_name, m, args.steps, args.profile_steps, group, **engine)
        columns[f"M={m}" + (f" G={group}" if group > 1 else "")] = split
        extra_types = {t: split["op_types_ms"].get(t, 0.0) - base["op_types_ms"].get(t, 0.0)
                       for t in set(split["op_types_ms"]) | set(base["op_types_ms"])}
        results[f"{model_name}_m{m}" + (f"_g{group}" if group > 1 else "")] = {
            "step_ms": round(split["step_ms"], 1),
            f"ratio_over_{'plain' if plain else 'm1'}":
                round(split["step_ms"] / base["step_ms"], 3),
            "phases_ms": _rounded(split["phases_ms"]),
            "op_time_ms": round(sum(split["op_types_ms"].values()), 1),
            "extra_phases_ms": _rounded({p: split["phases_ms"][p] - base["phases_ms"][p]
                                         for p in PHASES}),
            "extra_op_types_ms": _rounded({t: v for t, v in extra_types.items()
                                           if abs(v) >= 0.05})}
      _print_table(model_name, columns)
  summary = {"bench": "micro_batch_profile",
             "machine": f"{platform.machine()} {os.cpu_count()} cores, TF {tf.__version__}",
             "threads": "1 inter-op, 1 intra-op", "onednn": os.environ["TF_ENABLE_ONEDNN_OPTS"],
             **engine, "baseline": args.baseline, "results": results}
  if "mlp_m8" in results and "mlp_m8_g8" in results and not plain:
    summary["ratio_m8_over_m1"] = results["mlp_m8"]["ratio_over_m1"]
    summary["ratio_m8_g8_over_m1"] = results["mlp_m8_g8"]["ratio_over_m1"]
  print(json.dumps(summary))


if __name__ == "__main__":
  main()
