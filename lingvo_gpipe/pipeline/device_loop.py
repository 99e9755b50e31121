"""One loop per cell: the cell's device runs its schedule's action list, one per iteration.

For cell k, on its device, one functional While (`tf_internals.unlowered`) walks a
constant table with one row per action of `plan.actions[k]`, and a Case picks the
action's branch:

  F m   inputs: micro-batch m sliced from the batch (k = 0) or received from cell k−1
        → CellFunctions.forward → outputs sent to cell k+1 (last cell: the head's
        metrics kept per micro-batch); what the backward needs is stashed in a slot,
        the batch statistics kept per micro-batch
  B m   output gradient: received from cell k+1 (last cell: micro-batch m's loss
        weight) → CellFunctions.backward on the stashed slot → input gradients sent to
        cell k−1; variable gradients added to the running sums (loop variables)
  W m   (cells that defer weight gradients) the projections' inputs and output
        gradients of the backwards since the previous W, concatenated → one product
        each, added to the sums

An uneven split has two micro-batch shapes; each has its own F and B branch (the
cell's functions are traced once per shape). Each action's start and end are
timestamped on the device (the measured timeline).

The loop carries the sums, one stash slot per micro-batch the cell holds in flight
(`PipelineSchedule.max_in_flight`: M for gpipe, at most K−k for 1f1b), the head's
per-micro-batch metrics, the statistics and the timestamps; the step graph holds one
loop per cell whatever M is (`tests/pipeline_graph_test.py`).

The loss of the whole batch is the weighted mean of the micro-batch losses,
Σ w_m·loss_m / Σ w_m, with w_m the loss's weight (examples, or target tokens): each
backward is seeded with w_m, and the summed gradients are divided by Σ w_m once at
the end, so the update is the unpartitioned model's on the whole batch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from lingvo_gpipe.core import base_layer
from lingvo_gpipe.pipeline import channels, tf_internals, timeline
from lingvo_gpipe.pipeline.cell_function import CallSignature, CellFunctions
from lingvo_gpipe.pipeline.schedule import (
  BACKWARD,
  FORWARD,
  PipelineSchedule,
)

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


def weighted_mean(parts: Sequence[Metrics]) -> Metrics:
  """Metrics (value, weight) of parts of a batch (replicas' shards) → the whole
  batch's (weighted mean, summed weight)."""
  if len(parts) == 1:
    return dict(parts[0])
  return {name: _weighted_mean(tf.stack([tf.cast(m[name][0], tf.float32) for m in parts]),
                               tf.stack([tf.cast(m[name][1], tf.float32) for m in parts]))
          for name in parts[0]}


def _weighted_mean(values: tf.Tensor, weights: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
  """values, weights [n] → (Σ v·w / Σ w, Σ w)."""
  total = tf.reduce_sum(weights)
  return tf.math.divide_no_nan(tf.reduce_sum(values * weights), total), total


# Columns of a cell's action table.
BRANCH, MICRO_BATCH, OFFSET, SLOT, GROUP_POSITION = range(5)


@dataclasses.dataclass
class ActionTable:
  """A cell's actions as loop data: rows int32 [A, 5] (branch, micro-batch, example
  offset, stash slot, position in the weight-gradient group); the F branch of shape
  class c is 2c, its B branch 2c+1, W is 2C."""
  rows: np.ndarray
  num_slots: int
  keys: np.ndarray  # float64 [A, 3]: cell, micro-batch, phase index (timeline.PHASES)


def action_table(plan: PipelineSchedule, k: int, shape_class: Sequence[int],
                 offsets: Sequence[int], num_classes: int) -> ActionTable:
  """Cell k's table. Slots are given out lowest-free-first at each F and freed at its
  B, so the cell needs max_in_flight(k) of them."""
  rows, keys, free, slot_of, group_position = [], [], [], {}, 0
  num_slots = 0
  for action in plan.actions[k]:
    m = action.micro_batch
    if action.phase == FORWARD:
      if not free:
        free.append(num_slots)
        num_slots += 1
      slot_of[m] = min(free)
      free.remove(slot_of[m])
      rows.append([2 * shape_class[m], m, offsets[m], slot_of[m], 0])
    elif action.phase == BACKWARD:
      free.append(slot_of[m])
      rows.append([2 * shape_class[m] + 1, m, offsets[m], slot_of[m], group_position])
      group_position += 1
    else:
      rows.append([2 * num_classes, m, offsets[m], 0, 0])
      group_position = 0
    keys.append([k, m, timeline.PHASES.index(action.phase)])
  return ActionTable(np.array(rows, np.int32).reshape(-1, 5), num_slots,
                     np.array(keys, np.float64).reshape(-1, 3))


def _slice(flat: Sequence[tf.Tensor], offset: tf.Tensor, size: int) -> list[tf.Tensor]:
  """Rows offset..offset+size of each tensor (a micro-batch of static size)."""
  out = []
  for t in flat:
    rank = t.shape.rank
    begin = tf.concat([tf.reshape(tf.cast(offset, tf.int64), [1]),
                       tf.zeros([rank - 1], tf.int64)], 0)
    out.append(tf.slice(t, begin, tf.constant([size] + [-1] * (rank - 1), tf.int64)))
  return out


def _list(specs: Sequence[tf.TensorSpec], size: int) -> list[tf.TensorArray]:
  """One TensorArray per spec, `size` elements of that shape."""
  return [tf.TensorArray(s.dtype, size=size, element_shape=s.shape) for s in specs]


def _group(specs: Sequence[tf.TensorSpec]) -> list[tf.TensorArray]:
  """Empty growable TensorArrays for a weight-gradient group: [n, ...] elements whose
  n differs between micro-batch shapes."""
  return [tf.TensorArray(s.dtype, size=0, dynamic_size=True, infer_shape=False,
                         element_shape=tf.TensorShape([None]).concatenate(s.shape[1:]))
          for s in specs]


def _after(tensors: Sequence[Any], deps: Sequence[Any]) -> list[Any]:
  """`tensors`, passed on once `deps` have run."""
  with tf.control_dependencies([d for d in deps if d is not None]):
    return [tf.identity(t) for t in tensors]


@dataclasses.dataclass
class CellLoop:
  """What cell k's loop needs besides its table: the cell, its call signatures per
  micro-batch shape, the hand-offs to its neighbours and the step's inputs."""
  cell: CellFunctions
  k: int
  signatures: list[CallSignature]   # per shape class
  sizes: list[int]                  # per shape class, its micro-batch size
  table: ActionTable
  num_micro_batches: int
  previous: channels.Link | None     # to cell k−1
  following: channels.Link | None    # to cell k+1
  inputs: list[tf.Tensor]            # cell 0: the flat batch
  head_inputs: list[tf.Tensor]       # last cell: the head's flat batch
  step: tf.Tensor
  base_offset: Any

  # -- the loop's state ----------------------------------------------------------------

  def initial_state(self) -> dict[str, Any]:
    sig0 = self.signatures[0]
    return {
        "sums": self.cell.zero_gradients(),
        "stash": [_list(sig.saved, self.table.num_slots) for sig in self.signatures],
        "outputs": (_list(sig0.outputs, self.num_micro_batches) if self.cell.head is not None
                    else []),
        "stats": _list(sig0.stats, self.num_micro_batches),
        "product_inputs": _group(sig0.product_inputs),
        "product_grads": _group(sig0.product_grads),
        "times": tf.TensorArray(tf.float64, size=len(self.table.rows), element_shape=[2]),
    }

  # -- the actions ---------------------------------------------------------------------

  def _call_info(self, m: tf.Tensor, offset: tf.Tensor) -> tf.Tensor:
    return tf.stack([tf.cast(m, tf.int64),
                     tf.cast(self.base_offset, tf.int64) + tf.cast(offset, tf.int64)])

  def forward(self, c: int, state: dict, i, m, offset, slot, _) -> dict:
    sig, state = self.signatures[c], dict(state)
    if self.previous is None:
      flat = _slice(self.inputs, offset, self.sizes[c])
    else:
      flat = self.previous.forward.receive(sig.inputs)
    head = _slice(self.head_inputs, offset, self.sizes[c]) if self.cell.head else []
    start = _timestamp(flat + head)
    flat, head = _after(flat, [start]), _after(head, [start])
    outputs, stats, saved = self.cell.forward(sig, flat, head, self.step,
                                              self._call_info(m, offset))
    if self.following is not None:
      sent = self.following.forward.send(outputs)
    else:
      sent = []
      state["outputs"] = [ta.write(m, t) for ta, t in zip(state["outputs"], outputs)]
    state["stash"] = list(state["stash"])
    state["stash"][c] = [ta.write(slot, t) for ta, t in zip(state["stash"][c], saved)]
    state["stats"] = [ta.write(m, t) for ta, t in zip(state["stats"], stats)]
    end = _timestamp(list(outputs) + list(saved) + list(stats), sent)
    state["times"] = state["times"].write(i, tf.stack([start, end]))
    return state

  def backward(self, c: int, state: dict, i, m, offset, slot, position) -> dict:
    sig, cell, state = self.signatures[c], self.cell, dict(state)
    if self.following is None:
      loss_index, weight_index = cell.loss_positions()
      weight = state["outputs"][weight_index].read(m)
      loss_spec = sig.outputs[loss_index]
      seeds = [tf.cast(weight, loss_spec.dtype)]
    else:
      seeds = self.following.backward.receive(
          [s for s in sig.outputs if s.dtype.is_floating])
    saved = [ta.read(slot) for ta in state["stash"][c]]
    start = _timestamp(seeds + saved)
    seeds = _after(seeds, [start])
    input_grads, state["sums"], product_inputs, product_grads = cell.backward(
        sig, saved, seeds, state["sums"], self.step, self._call_info(m, offset))
    sent = self.previous.backward.send(input_grads) if self.previous is not None else []
    state["product_inputs"] = [ta.write(position, t) for ta, t in
                               zip(state["product_inputs"], product_inputs)]
    state["product_grads"] = [ta.write(position, t) for ta, t in
                              zip(state["product_grads"], product_grads)]
    end = _timestamp(list(input_grads) + list(state["sums"]), sent)
    state["times"] = state["times"].write(i, tf.stack([start, end]))
    return state

  def weight_gradient(self, state: dict, i, *_) -> dict:
    state = dict(state)
    start = _timestamp(list(state["sums"]))
    sig = self.signatures[0]
    inputs = [_concat(ta, s) for ta, s in zip(state["product_inputs"], sig.product_inputs)]
    grads = [_concat(ta, s) for ta, s in zip(state["product_grads"], sig.product_grads)]
    state["sums"] = self.cell.weight_gradients(_after(state["sums"], [start]), inputs, grads)
    state["product_inputs"] = _group(sig.product_inputs)
    state["product_grads"] = _group(sig.product_grads)
    end = _timestamp(list(state["sums"]))
    state["times"] = state["times"].write(i, tf.stack([start, end]))
    return state

  # -- the loop ------------------------------------------------------------------------

  def build(self) -> dict[str, Any]:
    """The loop, under tf.device(cell's device): its final state."""
    num_classes = len(self.signatures)
    table = tf.constant(self.table.rows)

    def body(i, state):
      row = tf.unstack(tf.gather(table, i))
      args = (i, row[MICRO_BATCH], row[OFFSET], row[SLOT], row[GROUP_POSITION])
      branches = []
      for c in range(num_classes):
        branches.append(lambda c=c: self.forward(c, state, *args))
        branches.append(lambda c=c: self.backward(c, state, *args))
      if self.cell.defers_weight_gradients:
        branches.append(lambda: self.weight_gradient(state, *args))
      new_state = tf_internals.unlowered(
          lambda: tf.switch_case(row[BRANCH], branches))
      return i + 1, new_state

    num_actions = len(self.table.rows)
    with tf.device(self.cell.device):
      _, final = tf_internals.unlowered(lambda: tf.while_loop(
          lambda i, _: i < num_actions, body, (tf.constant(0, tf.int32),
                                               self.initial_state())))
    return final


def _concat(ta: tf.TensorArray, spec: tf.TensorSpec) -> tf.Tensor:
  """A group's [n_g, ...] elements concatenated → [Σ n_g, ...]."""
  out = ta.concat()
  out.set_shape(tf.TensorShape([None]).concatenate(spec.shape[1:]))
  return out


def _timestamp(wait_for: Sequence[Any], also: Sequence[Any] = ()) -> tf.Tensor:
  """The time once `wait_for` (tensors) and `also` (ops) are done."""
  deps = [t for t in list(wait_for) + list(also) if t is not None]
  with tf.control_dependencies(deps):
    return tf.timestamp()


def _shape_classes(sizes: Sequence[int]) -> tuple[list[int], list[int]]:
  """(the distinct micro-batch sizes, largest first; each micro-batch's class)."""
  distinct = sorted(set(sizes), reverse=True)
  return distinct, [distinct.index(s) for s in sizes]


def _with_batch(structure: Any, size: int) -> Any:
  return tf.nest.map_structure(
      lambda t: tf.TensorSpec([size] + t.shape[1:].as_list(), t.dtype), structure)


@tf.autograph.experimental.do_not_convert  # plain Python on static values
def run(cells: Sequence[CellFunctions], plan: PipelineSchedule, inputs: Any, head_inputs: Any,
        sizes: Sequence[int], offsets: Sequence[int], link_prefix: str) -> StepGradients:
  """One training step: a loop per cell, each running plan.actions[k].

  inputs: the pipeline's nested inputs [B, ...] on cells[0]'s device; head_inputs: the
  head's nested tensors [B, ...] on the last cell's device; sizes, offsets: each
  micro-batch's size and first example's position in the batch. Batch statistics go
  to the StepContext's layer_stats, the loops' timestamps to its spans.
  """
  ctx = base_layer.current_context()
  num_cells = len(cells)
  if plan.num_cells != num_cells or plan.num_micro_batches != len(sizes):
    raise ValueError(f"schedule for {plan.num_cells} cells × {plan.num_micro_batches} "
                     f"micro-batches given {num_cells} cells × {len(sizes)}")
  step = tf.cast(ctx.step, tf.int64)
  inputs, head_inputs = tf.nest.map_structure(tf.convert_to_tensor, (inputs, head_inputs))
  class_sizes, shape_class = _shape_classes(sizes)
  # Trace each cell for each micro-batch shape, in order: cell k's outputs are cell
  # k+1's inputs.
  signatures: list[list[CallSignature]] = []
  for k, cell in enumerate(cells):
    per_class = []
    for c, size in enumerate(class_sizes):
      cell_inputs = (_with_batch(inputs, size) if k == 0 else tf.nest.pack_sequence_as(
          cells[k - 1].output_structure, signatures[k - 1][c].outputs))
      head = _with_batch(head_inputs, size) if cell.head is not None else None
      with tf.device(cell.device):
        per_class.append(cell.signature(cell_inputs, head))
    signatures.append(per_class)
  links = channels.links(link_prefix, [cell.device for cell in cells])
  finals = []
  for k, cell in enumerate(cells):
    table = action_table(plan, k, shape_class, offsets, len(class_sizes))
    loop = CellLoop(cell, k, signatures[k], class_sizes, table, len(sizes),
                    links[k - 1] if k > 0 else None, links[k] if k + 1 < num_cells else None,
                    tf.nest.flatten(inputs) if k == 0 else [],
                    tf.nest.flatten(head_inputs) if cell.head is not None else [],
                    step, ctx.example_offset)
    final = loop.build()
    finals.append(final)
    with tf.device(cell.device):
      if ctx.layer_stats is not None and final["stats"]:
        per_micro_batch = zip(*[tf.unstack(ta.stack()) for ta in final["stats"]])
        for flat_stats in per_micro_batch:
          ctx.layer_stats.extend(cell.unflatten_stats(list(flat_stats)))
      if ctx.spans is not None:
        ctx.spans.append(timeline.CellTimes(
            cell.device, tf.concat([final["times"].stack(),
                                    tf.constant(table.keys, tf.float64)], axis=1)))
  last = cells[-1]
  with tf.device(last.device):
    per_micro_batch = tf.nest.pack_sequence_as(
        last.output_structure, [ta.stack() for ta in finals[-1]["outputs"]])
    metrics = {name: _weighted_mean(tf.cast(value, tf.float32), tf.cast(weight, tf.float32))
               for name, (value, weight) in per_micro_batch.items()}
    inverse_weight = tf.math.divide_no_nan(1.0, metrics["loss"][1])
  variables: list[tf.Variable] = []
  gradients: list[tf.Tensor] = []
  position: dict[Any, int] = {}
  for cell, final in zip(cells, finals):
    with tf.device(cell.device):
      scale = tf.identity(inverse_weight)
      sums = cell.layout.unflatten([s * tf.cast(scale, s.dtype) for s in final["sums"]])
    for v, g in zip(cell.variables, sums):
      if v.ref() in position:  # a variable shared by two cells (tied weights)
        gradients[position[v.ref()]] += g
      else:
        position[v.ref()] = len(variables)
        variables.append(v)
        gradients.append(g)
  return StepGradients(metrics, variables, gradients)
