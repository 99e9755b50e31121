"""One loop per device: the device runs its cells' actions in the schedule's order.

For device d, one functional While (`tf_internals.unlowered`) walks a constant table
with one row per entry of `plan.device_orders[d]` (usually one cell's list; several
cells' with interleaved virtual stages), and a Case picks the action's branch:

  F m   inputs: micro-batch m sliced from the batch (k = 0) or received from cell k−1
        → CellFunctions.forward → outputs sent to cell k+1 (last cell: the head's
        metrics kept per micro-batch); what the backward needs is stashed in a slot,
        the batch statistics kept per micro-batch
  B m   output gradient: received from cell k+1 (last cell: micro-batch m's loss
        weight) → CellFunctions.backward on the stashed slot → input gradients sent to
        cell k−1; variable gradients added to the running sums (loop variables); in a
        cell that defers weight gradients, the projections' inputs and output
        gradients kept in a product slot
  W m   (cells that defer weight gradients) the product slots of the backwards since
        the cell's previous W, up to m's, concatenated → one product per projection,
        added to the sums

An uneven split has two micro-batch shapes; each has its own F and B branch (the
cell's functions are traced once per shape); W has a branch per group size. Each
action's start and end are timestamped on the device (the measured timeline).

The loop carries, per cell, the sums, one stash slot per micro-batch the cell holds
in flight (`PipelineSchedule.max_in_flight`: M for gpipe, at most K−k for 1f1b), one
product slot per backward awaiting its W (`max_awaiting_weights`), the head's
per-micro-batch metrics and the statistics; and the device's timestamps. The step
graph holds one loop per device whatever M is (`tests/pipeline_graph_test.py`).

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


# Columns of a device's action table.
BRANCH, MICRO_BATCH, OFFSET, SLOT, PRODUCT_SLOT, RECEIVE = range(6)
NO_RECEIVE = -1  # RECEIVE of an action whose inputs come from no other cell

# What an action receives from a neighbouring cell: (cell, FORWARD: its inputs from
# cell k−1 / BACKWARD: its output gradients from cell k+1, micro-batch shape class).
ReceiveKind = tuple[int, str, int]


@dataclasses.dataclass(frozen=True)
class Branches:
  """The Case branches of one cell in its device's loop, from `first` on: F and B of
  each micro-batch shape class c (first + 2c, first + 2c + 1), then W of each group
  size the cell's W actions have (in `weight_sizes` order)."""
  first: int
  num_classes: int
  weight_sizes: tuple[int, ...]

  def forward(self, c: int) -> int:
    return self.first + 2 * c

  def backward(self, c: int) -> int:
    return self.first + 2 * c + 1

  def weight_gradient(self, n: int) -> int:
    return self.first + 2 * self.num_classes + self.weight_sizes.index(n)

  @property
  def end(self) -> int:
    return self.first + 2 * self.num_classes + len(self.weight_sizes)


@dataclasses.dataclass
class ActionTable:
  """A device's actions as loop data: rows int32 [A, 6] (branch, micro-batch, example
  offset, stash slot, product slot, what it receives: an index into `receives` or
  NO_RECEIVE), one per entry of the device's order; per cell on the device, its
  branches and how many stash and product slots it needs."""
  rows: np.ndarray
  branches: dict[int, Branches]
  stash_slots: dict[int, int]
  product_slots: dict[int, int]
  receives: list[ReceiveKind]
  keys: np.ndarray  # float64 [A, 3]: cell, micro-batch, phase index (timeline.PHASES)


def action_table(plan: PipelineSchedule, d: int, shape_class: Sequence[int],
                 offsets: Sequence[int], num_classes: int) -> ActionTable:
  """Device d's table.

  Stash slots (what a backward needs) are given out per cell lowest-free-first at
  each F and freed at its B, so cell k needs max_in_flight(k) of them. Product slots
  (a deferred backward's projection inputs and output gradients, kept for its W) go
  round a ring of max_awaiting_weights(k): the i-th backward of the cell writes slot
  i mod R, and a W reads its group's consecutive backwards' slots.
  """
  cells = sorted({k for k, _ in plan.device_orders[d]})
  branches, first = {}, 0
  for k in cells:
    sizes = tuple(sorted({len(g) for g in plan.weight_groups(k).values()}))
    branches[k] = Branches(first, num_classes, sizes)
    first = branches[k].end
  stash_slots = dict.fromkeys(cells, 0)
  product_slots = {k: plan.max_awaiting_weights(k) for k in cells}
  free: dict[int, list[int]] = {k: [] for k in cells}
  slot_of: dict[tuple[int, int], int] = {}
  backward_index: dict[tuple[int, int], int] = {}  # (cell, m) → its position among B's
  backwards_run = dict.fromkeys(cells, 0)
  groups = {k: plan.weight_groups(k) for k in cells}
  receives = [(k, phase, c) for k in cells for c in range(num_classes)
              for phase, neighbour in ((FORWARD, k - 1), (BACKWARD, k + 1))
              if 0 <= neighbour < plan.num_cells]
  rows, keys = [], []
  for k, action in plan.device_orders[d]:
    m, b = action.micro_batch, branches[k]
    if action.phase == FORWARD:
      if not free[k]:
        free[k].append(stash_slots[k])
        stash_slots[k] += 1
      slot_of[(k, m)] = min(free[k])
      free[k].remove(slot_of[(k, m)])
      rows.append([b.forward(shape_class[m]), m, offsets[m], slot_of[(k, m)], 0,
                   _receive_index(receives, (k, FORWARD, shape_class[m]))])
    elif action.phase == BACKWARD:
      free[k].append(slot_of[(k, m)])
      index = backward_index[(k, m)] = backwards_run[k]
      backwards_run[k] += 1
      product_slot = index % product_slots[k] if product_slots[k] else 0
      rows.append([b.backward(shape_class[m]), m, offsets[m], slot_of[(k, m)], product_slot,
                   _receive_index(receives, (k, BACKWARD, shape_class[m]))])
    else:
      group = groups[k][m]
      rows.append([b.weight_gradient(len(group)), m, offsets[m], 0,
                   backward_index[(k, group[0])] % product_slots[k], NO_RECEIVE])
    keys.append([k, m, timeline.PHASES.index(action.phase)])
  return ActionTable(np.array(rows, np.int32).reshape(-1, 6), branches, stash_slots,
                     product_slots, receives, np.array(keys, np.float64).reshape(-1, 3))


def _receive_index(receives: list[ReceiveKind], kind: ReceiveKind) -> int:
  return receives.index(kind) if kind in receives else NO_RECEIVE


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


def _slots(specs: Sequence[tf.TensorSpec], size: int) -> list[tf.TensorArray]:
  """One TensorArray per spec, `size` slots that `_take` empties once read (a read
  element stays alive until its slot is written again otherwise); their batch size
  may differ between micro-batch shapes."""
  return [tf.TensorArray(s.dtype, size=size, infer_shape=False,
                         element_shape=tf.TensorShape([None]).concatenate(s.shape[1:]))
          if s.shape.rank else tf.TensorArray(s.dtype, size=size, element_shape=s.shape)
          for s in specs]


def _take(slots: Sequence[tf.TensorArray], index: Any, specs: Sequence[tf.TensorSpec]
          ) -> tuple[list[tf.Tensor], list[tf.TensorArray]]:
  """Slot `index` of each TensorArray of `_slots`, and the arrays with the slot
  emptied (scalars stay)."""
  values, emptied = [], []
  for ta, spec in zip(slots, specs):
    value = ta.read(index)
    value.set_shape(spec.shape)
    values.append(value)
    if spec.shape.rank:
      with tf.control_dependencies([value]):
        ta = ta.write(index, tf.zeros([0] + spec.shape[1:].as_list(), spec.dtype))
    emptied.append(ta)
  return values, emptied


def _read_group(ring: Sequence[tf.TensorArray], size: int, first: tf.Tensor, n: int,
                specs: Sequence[tf.TensorSpec]
                ) -> tuple[list[tf.Tensor], list[tf.TensorArray]]:
  """Slots first, first+1, ... (mod the ring's `size`) of each ring, concatenated
  along the batch: [Σ n_i, ...] per spec; and the rings with those slots emptied."""
  parts: list[list[tf.Tensor]] = [[] for _ in ring]
  ring = list(ring)
  unknown_batch = [tf.TensorSpec([None] + s.shape[1:].as_list(), s.dtype) for s in specs]
  for i in range(n):
    taken, ring = _take(ring, tf.math.floormod(first + i, size), unknown_batch)
    for part, t in zip(parts, taken):
      part.append(t)
  return [tf.concat(p, axis=0) if n > 1 else p[0] for p in parts], ring


def _after(tensors: Sequence[Any], deps: Sequence[Any]) -> list[Any]:
  """`tensors`, passed on once `deps` have run."""
  with tf.control_dependencies([d for d in deps if d is not None]):
    return [tf.identity(t) for t in tensors]


@dataclasses.dataclass
class CellLoop:
  """What cell k's actions need in its device's loop: the cell, its call signatures
  per micro-batch shape, its slots, the hand-offs to its neighbours and the step's
  inputs. Each action takes the cell's part of the loop state and returns it updated,
  with its start and end timestamps."""
  cell: CellFunctions
  k: int
  signatures: list[CallSignature]   # per shape class
  sizes: list[int]                  # per shape class, its micro-batch size
  branches: Branches
  stash_slots: int
  product_slots: int
  num_micro_batches: int
  previous: channels.Link | None     # to cell k−1
  following: channels.Link | None    # to cell k+1
  inputs: list[tf.Tensor]            # cell 0: the flat batch
  head_inputs: list[tf.Tensor]       # last cell: the head's flat batch
  step: tf.Tensor
  base_offset: Any

  # -- the cell's state ----------------------------------------------------------------

  def initial_state(self) -> dict[str, Any]:
    sig0 = self.signatures[0]
    return {
        "sums": self.cell.zero_gradients(),
        "stash": [_slots(sig.saved, self.stash_slots) for sig in self.signatures],
        "outputs": (_list(sig0.outputs, self.num_micro_batches) if self.cell.head is not None
                    else []),
        "stats": _list(sig0.stats, self.num_micro_batches),
        "product_inputs": _slots(sig0.product_inputs, self.product_slots),
        "product_grads": _slots(sig0.product_grads, self.product_slots),
    }

  def actions(self) -> list[tuple[int, ReceiveKind | None, Any]]:
    """Of each branch: its index, what it receives (None: nothing) and
    action(state, received, m, offset, slot, product_slot)."""
    out = []
    for c in range(len(self.signatures)):
      out.append((self.branches.forward(c), (self.k, FORWARD, c) if self.previous else None,
                  lambda *a, c=c: self.forward(c, *a)))
      out.append((self.branches.backward(c), (self.k, BACKWARD, c) if self.following else None,
                  lambda *a, c=c: self.backward(c, *a)))
    for n in self.branches.weight_sizes:
      out.append((self.branches.weight_gradient(n), None,
                  lambda *a, n=n: self.weight_gradient(n, *a)))
    return out

  def receive_specs(self, phase: str, c: int) -> list[tf.TensorSpec]:
    """What a forward (inputs) or backward (output gradients) of shape class c receives."""
    sig = self.signatures[c]
    return sig.inputs if phase == FORWARD else [s for s in sig.outputs if s.dtype.is_floating]

  def receive(self, phase: str, c: int) -> list[tf.Tensor]:
    """The hand-off a forward or backward of shape class c takes, received."""
    channel = self.previous.forward if phase == FORWARD else self.following.backward
    return channel.receive(self.receive_specs(phase, c))

  # -- the actions ---------------------------------------------------------------------

  def _call_info(self, m: tf.Tensor, offset: tf.Tensor) -> tf.Tensor:
    return tf.stack([tf.cast(m, tf.int64),
                     tf.cast(self.base_offset, tf.int64) + tf.cast(offset, tf.int64)])

  def forward(self, c: int, state: dict, received, m, offset, slot, _):
    sig, state = self.signatures[c], dict(state)
    if self.previous is None:
      flat = _slice(self.inputs, offset, self.sizes[c])
    else:
      flat = list(received)
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
    return state, start, end

  def backward(self, c: int, state: dict, received, m, offset, slot, product_slot):
    sig, cell, state = self.signatures[c], self.cell, dict(state)
    if self.following is None:
      loss_index, weight_index = cell.loss_positions()
      weight = state["outputs"][weight_index].read(m)
      loss_spec = sig.outputs[loss_index]
      seeds = [tf.cast(weight, loss_spec.dtype)]
    else:
      seeds = list(received)
    state["stash"] = list(state["stash"])
    saved, state["stash"][c] = _take(state["stash"][c], slot, sig.saved)
    start = _timestamp(seeds + saved)
    seeds = _after(seeds, [start])
    input_grads, state["sums"], product_inputs, product_grads = cell.backward(
        sig, saved, seeds, state["sums"], self.step, self._call_info(m, offset))
    sent = self.previous.backward.send(input_grads) if self.previous is not None else []
    state["product_inputs"] = [ta.write(product_slot, t) for ta, t in
                               zip(state["product_inputs"], product_inputs)]
    state["product_grads"] = [ta.write(product_slot, t) for ta, t in
                              zip(state["product_grads"], product_grads)]
    end = _timestamp(list(input_grads) + list(state["sums"]) + list(product_inputs)
                     + list(product_grads), sent)
    return state, start, end

  def weight_gradient(self, n: int, state: dict, _received, _m, _offset, _slot, first):
    state = dict(state)
    start = _timestamp(list(state["sums"]))
    sig = self.signatures[0]
    inputs, state["product_inputs"] = _read_group(
        state["product_inputs"], self.product_slots, first, n, sig.product_inputs)
    grads, state["product_grads"] = _read_group(
        state["product_grads"], self.product_slots, first, n, sig.product_grads)
    state["sums"] = self.cell.weight_gradients(_after(state["sums"], [start]), inputs, grads)
    end = _timestamp(list(state["sums"]))
    return state, start, end


@dataclasses.dataclass
class DeviceLoop:
  """One device's loop over its table: the Case of each row picks one action of one
  of the device's cells.

  Hand-offs are received one action ahead: while iteration i runs its action, a
  second Case receives what action i+1 takes (if anything) into the loop's inbox, so
  the receive's round trip (a remote worker's RecvTensor call, issued only when the
  Recv op runs) overlaps the computation instead of following it. The inbox holds one
  hand-off per kind (ActionTable.receives) until the next of that kind replaces it.
  """
  device: str | None
  cells: dict[int, CellLoop]
  table: ActionTable

  def _receive(self, kind: ReceiveKind) -> list[tf.Tensor]:
    k, phase, c = kind
    return self.cells[k].receive(phase, c)

  def _prefetch(self, inbox: list[list[tf.Tensor]], index: tf.Tensor) -> list[list[tf.Tensor]]:
    """`inbox` with the hand-off of receive kind `index` received (NO_RECEIVE: as is)."""
    def into(q: int):
      updated = list(inbox)
      updated[q] = self._receive(self.table.receives[q])
      return updated
    branches = [lambda: list(inbox)] + [lambda q=q: into(q)
                                       for q in range(len(self.table.receives))]
    return tf_internals.unlowered(lambda: tf.switch_case(index + 1, branches))

  def build(self) -> tuple[dict[int, dict[str, Any]], tf.TensorArray]:
    """The loop, under tf.device(device): each cell's final state, and the
    timestamps of its actions ([A, 2], in table order)."""
    rows = self.table.rows
    # One more row, receiving nothing, for the look-ahead of the last iteration.
    table = tf.constant(np.concatenate([rows, np.full([1, rows.shape[1]], NO_RECEIVE,
                                                      np.int32)]))
    order = sorted(self.cells)
    position = {kind: q for q, kind in enumerate(self.table.receives)}

    def body(i, state):
      row = tf.unstack(tf.gather(table, i))
      args = (row[MICRO_BATCH], row[OFFSET], row[SLOT], row[PRODUCT_SLOT])
      branches = {}
      for j, k in enumerate(order):
        for index, kind, action in self.cells[k].actions():
          received = state["inbox"][position[kind]] if kind is not None else None
          branches[index] = (lambda j=j, action=action, received=received:
                             self._step(state, i, j, action, received, args))
      new_state = tf_internals.unlowered(
          lambda: tf.switch_case(row[BRANCH], [branches[b] for b in range(len(branches))]))
      new_state["inbox"] = self._prefetch(state["inbox"], tf.gather(table, i + 1)[RECEIVE])
      return i + 1, new_state

    num_actions = len(rows)
    with tf.device(self.device):
      inbox = [[tf.zeros(spec.shape, spec.dtype)
                for spec in self.cells[k].receive_specs(phase, c)]
               for k, phase, c in self.table.receives]
      if num_actions and rows[0, RECEIVE] != NO_RECEIVE:
        inbox[rows[0, RECEIVE]] = self._receive(self.table.receives[rows[0, RECEIVE]])
      initial = {"cells": [self.cells[k].initial_state() for k in order],
                 "times": tf.TensorArray(tf.float64, size=num_actions, element_shape=[2]),
                 "inbox": inbox}
      _, final = tf_internals.unlowered(lambda: tf.while_loop(
          lambda i, _: i < num_actions, body, (tf.constant(0, tf.int32), initial)))
    return {k: cell_state for k, cell_state in zip(order, final["cells"])}, final["times"]

  @staticmethod
  def _step(state: dict, i, j: int, action, received, args) -> dict:
    cell_state, start, end = action(state["cells"][j], received, *args)
    cells = list(state["cells"])
    cells[j] = cell_state
    return {"cells": cells, "times": state["times"].write(i, tf.stack([start, end]))}


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
  """One training step: a loop per device, each running plan.device_orders[d].

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
  finals: dict[int, dict[str, Any]] = {}
  for d, device_order in enumerate(plan.device_orders):
    device_cells = sorted({k for k, _ in device_order})
    devices = {cells[k].device for k in device_cells}
    if len(devices) != 1:
      raise ValueError(f"the schedule puts cells {device_cells} on one device; they are on "
                       f"{sorted(map(str, devices))}")
    table = action_table(plan, d, shape_class, offsets, len(class_sizes))
    loops = {k: CellLoop(cells[k], k, signatures[k], class_sizes, table.branches[k],
                         table.stash_slots[k], table.product_slots[k], len(sizes),
                         links[k - 1] if k > 0 else None,
                         links[k] if k + 1 < num_cells else None,
                         tf.nest.flatten(inputs) if k == 0 else [],
                         tf.nest.flatten(head_inputs) if cells[k].head is not None else [],
                         step, ctx.example_offset)
             for k in device_cells}
    device = cells[device_cells[0]].device
    cell_states, times = DeviceLoop(device, loops, table).build()
    finals.update(cell_states)
    if ctx.spans is not None:
      with tf.device(device):
        ctx.spans.append(timeline.CellTimes(
            device, tf.concat([times.stack(), tf.constant(table.keys, tf.float64)], axis=1)))
  for k, cell in enumerate(cells):
    if ctx.layer_stats is not None and finals[k]["stats"]:
      with tf.device(cell.device):
        per_micro_batch = zip(*[tf.unstack(ta.stack()) for ta in finals[k]["stats"]])
        for flat_stats in per_micro_batch:
          ctx.layer_stats.extend(cell.unflatten_stats(list(flat_stats)))
  last = cells[-1]
  with tf.device(last.device):
    per_micro_batch = tf.nest.pack_sequence_as(
        last.output_structure, [ta.stack() for ta in finals[num_cells - 1]["outputs"]])
    metrics = {name: _weighted_mean(tf.cast(value, tf.float32), tf.cast(weight, tf.float32))
               for name, (value, weight) in per_micro_batch.items()}
    inverse_weight = tf.math.divide_no_nan(1.0, metrics["loss"][1])
  variables: list[tf.Variable] = []
  gradients: list[tf.Tensor] = []
  position: dict[Any, int] = {}
  for k, cell in enumerate(cells):
    final = finals[k]
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
