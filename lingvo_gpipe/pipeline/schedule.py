"""Pipeline schedules as data: for each cell, the ordered list of its actions.

An action is the forward (F) or the backward (B, recompute included) of one
micro-batch on one cell. A schedule gives every cell k its list; cell k's device runs
exactly that list, in that order (the executor chains the calls). The dependencies
between cells are fixed by the data:

  F(k, m) needs F(k−1, m)               (its inputs are cell k−1's outputs)
  B(k, m) needs F(k, m) and B(k+1, m)   (its output gradient is cell k+1's input gradient;
                                         the last cell computes the loss itself)

Two schedules, K = 3 cells, M = 4 micro-batches (one column per unit of time, with a
backward twice as long as a forward; `format_table` prints these):

  gpipe (fill-drain: all forwards, then all backwards, newest first)

    cell 0  F0 F1 F2 F3 .. .. .. .. .. .. B3 B3 B2 B2 B1 B1 B0 B0
    cell 1  .. F0 F1 F2 F3 .. .. .. B3 B3 B2 B2 B1 B1 B0 B0 .. ..
    cell 2  .. .. F0 F1 F2 F3 B3 B3 B2 B2 B1 B1 B0 B0 .. .. .. ..

  1f1b (PipeDream-flush, Megatron-LM: cell k runs K−k forwards, then one backward and
  one forward in turn, then drains its backwards)

    cell 0  F0 F1 F2 .. .. .. .. B0 B0 F3 B1 B1 .. B2 B2 .. B3 B3
    cell 1  .. F0 F1 .. .. B0 B0 F2 B1 B1 F3 B2 B2 .. B3 B3 .. ..
    cell 2  .. .. F0 B0 B0 F1 B1 B1 F2 B2 B2 F3 B3 B3 .. .. .. ..

Both have the same bubble, (K−1)/(M+K−1) of each device's time for equal cells;
1F1B's gain is memory: cell k holds at most K−k micro-batches in flight (forward done,
backward not yet) instead of M.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from lingvo_gpipe.core.hyperparams import ParamsError

FORWARD, BACKWARD = "forward", "backward"
# Not an action of a schedule: with weight_gradient_group = G > 1 the executor follows
# every G-th backward of a cell (and its last) with one call that computes the deferred
# weight gradients of those G micro-batches; the timeline records it under this phase.
WEIGHT_GRADIENT = "weight_gradient"


class ScheduleError(ParamsError):
  """A schedule that is not a valid order of actions; the message names the action."""


@dataclasses.dataclass(frozen=True)
class Action:
  """One cell call: the forward or the backward of micro-batch `micro_batch`."""
  phase: str  # FORWARD or BACKWARD
  micro_batch: int

  def __str__(self) -> str:
    return f"{'F' if self.phase == FORWARD else 'B'}{self.micro_batch}"


def forward(m: int) -> Action:
  return Action(FORWARD, m)


def backward(m: int) -> Action:
  return Action(BACKWARD, m)


@dataclasses.dataclass(frozen=True)
class PipelineSchedule:
  """`actions[k]`: cell k's actions in the order its device runs them."""
  name: str
  num_cells: int
  num_micro_batches: int
  actions: tuple[tuple[Action, ...], ...]

  def __post_init__(self):
    self._check_each_cell_runs_each_action_once()
    self.execution_order()  # raises ScheduleError on a deadlock

  def _check_each_cell_runs_each_action_once(self) -> None:
    if len(self.actions) != self.num_cells:
      raise ScheduleError(f"{self.name}: {len(self.actions)} action lists for "
                          f"{self.num_cells} cells")
    want = sorted((phase, m) for m in range(self.num_micro_batches)
                  for phase in (FORWARD, BACKWARD))
    for k, cell_actions in enumerate(self.actions):
      got = sorted((a.phase, a.micro_batch) for a in cell_actions)
      if got != want:
        raise ScheduleError(f"{self.name}: cell {k} must run F0..F{self.num_micro_batches - 1}"
                            f" and B0..B{self.num_micro_batches - 1} once each; it runs "
                            f"{' '.join(map(str, cell_actions))}")
      for i, action in enumerate(cell_actions):
        if action.phase == BACKWARD and forward(action.micro_batch) not in cell_actions[:i]:
          raise ScheduleError(f"{self.name}: cell {k} runs {action} before "
                              f"F{action.micro_batch}")

  def dependencies(self, k: int, action: Action) -> list[tuple[int, Action]]:
    """The (cell, action) pairs of other cells that `action` of cell k needs first."""
    m = action.micro_batch
    if action.phase == FORWARD:
      return [(k - 1, forward(m))] if k > 0 else []
    return [(k + 1, backward(m))] if k + 1 < self.num_cells else []

  def execution_order(self) -> list[tuple[int, Action]]:
    """Every (cell, action) once, each after what it needs and after the actions
    listed before it on its cell: the order in which the executor builds the calls.

    Raises ScheduleError naming the cells that wait on each other if there is none.
    """
    position = [0] * self.num_cells
    done: set[tuple[int, Action]] = set()
    order: list[tuple[int, Action]] = []
    total = 2 * self.num_cells * self.num_micro_batches
    while len(order) < total:
      progressed = False
      for k in range(self.num_cells):
        while position[k] < len(self.actions[k]):
          action = self.actions[k][position[k]]
          if not all(dep in done for dep in self.dependencies(k, action)):
            break
          done.add((k, action))
          order.append((k, action))
          position[k] += 1
          progressed = True
      if not progressed:
        waiting = [f"cell {k} at {self.actions[k][position[k]]}"
                   for k in range(self.num_cells) if position[k] < len(self.actions[k])]
        raise ScheduleError(f"{self.name}: deadlock, no cell can go on ({', '.join(waiting)})")
    return order

  def simulate(self, forward_time: float = 1.0, backward_time: float = 2.0
               ) -> dict[tuple[int, Action], tuple[float, float]]:
    """(start, end) of every action with equal cells, free transfers, one call at a time
    per device: the planned timeline the measured one is compared with."""
    times: dict[tuple[int, Action], tuple[float, float]] = {}
    free = [0.0] * self.num_cells
    for k, action in self.execution_order():
      ready = max([free[k]] + [times[dep][1] for dep in self.dependencies(k, action)])
      end = ready + (forward_time if action.phase == FORWARD else backward_time)
      times[(k, action)] = (ready, end)
      free[k] = end
    return times

  def bubble(self, forward_time: float = 1.0, backward_time: float = 2.0) -> float:
    """Planned idle fraction of the devices over the step (see `simulate`)."""
    times = self.simulate(forward_time, backward_time)
    span = max(end for _, end in times.values())
    busy = self.num_micro_batches * (forward_time + backward_time)
    return 1.0 - busy / span

  def max_in_flight(self, k: int) -> int:
    """The most micro-batches cell k holds between their forward and their backward:
    what its activation memory (inputs kept for re-materialization, or the whole
    forward without it) is proportional to."""
    in_flight = most = 0
    for action in self.actions[k]:
      in_flight += 1 if action.phase == FORWARD else -1
      most = max(most, in_flight)
    return most

  def format_table(self, forward_time: int = 1, backward_time: int = 2) -> str:
    """One row per cell, one column per unit of simulated time ('..' idle)."""
    times = self.simulate(forward_time, backward_time)
    width = int(max(end for _, end in times.values()))
    rows = []
    for k in range(self.num_cells):
      cells = [".."] * width
      for action in self.actions[k]:
        start, end = times[(k, action)]
        for t in range(int(start), int(end)):
          cells[t] = str(action).ljust(2)
      rows.append(f"cell {k}  " + " ".join(cells))
    return "\n".join(rows)

  def __str__(self) -> str:
    return "\n".join(f"cell {k}: {' '.join(map(str, a))}" for k, a in enumerate(self.actions))


def gpipe(num_cells: int, num_micro_batches: int) -> PipelineSchedule:
  """Fill-drain: every cell runs F0..F(M−1), then B(M−1)..B0 (the newest first, whose
  output gradient arrives first)."""
  m = num_micro_batches
  cell = tuple(forward(i) for i in range(m)) + tuple(backward(i) for i in reversed(range(m)))
  return PipelineSchedule("gpipe", num_cells, m, tuple(cell for _ in range(num_cells)))


def one_f_one_b(num_cells: int, num_micro_batches: int) -> PipelineSchedule:
  """PipeDream-flush: cell k runs min(K−k, M) forwards, then alternates one backward
  and one forward while forwards remain, then runs the remaining backwards."""
  m = num_micro_batches
  actions = []
  for k in range(num_cells):
    warmup = min(num_cells - k, m)
    cell = [forward(i) for i in range(warmup)]
    next_forward = warmup
    for i in range(m):
      cell.append(backward(i))
      if next_forward < m:
        cell.append(forward(next_forward))
        next_forward += 1
    actions.append(tuple(cell))
  return PipelineSchedule("1f1b", num_cells, m, tuple(actions))


SCHEDULES: dict[str, Callable[[int, int], PipelineSchedule]] = {
    "gpipe": gpipe, "1f1b": one_f_one_b}


def make(name: str, num_cells: int, num_micro_batches: int) -> PipelineSchedule:
  """The schedule called `name` (one of SCHEDULES) for K cells and M micro-batches."""
  if name not in SCHEDULES:
    raise ScheduleError(f"unknown pipeline schedule {name!r}; valid: {sorted(SCHEDULES)}")
  if num_cells < 1 or num_micro_batches < 1:
    raise ScheduleError(f"a schedule needs num_cells >= 1 and num_micro_batches >= 1, got "
                        f"{num_cells} and {num_micro_batches}")
  return SCHEDULES[name](num_cells, num_micro_batches)


def from_lists(name: str, actions: Sequence[Sequence[str]]) -> PipelineSchedule:
  """A schedule from per-cell lists of 'F<m>' / 'B<m>' strings (tests, custom orders)."""
  parsed = []
  for k, cell in enumerate(actions):
    row = []
    for text in cell:
      if text[:1] not in ("F", "B") or not text[1:].isdigit():
        raise ScheduleError(f"{name}: cell {k}: bad action {text!r}; write F<m> or B<m>")
      row.append((forward if text[0] == "F" else backward)(int(text[1:])))
    parsed.append(tuple(row))
  num_micro = 1 + max((a.micro_batch for row in parsed for a in row), default=-1)
  return PipelineSchedule(name, len(parsed), num_micro, tuple(parsed))
