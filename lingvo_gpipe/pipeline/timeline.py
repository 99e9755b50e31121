"""The measured pipeline schedule: when each cell ran each micro-batch, forward and back.

A pipelined training step records, for every cell call, a `Span`: two `tf.timestamp()`
ops placed on the cell's device, the first taken when the call's inputs are ready
(the call waits for it), the second when its outputs (forward) or its gradients
(backward, recompute included) are (whatever uses them waits for it). They are graph
nodes of the step itself, so they measure the schedule the dataflow executor actually
ran, on every device, without a profiler; their cost is a few scalar and identity ops
per cell call and one [spans, 2] tensor per device fetched with the step's results.

`fetches(spans)` stacks the timestamps of each device, with what each span is, into one
tensor (one transfer per device); `Schedule.from_fetched` turns the fetched numbers back
into spans, and from
them come each cell's busy fraction and the measured bubble beside GPipe's
(K−1)/(M+K−1); `schedule_chart` draws them for TensorBoard.

Timestamps are wall-clock seconds of the host running the device: cells on one host
(logical devices, one worker process per device) share a clock; across hosts the
schedule is as good as their clock synchronization. On a GPU, ops are timed when the
host dispatches them, not when the kernels run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from lingvo_gpipe.pipeline import tf_internals
from lingvo_gpipe.pipeline.schedule import (
  BACKWARD,
  FORWARD,
  WEIGHT_GRADIENT,
  Action,
  PipelineSchedule,
)


@dataclasses.dataclass(frozen=True)
class Span:
  """One cell call in one step: `start`, `end` are float64 scalar timestamp tensors."""
  cell: int
  micro_batch: int
  phase: str  # FORWARD, BACKWARD or WEIGHT_GRADIENT
  device: str
  start: tf.Tensor
  end: tf.Tensor


def _timestamp() -> tf.Tensor:
  """tf.timestamp() outside tf.function's program-order chain: chained, the stamps of
  cell 1 on micro-batch 0 would wait for those of cell 0 on micro-batch 1, and since
  the cells wait for their stamps, the whole pipeline would serialize
  (`tf_internals.exempt_from_program_order`)."""
  stamp = tf.timestamp()
  if not tf.executing_eagerly():
    tf_internals.exempt_from_program_order(stamp.op)
  return stamp


def _stamp(tensors: list[Any], also_wait_for: Sequence[tf.Tensor] = ()
           ) -> tuple[list[Any], tf.Tensor]:
  """A timestamp taken once `tensors` (and `also_wait_for`) are ready, and the tensors
  gated on it.

  The timestamp must sit on the path it measures: an op that only *waits* for a
  tensor is merely ready when that tensor is, and an executor with one inter-op
  thread (a worker standing in for an accelerator) runs it whenever its queue
  gets to it, long after. Passing the tensors on through identities that wait for
  the timestamp makes whatever comes next wait for it too.
  """
  deps = [t for t in list(tensors) + list(also_wait_for) if t is not None]
  with tf.control_dependencies(deps):
    stamp = _timestamp()
  with tf.control_dependencies([stamp]):
    return [None if t is None else tf.identity(t) for t in tensors], stamp


class SpanRecorder:
  """Times one cell call: `begin` gates its inputs, `end` gates its results.

    recorder = SpanRecorder(spans, cell, micro_batch, phase, device)
    inputs = recorder.begin(inputs)      # under tf.device(device)
    outputs = recorder.end(run(inputs))  # appends the Span to `spans`

  With spans None (no schedule asked for), both pass the tensors through unchanged.
  """

  def __init__(self, spans: list[Span] | None, cell: int, micro_batch: int, phase: str,
               device: str):
    self.spans, self.key, self.device = spans, (cell, micro_batch, phase), device
    self.start: tf.Tensor | None = None
    self.end_stamp: tf.Tensor | None = None

  def begin(self, tensors: list[Any]) -> list[Any]:
    if self.spans is None:
      return list(tensors)
    tensors, self.start = _stamp(list(tensors))
    return tensors

  def end(self, tensors: list[Any], also_wait_for: Sequence[tf.Tensor] = ()) -> list[Any]:
    """Gates `tensors` on the end stamp, taken once they and `also_wait_for` (results
    passed on some other way, e.g. gradient sums) are ready."""
    if self.spans is None:
      return list(tensors)
    tensors, self.end_stamp = _stamp(list(tensors), also_wait_for)
    self.spans.append(Span(*self.key, self.device, self.start, self.end_stamp))
    return tensors


@dataclasses.dataclass(frozen=True)
class SpanKey:
  """What a fetched row of timestamps belongs to (the Python half of a Span)."""
  cell: int
  micro_batch: int
  phase: str


# A span's phase travels in the fetched rows as its index here.
PHASES = (FORWARD, BACKWARD, WEIGHT_GRADIENT)


def fetches(spans: Sequence[Span]) -> list[tf.Tensor]:
  """Per device, one float64 [spans, 5] tensor on that device (one transfer each):
  each span's start and end timestamps, then its cell, micro-batch and phase index.

  The keys are constants of the graph, fetched with the timestamps, so a fetched
  step describes itself (`Schedule.from_fetched`): nothing about it is kept on the
  Python side while tracing.
  """
  by_device: dict[str, list[Span]] = {}
  for span in spans:
    by_device.setdefault(span.device, []).append(span)
  tensors = []
  for device, device_spans in by_device.items():
    keys = [[s.cell, s.micro_batch, PHASES.index(s.phase)] for s in device_spans]
    with tf.device(device):
      times = tf.stack([tf.stack([s.start, s.end]) for s in device_spans])
      tensors.append(tf.concat([times, tf.constant(keys, tf.float64)], axis=1))
  return tensors


def _union_length(intervals: np.ndarray) -> float:
  """Total length covered by [start, end] rows (overlapping calls count once)."""
  total, current_start, current_end = 0.0, None, None
  for start, end in sorted(map(tuple, intervals)):
    if current_end is None or start > current_end:
      if current_end is not None:
        total += current_end - current_start
      current_start, current_end = start, end
    else:
      current_end = max(current_end, end)
  if current_end is not None:
    total += current_end - current_start
  return total


@dataclasses.dataclass
class Schedule:
  """The measured schedule of one step.

  times: float64 [num_spans, 2] (start, end) in seconds from the step's first start;
  keys: the (cell, micro_batch, phase) of each row.
  """
  times: np.ndarray
  keys: list[SpanKey]

  @classmethod
  def from_fetched(cls, fetched: Sequence[np.ndarray]) -> Schedule:
    """From the fetched values of `fetches(spans)`: float64 [spans, 5] per device."""
    rows = np.concatenate([np.asarray(t, np.float64).reshape(-1, 5) for t in fetched])
    keys = [SpanKey(int(cell), int(micro_batch), PHASES[int(phase)])
            for cell, micro_batch, phase in rows[:, 2:]]
    return cls.from_spans(rows[:, :2], keys)

  @classmethod
  def from_spans(cls, times: np.ndarray, keys: Sequence[SpanKey]) -> Schedule:
    """times: [spans, 2] absolute (start, end) seconds; keys: what each row is."""
    times = np.asarray(times, np.float64).reshape(-1, 2)
    if len(keys) != len(times):
      raise ValueError(f"{len(times)} spans for {len(keys)} keys")
    return cls(times - times[:, 0].min(), list(keys))

  @property
  def num_cells(self) -> int:
    return 1 + max(k.cell for k in self.keys)

  @property
  def num_micro_batches(self) -> int:
    return 1 + max(k.micro_batch for k in self.keys)

  @property
  def duration(self) -> float:
    """Seconds from the first cell call's start to the last one's end."""
    return float(self.times[:, 1].max())

  def busy_fractions(self) -> list[float]:
    """Per cell: the fraction of the step its device spent in that cell's calls."""
    duration = max(self.duration, 1e-12)
    return [_union_length(self.times[[k.cell == c for k in self.keys]]) / duration
            for c in range(self.num_cells)]

  def bubble(self) -> float:
    """Measured idle fraction: 1 − the mean busy fraction over cells."""
    return 1.0 - float(np.mean(self.busy_fractions()))

  def theoretical_bubble(self) -> float:
    """GPipe's fill-drain bubble (K−1)/(M+K−1), for equal cells and free transfers."""
    k, m = self.num_cells, self.num_micro_batches
    return (k - 1) / (m + k - 1)

  def cell_orders(self) -> list[list[Action]]:
    """Per cell, its forward and backward calls in the order they started: the
    schedule's actions as the device actually ran them (deferred weight-gradient calls,
    which no schedule lists, are left out)."""
    orders: list[list[tuple[float, Action]]] = [[] for _ in range(self.num_cells)]
    for (start, _), key in zip(self.times, self.keys):
      if key.phase in (FORWARD, BACKWARD):
        orders[key.cell].append((start, Action(key.phase, key.micro_batch)))
    return [[action for _, action in sorted(cell, key=lambda t: t[0])] for cell in orders]

  def followed(self, plan: PipelineSchedule) -> list[bool]:
    """Per cell, whether it ran exactly the planned actions in the planned order."""
    return [list(ran) == list(planned) for ran, planned in zip(self.cell_orders(),
                                                               plan.actions)]

  def summary(self, plan: PipelineSchedule | None = None) -> dict[str, float]:
    """Named scalars for TensorBoard (and logs); with the `plan`, also its simulated
    bubble and the fraction of cells that ran its order."""
    out = {f"pipeline/busy_fraction/cell_{c}": f for c, f in enumerate(self.busy_fractions())}
    out["pipeline/bubble_measured"] = self.bubble()
    out["pipeline/bubble_theoretical"] = self.theoretical_bubble()
    out["pipeline/schedule_seconds"] = self.duration
    if plan is not None:
      out["pipeline/bubble_planned"] = plan.bubble()
      out["pipeline/cells_following_plan"] = float(np.mean(self.followed(plan)))
    return out
