"""What a pipeline plan's training step will take, predicted from measured costs:
its time and each device's peak memory.

Inputs: one `LayerCost` per layer of the main stack (layer_profiler: each layer
built and run alone at two batch sizes on the target device) and a `Machine`
(calibration.py measures its figures on the devices). A plan is R replicas × K cells
(layers [splits[k-1], splits[k])), M micro-batches of b = batch / (R·M) examples,
a recompute policy, a schedule and V cells per device (interleaved_1f1b).

Time. Per cell at micro-batch b (`cell_costs`):

  F_k = Σ_l (a_f,l + c_f,l·b) + action overhead         (fitted per layer: small
  B_k = Σ_l (a_b,l + c_b,l·b) [+ F_k re-materialized]     micro-batches cost more
                             + action overhead            than linear)

(each layer's backward as measured apart from its forward, as a cell runs it: the
cell calls each layer as a function, differentiated by its own backward function;
LayerCost.backward_split_s)

split, where the cell defers weight gradients (zb_h1, weight_gradient_group > 1),
into B (input gradients) and W (weight gradients) by the measured weight-gradient
share of each layer's backward. Every hand-off adds latency + bytes / link rate.
With weight_gradient_group G > 1 a W of G micro-batches runs one product of G·b rows
(`grouped_weight_s`). The schedule the pipeline runs (`schedule.build`) is simulated
with these times (`PipelineSchedule.simulate`; where fewer cores than devices compute
at once, the busy devices share the cores equally, and R replicas, computing at the
same time, each 1/R of them: `Machine.replica_cores`), then each device applies its
update (update seconds per weight byte, measured); with R replicas an all-reduce of
the gradients follows.

Memory. Each device holds, for each of its cells (`device_peaks`):

  weights · (1 + slot_factor         weights, optimizer slots, and the step's weight-
             + weight_copies)       sized buffers (the gradient sums and the copy a
                                    backward adds into by the formula: 2; measured:
                                    Machine.weight_copies)
  + in_flight · stash               stash slots, allocated for the whole loop
                                    (PipelineSchedule.max_in_flight): the cell's input
                                    when re-materialized, else all its forward keeps
  + awaiting · products             product slots of backwards awaiting their W
                                    (max_awaiting_weights; zb_h1): the inputs and
                                    output gradients of the cell's projections
  + inbox                           one hand-off received ahead each way
  + the largest working set of one action: a backward's recomputed forward (its
    kept tensors) when re-materialized, and the most one of its layers allocates
    while it runs beyond what it is given and leaves (temporaries, concatenations,
    kernels' buffers, the gradients it returns: measured by the allocator,
    LayerCost.forward_work_bytes / backward_work_bytes)
  the stash, product and cache slots, the inbox and the working set times
  Machine.activation_factor (what the engine's steps of the model's own layers
  allocate beyond the layers measured alone; measured);
  cell 0's device also holds the whole batch of inputs (micro-batches are slices);
  with R replicas every device also holds the all-reduce's two weight-sized buffers.
  A checkpoint save holds weights · (1 + slot_factor + save_copies): the peak is the
  larger of the two.

Left out: the task's head (loss and metrics on the last cell; its softmax is a layer
of the stack in this library's models, the loss itself is small), TensorFlow's own
buffers (a runtime's allocator pools), the input pipeline's prefetched batches, and
variables outside the stack (the global step, the loss scale).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from lingvo_gpipe.pipeline import schedule
from lingvo_gpipe.pipeline.layer import recomputes
from lingvo_gpipe.pipeline.layer_profiler import LayerCost


@dataclasses.dataclass(frozen=True)
class Machine:
  """What a plan runs on.

  num_devices, memory_bytes: devices and each one's budget (bytes, after the margin).
  slot_factor: optimizer slot elements per weight element (Adam 2).
  action_overhead_s: the device loop's own seconds per action (measured:
    calibration.py), on top of the cell's call.
  update_s_per_byte: the optimizer update's seconds per weight byte on one device.
  link_latency_s, link_bytes_per_s: one hand-off between two devices.
  cores: how many devices compute at once at full speed (None or inf: every device;
    devices sharing a host's cores: fewer, measured by calibration.concurrency).
  allreduce_bytes_per_s: gradient all-reduce bandwidth between replicas (measured:
    the link's).
  weight_copies_one, weight_copies: bytes a training step allocates beyond the
    weights and their slots, per weight byte, at one micro-batch and at several
    (gradient sums and the copy a backward adds into, rows of stacked weights read
    per call, the update's temporaries; measured by calibration.step_memory; 2 by
    the formula: the sums and their copy).
  activation_factor: the engine's step allocates this many times the bytes the
    layers measured alone count for its activations (stash, hand-offs, working sets;
    measured: calibration.step_memory).
  save_copies: bytes a checkpoint save allocates beyond the weights and slots, per
    weight byte (a stacked variable's rows copied out to be saved one by one).
  """
  num_devices: int
  memory_bytes: float
  slot_factor: float = 2.0
  action_overhead_s: float = 0.15e-3
  update_s_per_byte: float = 0.0
  link_latency_s: float = 0.0
  link_bytes_per_s: float = math.inf
  cores: float | None = None
  allreduce_bytes_per_s: float = 10e9
  weight_copies_one: float = 2.0
  weight_copies: float = 2.0
  activation_factor: float = 1.0
  save_copies: float = 0.0

  def weight_factor(self, num_replicas: int, num_micro_batches: int) -> float:
    """Bytes a device holds through a step per byte of its weights: the weights, their
    slots, the step's weight-sized buffers, and with replicas the all-reduce's two
    (what it sends and what it gets back)."""
    copies = self.weight_copies_one if num_micro_batches == 1 else self.weight_copies
    return 1.0 + self.slot_factor + copies + (2.0 if num_replicas > 1 else 0.0)

  def replica_cores(self, num_replicas: int) -> float | None:
    """How many of one replica's devices compute at once at full speed: `cores` is
    measured over all the machine's devices, and R replicas compute at the same time
    (two replicas of one device each on two logical CPUs that run 1.37 at once: 0.68
    each)."""
    return None if self.cores is None else self.cores / num_replicas

  @property
  def save_factor(self) -> float:
    """Bytes a device holds while a checkpoint is saved per byte of its weights."""
    return 1.0 + self.slot_factor + self.save_copies


@dataclasses.dataclass(frozen=True)
class PlanShape:
  """A plan's configuration: every `task.pipeline` field a plan decides
  (`pipeline_fields`, the one map between a plan and params both ways:
  planning.with_plan, planning.own_shape). token_slice_lengths None: near-equal
  slices (what the planner plans; the time model treats given lengths as equal)."""
  num_replicas: int
  splits: tuple[int, ...]
  num_micro_batches: int
  recompute: str
  schedule: str
  virtual_stages: int = 1
  weight_gradient_group: int = 1
  num_token_slices: int = 1
  token_slice_lengths: tuple[int, ...] | None = None

  @property
  def num_cells(self) -> int:
    return len(self.splits)

  @property
  def num_devices(self) -> int:
    """Devices per replica: K / V."""
    return self.num_cells // self.virtual_stages

  @property
  def bounds(self) -> list[tuple[int, int]]:
    return list(zip([0, *self.splits[:-1]], self.splits))

  def pipeline_fields(self) -> dict[str, Any]:
    """{task.pipeline key: value} that runs this shape."""
    return {"num_cells": self.num_cells, "splits": list(self.splits),
            "num_micro_batches": self.num_micro_batches, "recompute": self.recompute,
            "schedule": self.schedule, "virtual_stages": self.virtual_stages,
            "weight_gradient_group": self.weight_gradient_group,
            "num_token_slices": self.num_token_slices,
            "token_slice_lengths": (None if self.token_slice_lengths is None
                                    else list(self.token_slice_lengths)),
            "num_replicas": self.num_replicas}

  @classmethod
  def from_pipeline(cls, pipeline: Any, splits: Sequence[int]) -> PlanShape:
    """The shape pipeline params (a task's `pipeline`) run with the cells ending at
    `splits` (their partitioner's)."""
    lengths = pipeline.token_slice_lengths
    return cls(pipeline.num_replicas, tuple(splits), pipeline.num_micro_batches,
               pipeline.recompute, pipeline.schedule, pipeline.virtual_stages,
               pipeline.weight_gradient_group, pipeline.num_token_slices,
               None if lengths is None else tuple(lengths))

  def params_override(self) -> str:
    """The `--params_override` that runs this shape."""
    return ";".join(f"task.pipeline.{key}={value}"
                    for key, value in self.pipeline_fields().items())

  def make_schedule(self) -> schedule.PipelineSchedule:
    """The schedule the pipeline layer runs for this shape (schedule.build, its
    cells on the devices the schedule's own placement gives: k mod D, or zbv's V)."""
    return schedule.build(self.schedule, self.num_cells, self.num_micro_batches,
                          virtual_stages=self.virtual_stages,
                          weight_gradient_group=self.weight_gradient_group,
                          recomputed=tuple(recomputes(self.recompute, k, self.num_cells)
                                           for k in range(self.num_cells)),
                          num_token_slices=self.num_token_slices)


@dataclasses.dataclass(frozen=True)
class CellCost:
  """One cell at one micro-batch size: seconds per action and bytes."""
  forward_s: float
  backward_s: float  # input and weight gradients (and the recomputed forward)
  weight_s: float  # the weight-gradient part of backward_s
  weight_bytes: float
  stash_bytes: float  # per micro-batch in flight
  kept_bytes: float  # what the backward keeps of the forward, per micro-batch
  product_bytes: float  # what a deferred backward keeps for its W, per micro-batch
  input_bytes: float  # received per micro-batch (the hand-off in)
  output_bytes: float  # sent per micro-batch (the hand-off out; 0 for the last cell)
  recompute: bool  # re-materialized: a backward recomputes the forward's kept tensors
  # Token slices: every per-micro-batch figure above is per unit (a slice of a
  # micro-batch); the cache entries the cell keeps per micro-batch in flight.
  cache_bytes: float = 0.0
  # The most one of its layers allocates while it runs, beyond what it is given and
  # leaves (LayerCost.forward_work_bytes, backward_work_bytes), per unit.
  work_bytes: float = 0.0
  # Of weight_bytes, the tied copies (no optimizer slots); the variables not trained
  # (LayerCost.tied_bytes, frozen_bytes).
  tied_bytes: float = 0.0
  frozen_bytes: float = 0.0


def layer_times(cost: LayerCost, batch: float) -> tuple[float, float]:
  """(forward, backward) seconds of one layer at `batch` examples: the lines through
  its two measured sizes (a + c·b), never below zero. The backward is the one run
  apart from its forward (`LayerCost.backward_split_s`, where measured): a cell calls
  each layer as a function of its own, re-materialized or not, so TensorFlow
  differentiates each call by its own backward function."""
  forward = cost.at("forward_s", batch)
  backward = cost.at("backward_split_s" if cost.backward_split_s is not None else "backward_s",
                     batch)
  return max(forward, 0.0), max(backward, 0.0)


def unit_kept_bytes(cost: LayerCost, num_token_slices: int) -> float:
  """What a layer's backward keeps of one unit's forward, at the profiled `cost.batch`
  examples (scale by the unit's examples ÷ cost.batch): `kept_bytes` (profiled on
  whole sequences: it holds the layer's cache entries once, `cache_bytes`), and on
  S > 1 token slices the rest of the entries a slice's forward keeps. A slice keeps
  the keys and values it read, the sequence's up to its own end: all T positions for
  the last slice (core/token_slices.py), whose recompute is the largest working set;
  scaling kept_bytes to a slice leaves 1/S of them, S − 1 profiled caches short.
  Counted for every slice, the bound is conservative where several slices of one
  micro-batch are held at once (not re-materialized: slice j keeps (j+1)/S of them)
  (tests/token_slices_test.py: test_the_cost_model_counts_units_and_caches_by_hand)."""
  return cost.kept_bytes + cost.cache_bytes * (num_token_slices - 1)


def inputs_kept_beyond_outputs(costs: Sequence[LayerCost]) -> list[float]:
  """Per layer l, the bytes of its kept inputs that layer l − 1 does not keep as its
  kept outputs (0 for the first): a tensor between two layers is one buffer, kept
  if either layer's backward needs it. A batch norm keeps its input, the conv before
  it does not keep its output: counted here; a ReLU keeps its output, the conv after
  it its input: counted once, in the ReLU's kept_bytes."""
  return [0.0] + [max(0.0, c.kept_input_bytes - before.kept_output_bytes)
                  for before, c in zip(costs[:-1], costs[1:])]


def cell_kept_bytes(costs: Sequence[LayerCost], num_token_slices: int) -> float:
  """What a backward keeps of the forward of a cell of these layers, at the profiled
  batch: each layer's kept intermediates (`unit_kept_bytes`), the inputs its first
  layer keeps, and the inputs each later layer keeps that the one before it does not
  keep as outputs (`inputs_kept_beyond_outputs`)."""
  return (sum(unit_kept_bytes(c, num_token_slices) for c in costs) +
          costs[0].kept_input_bytes + sum(inputs_kept_beyond_outputs(costs)))


def cell_costs(costs: Sequence[LayerCost], shape: PlanShape, batch_size: int,
               machine: Machine) -> list[CellCost]:
  """Per cell of `shape`: its actions' seconds (overhead included) and bytes at the
  micro-batch of `batch_size` / (R·M) examples, or with S token slices per unit of
  1/S of its tokens, counted as 1/S of its sequences: exact for the projections; a
  slice's attention reads the keys up to its own end (core/token_slices.py), so
  slice j does (2j+1)/S² of the [T, T] products, (S+1)/2S for the S together, and
  this overcounts the attention and treats the slices as equal."""
  whole = batch_size / shape.num_replicas / shape.num_micro_batches
  micro = whole / shape.num_token_slices
  scale = micro / costs[0].batch
  cells = []
  for k, (s, e) in enumerate(shape.bounds):
    remat = recomputes(shape.recompute, k, shape.num_cells)
    times = [layer_times(c, micro) for c in costs[s:e]]
    forward = sum(f for f, _ in times)
    backward = sum(b for _, b in times)
    weight = sum(b * c.weight_share for (_, b), c in zip(times, costs[s:e]))
    kept = cell_kept_bytes(costs[s:e], shape.num_token_slices) * scale
    work = max(layer_work_bytes(c, micro) for c in costs[s:e])
    inputs = costs[s].input_bytes * scale
    cells.append(CellCost(
        forward_s=forward + machine.action_overhead_s,
        backward_s=backward + (forward if remat else 0.0) + machine.action_overhead_s,
        weight_s=weight, weight_bytes=sum(c.weight_bytes for c in costs[s:e]),
        stash_bytes=inputs if remat else kept, kept_bytes=kept,
        product_bytes=sum(c.product_bytes for c in costs[s:e]) * scale, input_bytes=inputs,
        output_bytes=costs[e].input_bytes * scale if e < len(costs) else 0.0,
        recompute=remat,
        cache_bytes=(sum(c.cache_bytes for c in costs[s:e]) * whole / costs[0].batch
                     if shape.num_token_slices > 1 else 0.0),
        work_bytes=work, tied_bytes=sum(c.tied_bytes for c in costs[s:e]),
        frozen_bytes=sum(c.frozen_bytes for c in costs[s:e])))
  return cells


@dataclasses.dataclass(frozen=True)
class Prediction:
  """What `predict` expects of one plan."""
  shape: PlanShape
  step_s: float
  bubble: float
  peak_bytes: tuple[float, ...]  # per device
  schedule_s: float = 0.0  # the devices' loops alone: first action start to last end
  # per cell: seconds of a forward, a backward and a micro-batch's weight gradients
  # (W; 0 where the cell does not defer them), as MeasuredTimeline.action_times
  action_s: tuple[tuple[float, ...], ...] = ()


def predict(costs: Sequence[LayerCost], machine: Machine, shape: PlanShape,
            batch_size: int) -> Prediction:
  """The step time, bubble and per-device peak of `shape` (module docstring)."""
  plan = shape.make_schedule()
  cells = cell_costs(costs, shape, batch_size, machine)
  transfer = [machine.link_latency_s + c.output_bytes / machine.link_bytes_per_s
              for c in cells]
  forward = [c.forward_s for c in cells]
  # A cell that defers runs B without its weight gradients and each W at the weight
  # share (of G micro-batches at once: `grouped_weight_s`); `simulate` adds weight
  # time to B where the cell does not defer.
  input_grad = [c.backward_s - c.weight_s for c in cells]
  weight = [c.weight_s for c in cells]
  if shape.weight_gradient_group > 1:
    grouped = grouped_weight_s(costs, shape, batch_size)
    weight = [g if plan.defers(k) else w for k, (w, g) in enumerate(zip(weight, grouped))]
  times = plan.simulate(forward, input_grad, weight, max(transfer),
                        cores=machine.replica_cores(shape.num_replicas))
  finish = [0.0] * plan.num_devices
  for (k, _), (_, end) in times.items():
    finish[plan.device_of[k]] = max(finish[plan.device_of[k]], end)
  step = _with_update_and_allreduce(finish, max(finish), _device_weights(plan, cells),
                                    machine, shape.num_replicas)
  inputs = costs[0].input_bytes * batch_size / shape.num_replicas / costs[0].batch
  peaks = device_peaks(plan, cells, machine.weight_factor(shape.num_replicas,
                                                          shape.num_micro_batches),
                       inputs, machine.save_factor, machine.activation_factor,
                       machine.slot_factor)
  defers = [plan.defers(k) for k in range(plan.num_cells)]
  action_s = (tuple(forward),
              tuple(b if d else b + w for b, w, d in zip(input_grad, weight, defers)),
              tuple(w if d else 0.0 for w, d in zip(weight, defers)))
  return Prediction(shape, step, schedule.idle_fraction(times, plan.num_devices), peaks,
                    max(finish), action_s)


def grouped_weight_s(costs: Sequence[LayerCost], shape: PlanShape, batch_size: int
                     ) -> list[float]:
  """Per cell: the weight-gradient seconds per micro-batch (unit) of a W over G =
  shape.weight_gradient_group of them at once (one product of G·b rows: the fitted
  line's fixed part paid once per group, not per micro-batch)."""
  micro = batch_size / shape.num_replicas / shape.num_micro_batches / shape.num_token_slices
  group = shape.weight_gradient_group
  return [sum(layer_times(c, group * micro)[1] * c.weight_share for c in costs[s:e]) / group
          for s, e in shape.bounds]


def _device_weights(plan: schedule.PipelineSchedule, cells: Sequence[CellCost]
                    ) -> list[float]:
  """Per device: the weight bytes of its cells."""
  weights = [0.0] * plan.num_devices
  for k, c in enumerate(cells):
    weights[plan.device_of[k]] += c.weight_bytes
  return weights


def _with_update_and_allreduce(device_s: Sequence[float], all_done_s: float,
                               device_weights: Sequence[float], machine: Machine,
                               num_replicas: int) -> float:
  """The step: each device's seconds before its update (`device_s`) and its update
  (seconds per weight byte); where fewer cores than devices compute at once, the
  updates share the cores after `all_done_s` (what every device's work takes); then,
  with R replicas, the all-reduce of the largest device's gradients (2(R−1)/R of
  them each way at the link's rate). `predict` and `lower_bound_s` both end here."""
  updates = [w * machine.update_s_per_byte for w in device_weights]
  step = max(d + u for d, u in zip(device_s, updates))
  cores = machine.replica_cores(num_replicas)
  if cores is not None and cores < len(device_s):
    step = max(step, all_done_s + sum(updates) / cores)
  if num_replicas > 1:
    step += (2.0 * (num_replicas - 1) / num_replicas * max(device_weights) /
             machine.allreduce_bytes_per_s)
  return step


def lower_bound_s(plan: schedule.PipelineSchedule, cells: Sequence[CellCost],
                  machine: Machine, num_replicas: int, weight_gradient_group: int = 1
                  ) -> float:
  """A bound `predict`'s step never falls below, without simulating: the busiest
  device's actions back to back and its update (with fewer cores than devices, also
  all devices' work over the cores), plus the all-reduce. The search simulates plans
  in the order of this bound and stops where it passes the plans it keeps. (With
  G > 1 the weight gradients are left out: grouped, they take less than
  CellCost.weight_s.)"""
  busy = [0.0] * plan.num_devices
  for k, c in enumerate(cells):
    weight = c.weight_s if weight_gradient_group > 1 else 0.0
    busy[plan.device_of[k]] += plan.num_units * (c.forward_s + c.backward_s - weight)
  cores = machine.replica_cores(num_replicas)
  cores = math.inf if cores is None else cores
  all_busy = sum(busy) / cores if cores < plan.num_devices else 0.0
  return _with_update_and_allreduce(busy, all_busy, _device_weights(plan, cells), machine,
                                    num_replicas)


def held_bytes(stash_bytes: Any, product_bytes: Any, input_bytes: Any, output_bytes: Any,
               in_flight: int, awaiting: int, cache_bytes: Any = 0.0, cached: int = 0
               ) -> Any:
  """What a cell holds on its device through the step besides its weights (module
  docstring): stash and product slots, the inbox; with token slices, the cache slots
  of `cached` micro-batches and their gradients'. Elementwise over arrays too (the
  planner's split search evaluates many cells at once)."""
  return (in_flight * stash_bytes + awaiting * product_bytes + input_bytes + output_bytes +
          2.0 * cached * cache_bytes)


def peak_bytes(weight_bytes: Any, held: Any, working: Any, batch_input_bytes: Any,
               weight_factor: float, activation_factor: float, save_factor: float,
               tied_bytes: Any = 0.0, frozen_bytes: Any = 0.0, slot_factor: float = 0.0
               ) -> Any:
  """A device's peak: its weights times `weight_factor` (Machine.weight_factor) less
  the optimizer slots its tied copies do not have (`slot_factor` per byte of
  `tied_bytes`, of `weight_bytes`), its variables not trained (`frozen_bytes`: held
  once), `activation_factor` times what its cells hold besides (`held_bytes`) and
  its largest working set (`working_bytes`), and the batch of inputs where cell 0
  is; or, where more, a checkpoint save's: its weights times `save_factor`
  (Machine.save_factor) less the copies' slots, and the variables not trained with
  the save's own copies. Elementwise over arrays too (`device_peaks` and the
  planner's split search)."""
  no_slots = slot_factor * tied_bytes
  step = (weight_bytes * weight_factor - no_slots + frozen_bytes +
          activation_factor * (held + working) + batch_input_bytes)
  save = (save_factor * weight_bytes - no_slots +
          max(save_factor - slot_factor, 1.0) * frozen_bytes)
  return np.maximum(step, save)


def layer_work_bytes(cost: LayerCost, batch: float) -> float:
  """The most a layer allocates while its forward or its backward runs at `batch`
  examples, beyond what it is given and what it leaves (measured by the allocator at
  two sizes: lines a + c·b, as the times; a backward's weight gradients are its
  fixed part)."""
  return float(max(cost.at("forward_work_bytes", batch), cost.at("backward_work_bytes", batch),
                   0.0))


def working_bytes(kept_bytes: Any, recompute: bool, cache_bytes: Any = 0.0,
                  work_bytes: Any = 0.0) -> Any:
  """The largest working set of one of a cell's actions: a re-materialized backward's
  recomputed forward (without re-materialization it is in the stash), and the most
  one layer allocates while it runs (`layer_work_bytes`: its temporaries and the
  gradients it returns), counted as if the largest ran while the whole forward is
  recomputed (a bound: a backward frees the layers' kept tensors as it goes down);
  on token slices also the whole-sequence cache entries a backward makes: those its
  slice extends and the gradient of those it read."""
  return (kept_bytes if recompute else 0.0) + work_bytes + 2.0 * cache_bytes


def device_peaks(plan: schedule.PipelineSchedule, cells: Sequence[CellCost],
                 weight_factor: float, batch_input_bytes: float,
                 save_factor: float = 0.0, activation_factor: float = 1.0,
                 slot_factor: float = 0.0) -> tuple[float, ...]:
  """Per device, `peak_bytes` of its cells: what they hold through the step, the
  largest working set among them (one action at a time), and the batch of inputs on
  cell 0's device."""
  peaks = []
  for d in range(plan.num_devices):
    mine = [k for k in range(plan.num_cells) if plan.device_of[k] == d]
    held = sum(held_bytes(cells[k].stash_bytes, cells[k].product_bytes,
                          cells[k].input_bytes, cells[k].output_bytes,
                          plan.max_in_flight(k), plan.max_awaiting_weights(k),
                          cells[k].cache_bytes, plan.max_cached(k))
               for k in mine)
    working = max(working_bytes(cells[k].kept_bytes, cells[k].recompute,
                                cells[k].cache_bytes, cells[k].work_bytes) for k in mine)
    peaks.append(float(peak_bytes(sum(cells[k].weight_bytes for k in mine), held, working,
                                  batch_input_bytes if 0 in mine else 0.0, weight_factor,
                                  activation_factor, save_factor,
                                  sum(cells[k].tied_bytes for k in mine),
                                  sum(cells[k].frozen_bytes for k in mine), slot_factor)))
  return tuple(peaks)
