"""Pipeline schedules as data: for each cell, the ordered list of its actions.

An action is the forward (F) or the backward (B, recompute included) of one
micro-batch on one cell, or (W) the deferred weight gradients of the backwards the
cell ran since its previous W (only in cells that defer them: `with_weight_gradients`).
A schedule gives every cell k its list; cell k's device runs exactly that list, in
that order, as one loop (device_loop.py). The dependencies between cells are fixed by
the data:

  F(k, m) needs F(k−1, m)               (its inputs are cell k−1's outputs)
  B(k, m) needs F(k, m) and B(k+1, m)   (its output gradient is cell k+1's input gradient;
                                         the last cell computes the loss itself)
  W(k, m) needs B(k, m)                 (it ends a group of backwards; m is the group's last)

Hand-offs between neighbouring cells are matched first-in first-out per link
(channels.py), so both ends of a link must list its transfers in the same order:
cell k's forwards in the order of cell k+1's, cell k+1's backwards in the order of
cell k's. `PipelineSchedule` refuses a schedule where they differ, naming the link.

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

FORWARD, BACKWARD, WEIGHT_GRADIENT = "forward", "backward", "weight_gradient"
_LETTERS = {FORWARD: "F", BACKWARD: "B", WEIGHT_GRADIENT: "W"}


class ScheduleError(ParamsError):
  """A schedule that is not a valid order of actions; the message names the action."""


@dataclasses.dataclass(frozen=True)
class Action:
  """One cell call: the forward or the backward of micro-batch `micro_batch`, or the
  weight gradients of the backwards since the cell's previous W, the last of them
  being `micro_batch`'s."""
  phase: str  # FORWARD, BACKWARD or WEIGHT_GRADIENT
  micro_batch: int

  def __str__(self) -> str:
    return f"{_LETTERS[self.phase]}{self.micro_batch}"


def forward(m: int) -> Action:
  return Action(FORWARD, m)


def backward(m: int) -> Action:
  return Action(BACKWARD, m)


def weight_gradient(m: int) -> Action:
  return Action(WEIGHT_GRADIENT, m)


@dataclasses.dataclass(frozen=True)
class PipelineSchedule:
  """`actions[k]`: cell k's actions in the order its device runs them."""
  name: str
  num_cells: int
  num_micro_batches: int
  actions: tuple[tuple[Action, ...], ...]

  def __post_init__(self):
    self._check_each_cell_runs_each_action_once()
    self._check_links_carry_the_same_order()
    self.execution_order()  # raises ScheduleError on a deadlock

  def _error(self, k: int, position: int, why: str) -> ScheduleError:
    """`why`, with cell k's list printed and its action at `position` marked."""
    listed = " ".join(f">{a}<" if i == position else str(a)
                      for i, a in enumerate(self.actions[k]))
    return ScheduleError(f"{self.name}: cell {k} {why}\n  cell {k}: {listed}")

  def _check_each_cell_runs_each_action_once(self) -> None:
    if len(self.actions) != self.num_cells:
      raise ScheduleError(f"{self.name}: {len(self.actions)} action lists for "
                          f"{self.num_cells} cells")
    last = self.num_micro_batches - 1
    for k, cell_actions in enumerate(self.actions):
      seen: set[Action] = set()
      pending_weights = False  # a backward ran since the last W (cells that defer)
      defers = any(a.phase == WEIGHT_GRADIENT for a in cell_actions)
      for i, action in enumerate(cell_actions):
        if not 0 <= action.micro_batch <= last or action in seen:
          raise self._error(k, i, f"must run F0..F{last} and B0..B{last} once each; "
                                  f"{action} is {'repeated' if action in seen else 'unknown'}")
        seen.add(action)
        if action.phase == BACKWARD and forward(action.micro_batch) not in seen:
          raise self._error(k, i, f"runs {action} before F{action.micro_batch}")
        if action.phase == WEIGHT_GRADIENT and (
            not pending_weights or backward(action.micro_batch) not in seen):
          raise self._error(k, i, f"runs {action} with no backward since its previous W "
                                  f"or before B{action.micro_batch}")
        pending_weights = (pending_weights or action.phase == BACKWARD) and (
            action.phase != WEIGHT_GRADIENT)
      if len([a for a in seen if a.phase != WEIGHT_GRADIENT]) != 2 * self.num_micro_batches:
        raise ScheduleError(f"{self.name}: cell {k} must run F0..F{last} and B0..B{last} "
                            f"once each; it runs {' '.join(map(str, cell_actions))}")
      if defers and pending_weights:
        raise self._error(k, len(cell_actions) - 1,
                          "ends with backwards whose weight gradients no W computes")

  def link_orders(self, k: int) -> tuple[list[int], list[int], list[int], list[int]]:
    """For the link between cells k and k+1: the micro-batches of cell k's forwards
    (sent), cell k+1's forwards (received), cell k+1's backwards (sent back) and
    cell k's backwards (received), each in list order."""
    def order(cell: int, phase: str) -> list[int]:
      return [a.micro_batch for a in self.actions[cell] if a.phase == phase]
    return (order(k, FORWARD), order(k + 1, FORWARD), order(k + 1, BACKWARD),
            order(k, BACKWARD))

  def _check_links_carry_the_same_order(self) -> None:
    for k in range(self.num_cells - 1):
      sent, received, sent_back, received_back = self.link_orders(k)
      for direction, a, b, sender, receiver, phase in (
          ("forward", sent, received, k, k + 1, FORWARD),
          ("backward", sent_back, received_back, k + 1, k, BACKWARD)):
        if a != b:
          i = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
          position = [j for j, act in enumerate(self.actions[receiver])
                      if act.phase == phase][i]
          raise self._error(
              receiver, position,
              f"receives on the {direction} link between cells {min(sender, receiver)} "
              f"and {max(sender, receiver)} in another order than cell {sender} sends: "
              f"micro-batches {' '.join(map(str, b))} against "
              f"{' '.join(map(str, a))}; hand-offs are matched first in, first out")

  def dependencies(self, k: int, action: Action) -> list[tuple[int, Action]]:
    """The (cell, action) pairs of other cells that `action` of cell k needs first."""
    m = action.micro_batch
    if action.phase == FORWARD:
      return [(k - 1, forward(m))] if k > 0 else []
    if action.phase == WEIGHT_GRADIENT:
      return []  # its own backward comes earlier in its list
    return [(k + 1, backward(m))] if k + 1 < self.num_cells else []

  def execution_order(self) -> list[tuple[int, Action]]:
    """Every (cell, action) once, each after what it needs and after the actions
    listed before it on its cell (a check that the loops cannot deadlock; the simulator's order).

    Raises ScheduleError naming the cells that wait on each other if there is none.
    """
    position = [0] * self.num_cells
    done: set[tuple[int, Action]] = set()
    order: list[tuple[int, Action]] = []
    total = sum(len(cell) for cell in self.actions)
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

  def simulate(self, forward_time: float = 1.0, backward_time: float = 2.0,
               weight_time: float = 0.0) -> dict[tuple[int, Action], tuple[float, float]]:
    """(start, end) of every action with equal cells, free transfers, one call at a time
    per device: the planned timeline the measured one is compared with."""
    times: dict[tuple[int, Action], tuple[float, float]] = {}
    free = [0.0] * self.num_cells
    duration = {FORWARD: forward_time, BACKWARD: backward_time, WEIGHT_GRADIENT: weight_time}
    for k, action in self.execution_order():
      ready = max([free[k]] + [times[dep][1] for dep in self.dependencies(k, action)])
      end = ready + duration[action.phase]
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
      in_flight += {FORWARD: 1, BACKWARD: -1, WEIGHT_GRADIENT: 0}[action.phase]
      most = max(most, in_flight)
    return most

  def with_weight_gradients(self, group: int, cells: Sequence[int]) -> PipelineSchedule:
    """This schedule with a W after every `group`-th backward of each of `cells` (the
    cells that defer their weight gradients) and after its last backward."""
    if group <= 1 or not cells:
      return self
    actions = []
    for k, cell_actions in enumerate(self.actions):
      row, since = [], 0
      last_backward = [a for a in cell_actions if a.phase == BACKWARD][-1]
      for action in cell_actions:
        row.append(action)
        if k in cells and action.phase == BACKWARD:
          since += 1
          if since == group or action == last_backward:
            row.append(weight_gradient(action.micro_batch))
            since = 0
      actions.append(tuple(row))
    return PipelineSchedule(self.name, self.num_cells, self.num_micro_batches, tuple(actions))

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
  """A schedule from per-cell lists of 'F<m>' / 'B<m>' / 'W<m>' strings (tests, custom
  orders)."""
  parsed = []
  phases = {letter: phase for phase, letter in _LETTERS.items()}
  for k, cell in enumerate(actions):
    row = []
    for text in cell:
      if text[:1] not in phases or not text[1:].isdigit():
        raise ScheduleError(f"{name}: cell {k}: bad action {text!r}; write F<m>, B<m> or W<m>")
      row.append(Action(phases[text[0]], int(text[1:])))
    parsed.append(tuple(row))
  num_micro = 1 + max((a.micro_batch for row in parsed for a in row), default=-1)
  return PipelineSchedule(name, len(parsed), num_micro, tuple(parsed))
