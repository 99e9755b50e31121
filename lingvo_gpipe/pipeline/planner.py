"""An automatic pipeline plan: cells, split, micro-batches, re-materialization, schedule
and replicas chosen from measured per-layer costs and a per-device memory budget.

The cost model (`LayerCost`, one per layer of the main stack, measured at one
micro-batch size and scaled linearly with it):

  time    forward F and gradient pass B of each layer (`measure_layer_costs`: each
          layer built and timed alone, as `partition.profile_layer_costs` does)
  memory  its weights; its input per micro-batch; what TensorFlow keeps of its
          forward for the backward (`tf_internals.forward_backward_pair`: the exact
          tensors, counted from their static shapes)

A cell of layers [s, e) on its device, at micro-batch size b, holds

  weights · (2 + slot_factor)                 (the weights, their gradient sums, the
                                               optimizer slots)
  + held(k) · (input of layer s           re-materialized: it keeps its input
               or Σ kept[s:e])            otherwise: every intermediate
  + Σ kept[s:e]   (re-materialized: the one backward's recomputed forward at a time)

with held(k) the schedule's micro-batches in flight on cell k (gpipe M, 1f1b K−k;
`PipelineSchedule.max_in_flight`). Its calls take Σ F and Σ B (+ Σ F again when
re-materialized) over its layers. The predicted step is the schedule's simulated
timeline with those per-cell times (`PipelineSchedule.simulate`), plus a per-action
overhead, plus, with R replicas, an all-reduce of the gradients.

`plan` searches R (dividing the devices and the batch), K ≤ devices / R, the
contiguous split (exact: the least largest cell time whose cells all fit, by dynamic
programming over the layers), M (dividing the per-replica batch), the recompute
policy and the schedule, and ranks what fits by predicted step time.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from lingvo_gpipe.core.hyperparams import ParamsError
from lingvo_gpipe.pipeline import schedule

RECOMPUTE = ("always", "never")
SCHEDULES = ("gpipe", "1f1b")


class PlanError(ParamsError):
  """No plan fits; the message names the smallest memory any plan needs."""


@dataclasses.dataclass(frozen=True)
class LayerCost:
  """One layer at a micro-batch of `batch` examples: seconds and bytes."""
  forward_s: float
  backward_s: float
  weight_bytes: int
  input_bytes: int
  kept_bytes: int
  batch: int


@dataclasses.dataclass(frozen=True)
class Plan:
  """One candidate: R replicas × K cells (layers [splits[k-1], splits[k])), M
  micro-batches, and what the model predicts for it."""
  num_replicas: int
  num_cells: int
  splits: tuple[int, ...]
  num_micro_batches: int
  recompute: str
  schedule: str
  step_s: float
  bubble: float
  peak_bytes: tuple[float, ...]  # per cell (device)

  def params_override(self) -> str:
    """The `--params_override` that runs this plan."""
    return (f"task.pipeline.num_cells={self.num_cells};"
            f"task.pipeline.splits={list(self.splits)};"
            f"task.pipeline.num_micro_batches={self.num_micro_batches};"
            f"task.pipeline.recompute={self.recompute};"
            f"task.pipeline.schedule={self.schedule};"
            f"task.pipeline.num_replicas={self.num_replicas}")


@dataclasses.dataclass(frozen=True)
class Machine:
  """What the plan runs on: devices, each device's memory budget (bytes, after the
  margin), optimizer slots per weight byte (Adam 2), seconds per scheduled action
  (loop and hand-off overhead), and the all-reduce bandwidth between replicas."""
  num_devices: int
  memory_bytes: float
  slot_factor: float = 2.0
  action_overhead_s: float = 0.15e-3  # a device loop's action in one process, measured
  allreduce_bytes_per_s: float = 10e9


class _MemoryModel:
  """Prefix sums of the layers' bytes at one micro-batch size: `peak(starts, end, held)`
  gives the cells [start, end) their predicted peaks at once (module docstring)."""

  def __init__(self, costs: Sequence[LayerCost], micro_batch: int, recompute: bool,
               slot_factor: float):
    scale = micro_batch / costs[0].batch
    self.weights = np.concatenate([[0.0], np.cumsum([c.weight_bytes for c in costs])]) * (
        2.0 + slot_factor)
    self.kept = np.concatenate([[0.0], np.cumsum([c.kept_bytes * scale for c in costs])])
    self.inputs = np.array([c.input_bytes * scale for c in costs])
    self.recompute = recompute

  def peak(self, starts: Any, end: int, held: int) -> Any:
    kept = self.kept[end] - self.kept[starts]
    held_bytes = held * (self.inputs[starts] if self.recompute else kept)
    # re-materialized: one backward's recomputed forward at a time on top
    return self.weights[end] - self.weights[starts] + held_bytes + (
        kept if self.recompute else 0.0)


def cell_memory(costs: Sequence[LayerCost], start: int, end: int, micro_batch: int,
                held: int, recompute: bool, slot_factor: float) -> float:
  """Predicted peak bytes of the cell of layers [start, end) (module docstring)."""
  return float(_MemoryModel(costs, micro_batch, recompute, slot_factor).peak(start, end, held))


def cell_times(costs: Sequence[LayerCost], bounds: Sequence[tuple[int, int]],
               micro_batch: int, recompute: bool) -> tuple[list[float], list[float]]:
  """Per cell: forward and backward seconds (the backward recomputes the forward
  when re-materialized) at `micro_batch` examples."""
  scale = micro_batch / costs[0].batch
  forward = [sum(c.forward_s for c in costs[s:e]) * scale for s, e in bounds]
  backward = [sum(c.backward_s for c in costs[s:e]) * scale + (f if recompute else 0.0)
              for (s, e), f in zip(bounds, forward)]
  return forward, backward


def best_split(costs: Sequence[LayerCost], num_cells: int, micro_batch: int,
               held: Sequence[int], recompute: bool, slot_factor: float,
               memory_bytes: float) -> tuple[int, ...] | None:
  """The split (cells' end indices) with the least largest cell time (forward +
  backward) whose every cell k fits `memory_bytes` with held[k] micro-batches in
  flight; None when none fits. Exact: dynamic programming over (cells, layers), one
  numpy pass over the possible starts of each (cell, end)."""
  num_layers = len(costs)
  scale = micro_batch / costs[0].batch
  per_layer = [(c.forward_s * (2.0 if recompute else 1.0) + c.backward_s) * scale
               for c in costs]
  time_prefix = np.concatenate([[0.0], np.cumsum(per_layer)])
  memory = _MemoryModel(costs, micro_batch, recompute, slot_factor)
  best = np.full((num_cells + 1, num_layers + 1), np.inf)
  come_from = np.full((num_cells + 1, num_layers + 1), -1)
  best[0, 0] = 0.0
  starts = np.arange(num_layers + 1)
  for k in range(1, num_cells + 1):
    for end in range(k, num_layers - (num_cells - k) + 1):
      s = starts[k - 1:end]
      bottleneck = np.maximum(best[k - 1, s], time_prefix[end] - time_prefix[s])
      bottleneck[memory.peak(s, end, held[k - 1]) > memory_bytes] = np.inf
      i = int(np.argmin(bottleneck))
      if bottleneck[i] < np.inf:
        best[k, end], come_from[k, end] = bottleneck[i], s[i]
  if not np.isfinite(best[num_cells, num_layers]):
    return None
  splits, end = [], num_layers
  for k in range(num_cells, 0, -1):
    splits.append(end)
    end = int(come_from[k, end])
  return tuple(reversed(splits))


def _bounds(splits: Sequence[int]) -> list[tuple[int, int]]:
  return list(zip([0, *splits[:-1]], splits))


def predict(costs: Sequence[LayerCost], machine: Machine, num_replicas: int,
            splits: Sequence[int], num_micro_batches: int, recompute: str,
            schedule_name: str, batch_size: int) -> Plan:
  """The model's step time, bubble and per-cell peak memory of one plan."""
  num_cells = len(splits)
  micro_batch = batch_size // num_replicas // num_micro_batches
  plan = schedule.make(schedule_name, num_cells, num_micro_batches)
  bounds = _bounds(splits)
  forward, backward = cell_times(costs, bounds, micro_batch, recompute == "always")
  times = plan.simulate(forward, backward, 0.0)
  span = max(end for _, end in times.values())
  actions = max(len(a) for a in plan.actions)
  step = span + actions * machine.action_overhead_s
  if num_replicas > 1:
    weights = sum(c.weight_bytes for c in costs) / num_cells
    step += 2.0 * (num_replicas - 1) / num_replicas * weights / machine.allreduce_bytes_per_s
  peaks = tuple(cell_memory(costs, s, e, micro_batch, plan.max_in_flight(k),
                            recompute == "always", machine.slot_factor)
                for k, (s, e) in enumerate(bounds))
  return Plan(num_replicas, num_cells, tuple(splits), num_micro_batches, recompute,
              schedule_name, step, schedule.idle_fraction(times, plan.num_devices), peaks)


def parse_bytes(text: str) -> float:
  """'16GB', '16GiB', '512MiB', '2e9' → bytes (GB and GiB both 2**30: device memory is
  quoted in either)."""
  units = {"": 1, "b": 1, "kb": 2**10, "kib": 2**10, "mb": 2**20, "mib": 2**20,
           "gb": 2**30, "gib": 2**30, "tb": 2**40, "tib": 2**40}
  stripped = text.strip().lower()
  number = stripped.rstrip("kmgtib")
  unit = stripped[len(number):]
  try:
    value = float(number) * units[unit]
  except (ValueError, KeyError):
    raise ValueError(f"{text!r} is not a memory size; write e.g. 16GB or 512MiB") from None
  if value <= 0:
    raise ValueError(f"{text!r}: a memory size must be > 0")
  return value


def slot_factor(optimizer_params: Any) -> float:
  """Optimizer slot elements per weight element (Adam 2, SGD with momentum 1), from a
  1024×1024 variable's slots."""
  import tensorflow as tf

  optimizer = optimizer_params.instantiate()
  probe = tf.Variable(tf.zeros([1024, 1024]))
  shapes = optimizer.slot_shapes(probe)
  return sum(float(np.prod(shape)) for shape, _ in shapes.values()) / (1024 * 1024)


def _divisors(n: int) -> list[int]:
  return [d for d in range(1, n + 1) if n % d == 0]


def plan(costs: Sequence[LayerCost], machine: Machine, batch_size: int,
         micro_batch_counts: Sequence[int] | None = None, top: int = 5) -> list[Plan]:
  """The `top` plans that fit, fastest first. Raises PlanError naming the smallest
  peak any plan needs when none fits."""
  fitting: list[Plan] = []
  smallest_need = float("inf")
  for replicas in _divisors(machine.num_devices):
    if batch_size % replicas:
      continue
    per_replica = batch_size // replicas
    for num_cells in range(1, min(machine.num_devices // replicas, len(costs)) + 1):
      counts = micro_batch_counts or _divisors(per_replica)
      for m in [m for m in counts if per_replica % m == 0]:
        for recompute in RECOMPUTE:
          for name in SCHEDULES:
            layout = schedule.make(name, num_cells, m)
            held = [layout.max_in_flight(k) for k in range(num_cells)]
            splits = best_split(costs, num_cells, per_replica // m, held,
                                recompute == "always", machine.slot_factor,
                                machine.memory_bytes)
            if splits is None:
              unlimited = best_split(costs, num_cells, per_replica // m, held,
                                     recompute == "always", machine.slot_factor, float("inf"))
              candidate = predict(costs, machine, replicas, unlimited, m, recompute, name,
                                  batch_size)
              smallest_need = min(smallest_need, max(candidate.peak_bytes))
              continue
            fitting.append(predict(costs, machine, replicas, splits, m, recompute, name,
                                   batch_size))
  if not fitting:
    raise PlanError(f"no plan fits {format_bytes(machine.memory_bytes)} per device on "
                    f"{machine.num_devices} device(s); the smallest any plan needs is "
                    f"{format_bytes(smallest_need)}")
  fitting.sort(key=lambda p: (p.step_s, max(p.peak_bytes)))
  return fitting[:top]


def format_bytes(n: float) -> str:
  for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
    if n >= size:
      return f"{n / size:.3g} {unit}"
  return f"{n:.0f} B"


def format_plans(plans: Sequence[Plan]) -> str:
  """A table: one row per plan."""
  rows = [f"{'R':>2} {'K':>3} {'M':>4}  {'recompute':9} {'schedule':8} {'step':>9} "
          f"{'bubble':>6}  {'peak/device':>11}  splits"]
  for p in plans:
    rows.append(f"{p.num_replicas:>2} {p.num_cells:>3} {p.num_micro_batches:>4}  "
                f"{p.recompute:9} {p.schedule:8} {p.step_s * 1e3:7.1f}ms {p.bubble:6.1%}  "
                f"{max(p.peak_bytes) / 2**20:8.1f}MiB  {list(p.splits)}")
  return "\n".join(rows)


# -- measuring -----------------------------------------------------------------------


def measure_layer_costs(layer_params: Sequence[Any], input_specs: Any, steps: int = 5
                        ) -> list[LayerCost]:
  """Each layer built and run alone on the default device at the batch of
  `input_specs` (nested TensorSpecs, batch first), its input the previous layer's
  output: median forward and forward+backward seconds over `steps` runs after a
  warm-up, weight bytes, input bytes, and the bytes TensorFlow keeps of its forward
  for the backward."""
  import tensorflow as tf

  from lingvo_gpipe.pipeline import tf_internals

  def random_like(spec):
    if spec.dtype.is_floating:
      return tf.random.normal(spec.shape, dtype=spec.dtype)
    return tf.zeros(spec.shape, spec.dtype)

  def nbytes(tensors) -> int:
    return int(sum(t.shape.num_elements() * t.dtype.size for t in tensors))

  inputs = tf.nest.map_structure(random_like, input_specs)
  batch = tf.nest.flatten(input_specs)[0].shape[0]
  costs = []
  for p in layer_params:
    layer = p.copy().instantiate()

    structure: dict[str, Any] = {}
    call = _flat_call(layer, inputs, structure)
    flat = tf.nest.flatten(inputs)
    forward = tf.function(call, autograph=False)

    @tf.function(autograph=False)
    def forward_backward(*flat, layer=layer, call=call):
      with tf.GradientTape() as tape:
        tape.watch([t for t in flat if t.dtype.is_floating])
        out = call(*flat)
        total = tf.add_n([tf.reduce_sum(t) for t in out if t.dtype.is_floating])
      return tape.gradient(total, layer.trainable_variables)

    outputs = forward(*flat)
    forward_backward(*flat)
    concrete = tf.function(call, autograph=False).get_concrete_function(
        *[tf.TensorSpec(t.shape, t.dtype) for t in flat])
    pair = tf_internals.forward_backward_pair(concrete)
    kept = nbytes([concrete.graph.outputs[i] for i in pair.kept_positions])

    forward_s = _median_seconds(forward, flat, steps)
    both_s = _median_seconds(forward_backward, flat, steps)
    costs.append(LayerCost(forward_s, max(both_s - forward_s, 0.0),
                           nbytes(layer.trainable_variables), nbytes(flat), kept, batch))
    inputs = tf.nest.pack_sequence_as(structure["out"], list(outputs))
  return costs


def _flat_call(layer: Any, given: Any, structure: dict) -> Any:
  """flat inputs (shaped as `given`) → the layer's flat outputs in training; the
  outputs' nesting is left in structure["out"]."""
  import tensorflow as tf

  from lingvo_gpipe.core import base_layer

  def call(*flat):
    with base_layer.step_context(training=True, layer_stats=[]):
      out = base_layer.call_with(layer, tf.nest.pack_sequence_as(given, list(flat)))
    structure["out"] = out
    return tf.nest.flatten(out)

  return call


def _median_seconds(fn, args: Sequence[Any], steps: int) -> float:
  """Median wall seconds of fn(*args), its results fetched, over `steps` runs."""
  import tensorflow as tf

  runs = []
  for _ in range(steps):
    start = time.perf_counter()
    for t in fn(*args):
      if t is not None:
        tf.convert_to_tensor(t).numpy()  # embeddings' gradients are IndexedSlices
    runs.append(time.perf_counter() - start)
  return float(np.median(runs))


def cached_layer_costs(path: str, key_parts: Sequence[Any], measure) -> list[LayerCost]:
  """The costs stored under the key of `key_parts` in the JSON file `path`, or
  `measure()`'s, stored there (written whole to a temporary file, then renamed)."""
  key = hashlib.sha256(json.dumps([str(k) for k in key_parts]).encode()).hexdigest()[:16]
  stored: dict = {}
  if os.path.exists(path):
    with open(path) as f:
      stored = json.load(f)
  if key in stored:
    return [LayerCost(**c) for c in stored[key]]
  costs = measure()
  stored[key] = [dataclasses.asdict(c) for c in costs]
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path + ".tmp", "w") as f:
    json.dump(stored, f)
  os.replace(path + ".tmp", path)
  return costs
