"""Builds one pipelined training step from a schedule: the calls, their order, the sums.

For every (cell k, action) in `schedule.execution_order()`, under tf.device(cell k):

  F(k, m)   inputs: micro-batch m (k = 0) or F(k−1, m)'s outputs, arrived on device k
            → CellFunctions.forward; batch statistics go to the StepContext; on the
            last cell the head turns the outputs into micro-batch m's metrics.
  B(k, m)   output gradient: the loss weight w_m (last cell) or B(k+1, m)'s input
            gradients, arrived on device k → CellFunctions.backward, which adds its
            variable gradients to cell k's running sums (inside the call, so the step
            graph does not grow by one add per variable per micro-batch).
  W(k)      only with weight_gradient_group G > 1: after every G-th B of cell k (and
            its last), once that B's input gradients have left for device k−1 →
            CellFunctions.weight_gradients: the projections' weight gradients of
            those G micro-batches, one product each, added to the running sums.

Invariant: a device runs its actions exactly in the schedule's order, and each result
reaches the neighbouring device before the sender starts its next action. Each call
waits (one control gate) for what the cell's previous action handed on to have
*arrived* there; waiting only for the result to be made is not enough, since a device
with one inter-op thread then runs its own chain of ready calls before it sends
(docs/benchmarks.md: the pipeline serialized). Pinned by
`tests/gpipe_test.py::test_each_hand_off_is_awaited_on_the_receiving_device` and
`tests/timeline_test.py` (the measured order is the plan's). The timeline records a
span per call.

The loss of the whole batch is the weighted mean of the micro-batch losses,
Σ w_m·loss_m / Σ w_m, with w_m the loss's weight (examples, or target tokens):
each backward is seeded with w_m, and the summed gradients are divided by Σ w_m once
at the end, so the update is the unpartitioned model's on the whole batch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from lingvo_gpipe.core import base_layer
from lingvo_gpipe.pipeline import timeline
from lingvo_gpipe.pipeline.cell_function import CellFunctions
from lingvo_gpipe.pipeline.schedule import FORWARD, WEIGHT_GRADIENT, PipelineSchedule

Metrics = dict[str, tuple[tf.Tensor, tf.Tensor]]


@dataclasses.dataclass
class StepGradients:
  """The result of one pipelined step: the whole batch's metrics (on the last device)
  and each variable's gradient of the whole batch's loss (on the variable's device)."""
  metrics: Metrics
  variables: list[tf.Variable]
  gradients: list[tf.Tensor]

  def gradients_for(self, variables: Sequence[tf.Variable]) -> list[tf.Tensor]:
    """Gradients in the order of `variables`; zeros for variables no cell used."""
    by_ref = {v.ref(): g for v, g in zip(self.variables, self.gradients)}
    grads = []
    for v in variables:
      if v.ref() in by_ref:
        grads.append(by_ref[v.ref()])
      else:
        with tf.device(v.device):
          grads.append(tf.zeros_like(v))
    return grads


def arrived(tensors: Sequence[Any], destination: str | None) -> list[Any]:
  """Identities of `tensors` made on `destination`: markers of their having arrived.

  The tensors travel once: the next cell's Recv of them is the markers' Recv.
  """
  if destination is None:
    return list(tensors)
  with tf.device(destination):
    return [None if t is None else tf.identity(t) for t in tensors]


def _gated(tensors: Sequence[Any], gate: Sequence[tf.Tensor]) -> list[Any]:
  """The tensors, passed on only once everything in `gate` is ready.

  One tf.group, so that each identity carries one control input (not one per tensor
  waited for: that made tracing quadratic).
  """
  if not gate:
    return list(tensors)
  with tf.control_dependencies([tf.group(*gate)]):
    return [None if t is None else tf.identity(t) for t in tensors]


def call_infos(example_offsets: Sequence[int], base_offset: Any = 0) -> list[tf.Tensor]:
  """Per micro-batch m, int64 [m, base_offset + example_offsets[m]]: what a cell call
  needs to know besides its inputs and the step, as one tensor that Grappler does not
  see as a constant.

  A call with a constant input is *specialized* by Grappler's function optimizer: a
  copy of the body with the constant folded in, optimized on its own, for every call,
  so the first step grows with layers × micro-batches (bench/startup_time.py;
  docs/benchmarks.md has the figures).
  PlaceholderWithDefault is never constant-folded, so each call keeps the shared body;
  one for all micro-batches keeps the step graph small.
  """
  rows = [[m, offset] for m, offset in enumerate(example_offsets)]
  if isinstance(base_offset, int):
    rows = [[m, offset + base_offset] for m, offset in rows]
  packed = tf.raw_ops.PlaceholderWithDefault(input=tf.constant(rows, tf.int64),
                                             shape=[len(rows), 2])
  if not isinstance(base_offset, int):
    packed += tf.stack([tf.constant(0, tf.int64), tf.cast(base_offset, tf.int64)])
  return tf.unstack(packed)


def weighted_mean(parts: Sequence[Metrics]) -> Metrics:
  """Metrics (value, weight) of parts of a batch (micro-batches, replicas' shards) →
  the whole batch's (weighted mean, summed weight)."""
  if len(parts) == 1:
    return dict(parts[0])
  result = {}
  for name in parts[0]:
    values = [tf.cast(m[name][0], tf.float32) for m in parts]
    weights = [tf.cast(m[name][1], tf.float32) for m in parts]
    total = tf.add_n(weights)
    result[name] = (tf.math.divide_no_nan(tf.add_n([v * w for v, w in zip(values, weights)]),
                                          total), total)
  return result


@tf.autograph.experimental.do_not_convert  # plain Python on static values
def run(cells: Sequence[CellFunctions], plan: PipelineSchedule, micro_inputs: Sequence[Any],
        micro_head_inputs: Sequence[Any], example_offsets: Sequence[int]) -> StepGradients:
  """Builds the calls of one training step in the order `plan` gives each cell.

  micro_inputs[m]: nested tensors [b_m, ...] on cells[0]'s device; micro_head_inputs[m]:
  the head's nested tensors [b_m, ...] on the last cell's device; example_offsets[m]:
  the position of micro-batch m's first example in the batch.
  """
  ctx = base_layer.current_context()
  num_cells = len(cells)
  if plan.num_cells != num_cells or plan.num_micro_batches != len(micro_inputs):
    raise ValueError(f"schedule for {plan.num_cells} cells × {plan.num_micro_batches} "
                     f"micro-batches given {num_cells} cells × {len(micro_inputs)}")
  step = tf.cast(ctx.step, tf.int64)
  with tf.device(cells[0].device):
    infos = call_infos(example_offsets, ctx.example_offset)
  devices = [cell.device for cell in cells]
  handed_on: dict[tuple[int, int], list[Any]] = {}   # F(k, m)'s outputs on device k+1
  grads_handed_back: dict[tuple[int, int], list[Any]] = {}  # B(k, m)'s on device k−1
  saved = {}
  metrics: list[Metrics | None] = [None] * len(micro_inputs)
  sums: list[list[tf.Tensor] | None] = [None] * num_cells
  gate: list[list[tf.Tensor]] = [[] for _ in cells]
  deferred: list[list[Any]] = [[] for _ in cells]  # backwards since the last weight call
  backwards_left = [plan.num_micro_batches] * num_cells
  for k, action in plan.execution_order():
    cell, m = cells[k], action.micro_batch
    with tf.device(cell.device):
      span = timeline.SpanRecorder(ctx.spans, k, m, action.phase, cell.device)
      if action.phase == FORWARD:
        x = micro_inputs[m] if k == 0 else handed_on.pop((k - 1, m))
        flat = span.begin(_gated(tf.nest.flatten(x), gate[k]))
        outputs, stats, saved[(k, m)] = cell.forward(
            tf.nest.pack_sequence_as(x, flat),
            micro_head_inputs[m] if k == num_cells - 1 else None, step, infos[m])
        if ctx.layer_stats is not None:
          ctx.layer_stats.extend(stats)
        flat_out = span.end(tf.nest.flatten(outputs))
        if k + 1 < num_cells:
          handed_on[(k, m)] = tf.nest.pack_sequence_as(
              outputs, arrived(flat_out, devices[k + 1]))
          gate[k] = [t for t in tf.nest.flatten(handed_on[(k, m)]) if t is not None]
        else:
          metrics[m] = tf.nest.pack_sequence_as(outputs, flat_out)
          gate[k] = list(flat_out)
      else:
        if k == num_cells - 1:
          loss, weight = metrics[m]["loss"]
          seeds = [tf.cast(tf.stop_gradient(weight), loss.dtype)]
        else:
          seeds = [g for g in grads_handed_back.pop((k + 1, m)) if g is not None]
        seeds = span.begin(_gated(seeds, gate[k]))
        if sums[k] is None:
          sums[k] = cell.zero_gradients()
        input_grads, sums[k], weight_inputs = cell.backward(saved.pop((k, m)), seeds, sums[k],
                                                            step, infos[m])
        input_grads = span.end(input_grads, also_wait_for=sums[k])
        gate[k] = list(sums[k]) + ([span.end_stamp] if span.end_stamp is not None else [])
        if k > 0:
          grads_handed_back[(k, m)] = arrived(input_grads, devices[k - 1])
          gate[k] += [g for g in grads_handed_back[(k, m)] if g is not None]
        backwards_left[k] -= 1
        if cell.defers_weight_gradients:
          deferred[k].append(weight_inputs)
          if len(deferred[k]) == cell.weight_gradient_group or not backwards_left[k]:
            # After the backward's input gradients have left: they are what the
            # previous cell waits for; the weight gradients are only summed.
            weight_span = timeline.SpanRecorder(ctx.spans, k, m, WEIGHT_GRADIENT,
                                                cell.device)
            sums_in = weight_span.begin(_gated(sums[k], gate[k]))
            sums[k] = weight_span.end(cell.weight_gradients(deferred[k], sums_in))
            deferred[k] = []
            gate[k] = list(sums[k]) + ([weight_span.end_stamp]
                                       if weight_span.end_stamp is not None else [])
  with tf.device(devices[-1]):
    batch_metrics = weighted_mean(metrics)
    inverse_weight = tf.math.divide_no_nan(1.0, tf.add_n(
        [tf.cast(m["loss"][1], tf.float32) for m in metrics]))
  variables: list[tf.Variable] = []
  gradients: list[tf.Tensor] = []
  position: dict[Any, int] = {}
  for cell, sum_k in zip(cells, sums):
    with tf.device(cell.device):
      scale = tf.identity(inverse_weight)
      for v, g in zip(cell.variables, sum_k):
        g = g * tf.cast(scale, g.dtype)
        if v.ref() in position:  # a variable shared by two cells (tied weights)
          gradients[position[v.ref()]] += g
        else:
          position[v.ref()] = len(variables)
          variables.append(v)
          gradients.append(g)
  return StepGradients(batch_metrics, variables, gradients)
