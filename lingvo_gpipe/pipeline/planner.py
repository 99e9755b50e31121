"""An automatic pipeline plan: cells, split, micro-batches, re-materialization, schedule
and replicas chosen from measured per-layer costs and a per-device memory budget.

The cost model is `step_model`'s (per-layer times fitted at two micro-batch sizes,
the machine's measured action overhead, update rate and link, every schedule's real
in-flight counts). `plan` searches R (dividing the devices and the batch), K cells
(at most the devices / R, or twice that with two cells per device), the contiguous split, M
(dividing the per-replica batch), every recompute policy, every schedule (schedule.SCHEDULES;
interleaved_1f1b and interleaved_zb at each V that divides K, zbv at V = 2), the weight
gradient group G (`_weight_gradient_groups`) and the token slices asked for, and
ranks what fits by predicted step time.

The split is exact for one cell per device (`partition.min_bottleneck_split`: the
least largest cell time whose every cell fits, each cell with its own in-flight
counts). With V cells per device a device's memory is the sum over cells spread
along the pipeline, which a contiguous split cannot bound cell by cell: there each
cell is held to 1/V of the budget, and the whole plan is then checked per device.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from lingvo_gpipe.core.hyperparams import ParamsError
from lingvo_gpipe.pipeline import partition, schedule, step_model
from lingvo_gpipe.pipeline.layer import RECOMPUTE_POLICIES, recomputes
from lingvo_gpipe.pipeline.layer_profiler import LayerCost
from lingvo_gpipe.pipeline.step_model import Machine, PlanShape  # noqa: F401 (API)

RECOMPUTE = RECOMPUTE_POLICIES


class PlanError(ParamsError):
  """No plan fits; the message names the smallest memory any plan needs."""


# A plan is its shape with what the model predicts for it.
Plan = step_model.Prediction


class _MemoryModel:
  """Prefix sums of the layers' bytes at one micro-batch size (with S token slices,
  `micro_batch` is a unit's: 1/S of a micro-batch's sequences' worth): `peak(starts,
  ends, ...)` gives cells [start, end) their `step_model` bytes (held + working set,
  and the batch of inputs on cell 0), elementwise over arrays of starts and ends."""

  def __init__(self, costs: Sequence[LayerCost], micro_batch: float, weight_factor: float,
               batch_input_bytes: float, num_token_slices: int = 1, save_factor: float = 0.0,
               activation_factor: float = 1.0, slot_factor: float = 0.0):
    scale = micro_batch / costs[0].batch

    def prefix(values: list[float]) -> np.ndarray:
      return np.concatenate([[0.0], np.cumsum(values)])

    self.weights = prefix([c.weight_bytes for c in costs])
    self.tied = prefix([c.tied_bytes for c in costs])
    self.frozen = prefix([c.frozen_bytes for c in costs])
    self.slot_factor = slot_factor
    self.kept = prefix([step_model.unit_kept_bytes(c, num_token_slices) * scale
                        for c in costs])
    self.products = prefix([c.product_bytes * scale for c in costs])
    # a cell's input is its first layer's; its output the next cell's input (none last)
    self.inputs = np.array([c.input_bytes * scale for c in costs] + [0.0])
    self.kept_inputs = np.array([c.kept_input_bytes * scale for c in costs] + [0.0])
    # (layer l's, where l − 1 is in its cell: step_model.cell_kept_bytes)
    self.inputs_beyond = prefix([b * scale for b in
                                 step_model.inputs_kept_beyond_outputs(costs)])
    self.cache = prefix([c.cache_bytes * scale * num_token_slices if num_token_slices > 1
                         else 0.0 for c in costs])
    self.work = _RangeMax([step_model.layer_work_bytes(c, micro_batch) for c in costs])
    self.weight_factor = weight_factor
    self.save_factor = save_factor
    self.activation_factor = activation_factor
    self.batch_input_bytes = batch_input_bytes

  def peak(self, starts: Any, ends: Any, in_flight: int, awaiting: int, recompute: bool,
           first: bool, cached: int = 0) -> Any:
    kept = (self.kept[ends] - self.kept[starts] + self.kept_inputs[starts] +
            self.inputs_beyond[ends] - self.inputs_beyond[np.asarray(starts) + 1])
    cache = self.cache[ends] - self.cache[starts]
    held = step_model.held_bytes(
        self.inputs[starts] if recompute else kept, self.products[ends] - self.products[starts],
        self.inputs[starts], self.inputs[ends], in_flight, awaiting, cache, cached)
    working = step_model.working_bytes(kept, recompute, cache, self.work(starts, ends))
    return step_model.peak_bytes(self.weights[ends] - self.weights[starts], held, working,
                                 self.batch_input_bytes if first else 0.0,
                                 self.weight_factor, self.activation_factor,
                                 self.save_factor, self.tied[ends] - self.tied[starts],
                                 self.frozen[ends] - self.frozen[starts], self.slot_factor)


class _RangeMax:
  """max(values[s:e]) for arrays of s < e, in O(1) per pair (a sparse table:
  level j holds the max of each run of 2**j values)."""

  def __init__(self, values: Sequence[float]):
    levels = [np.asarray(values, dtype=float)]
    while 2 ** len(levels) <= len(values):
      below, half = levels[-1], 2 ** (len(levels) - 1)
      levels.append(np.maximum(below[:-half], below[half:]))
    self.table = np.full((len(levels), len(values)), -np.inf)
    for j, row in enumerate(levels):
      self.table[j, :len(row)] = row

  def __call__(self, starts: Any, ends: Any) -> Any:
    starts, ends = np.asarray(starts), np.asarray(ends)
    level = np.floor(np.log2(np.maximum(ends - starts, 1))).astype(int)
    return np.maximum(self.table[level, starts], self.table[level, ends - 2 ** level])


def _batch_input_bytes(costs: Sequence[LayerCost], per_replica_batch: int) -> float:
  return costs[0].input_bytes * per_replica_batch / costs[0].batch


def cell_memory(costs: Sequence[LayerCost], start: int, end: int, micro_batch: float,
                in_flight: int, recompute: bool, weight_factor: float, awaiting: int = 0,
                batch_input_bytes: float = 0.0) -> float:
  """Predicted peak bytes of the cell of layers [start, end) alone on its device
  (step_model's terms; `batch_input_bytes` for cell 0)."""
  model = _MemoryModel(costs, micro_batch, weight_factor, batch_input_bytes)
  return float(model.peak(start, end, in_flight, awaiting, recompute,
                          first=batch_input_bytes > 0))


def cell_times(costs: Sequence[LayerCost], bounds: Sequence[tuple[int, int]],
               micro_batch: float, recompute: str) -> tuple[list[float], list[float]]:
  """Per cell: forward and backward seconds at `micro_batch` examples (the backward
  recomputes the forward in a cell the policy `recompute` re-materializes), without
  the machine's per-action overhead."""
  times = [[step_model.layer_times(c, micro_batch) for c in costs[s:e]] for s, e in bounds]
  forward = [sum(f for f, _ in cell) for cell in times]
  backward = [sum(b for _, b in cell) + (f if recomputes(recompute, k, len(bounds)) else 0.0)
              for k, (cell, f) in enumerate(zip(times, forward))]
  return forward, backward


def best_split(costs: Sequence[LayerCost], num_cells: int, micro_batch: float,
               held: Sequence[int], recompute: str, weight_factor: float,
               memory_bytes: float, awaiting: Sequence[int] | None = None,
               batch_input_bytes: float = 0.0, num_token_slices: int = 1,
               cached: Sequence[int] | None = None, save_factor: float = 0.0,
               activation_factor: float = 1.0, slot_factor: float = 0.0
               ) -> tuple[int, ...] | None:
  """The split (cells' end indices) with the least largest cell time (forward +
  backward) whose every cell k fits `memory_bytes` with held[k] micro-batches (units
  of `micro_batch`) in flight, awaiting[k] awaiting their W and, with token slices,
  cached[k] micro-batches' caches, under the policy `recompute`, its weights held
  `weight_factor` times (Machine.weight_factor; tied copies without their
  `slot_factor`) and `save_factor` times in a checkpoint save; None when none fits
  (partition.min_bottleneck_split, exact)."""
  remat = [recomputes(recompute, k, num_cells) for k in range(num_cells)]
  layer = [step_model.layer_times(c, micro_batch) for c in costs]
  times = [[f * (2.0 if remat[k] else 1.0) + b for f, b in layer] for k in range(num_cells)]
  memory = _MemoryModel(costs, micro_batch, weight_factor, batch_input_bytes,
                        num_token_slices, save_factor, activation_factor, slot_factor)
  awaiting = awaiting or [0] * num_cells
  cached = cached or [0] * num_cells

  def fits(k: int, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    return memory.peak(starts, ends, held[k], awaiting[k], remat[k], k == 0,
                       cached[k]) <= memory_bytes

  return partition.min_bottleneck_split(times, num_cells, fits)


def predict(costs: Sequence[LayerCost], machine: Machine, num_replicas: int,
            splits: Sequence[int], num_micro_batches: int, recompute: str,
            schedule_name: str, batch_size: int, virtual_stages: int = 1,
            num_token_slices: int = 1, weight_gradient_group: int = 1) -> Plan:
  """The model's step time, bubble and per-device peak memory of one plan."""
  return step_model.predict(costs, machine, PlanShape(
      num_replicas, tuple(splits), num_micro_batches, recompute, schedule_name,
      virtual_stages, weight_gradient_group, num_token_slices), batch_size)


# The most a device's measured peak has exceeded its predicted one over the plans of
# bench/planner.py (docs/benchmarks_history.md, "A memory bound by measurement, one path
# from plan to run (2026-11-26)": +21%, AmoebaNet's last cell under 1F1B without
# re-materialization): a plan with less margin than this is "tight", not "fits".
MEMORY_MODEL_ERROR = 0.22


def fit_word(need: float, budget: float) -> str:
  """'fits' where `need` bytes leave at least MEMORY_MODEL_ERROR of themselves free
  in `budget`, 'tight' where they fit with less, 'does NOT fit' over it."""
  if need > budget:
    return "does NOT fit"
  return "fits" if need * (1.0 + MEMORY_MODEL_ERROR) <= budget else "tight"


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


def _schedule_variants(name: str, num_cells: int, devices: int) -> list[int]:
  """The virtual stages V to try for schedule `name`: 1; for zbv 2 (an even K on at
  most `devices` devices); for interleaved_1f1b and interleaved_zb each V ≥ 2
  dividing K whose K/V devices are at most `devices`."""
  if name == "zbv":
    return [2] if num_cells % 2 == 0 and num_cells // 2 <= devices else []
  if name not in ("interleaved_1f1b", "interleaved_zb"):
    return [1]
  return [v for v in range(2, num_cells + 1) if num_cells % v == 0 and
          num_cells // v <= devices]


def plan(costs: Sequence[LayerCost], machine: Machine, batch_size: int,
         micro_batch_counts: Sequence[int] | None = None, top: int = 5,
         max_virtual_cells: int | None = None,
         schedules: Sequence[str] = schedule.SCHEDULES,
         token_slices: Sequence[int] = (1,)) -> list[Plan]:
  """The `top` plans that fit, fastest first. Up to `max_virtual_cells` cells per
  replica (default twice its devices; more cells than devices only interleaved), of
  `schedules`, each S of `token_slices` (S > 1 only with schedule.SLICED_SCHEDULES, for
  a causal model whose costs count its caches: LayerCost.cache_bytes). Each
  configuration gets its split and peaks; those that fit are
  simulated in the order of `step_model.lower_bound_s` until the bound passes the
  `top`-th fastest found (exact: no plan below the bound is skipped).
  Raises PlanError naming the smallest peak any plan needs when none fits."""
  candidates: list[tuple[float, PlanShape]] = []
  smallest_need = float("inf")
  seen: set = set()  # (what runs: the same split, M, ... and schedule table)
  for replicas in _divisors(machine.num_devices):
    if batch_size % replicas:
      continue
    per_replica = batch_size // replicas
    devices = machine.num_devices // replicas
    most_cells = min(max_virtual_cells or 2 * devices, len(costs))
    for num_cells in range(1, most_cells + 1):
      counts = micro_batch_counts or _divisors(per_replica)
      for m in [m for m in counts if per_replica % m == 0]:
        # one cell is its last: except_last is never there
        for recompute in [r for r in RECOMPUTE if num_cells > 1 or r != "except_last"]:
          for name, s in itertools.product(schedules, token_slices):
            if s > 1 and name not in schedule.SLICED_SCHEDULES:
              continue
            for v in _schedule_variants(name, num_cells, devices):
              if v == 1 and num_cells > devices:
                continue
              for g in _weight_gradient_groups(name, recompute, m * s, s):
                shape = _best_shape(costs, machine, PlanShape(
                    replicas, tuple(range(1, num_cells + 1)), m, recompute, name, v, g, s),
                    batch_size)
                layout = shape.make_schedule()
                runs = _what_runs(shape, layout)
                if runs in seen:  # (another schedule's name for the same step)
                  continue
                seen.add(runs)
                cells = step_model.cell_costs(costs, shape, batch_size, machine)
                need = max(step_model.device_peaks(
                    layout, cells, machine.weight_factor(replicas, m),
                    _batch_input_bytes(costs, per_replica), machine.save_factor,
                    machine.activation_factor, machine.slot_factor))
                if need <= machine.memory_bytes:
                  candidates.append((step_model.lower_bound_s(
                      layout, cells, machine, replicas, g), shape))
                else:
                  smallest_need = min(smallest_need, need)
  if not candidates:
    raise PlanError(f"no plan fits {format_bytes(machine.memory_bytes)} per device on "
                    f"{machine.num_devices} device(s); the smallest any plan needs is "
                    f"{format_bytes(smallest_need)}")
  candidates.sort(key=lambda c: c[0])
  kept: list[Plan] = []
  for bound, shape in candidates:
    if len(kept) >= top and bound > kept[top - 1].step_s:
      break
    kept.append(step_model.predict(costs, machine, shape, batch_size))
    kept.sort(key=lambda p: (p.step_s, max(p.peak_bytes)))
  return kept[:top]


def _what_runs(shape: PlanShape, layout: schedule.PipelineSchedule) -> tuple:
  """What a plan executes, its schedule's name aside: two shapes with equal keys run the
  same actions in the same order on the same devices (at K=1 and M=1 gpipe and 1f1b
  are both one forward, then one backward), so a plan table lists it once."""
  return (dataclasses.replace(shape, schedule=""), layout.device_of, layout.device_orders,
          layout.slices)


WEIGHT_GRADIENT_GROUPS = (1, 2, 4)


def _weight_gradient_groups(name: str, recompute: str, units: int, slices: int
                            ) -> list[int]:
  """The G to try: 1, and where a cell can defer its weight gradients (a
  re-materialized cell under any schedule but SPLIT_BACKWARD's (zb_h1, zbv,
  interleaved_zb), which place one W per
  backward themselves) WEIGHT_GRADIENT_GROUPS and S (a micro-batch's slices in one
  product) up to the units M·S. G trades a larger product's speed (the fitted
  line's fixed part paid once per group) for the projections' inputs held until it."""
  if name in schedule.SPLIT_BACKWARD or recompute == "never":
    return [1]
  return sorted({g for g in (*WEIGHT_GRADIENT_GROUPS, slices) if g <= units})


def _best_shape(costs: Sequence[LayerCost], machine: Machine, shape: PlanShape,
                batch_size: int) -> PlanShape:
  """`shape` with the best split that fits (`best_split`), or, when none does, with
  the split that needs no budget (its peaks say by how much)."""
  per_replica = batch_size // shape.num_replicas
  layout = shape.make_schedule()
  num_cells = shape.num_cells
  held = [layout.max_in_flight(k) for k in range(num_cells)]
  awaiting = [layout.max_awaiting_weights(k) for k in range(num_cells)]
  cached = [layout.max_cached(k) for k in range(num_cells)]
  unit = per_replica / shape.num_micro_batches / shape.num_token_slices
  inputs = _batch_input_bytes(costs, per_replica)
  budget = machine.memory_bytes / shape.virtual_stages
  factor = machine.weight_factor(shape.num_replicas, shape.num_micro_batches)
  splits = best_split(costs, num_cells, unit, held, shape.recompute, factor, budget, awaiting,
                      inputs, shape.num_token_slices, cached, machine.save_factor,
                      machine.activation_factor, machine.slot_factor)
  if splits is None:
    splits = best_split(costs, num_cells, unit, held, shape.recompute, factor, float("inf"),
                        awaiting, inputs, shape.num_token_slices, cached)
  return dataclasses.replace(shape, splits=tuple(splits))


def format_bytes(n: float) -> str:
  for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
    if n >= size:
      return f"{n / size:.3g} {unit}"
  return f"{n:.0f} B"


def format_plans(plans: Sequence[Plan]) -> str:
  """A table: one row per plan."""
  rows = [f"{'R':>2} {'K':>3} {'M':>4}  {'recompute':11} {'schedule':20} {'step':>9} "
          f"{'bubble':>6}  {'peak/device':>11}  splits"]
  for p in plans:
    shape = p.shape
    name = (shape.schedule
            + (f" V={shape.virtual_stages}" if shape.virtual_stages > 1 else "")
            + (f" G={shape.weight_gradient_group}" if shape.weight_gradient_group > 1
               else "")
            + (f" S={shape.num_token_slices}" if shape.num_token_slices > 1 else ""))
    rows.append(f"{shape.num_replicas:>2} {shape.num_cells:>3} "
                f"{shape.num_micro_batches:>4}  {shape.recompute:11} {name:20} "
                f"{p.step_s * 1e3:7.1f}ms {p.bubble:6.1%}  "
                f"{max(p.peak_bytes) / 2**20:8.1f}MiB  {list(shape.splits)}")
  return "\n".join(rows)
