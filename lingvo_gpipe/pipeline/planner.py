"""An automatic pipeline plan: cells, split, micro-batches, re-materialization, schedule
and replicas chosen from measured per-layer costs and a per-device memory budget.

The cost model (`LayerCost`, one per layer of the main stack, measured at one
micro-batch size and scaled linearly with it):

  time    forward F and gradient pass B of each layer (`layer_profiler.measure_layer_costs`:
          each layer built and timed alone)
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
`PipelineSchedule.max_in_flight`); a cell is re-materialized as the recompute policy
says for cell k (`layer.recomputes`: except_last keeps the last cell's
intermediates). Its calls take Σ F and Σ B (+ Σ F again when re-materialized) over
its layers. The predicted step is the schedule's simulated
timeline with those per-cell times (`PipelineSchedule.simulate`), plus a per-action
overhead, plus, with R replicas, an all-reduce of the gradients.

`plan` searches R (dividing the devices and the batch), K ≤ devices / R, the
contiguous split (exact: the least largest cell time whose cells all fit,
`partition.min_bottleneck_split`), M (dividing the per-replica batch), every recompute
policy and the schedules this model covers (SCHEDULES), and ranks what fits by
predicted step time.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from lingvo_gpipe.core.hyperparams import ParamsError
from lingvo_gpipe.pipeline import partition, schedule
from lingvo_gpipe.pipeline.layer import RECOMPUTE_POLICIES, recomputes
from lingvo_gpipe.pipeline.layer_profiler import LayerCost

RECOMPUTE = RECOMPUTE_POLICIES
# The schedules the model above covers, of schedule.SCHEDULES (a new schedule is not
# planned until its memory is modelled: zb_h1 holds each deferred backward's products
# until its W, interleaved_1f1b places V cells per device).
MODELLED = ("gpipe", "1f1b")
SCHEDULES = tuple(name for name in schedule.SCHEDULES if name in MODELLED)


class PlanError(ParamsError):
  """No plan fits; the message names the smallest memory any plan needs."""


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
  """Prefix sums of the layers' bytes at one micro-batch size: `peak(starts, ends, held,
  recompute)` gives cells [start, end) their predicted peaks, elementwise over arrays
  of starts and ends (module docstring)."""

  def __init__(self, costs: Sequence[LayerCost], micro_batch: int, slot_factor: float):
    scale = micro_batch / costs[0].batch
    self.weights = np.concatenate([[0.0], np.cumsum([c.weight_bytes for c in costs])]) * (
        2.0 + slot_factor)
    self.kept = np.concatenate([[0.0], np.cumsum([c.kept_bytes * scale for c in costs])])
    self.inputs = np.array([c.input_bytes * scale for c in costs])  # a cell's: its first's

  def peak(self, starts: Any, ends: Any, held: int, recompute: bool) -> Any:
    kept = self.kept[ends] - self.kept[starts]
    held_bytes = held * (self.inputs[starts] if recompute else kept)
    # re-materialized: one backward's recomputed forward at a time on top
    return self.weights[ends] - self.weights[starts] + held_bytes + (
        kept if recompute else 0.0)


def cell_memory(costs: Sequence[LayerCost], start: int, end: int, micro_batch: int,
                held: int, recompute: bool, slot_factor: float) -> float:
  """Predicted peak bytes of the cell of layers [start, end) (module docstring)."""
  return float(_MemoryModel(costs, micro_batch, slot_factor).peak(start, end, held,
                                                                   recompute))


def cell_times(costs: Sequence[LayerCost], bounds: Sequence[tuple[int, int]],
               micro_batch: int, recompute: str) -> tuple[list[float], list[float]]:
  """Per cell: forward and backward seconds at `micro_batch` examples (the backward
  recomputes the forward in a cell the policy `recompute` re-materializes)."""
  scale = micro_batch / costs[0].batch
  forward = [sum(c.forward_s for c in costs[s:e]) * scale for s, e in bounds]
  backward = [sum(c.backward_s for c in costs[s:e]) * scale +
              (f if recomputes(recompute, k, len(bounds)) else 0.0)
              for k, ((s, e), f) in enumerate(zip(bounds, forward))]
  return forward, backward


def best_split(costs: Sequence[LayerCost], num_cells: int, micro_batch: int,
               held: Sequence[int], recompute: str, slot_factor: float,
               memory_bytes: float) -> tuple[int, ...] | None:
  """The split (cells' end indices) with the least largest cell time (forward +
  backward) whose every cell k fits `memory_bytes` with held[k] micro-batches in
  flight, under the policy `recompute`; None when none fits
  (partition.min_bottleneck_split, exact)."""
  scale = micro_batch / costs[0].batch
  remat = [recomputes(recompute, k, num_cells) for k in range(num_cells)]
  times = [[(c.forward_s * (2.0 if remat[k] else 1.0) + c.backward_s) * scale
            for c in costs] for k in range(num_cells)]
  memory = _MemoryModel(costs, micro_batch, slot_factor)

  def fits(k: int, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    return memory.peak(starts, ends, held[k], remat[k]) <= memory_bytes

  return partition.min_bottleneck_split(times, num_cells, fits)


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
  forward, backward = cell_times(costs, bounds, micro_batch, recompute)
  times = plan.simulate(forward, backward, 0.0)
  span = max(end for _, end in times.values())
  actions = max(len(a) for a in plan.actions)
  step = span + actions * machine.action_overhead_s
  if num_replicas > 1:
    weights = sum(c.weight_bytes for c in costs) / num_cells
    step += 2.0 * (num_replicas - 1) / num_replicas * weights / machine.allreduce_bytes_per_s
  peaks = tuple(cell_memory(costs, s, e, micro_batch, plan.max_in_flight(k),
                            recomputes(recompute, k, num_cells), machine.slot_factor)
                for k, (s, e) in enumerate(bounds))
  return Plan(num_replicas, num_cells, tuple(splits), num_micro_batches, recompute,
              schedule_name, step, schedule.idle_fraction(times, plan.num_devices), peaks)


MAX_DEVICE_BYTES = 2.0**50  # 1 PiB: no device's memory is larger


def parse_bytes(text: str) -> float:
  """'16GB', '16GiB', '512MiB', '2e9' → bytes (GB and GiB both 2**30: device memory is
  quoted in either).

  Raises:
    ValueError: naming the text, when it is not a size, not > 0 and finite, or above
      MAX_DEVICE_BYTES (1 PiB; 1e30 is a typo, not a device).
  """
  units = {"": 1, "b": 1, "kb": 2**10, "kib": 2**10, "mb": 2**20, "mib": 2**20,
           "gb": 2**30, "gib": 2**30, "tb": 2**40, "tib": 2**40}
  stripped = text.strip().lower()
  number = stripped.rstrip("kmgtib")
  unit = stripped[len(number):]
  try:
    value = float(number) * units[unit]
  except (ValueError, KeyError):
    raise ValueError(f"{text!r} is not a memory size; write e.g. 16GB or 512MiB") from None
  if not math.isfinite(value) or not 0 < value <= MAX_DEVICE_BYTES:
    raise ValueError(f"{text!r}: a device's memory must be a finite size > 0 and at most "
                     f"1 PiB; write e.g. 16GB or 512MiB")
  return value


def slot_factor(optimizer_params: Any) -> float:
  """Optimizer slot elements per weight element (Adam 2, SGD with momentum 1), from a
  1024×1024 variable's slots."""
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
        # one cell is its last: except_last is never there
        for recompute in [r for r in RECOMPUTE if num_cells > 1 or r != "except_last"]:
          for name in SCHEDULES:
            layout = schedule.make(name, num_cells, m)
            held = [layout.max_in_flight(k) for k in range(num_cells)]
            splits = best_split(costs, num_cells, per_replica // m, held,
                                recompute, machine.slot_factor, machine.memory_bytes)
            if splits is None:
              unlimited = best_split(costs, num_cells, per_replica // m, held,
                                     recompute, machine.slot_factor, float("inf"))
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
