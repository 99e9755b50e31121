"""The measured pipeline schedule: when each cell ran each action, forward and back.

Each device's loop (device_loop.py) takes two `tf.timestamp()`s per action on the
device, the first once the action's inputs are there, the second once its results
are made and sent on, and returns them with what each action is as one float64
[actions, 5] tensor: a `CellTimes`. They are ops of the step itself, so they measure
the schedule the devices actually ran, without a profiler.

`fetches(cell_times)` gives one tensor per device (one transfer each);
`MeasuredTimeline.from_fetched` turns the fetched numbers back into spans, and from them come
each cell's and each device's busy fraction, the measured bubble beside GPipe's
(D−1)/(U+D−1) over U = M·S units, and the plan simulated with the step's own call
times (`planned`);
`schedule_chart` draws them for TensorBoard.

Timestamps are wall-clock seconds of the host running the device: cells on one host
(logical devices, one worker process per device) share a clock; across hosts the
schedule is as good as their clock synchronization. On a GPU, ops are timed when the
host dispatches them, not when the kernels run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import tensorflow as tf

from lingvo_gpipe.pipeline.schedule import (
  BACKWARD,
  FORWARD,
  WEIGHT_GRADIENT,
  Action,
  PipelineSchedule,
  idle_fraction,
)


@dataclasses.dataclass(frozen=True)
class CellTimes:
  """One cell's actions in one step, on `device`: float64 [actions, 5] rows of start
  and end timestamps, then the cell, unit and phase index (PHASES)."""
  device: str
  rows: tf.Tensor


@dataclasses.dataclass(frozen=True)
class SpanKey:
  """What a fetched row of timestamps belongs to (the Python half of a Span)."""
  cell: int
  unit: int
  phase: str


# A span's phase travels in the fetched rows as its index here.
PHASES = (FORWARD, BACKWARD, WEIGHT_GRADIENT)


def fetches(cell_times: Sequence[CellTimes]) -> list[tf.Tensor]:
  """Per device, one float64 [spans, 5] tensor on that device (one transfer each): the
  rows of every cell there.

  The keys are constants of the graph, fetched with the timestamps, so a fetched
  step describes itself (`MeasuredTimeline.from_fetched`): nothing about it is kept on the
  Python side while tracing.
  """
  by_device: dict[str, list[tf.Tensor]] = {}
  for times in cell_times:
    by_device.setdefault(times.device, []).append(times.rows)
  tensors = []
  for device, rows in by_device.items():
    with tf.device(device):
      tensors.append(rows[0] if len(rows) == 1 else tf.concat(rows, axis=0))
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
class MeasuredTimeline:
  """The measured schedule of one step.

  times: float64 [num_spans, 2] (start, end) in seconds from the step's first start;
  keys: the (cell, unit, phase) of each row; devices: int [num_spans], the
  device (loop) that ran each row (default: each cell its own).
  """
  times: np.ndarray
  keys: list[SpanKey]
  devices: np.ndarray | None = None

  def __post_init__(self):
    if self.devices is None:
      self.devices = np.array([k.cell for k in self.keys], np.int64)

  @classmethod
  def from_fetched(cls, fetched: Sequence[np.ndarray]) -> MeasuredTimeline:
    """From the fetched values of `fetches(spans)`: float64 [spans, 5] per device."""
    per_device = [np.asarray(t, np.float64).reshape(-1, 5) for t in fetched]
    rows = np.concatenate(per_device)
    keys = [SpanKey(int(cell), int(unit), PHASES[int(phase)])
            for cell, unit, phase in rows[:, 2:]]
    devices = np.concatenate([np.full(len(t), d, np.int64) for d, t in enumerate(per_device)])
    return cls.from_spans(rows[:, :2], keys, devices)

  @classmethod
  def from_spans(cls, times: np.ndarray, keys: Sequence[SpanKey],
                 devices: Sequence[int] | None = None) -> MeasuredTimeline:
    """times: [spans, 2] absolute (start, end) seconds; keys: what each row is;
    devices: the device of each row (default: each cell its own)."""
    times = np.asarray(times, np.float64).reshape(-1, 2)
    if len(keys) != len(times):
      raise ValueError(f"{len(times)} spans for {len(keys)} keys")
    return cls(times - times[:, 0].min(), list(keys),
               None if devices is None else np.asarray(devices, np.int64))

  @property
  def num_cells(self) -> int:
    return 1 + max(k.cell for k in self.keys)

  @property
  def num_devices(self) -> int:
    return len(set(self.devices.tolist()))

  @property
  def num_units(self) -> int:
    return 1 + max(k.unit for k in self.keys)

  @property
  def duration(self) -> float:
    """Seconds from the first cell call's start to the last one's end."""
    return float(self.times[:, 1].max())

  def busy_fractions(self) -> list[float]:
    """Per cell: the fraction of the step its device spent in that cell's calls."""
    duration = max(self.duration, 1e-12)
    return [_union_length(self.times[[k.cell == c for k in self.keys]]) / duration
            for c in range(self.num_cells)]

  def device_busy_fractions(self) -> list[float]:
    """Per device: the fraction of the step it spent in calls of any of its cells."""
    duration = max(self.duration, 1e-12)
    return [_union_length(self.times[self.devices == d]) / duration
            for d in sorted(set(self.devices.tolist()))]

  def bubble(self) -> float:
    """Measured idle fraction: 1 − the mean busy fraction over devices."""
    return 1.0 - float(np.mean(self.device_busy_fractions()))

  def theoretical_bubble(self) -> float:
    """GPipe's fill-drain bubble (D−1)/(U+D−1) over these D devices and U units (M·S:
    micro-batches × token slices), for equal cells and free transfers."""
    d, m = self.num_devices, self.num_units
    return (d - 1) / (m + d - 1)

  def action_times(self) -> tuple[list[float], list[float], list[float]]:
    """Per cell, the mean seconds of its forward and backward calls and its weight
    gradients per unit (its W calls' total / U; 0 where it runs none): what
    `PipelineSchedule.simulate` takes to plan with this step's costs."""
    per_phase: dict[tuple[int, str], float] = {}
    for (start, end), key in zip(self.times, self.keys):
      per_phase[(key.cell, key.phase)] = per_phase.get((key.cell, key.phase), 0.0) + end - start
    m = self.num_units
    return tuple([per_phase.get((k, phase), 0.0) / m for k in range(self.num_cells)]
                 for phase in PHASES)

  def planned(self, plan: PipelineSchedule
              ) -> dict[tuple[int, Action], tuple[float, float]]:
    """The plan's simulated timeline with this step's per-cell action times (hand-offs
    free): what the devices would have run without waiting on anything else."""
    # A cell that does not defer has no W calls: its weight gradients are measured
    # inside B and its W time is 0.
    return plan.simulate(*self.action_times())

  def cell_orders(self) -> list[list[Action]]:
    """Per cell, its forward and backward actions in the order they started, as the
    device actually ran them (weight-gradient actions left out)."""
    orders: list[list[tuple[float, Action]]] = [[] for _ in range(self.num_cells)]
    for (start, _), key in zip(self.times, self.keys):
      if key.phase in (FORWARD, BACKWARD):
        orders[key.cell].append((start, Action(key.phase, key.unit)))
    return [[action for _, action in sorted(cell, key=lambda t: t[0])] for cell in orders]

  def followed(self, plan: PipelineSchedule) -> list[bool]:
    """Per cell, whether it ran exactly the planned forwards and backwards in the
    planned order."""
    return [list(ran) == [a for a in planned if a.phase != WEIGHT_GRADIENT]
            for ran, planned in zip(self.cell_orders(), plan.actions)]

  def summary(self, plan: PipelineSchedule | None = None) -> dict[str, float]:
    """Named scalars for TensorBoard (and logs); with the `plan`, also its simulated
    bubble and step with this step's measured action times (`planned`), its bubble
    with equal cells, and the fraction of cells that ran its order."""
    out = {f"pipeline/busy_fraction/cell_{c}": f for c, f in enumerate(self.busy_fractions())}
    out["pipeline/bubble_measured"] = self.bubble()
    out["pipeline/bubble_theoretical"] = self.theoretical_bubble()
    out["pipeline/schedule_seconds"] = self.duration
    if plan is not None:
      planned = self.planned(plan)
      out["pipeline/bubble_planned"] = idle_fraction(planned, plan.num_devices)
      out["pipeline/schedule_seconds_planned"] = max(end for _, end in planned.values())
      out["pipeline/bubble_planned_equal_cells"] = plan.bubble()
      out["pipeline/cells_following_plan"] = float(np.mean(self.followed(plan)))
    return out
