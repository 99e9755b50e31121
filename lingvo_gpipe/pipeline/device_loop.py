"""One loop per device: the device runs its cells' actions in the schedule's order.

For device d, one functional While (`tf_internals.unlowered`) walks a constant int32
table (`ActionTable`) with one row per entry of `plan.device_orders[d]` (usually one
cell's list; several cells' with interleaved virtual stages). A row is a `TableRow`:
its Case branch, unit, example offset, stash slot, product slot (B), first product
slot (W) and what it receives; `COLUMNS` names each field's column. The row's Case
branch runs the action, given an `ActionArgs` (the row and the hand-off received).
A unit u is a micro-batch, or with token slices a slice (m, j) of one (schedule.py):

  F u   inputs: unit u sliced from the batch (k = 0) or received from cell k−1
        → CellFunctions.forward → outputs sent to cell k+1 (last cell: the head's
        metrics kept per unit); what the backward needs is stashed in a slot, the
        batch statistics kept per unit
  B u   output gradient: received from cell k+1 (last cell: unit u's loss weight)
        → CellFunctions.backward on the stashed slot → input gradients sent to cell
        k−1; variable gradients added to the running sums (loop variables); in a
        cell that defers weight gradients, the projections' inputs and output
        gradients kept in a product slot
  W u   (cells that defer weight gradients) the product slots of the backwards since
        the cell's previous W, up to u's, concatenated → one product per projection,
        added to the sums

An uneven split has two unit shapes; each has its own F and B branch (the cell's
functions are traced once per shape); W has a branch per group size. A cell's first B
of the step has a branch of its own, and so has its first W where some of its sums
only W adds to (`weight_only_sums`): they make the sums still zero from their
gradients instead of adding to them (`Branch.first`). Each action's
start (its inbox there) and end (its Case done) are timestamped on the device's
host, around the Case in the loop's body (the measured timeline).

Token slices (`plan.slices` S > 1): a shape class is a (rows, tokens) pair. A cell
with causal layers keeps, per micro-batch in flight, its cache entries in a cache slot
(taken at F(m, 0), released at B(m, 0)): F(m, j) reads them (j > 0) and writes them
back extended; B(m, j) reads them as the last slice left them, takes the gradient of
the entries F(m, j) wrote from the cache-gradient slot B(m, j+1) filled (zeros for
the last slice) and fills it with the gradient of those F(m, j) read, for B(m, j−1).

The loop carries a `LoopState`: per cell a `CellState` (the sums, one stash slot per
unit the cell holds in flight (`PipelineSchedule.max_in_flight`: U = M·S for gpipe,
K−k+S−1 for 1f1b on cell k), one product slot per backward awaiting its W
(`max_awaiting_weights`), the head's per-unit metrics and the statistics); the
device's timestamps; and the inbox of hand-offs received one action ahead. Each cell's
state crosses the While and the Case as one variant (`_packed`): the branch that runs
one of the cell's actions unpacks it, and the other cells' states pass through whole.
Each kind of slot has its allocator (`_LowestFree`, `_ProductRing`), composed in
`action_table`. The step graph holds one loop per device whatever M is
(`tests/pipeline_graph_test.py`).

`run`, one training step, reads as its steps: `_check_schedule`, `_trace` (each cell
per unit shape: `CellFunctions.signature`), the links, `action_table` and
`_device_loop` per device (`_record_times` keeps its timestamps), then
`_report_stats`, `_metrics` and `_mean_gradients`.

The loss of the whole batch is the weighted mean of the micro-batch losses,
Σ w_m·loss_m / Σ w_m, with w_m the loss's weight (examples, or target tokens): each
backward is seeded with w_m, and the summed gradients are divided by Σ w_m once at
the end, so the update is the unpartitioned model's on the whole batch.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Any, NamedTuple

import numpy as np
import tensorflow as tf

from lingvo_gpipe.core import base_layer, stacked_variables, tf_internals
from lingvo_gpipe.pipeline import channels, timeline
from lingvo_gpipe.pipeline.cell_function import CallSignature, CellFunctions
from lingvo_gpipe.pipeline.placement_audit import on_host
from lingvo_gpipe.pipeline.schedule import (
  BACKWARD,
  FORWARD,
  WEIGHT_GRADIENT,
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

  def gradients_for(self, variables: Sequence[Any]) -> list[tf.Tensor]:
    """Gradients in the order of `variables` (tf.Variables, or a stacked variable's
    rows: `stacked_variables.trainable_weights`); zeros for variables no cell used."""
    grads = stacked_variables.per_weight(variables, self.variables, self.gradients)
    for i, (v, g) in enumerate(zip(variables, grads)):
      if g is None:
        with tf.device(v.device):
          grads[i] = tf.zeros(v.shape, v.dtype)
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


# A field of a TableRow: a Python int in the table, a scalar tensor in the loop.
Entry = int | tf.Tensor


class TableRow(NamedTuple):
  """One action of a device's table: a row of `ActionTable.rows` (Python ints there;
  int64 scalars in the loop body, int32 in the action's Case branch, where `ActionArgs`
  hands them to the action).

  branch: its Case branch, an index into `ActionTable.branches` (which cell, which
  action, which shape class or W group size); unit: u, the schedule's unit (a
  micro-batch, or slice (m, j) of one, u = m·S + j); offset: u's first example's
  position in the batch;
  stash_slot: F: the stash slot it fills, B: the one it takes (W: 0);
  product_slot: B: the product ring slot it writes (F, W: 0);
  first_product_slot: W: the ring slot of its group's first backward, the first of
  the consecutive slots it reads (F, B: 0);
  receive: what it receives, an index into `ActionTable.receives`, or NO_RECEIVE;
  token_offset, token_slice: the unit's first token's position and its slice j (0
  without token slices); cache_slot: F, B: the cache slot of its micro-batch (0
  without token slices).
  """
  branch: Entry
  unit: Entry
  offset: Entry
  stash_slot: Entry = 0
  product_slot: Entry = 0
  first_product_slot: Entry = 0
  receive: Entry = -1  # NO_RECEIVE
  token_offset: Entry = 0
  token_slice: Entry = 0
  cache_slot: Entry = 0


COLUMNS = TableRow(*range(len(TableRow._fields)))  # each field's column in the table
NO_RECEIVE = -1  # `receive` of an action whose inputs come from no other cell


class ReceiveKind(NamedTuple):
  """What an action receives from a neighbouring cell: FORWARD, its inputs from cell
  k−1; BACKWARD, its output gradients from cell k+1; of one unit shape class."""
  cell: int
  phase: str
  shape_class: int


class Branch(NamedTuple):
  """One Case branch of a device's loop (a row of `ActionTable.branches`, whose index
  is the branch's): cell k's F or B of the units of shape class c, or its W of a group
  of n backwards; `receive`, the hand-off it takes (None: its inputs come from no
  other cell, or it is a W). `first`: a B or W that is the first of its kind of its
  cell in the step, so the sums it adds to are still zeros: before a cell's first B
  nothing adds to its sums (F adds nothing, a W follows a B), and before its first W
  only Bs do, which leave alone the stacks no backward gives a gradient
  (`weight_only_sums`: projection weights read only by deferred products). It
  makes those sums from its gradients instead of adding (the `zeros` of
  `CellFunctions.backward` and `CellFunctions.weight_gradients`)."""
  cell: int
  phase: str          # FORWARD, BACKWARD or WEIGHT_GRADIENT
  shape_class: int = 0  # F, B
  group_size: int = 0   # W
  receive: ReceiveKind | None = None
  first: bool = False   # B, W


class _Variants(NamedTuple):
  """The B or W actions of a device's cells, by what sets their branch (a B's shape
  class, a W's group size): each cell's first action's row and variant, and the
  (cell, variant) pairs of the later ones."""
  first: dict[int, tuple[int, int]]
  later: set[tuple[int, int]]

  @classmethod
  def of(cls, variants: Sequence[tuple[int, int, int]],
         firsts: Collection[int] | None = None) -> _Variants:
    """From (row, cell, variant) of each such action, in the device's order; `firsts`:
    the cells whose first action is told apart (None: every cell)."""
    out = cls({}, set())
    for row, k, v in variants:
      if k in out.first or (firsts is not None and k not in firsts):
        out.later.add((k, v))
      else:
        out.first[k] = (row, v)
    return out

  def branches(self, k: int) -> list[tuple[int, bool]]:
    """Cell k's (variant, first) branches: its first action's, then each later variant."""
    later = sorted(v for cell, v in self.later if cell == k)
    return ([(self.first[k][1], True)] if k in self.first else []) + [(v, False) for v in later]

  def is_first(self, k: int, row: int) -> bool:
    return k in self.first and self.first[k][0] == row


def _branches(plan: PipelineSchedule, cells: Sequence[int], num_classes: int,
              backwards: _Variants, weights: _Variants) -> list[Branch]:
  """The Case branches of a device holding `cells`: per cell, F of each unit shape
  class, its first B (of that B's shape class), B of each shape class its later Bs
  have, then its first W (of that W's group size) and W of each group size its later
  Ws have."""
  out = []
  for k in cells:
    for c in range(num_classes):
      receive = ReceiveKind(k, FORWARD, c) if k > 0 else None
      out.append(Branch(k, FORWARD, shape_class=c, receive=receive))
    for c, first in backwards.branches(k):
      receive = ReceiveKind(k, BACKWARD, c) if k + 1 < plan.num_cells else None
      out.append(Branch(k, BACKWARD, shape_class=c, receive=receive, first=first))
    for n, first in weights.branches(k):
      out.append(Branch(k, WEIGHT_GRADIENT, group_size=n, first=first))
  return out


class SlotCounts(NamedTuple):
  """How many slots of each kind a cell's loop state holds: stash (what a backward
  needs), product (a deferred backward's projection inputs and output gradients) and
  cache (token slices' cache entries, per micro-batch)."""
  stash: int
  product: int
  cache: int


@dataclasses.dataclass
class ActionTable:
  """A device's actions as loop data: rows int32 [A, len(COLUMNS)], one `TableRow` per
  entry of the device's order; its Case branches, what each runs; per cell on the
  device, its slot counts; the kinds of hand-off its actions receive."""
  rows: np.ndarray
  branches: list[Branch]
  slots: dict[int, SlotCounts]
  receives: list[ReceiveKind]
  keys: np.ndarray  # float64 [A, 3]: cell, unit, phase index (timeline.PHASES)


class _LowestFree:
  """Slots given out lowest-free-first, each held by a key until released; `size`:
  the most held at once (the slots the loop state needs)."""

  def __init__(self):
    self.size = 0
    self._free: list[int] = []
    self._slot_of: dict[Any, int] = {}

  def take(self, key: Any) -> int:
    if not self._free:
      self._free.append(self.size)
      self.size += 1
    slot = min(self._free)
    self._free.remove(slot)
    self._slot_of[key] = slot
    return slot

  def release(self, key: Any) -> int:
    """Frees key's slot (it stays key's to read in the same action) and returns it."""
    self._free.append(self._slot_of[key])
    return self._slot_of[key]

  def of(self, key: Any) -> int:
    """key's slot (0 for a key never given one)."""
    return self._slot_of.get(key, 0)


class _ProductRing:
  """A deferred backward's product slots: the i-th backward of the cell writes slot
  i mod size; a W reads its group's consecutive slots from its first backward's."""

  def __init__(self, size: int):
    self.size = size
    self._index_of: dict[int, int] = {}  # unit → its position among the backwards

  def write(self, unit: int) -> int:
    self._index_of[unit] = len(self._index_of)
    return self._index_of[unit] % self.size if self.size else 0

  def first(self, group: Sequence[int]) -> int:
    return self._index_of[group[0]] % self.size


def action_table(plan: PipelineSchedule, d: int, shape_class: Sequence[int],
                 offsets: Sequence[int], num_classes: int,
                 token_offsets: Sequence[int] | None = None,
                 first_weight_cells: Collection[int] | None = None) -> ActionTable:
  """Device d's table. Per unit u (micro-batch, or (m, j) with token slices):
  shape_class[u], offsets[u] (its first example's position) and token_offsets[u]
  (its first token's; None: 0). first_weight_cells: the cells whose first W has a
  branch of its own (those with sums only W adds to: `weight_only_sums`; None: every
  cell); a cell's first B always has.

  Each cell has three allocators. Stash slots: lowest-free-first, taken at F and
  freed at B, so cell k needs max_in_flight(k) of them. Product slots: a ring of
  max_awaiting_weights(k) (`_ProductRing`). Cache slots (token slices): lowest-free-
  first, taken at F(m, 0) and freed at B(m, 0).
  """
  slices = plan.slices
  token_offsets = token_offsets or [0] * len(offsets)
  order = plan.device_orders[d]
  cells = sorted({k for k, _ in order})
  groups = {k: plan.weight_groups(k) for k in cells}
  backwards = _Variants.of([(row, k, shape_class[a.unit]) for row, (k, a) in enumerate(order)
                            if a.phase == BACKWARD])
  weights = _Variants.of([(row, k, len(groups[k][a.unit])) for row, (k, a) in enumerate(order)
                          if a.phase == WEIGHT_GRADIENT], first_weight_cells)
  branches = _branches(plan, cells, num_classes, backwards, weights)
  branch_of = {(b.cell, b.phase, b.shape_class, b.group_size, b.first): i
               for i, b in enumerate(branches)}
  stash = {k: _LowestFree() for k in cells}
  cache = {k: _LowestFree() for k in cells}
  products = {k: _ProductRing(plan.max_awaiting_weights(k)) for k in cells}
  # (a cell's first B receives what its other B of that shape class receives)
  receives = list(dict.fromkeys(b.receive for b in branches if b.receive is not None))
  rows: list[TableRow] = []
  for index, (k, action) in enumerate(order):
    u, phase = action.unit, action.phase
    m, j = divmod(u, slices)
    if phase == WEIGHT_GRADIENT:
      group = groups[k][u]
      rows.append(TableRow(branch_of[k, phase, 0, len(group), weights.is_first(k, index)],
                           u, offsets[u], first_product_slot=products[k].first(group)))
      continue
    first_slice = j == 0 and slices > 1  # takes (F) or frees (B) the micro-batch's cache
    if phase == FORWARD:
      stash_slot, product_slot = stash[k].take(u), 0
      if first_slice:
        cache[k].take(m)
    else:
      stash_slot, product_slot = stash[k].release(u), products[k].write(u)
      if first_slice:
        cache[k].release(m)
    branch = branch_of[k, phase, shape_class[u], 0,
                       phase == BACKWARD and backwards.is_first(k, index)]
    receive = branches[branch].receive
    rows.append(TableRow(
        branch, u, offsets[u], stash_slot=stash_slot, product_slot=product_slot,
        receive=receives.index(receive) if receive is not None else NO_RECEIVE,
        token_offset=token_offsets[u], token_slice=j, cache_slot=cache[k].of(m)))
  keys = [[k, a.unit, timeline.PHASES.index(a.phase)] for k, a in order]
  return ActionTable(np.array(rows, np.int32).reshape(-1, len(COLUMNS)), branches,
                     {k: SlotCounts(stash[k].size, products[k].size, cache[k].size)
                      for k in cells},
                     receives, np.array(keys, np.float64).reshape(-1, 3))


def weight_only_sums(signatures: Sequence[CallSignature]) -> frozenset[int]:
  """The positions of a cell's sums that no backward of any of its shapes adds to
  (`CallSignature.weight_only_sums`): still zeros at the cell's first W."""
  return frozenset.intersection(*[sig.weight_only_sums for sig in signatures])


def _int32_as_int64(flat: Sequence[tf.Tensor]) -> list[tf.Tensor]:
  """Each int32 tensor of `flat` as int64 (the others as they are): what the loops slice.

  A GPU has no device kernel for an int32 Slice: TensorFlow runs it on the host's memory
  (as for most int32 ops on a GPU). The int32 batch captured into a device's While and
  its Case branches on a GPU reached that Slice in the GPU's memory, and the host kernel
  read it as a host pointer: a segmentation fault in every training step (an H200,
  docs/benchmarks_history.md, "The second GPU contact", 2026-11-27). An int64 Slice is a
  GPU kernel; `_slice` casts the micro-batch back, so the cells see the dtypes they were
  given.
  """
  return [tf.cast(t, tf.int64) if t.dtype == tf.int32 else t for t in flat]


def _slice(flat: Sequence[tf.Tensor], offset: tf.Tensor, size: int,
           token_offset: tf.Tensor | None = None, length: int = 0,
           dtypes: Sequence[tf.DType] | None = None) -> list[tf.Tensor]:
  """Rows offset..offset+size of each tensor (a micro-batch of static size); with a
  `length`, only its tokens token_offset..token_offset+length along axis 1 (a token
  slice). `dtypes`: each slice's dtype (a cast where it differs from its tensor's)."""
  out = []
  for n, t in enumerate(flat):
    rank = t.shape.rank
    start = [tf.cast(offset, tf.int64)]
    size_of = [size]
    if length:
      start.append(tf.cast(token_offset, tf.int64))
      size_of.append(length)
    begin = tf.concat([tf.stack(start), tf.zeros([rank - len(start)], tf.int64)], 0)
    piece = tf.slice(t, begin, tf.constant(size_of + [-1] * (rank - len(start)), tf.int64))
    out.append(piece if dtypes is None or dtypes[n] == t.dtype else tf.cast(piece, dtypes[n]))
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


# TensorLists have no GPU kernels for int16 (tools/gpu_audit.py found them): the bits
# of a half-precision float that a forward keeps as int16 (cell_function._as_bits)
# sit in the stash as float16 bits. A slot only copies them: every bit comes back.
_STASHED_AS = {tf.int16: tf.float16}


def _stash_slots(specs: Sequence[tf.TensorSpec], size: int) -> list[tf.TensorArray]:
  """`_slots` for what a forward keeps for its backward (`_stashed` writes, `_take`
  reads back in the specs' dtypes)."""
  return _slots([tf.TensorSpec(s.shape, _STASHED_AS.get(s.dtype, s.dtype)) for s in specs],
                size)


def _stashed(t: tf.Tensor) -> tf.Tensor:
  return tf.bitcast(t, _STASHED_AS[t.dtype]) if t.dtype in _STASHED_AS else t


def _take(slots: Sequence[tf.TensorArray], index: Any, specs: Sequence[tf.TensorSpec]
          ) -> tuple[list[tf.Tensor], list[tf.TensorArray]]:
  """Slot `index` of each TensorArray of `_slots`, in its spec's dtype, and the
  arrays with the slot emptied (scalars stay)."""
  values, emptied = [], []
  for ta, spec in zip(slots, specs):
    value = ta.read(index)
    value.set_shape(spec.shape)
    values.append(tf.bitcast(value, spec.dtype) if value.dtype != spec.dtype else value)
    if spec.shape.rank:
      with tf.control_dependencies([value]):
        # an empty placeholder (0 along the batch and any dimension only known at run
        # time, such as a token slice's keys up to its end)
        ta = ta.write(index, tf.zeros([0] + [d or 0 for d in spec.shape[1:].as_list()],
                                      ta.dtype))
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


@dataclasses.dataclass(frozen=True)
class StepInputs:
  """What the actions read of the step besides the loop state.

  inputs: the pipeline's flat batch [B, ...] (cell 0 slices its micro-batches from
  it); head_inputs: the head's flat batch [B, ...] (the last cell's); step: the
  global step, int64 []; base_offset: the batch's first example's position (r·B on
  replica r; it keys dropout with each micro-batch's offset); loss_scale: S, float32
  [] (the last cell seeds each backward with S·w_m), or None (1); input_dtypes,
  head_dtypes: the dtypes the cells take (`of` carries int32 inputs as int64,
  `_int32_as_int64`).
  """
  inputs: list[tf.Tensor]
  head_inputs: list[tf.Tensor]
  step: tf.Tensor
  base_offset: Any
  loss_scale: tf.Tensor | None = None
  input_dtypes: Sequence[tf.DType] | None = None
  head_dtypes: Sequence[tf.DType] | None = None

  @classmethod
  def of(cls, inputs: Sequence[tf.Tensor], head_inputs: Sequence[tf.Tensor],
         step: tf.Tensor, base_offset: Any, loss_scale: tf.Tensor | None) -> StepInputs:
    """The step's inputs as the loops slice them (int32 carried as int64)."""
    return cls(_int32_as_int64(inputs), _int32_as_int64(head_inputs), step, base_offset,
               loss_scale, [t.dtype for t in inputs], [t.dtype for t in head_inputs])


class CellState(NamedTuple):
  """One cell's part of its device's loop state (loop variables; tf.nest takes a
  NamedTuple apart field by field)."""
  sums: list[tf.Tensor]                # the running gradient sums (sig.layout's tensors)
  stash: list[list[tf.TensorArray]]    # per shape class, per saved spec: the stash slots
  outputs: list[tf.TensorArray]        # last cell: per flat output (metrics), M elements
  stats: list[tf.TensorArray]          # per flat statistic, M elements
  product_inputs: list[tf.TensorArray]  # per deferred product, its ring of product slots
  product_grads: list[tf.TensorArray]   # (inputs [n, I] and output gradients [n, O])
  cache: list[tf.TensorArray]           # per cache entry (token slices), its cache slots
  cache_grads: list[tf.TensorArray]     # and the gradient handed to the previous slice


class LoopState(NamedTuple):
  """A device's loop state."""
  cells: list[tf.experimental.Optional]  # per cell, in the device's order: its CellState,
                                         # packed (`_packed`)
  times: tf.TensorArray           # float64 [A, 2]: each action's start and end
  inbox: list[list[tf.Tensor]]    # per receive kind: its latest hand-off


def _packed(state: CellState) -> tf.experimental.Optional:
  """A cell's state as one variant tensor: an Optional of its leaves (tensors, and
  TensorArrays by their lists), which holds them without copying.

  Why: every tensor of the loop state passes through each iteration's While body and
  through the Case branch it runs, as an argument, an Identity and a result, traced
  into every branch: 2.1 µs per tensor and action, against 0.2 µs packed
  (`bench/loop_state_cost.py`, one thread). A device's state is tens to hundreds of
  tensors (the stash is one list per saved tensor and shape class), most of which an
  action does not touch. Packed, each cell's state crosses as one tensor; the branch
  that runs the cell's action unpacks it (`_unpacked`) and packs the result."""
  return tf.experimental.Optional.from_value(tuple(tf.nest.flatten(state)))


def _unpacked(packed: tf.experimental.Optional, like: CellState) -> CellState:
  """The CellState `_packed` holds, structured as `like` (the cell's initial state)."""
  return tf.nest.pack_sequence_as(like, list(packed.get_value()))


class ActionArgs(NamedTuple):
  """What an action is given besides its cell's state: its table row (int32 scalars)
  and the hand-off it received (None: it receives nothing)."""
  row: TableRow
  received: list[tf.Tensor] | None


# An action: (the cell's state, its arguments) → the state updated (the timestamps
# around it are taken by the loop, `_host_clock`).
ActionResult = CellState


@dataclasses.dataclass
class CellLoop:
  """What cell k's actions need in its device's loop: the cell, its call signatures
  per unit shape, its slots, the hand-offs to its neighbours and the step's
  inputs. Each action takes the cell's part of the loop state and returns it
  updated."""
  cell: CellFunctions
  k: int
  signatures: list[CallSignature]   # per shape class
  sizes: list[tuple[int, int]]      # per shape class, its (rows, tokens; 0: whole)
  slots: SlotCounts
  num_units: int                    # U = M·S: micro-batches × token slices
  slices: int                       # S
  previous: channels.Link | None     # to cell k−1
  following: channels.Link | None    # to cell k+1
  step_inputs: StepInputs

  # -- the cell's state ----------------------------------------------------------------

  def initial_state(self) -> CellState:
    sig0 = self.signatures[0]
    return CellState(
        sums=sig0.layout.zeros(tf_internals.runtime_zero(self.step_inputs.step)),
        stash=[_stash_slots(sig.saved.flat(), self.slots.stash) for sig in self.signatures],
        outputs=(_list(sig0.outputs, self.num_units) if self.cell.head is not None
                 else []),
        stats=_list(sig0.stats, self.num_units),
        product_inputs=_slots(sig0.products.inputs, self.slots.product),
        product_grads=_slots(sig0.products.grads, self.slots.product),
        cache=_slots(sig0.cache, self.slots.cache),
        cache_grads=_slots(sig0.cache, self.slots.cache))

  def action(self, branch: Branch) -> Callable[[CellState, ActionArgs], ActionResult]:
    """What one of the cell's Case branches runs."""
    if branch.phase == FORWARD:
      return functools.partial(self.forward, branch.shape_class)
    if branch.phase == BACKWARD:
      return functools.partial(self.backward, branch.shape_class, branch.first)
    return functools.partial(self.weight_gradient, branch.group_size, branch.first)

  def receive_specs(self, phase: str, c: int) -> list[tf.TensorSpec]:
    """What a forward (inputs) or backward (output gradients) of shape class c receives."""
    sig = self.signatures[c]
    return (list(sig.inputs) if phase == FORWARD
            else [s for s in sig.outputs if s.dtype.is_floating])

  def receive(self, phase: str, c: int) -> list[tf.Tensor]:
    """The hand-off a forward or backward of shape class c takes, received."""
    channel = self.previous.forward if phase == FORWARD else self.following.backward
    return channel.receive(self.receive_specs(phase, c))

  # -- the actions ---------------------------------------------------------------------

  def _call_info(self, row: TableRow) -> tf.Tensor:
    """int64 [example offset in the whole batch, token offset]."""
    offset = tf.cast(self.step_inputs.base_offset, tf.int64) + tf.cast(row.offset, tf.int64)
    return tf.stack([offset, tf.cast(row.token_offset, tf.int64)])

  def _cache_entries(self, slots: Sequence[tf.TensorArray], row: TableRow,
                     specs: Sequence[tf.TensorSpec], filled: tf.Tensor) -> list[tf.Tensor]:
    """The entries in the row's cache slot of `slots`, where `filled` (a bool scalar),
    else zeros (shaped as `specs`, its shape class's)."""
    def read(ta: tf.TensorArray, spec: tf.TensorSpec, slot: tf.Tensor) -> tf.Tensor:
      value = ta.read(slot)
      value.set_shape(spec.shape)
      return value
    if filled is True:
      return [read(ta, spec, row.cache_slot) for ta, spec in zip(slots, specs)]
    # The slot crosses into the cond's branch as int64: an int32 would arrive there in
    # a GPU's memory taken for the host's (placement_audit).
    slot = tf.cast(row.cache_slot, tf.int64)
    return [tf.cond(filled,
                    lambda ta=ta, spec=spec: read(ta, spec, tf.cast(slot, tf.int32)),
                    lambda spec=spec: tf_internals.zeros(spec.shape, spec.dtype))
            for ta, spec in zip(slots, specs)]

  def _write_cache(self, slots: Sequence[tf.TensorArray], row: TableRow,
                   values: Sequence[tf.Tensor], keep: Any = True) -> list[tf.TensorArray]:
    """`slots` with `values` in the row's cache slot, or (where `keep` is false: the
    micro-batch's first slice is done) emptied."""
    def kept(value: tf.Tensor) -> tf.Tensor:
      if keep is True:
        return value
      empty = tf.zeros([0] + value.shape[1:].as_list(), value.dtype)
      return tf.cond(keep, lambda: value, lambda: empty)
    return [ta.write(row.cache_slot, kept(v)) for ta, v in zip(slots, values)]

  def forward(self, c: int, state: CellState, args: ActionArgs) -> ActionResult:
    """F: the row's unit (micro-batch m, or slice (m, j)) of shape class c through the
    cell; its outputs sent on (last cell: kept), what its backward needs stashed, its
    statistics kept."""
    sig, row = self.signatures[c], args.row
    rows, tokens = self.sizes[c]
    if self.previous is None:
      flat = _slice(self.step_inputs.inputs, row.offset, rows, row.token_offset, tokens,
                    self.step_inputs.input_dtypes)
    else:
      flat = list(args.received)
    head = (_slice(self.step_inputs.head_inputs, row.offset, rows, row.token_offset, tokens,
                   self.step_inputs.head_dtypes) if self.cell.head else [])
    cache = self._cache_entries(state.cache, row, sig.cache, row.token_slice > 0)
    outputs, stats, saved, cache = self.cell.forward(sig, flat, head, self.step_inputs.step,
                                                     self._call_info(row), cache)
    kept = state.outputs
    if self.following is not None:
      self.following.forward.send(outputs)
    else:
      kept = [ta.write(row.unit, t) for ta, t in zip(state.outputs, outputs)]
    stash = list(state.stash)
    stash[c] = [ta.write(row.stash_slot, _stashed(t))
                for ta, t in zip(stash[c], saved.flat())]
    return state._replace(
        outputs=kept, stash=stash,
        stats=[ta.write(row.unit, t) for ta, t in zip(state.stats, stats)],
        cache=self._write_cache(state.cache, row, cache))

  def backward(self, c: int, first: bool, state: CellState, args: ActionArgs
               ) -> ActionResult:
    """B: the backward of the row's unit of shape class c on its stash slot; input
    gradients sent back, variable gradients added to the sums (`first`: the cell's
    first B, whose sums are still zeros), deferred products written to the row's
    product slot."""
    sig, cell, row = self.signatures[c], self.cell, args.row
    if self.following is None:
      loss_index, weight_index = sig.loss_positions()
      weight = state.outputs[weight_index].read(row.unit)
      loss_spec = sig.outputs[loss_index]
      if self.step_inputs.loss_scale is not None:
        weight = weight * tf.cast(self.step_inputs.loss_scale, weight.dtype)
      seeds = [tf.cast(weight, loss_spec.dtype)]
    else:
      seeds = list(args.received)
    stash = list(state.stash)
    taken, stash[c] = _take(stash[c], row.stash_slot, sig.saved.flat())
    cache = self._cache_entries(state.cache, row, sig.cache, True)
    cache_grads = self._cache_entries(state.cache_grads, row, sig.cache,
                                      row.token_slice < self.slices - 1)
    input_grads, cache_grads, sums, product_inputs, product_grads = cell.backward(
        sig, sig.saved.like(taken), seeds, state.sums, self.step_inputs.step,
        self._call_info(row), cache, cache_grads, zeros=range(len(state.sums)) if first else ())
    if self.previous is not None:
      self.previous.backward.send(input_grads)
    later_slices = row.token_slice > 0  # whose backwards still need the cache
    return state._replace(
        cache=self._write_cache(state.cache, row, cache, later_slices),
        cache_grads=self._write_cache(state.cache_grads, row, cache_grads, later_slices),
        stash=stash, sums=sums,
        product_inputs=[ta.write(row.product_slot, t) for ta, t in
                        zip(state.product_inputs, product_inputs)],
        product_grads=[ta.write(row.product_slot, t) for ta, t in
                       zip(state.product_grads, product_grads)])

  def weight_gradient(self, n: int, first: bool, state: CellState, args: ActionArgs
                      ) -> ActionResult:
    """W of a group of n backwards: their product slots, from the row's first one,
    concatenated → one product per projection, added to the sums (`first`: the cell's
    first W, before which the sums only W adds to are still zeros: those no backward
    of any of the cell's shapes adds to)."""
    sig, slot = self.signatures[0], args.row.first_product_slot
    inputs, product_inputs = _read_group(
        state.product_inputs, self.slots.product, slot, n, sig.products.inputs)
    grads, product_grads = _read_group(
        state.product_grads, self.slots.product, slot, n, sig.products.grads)
    zeros = weight_only_sums(self.signatures) if first else ()
    sums = self.cell.weight_gradients(state.sums, inputs, grads, zeros)
    return state._replace(sums=sums, product_inputs=product_inputs,
                          product_grads=product_grads)


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
    return self.cells[kind.cell].receive(kind.phase, kind.shape_class)

  def _prefetch(self, inbox: list[list[tf.Tensor]], index: tf.Tensor) -> list[list[tf.Tensor]]:
    """`inbox` with the hand-off of receive kind `index` received (NO_RECEIVE: as is)."""
    def into(q: int):
      updated = list(inbox)
      updated[q] = self._receive(self.table.receives[q])
      return updated
    branches = [lambda: list(inbox)] + [lambda q=q: into(q)
                                       for q in range(len(self.table.receives))]
    return tf_internals.unlowered(lambda: tf.switch_case(index + 1, branches))

  def build(self) -> tuple[dict[int, CellState], tf.TensorArray]:
    """The loop, under tf.device(device): each cell's final state, and the
    timestamps of its actions ([A, 2], in table order)."""
    rows = self.table.rows
    # One more row, receiving nothing, for the look-ahead of the last iteration. int64:
    # a row crosses into the Case's branches, where an int32 would arrive in a GPU's
    # memory taken for the host's (placement_audit); `_step` casts it inside.
    table = tf.constant(np.concatenate([rows, np.full([1, rows.shape[1]], NO_RECEIVE,
                                                      np.int32)]).astype(np.int64))
    order = sorted(self.cells)
    position = {kind: q for q, kind in enumerate(self.table.receives)}
    with tf.device(self.device):
      # each cell's state before the loop; also the structure `_unpacked` rebuilds
      initial_cells = [self.cells[k].initial_state() for k in order]

    def body(i: tf.Tensor, state: LoopState) -> tuple[tf.Tensor, LoopState]:
      row = TableRow(*tf.unstack(tf.gather(table, i)))

      def branch_fn(branch: Branch) -> Callable[[], list[tf.experimental.Optional]]:
        received = (state.inbox[position[branch.receive]] if branch.receive is not None
                    else None)
        run = self.cells[branch.cell].action(branch)
        return lambda: _step(state.cells, order.index(branch.cell), initial_cells, run,
                             ActionArgs(row, received))

      # The action's timestamps, around its Case (each a call of the host clock).
      start = _timestamp(self.device, tf.nest.flatten(state.inbox) + [i])
      with tf.control_dependencies([start]):
        cells = tf_internals.unlowered(
            lambda: tf.switch_case(tf.cast(row.branch, tf.int32),
                                   [branch_fn(b) for b in self.table.branches]))
      # (each cell's packed state, as its variant: made once the Case is done)
      end = _timestamp(self.device, tf.nest.flatten(cells, expand_composites=True))
      times = state.times.write(i, tf.stack([start, end]))
      inbox = self._prefetch(state.inbox,
                             tf.cast(tf.gather(table, i + 1)[COLUMNS.receive], tf.int32))
      return i + 1, LoopState(cells, times, inbox)

    num_actions = len(rows)
    with tf.device(self.device):
      # (outside the loop: filled with a runtime zero, tf_internals.zeros)
      zero = tf_internals.runtime_zero(self.cells[order[0]].step_inputs.step)
      inbox = [[tf_internals.zeros(spec.shape, spec.dtype, zero)
                for spec in self.cells[kind.cell].receive_specs(kind.phase, kind.shape_class)]
               for kind in self.table.receives]
      first_receive = rows[0, COLUMNS.receive] if num_actions else NO_RECEIVE
      if first_receive != NO_RECEIVE:
        inbox[first_receive] = self._receive(self.table.receives[first_receive])
      initial = LoopState(
          cells=[_packed(cell) for cell in initial_cells],
          times=tf.TensorArray(tf.float64, size=num_actions, element_shape=[2]),
          inbox=inbox)
      _, final = tf_internals.unlowered(lambda: tf.while_loop(
          lambda i, _: i < num_actions, body, (tf.constant(0, tf.int32), initial)))
      cells = [_unpacked(packed, like) for packed, like in zip(final.cells, initial_cells)]
    return dict(zip(order, cells)), final.times


def _step(cells: Sequence[tf.experimental.Optional], j: int, like: Sequence[CellState],
          run: Callable[[CellState, ActionArgs], ActionResult], args: ActionArgs
          ) -> list[tf.experimental.Optional]:
  """A Case branch: the action of the device's j-th cell → every cell's packed state
  (j's unpacked, updated and packed again; `like`: each cell's initial state). The row
  comes in as int64 and is cast to int32 here, inside the branch."""
  args = args._replace(row=TableRow(*(tf.cast(f, tf.int32) for f in args.row)))
  updated = list(cells)
  updated[j] = _packed(run(_unpacked(cells[j], like[j]), args))
  return updated


def _timestamp(device: str | None, wait_for: Sequence[Any]) -> tf.Tensor:
  """The time once `wait_for` (tensors) are done, read on `device`'s host (on a GPU:
  once the host has dispatched them, timeline.py)."""
  with tf.control_dependencies([t for t in wait_for if t is not None]):
    return _host_clock(device)()


@functools.cache
def _host_clock(device: str | None) -> Callable[[], tf.Tensor]:
  """A call that reads the clock of `device`'s host: float64 [] seconds.

  A call of its own (never inlined), because a While's or Case's body runs every op on
  the loop's device, whatever device an op names (tf_internals item 16; on an H200:
  "No registered 'Timestamp' OpKernel for 'GPU'"); a function call partitions its body
  by device, so the Timestamp in it runs on the host.
  """
  @tf.function(experimental_attributes=tf_internals.NOT_INLINED, autograph=False)
  def clock() -> tf.Tensor:
    with on_host(device, "Timestamp has CPU kernels only: the host's clock, 8 bytes per "
                 "stamp, two per action"):
      return tf.timestamp()
  return clock


def _shape_classes(sizes: Sequence[Any]) -> tuple[list[Any], list[int]]:
  """(the distinct unit shapes, largest first; each unit's class)."""
  distinct = sorted(set(sizes), reverse=True)
  return distinct, [distinct.index(s) for s in sizes]


def _with_batch(structure: Any, size: int, length: int = 0) -> Any:
  """Specs of `structure`'s tensors with `size` rows (and `length` tokens on axis 1:
  a token slice; 0: as they are)."""
  def spec(t: Any) -> tf.TensorSpec:
    shape = [size] + t.shape[1:].as_list()
    if length:
      shape[1] = length
    return tf.TensorSpec(shape, t.dtype)
  return tf.nest.map_structure(spec, structure)


@dataclasses.dataclass(frozen=True)
class Units:
  """A step's schedule units (micro-batches, or (m, j) slices u = m·S + j), each with
  its shape (rows, tokens: 0 for whole sequences), first example and first token."""
  shapes: list[tuple[int, int]]
  offsets: list[int]
  token_offsets: list[int]
  full_length: int  # T of token slices (0: whole sequences)

  @classmethod
  def of(cls, sizes: Sequence[int], offsets: Sequence[int],
         slice_lengths: Sequence[int] | None) -> Units:
    lengths = list(slice_lengths) if slice_lengths else [0]
    starts = [sum(lengths[:j]) for j in range(len(lengths))]
    return cls([(size, n) for size in sizes for n in lengths],
               [offset for offset in offsets for _ in lengths],
               [start for _ in sizes for start in starts], sum(lengths))


# -- one training step: run's steps --------------------------------------------------------


@tf.autograph.experimental.do_not_convert  # plain Python on static values
def run(cells: Sequence[CellFunctions], plan: PipelineSchedule, inputs: Any, head_inputs: Any,
        sizes: Sequence[int], offsets: Sequence[int], link_prefix: str,
        slice_lengths: Sequence[int] | None = None) -> StepGradients:
  """One training step: a loop per device, each running plan.device_orders[d].

  inputs: the pipeline's nested inputs [B, ...] on cells[0]'s device; head_inputs: the
  head's nested tensors [B, ...] on the last cell's device; sizes, offsets: each
  micro-batch's size and first example's position in the batch; slice_lengths: with
  plan.slices S > 1, the S slices' lengths (summing to the sequence length,
  axis 1 of every input and head input). Batch statistics go to the StepContext's
  layer_stats, the loops' timestamps to its spans.

  Raises:
    ValueError: the schedule is for another number of cells, micro-batches or token
      slices, or puts cells of different devices on one device.
  """
  ctx = base_layer.current_context()
  _check_schedule(cells, plan, sizes, slice_lengths)
  step = tf.cast(ctx.step, tf.int64)
  inputs, head_inputs = tf.nest.map_structure(tf.convert_to_tensor, (inputs, head_inputs))
  units = Units.of(sizes, offsets, slice_lengths if plan.slices > 1 else None)
  class_sizes, shape_class = _shape_classes(units.shapes)
  signatures = _trace(cells, inputs, head_inputs, class_sizes, units.full_length)
  links = channels.links(link_prefix, [cell.device for cell in cells])
  step_inputs = StepInputs.of(tf.nest.flatten(inputs), tf.nest.flatten(head_inputs), step,
                              ctx.example_offset, ctx.loss_scale)
  finals: dict[int, CellState] = {}
  for d in range(len(plan.device_orders)):
    table = action_table(plan, d, shape_class, units.offsets, len(class_sizes),
                         units.token_offsets,
                         [k for k, sigs in enumerate(signatures) if weight_only_sums(sigs)])
    loop = _device_loop(cells, signatures, class_sizes, plan, table, links, step_inputs)
    cell_states, times = loop.build()
    finals.update(cell_states)
    _record_times(ctx.spans, loop.device, times, table)
  _report_stats(cells, signatures, finals, ctx.layer_stats, plan.num_units)
  metrics = _metrics(cells[-1], signatures[-1][0], finals[len(cells) - 1])
  variables, gradients = _mean_gradients(cells, signatures, finals, metrics["loss"][1],
                                         ctx.loss_scale)
  return StepGradients(metrics, variables, gradients)


def _check_schedule(cells: Sequence[CellFunctions], plan: PipelineSchedule,
                    sizes: Sequence[int], slice_lengths: Sequence[int] | None) -> None:
  """Raises ValueError unless `plan` is for these cells, micro-batches and token
  slices and each of its devices' cells are on one device."""
  num_slices = plan.slices
  if num_slices > 1 and len(slice_lengths or ()) != num_slices:
    raise ValueError(f"schedule for {num_slices} token slices given slice lengths "
                     f"{slice_lengths}")
  if plan.num_cells != len(cells) or plan.num_units != len(sizes) * num_slices:
    raise ValueError(f"schedule for {plan.num_cells} cells × {plan.num_units} "
                     f"units given {len(cells)} cells × {len(sizes)} micro-batches × "
                     f"{num_slices} slices")
  for device_order in plan.device_orders:
    device_cells = sorted({k for k, _ in device_order})
    devices = {cells[k].device for k in device_cells}
    if len(devices) != 1:
      raise ValueError(f"the schedule puts cells {device_cells} on one device; they are on "
                       f"{sorted(map(str, devices))}")


def _trace(cells: Sequence[CellFunctions], inputs: Any, head_inputs: Any,
           class_sizes: Sequence[tuple[int, int]], full_length: int = 0
           ) -> list[list[CallSignature]]:
  """Each cell traced for each unit shape (rows, tokens), in order (cell k's outputs
  are cell k+1's inputs): per cell, per shape class, its CallSignature."""
  signatures: list[list[CallSignature]] = []
  for k, cell in enumerate(cells):
    per_class = []
    for c, (size, length) in enumerate(class_sizes):
      cell_inputs = (_with_batch(inputs, size, length) if k == 0
                     else signatures[k - 1][c].unflatten_outputs(signatures[k - 1][c].outputs))
      head = _with_batch(head_inputs, size, length) if cell.head is not None else None
      with tf.device(cell.device):
        per_class.append(cell.signature(cell_inputs, head, full_length))
    signatures.append(per_class)
  return signatures


def _device_loop(cells: Sequence[CellFunctions], signatures: list[list[CallSignature]],
                 class_sizes: list[tuple[int, int]], plan: PipelineSchedule,
                 table: ActionTable, links: list[channels.Link], step_inputs: StepInputs
                 ) -> DeviceLoop:
  """The loop of the device whose table is `table`, over the cells it holds."""
  last = len(cells) - 1
  loops = {k: CellLoop(cells[k], k, signatures[k], class_sizes, slots, plan.num_units,
                       plan.slices, previous=links[k - 1] if k > 0 else None,
                       following=links[k] if k < last else None, step_inputs=step_inputs)
           for k, slots in table.slots.items()}
  return DeviceLoop(cells[min(loops)].device, loops, table)


def _record_times(spans: list | None, device: str | None, times: tf.TensorArray,
                  table: ActionTable) -> None:
  """The loop's timestamps [A, 2] with the table's keys [A, 3] → a CellTimes in `spans`
  (the StepContext's; None: not collected)."""
  if spans is None:
    return
  with tf.device(device):
    spans.append(timeline.CellTimes(
        device, tf.concat([times.stack(), tf.constant(table.keys, tf.float64)], axis=1)))


def _report_stats(cells: Sequence[CellFunctions], signatures: list[list[CallSignature]],
                  finals: dict[int, CellState], layer_stats: list | None,
                  num_units: int) -> None:
  """Each cell's batch statistics, per unit (each TensorArray of `finals[k].stats` has
  `num_units` elements), as (layer, stats) into `layer_stats` (the StepContext's;
  None: not collected)."""
  if layer_stats is None:
    return
  for k, cell in enumerate(cells):
    if finals[k].stats:
      with tf.device(cell.device):
        per_unit = zip(*[tf.unstack(ta.stack(), num=num_units) for ta in finals[k].stats])
        for flat_stats in per_unit:
          layer_stats.extend(signatures[k][0].unflatten_stats(list(flat_stats)))


def _metrics(last: CellFunctions, sig: CallSignature, final: CellState) -> Metrics:
  """The head's metrics of the M micro-batches (kept by the last cell) → the whole
  batch's {name: (weighted mean, summed weight)}."""
  with tf.device(last.device):
    per_micro_batch = sig.unflatten_outputs([ta.stack() for ta in final.outputs])
    return {name: _weighted_mean(tf.cast(value, tf.float32), tf.cast(weight, tf.float32))
            for name, (value, weight) in per_micro_batch.items()}


def _mean_gradients(cells: Sequence[CellFunctions], signatures: list[list[CallSignature]],
                    finals: dict[int, CellState], loss_weight: tf.Tensor,
                    loss_scale: tf.Tensor | None = None
                    ) -> tuple[list[tf.Variable], list[tf.Tensor]]:
  """The cells' summed gradients (each backward seeded with its micro-batch's loss
  weight, times the loss scale S if there is one) divided by Σ w_m, the whole batch's
  `loss_weight`, and by S: the gradient of the weighted mean loss. One per variable,
  in first-use order (a stacked variable's [n, *shape] whole); a variable two
  cells share (tied weights) gets the sum of theirs."""
  with tf.device(cells[-1].device):
    if loss_scale is not None:
      loss_weight = loss_weight * tf.cast(loss_scale, loss_weight.dtype)
    inverse_weight = tf.math.divide_no_nan(1.0, loss_weight)
  pairs: list[tuple[tf.Variable, tf.Tensor]] = []
  for k, cell in enumerate(cells):
    sig = signatures[k][0]
    with tf.device(cell.device):
      scale = tf.identity(inverse_weight)
      pairs += sig.layout.by_variable([s * tf.cast(scale, s.dtype) for s in finals[k].sums])
  return summed_per_variable(pairs)


def summed_per_variable(pairs: Iterable[tuple[Any, tf.Tensor]]
                        ) -> tuple[list[Any], list[tf.Tensor]]:
  """(variables, gradients) from (variable, gradient) pairs: one per variable, in
  first-use order; a variable met twice (read by two cells: a tied weight) gets the sum
  of its gradients, added on the variable's device."""
  variables: list[Any] = []
  gradients: list[tf.Tensor] = []
  position: dict[Any, int] = {}
  for v, g in pairs:
    if v.ref() in position:
      with tf.device(v.device):
        gradients[position[v.ref()]] += g
    else:
      position[v.ref()] = len(variables)
      variables.append(v)
      gradients.append(g)
  return variables, gradients
