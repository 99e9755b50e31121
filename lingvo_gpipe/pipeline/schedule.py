"""Pipeline schedules as data: for each cell, the ordered list of its actions.

An action is the forward (F) or the backward (B, recompute included) of one unit
(a micro-batch; with token slices, a slice of one) on one cell, or (W) the deferred
weight gradients of the backwards the cell ran since its previous W, up to the unit
it names (only in cells that
defer them: `with_weight_gradients`; every cell under the split-backward schedules,
SPLIT_BACKWARD: zb_h1, zbv, interleaved_zb). Cell k runs on device `device_of[k]`;
each device runs its cells' actions in one order (`device_orders`), as one loop
(device_loop.py). The dependencies between cells are fixed by the data:

  F(k, m) needs F(k−1, m)               (its inputs are cell k−1's outputs)
  B(k, m) needs F(k, m) and B(k+1, m)   (its output gradient is cell k+1's input gradient;
                                         the last cell computes the loss itself)
  W(k, m) needs B(k, m)                 (listed after it on its cell)

Hand-offs between neighbouring cells are matched first-in first-out per link
(channels.py), so both ends of a link must list its transfers in the same order:
cell k's forwards in the order of cell k+1's, cell k+1's backwards in the order of
cell k's. `PipelineSchedule` refuses a schedule where they differ, naming the link,
and one whose device orders can deadlock, naming the waiting cells.

The schedules, K = 3 cells, M = 4 micro-batches, one column per unit of time: F, B
and W equal, a backward that includes its weight gradients twice as long
(`format_table` prints these):

  gpipe (fill-drain: all forwards, then all backwards, newest first)

    cell 0  F0 F1 F2 F3 .. .. .. .. .. .. B3 B3 B2 B2 B1 B1 B0 B0
    cell 1  .. F0 F1 F2 F3 .. .. .. B3 B3 B2 B2 B1 B1 B0 B0 .. ..
    cell 2  .. .. F0 F1 F2 F3 B3 B3 B2 B2 B1 B1 B0 B0 .. .. .. ..

  1f1b (PipeDream-flush, Megatron-LM: cell k runs K−k forwards, then one backward and
  one forward in turn, then drains its backwards)

    cell 0  F0 F1 F2 .. .. .. .. B0 B0 F3 B1 B1 .. B2 B2 .. B3 B3
    cell 1  .. F0 F1 .. .. B0 B0 F2 B1 B1 F3 B2 B2 .. B3 B3 .. ..
    cell 2  .. .. F0 B0 B0 F1 B1 B1 F2 B2 B2 F3 B3 B3 .. .. .. ..

  zb_h1 (zero bubble, Qi et al. 2024: 1F1B with B and W apart; cell k runs the W of
  micro-batch i − k after the B of i, and so fills the cool-down with weight gradients)

    cell 0  F0 F1 F2 .. .. B0 W0 F3 B1 W1 B2 W2 B3 W3
    cell 1  .. F0 F1 .. B0 F2 B1 W0 F3 B2 W1 B3 W2 W3
    cell 2  .. .. F0 B0 F1 B1 F2 B2 W0 F3 B3 W1 W2 W3

  interleaved_1f1b (Megatron-LM 2021: D devices hold V cells each, cell k on device
  k mod D; the devices run 1F1B over their cells in rounds of D micro-batches, or of
  near-equal sizes where D does not divide M)

  zbv (ZB-V, Qi et al. 2024: D devices hold two cells each in a V, device d cells d
  and K−1−d; B and W apart, `zero_bubble_v`)

  interleaved_zb (ZB-1P over interleaved cells: interleaved_1f1b's placement and
  rounds, B and W apart, each W in a bubble; `interleaved_zero_bubble`)

Token slices (TeraPipe, Li et al. 2021; `num_token_slices` S > 1, causal sequence
models only: core/token_slices.py): each micro-batch m is cut along the sequence into
S slices j, and the schedule's unit is (m, j), numbered u = m·S + j. An action names
a unit (`Action.unit`); a schedule runs `num_units` U = M·S of them (`micro_batches`
M, `slices` S); without token slices a unit is a micro-batch. Besides the
dependencies above, on each cell

  F(k, (m, j)) comes after F(k, (m, j−1))   (slice j reads the cache slices < j left)
  B(k, (m, j−1)) comes after B(k, (m, j))   (the cache's gradient flows back from
                                             later slices to earlier ones)

which `PipelineSchedule` checks, naming the action. gpipe and 1f1b run over units;
1f1b's backwards take each micro-batch's slices newest first and its warm-up is
S + K−k−1 units (the last cell's first backward needs all S slices of micro-batch 0).
K = 3, M = 2, S = 2 (F = B = 1 per slice, `format_table(1, 1, 0)`; labels m.j):

  gpipe
    cell 0  F0.0 F0.1 F1.0 F1.1 .... .... .... .... B1.1 B1.0 B0.1 B0.0
    cell 1  .... F0.0 F0.1 F1.0 F1.1 .... .... B1.1 B1.0 B0.1 B0.0 ....
    cell 2  .... .... F0.0 F0.1 F1.0 F1.1 B1.1 B1.0 B0.1 B0.0 .... ....

  1f1b
    cell 0  F0.0 F0.1 F1.0 F1.1 .... .... B0.1 .... B0.0 .... B1.1 B1.0
    cell 1  .... F0.0 F0.1 F1.0 .... B0.1 F1.1 B0.0 .... B1.1 B1.0 ....
    cell 2  .... .... F0.0 F0.1 B0.1 F1.0 B0.0 F1.1 B1.1 B1.0 .... ....

A pipeline of K cells over M micro-batches idles (K−1)/(M+K−1) of the step; over
M·S slices of 1/S the work each, (K−1)/(M·S+K−1).

Idle time per device (equal cells, free hand-offs; F, B and W the times of one
micro-batch on a device's layers; the bubble, `bubble`, is idle / (M(F+B+W) + idle)):

  schedule          idle per device     micro-batches held (forward done, not finished)
  gpipe, 1f1b       (K−1)(F+B+W)        M per cell (gpipe); K−k on cell k (1f1b)
  zb_h1             (K−1)(F+B−W)        up to K on every cell: 1F1B's peak (cell 0's)
  interleaved_1f1b  (D−1)(F+B+W)/V      device d: up to 2(D−d−1)+(V−1)P+1 of its cells'
                                        micro-batches, each 1/V of the device's layers
                                        (P: the first round's size, D where D divides M)
  zbv               about half zb_h1's  up to 2D of its two cells', each half of the
                    (simulated)         device's layers: 1F1B's peak
  interleaved_zb    as zbv (simulated)  interleaved_1f1b's warm-up, less D−d−1, + 1, and
                                        each B's products until its W
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import re
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from lingvo_gpipe.core import near_equal
from lingvo_gpipe.core.hyperparams import ParamsError

_COMPACT_ACTION = re.compile(r"(\d+)([FBIW])(\d+)")

FORWARD, BACKWARD, WEIGHT_GRADIENT = "forward", "backward", "weight_gradient"
_LETTERS = {FORWARD: "F", BACKWARD: "B", WEIGHT_GRADIENT: "W"}


class ScheduleError(ParamsError):
  """A schedule that is not a valid order of actions; the message names the action."""


@dataclasses.dataclass(frozen=True)
class Action:
  """One cell call: the forward or the backward of unit `unit` (a micro-batch, or a
  token slice of one), or the weight gradients of the backwards since the cell's
  previous W, the last of them being `unit`'s."""
  phase: str  # FORWARD, BACKWARD or WEIGHT_GRADIENT
  unit: int

  def __str__(self) -> str:
    return f"{_LETTERS[self.phase]}{self.unit}"


def forward(m: int) -> Action:
  return Action(FORWARD, m)


def backward(m: int) -> Action:
  return Action(BACKWARD, m)


def weight_gradient(m: int) -> Action:
  return Action(WEIGHT_GRADIENT, m)


Times = float | Sequence[float]  # one for every cell, or one per cell


def cell_lists(device_orders: Sequence[Sequence[tuple[int, Action]]], num_cells: int
               ) -> tuple[tuple[Action, ...], ...]:
  """Each cell's actions in the order its device runs them, taken from the devices'
  orders of (cell, action) pairs."""
  return tuple(tuple(a for order in device_orders for c, a in order if c == k)
               for k in range(num_cells))


class _WeightGroups(NamedTuple):
  """A cell's backwards grouped by its W actions (`of`): groups, per W (by unit), the
  units of the backwards since the previous W up to its own; left, the backwards after
  the last W; orphan, the position of the first W with no backward of its own pending
  (its B has not run, or an earlier W took it), or None."""
  groups: dict[int, list[int]]
  left: list[int]
  orphan: int | None

  @classmethod
  def of(cls, cell_actions: Sequence[Action]) -> _WeightGroups:
    groups: dict[int, list[int]] = {}
    pending: list[int] = []
    for i, action in enumerate(cell_actions):
      if action.phase == BACKWARD:
        pending.append(action.unit)
      elif action.phase == WEIGHT_GRADIENT:
        if action.unit not in pending:
          return cls(groups, pending, i)
        cut = pending.index(action.unit) + 1
        groups[action.unit], pending = pending[:cut], pending[cut:]
    return cls(groups, pending, None)


def _per_cell(value: Times, num_cells: int, what: str) -> list[float]:
  if isinstance(value, (int, float)):
    return [float(value)] * num_cells
  values = [float(v) for v in value]
  if len(values) != num_cells:
    raise ScheduleError(f"{what}: {len(values)} times for {num_cells} cells")
  return values


def idle_fraction(times: dict[Any, tuple[float, float]], num_devices: int) -> float:
  """1 − busy / (devices × span) of a simulated timeline (calls never overlap on a
  device)."""
  span = max(end for _, end in times.values())
  busy = sum(end - start for start, end in times.values())
  return 1.0 - busy / (num_devices * span) if span > 0 else 0.0


@dataclasses.dataclass(frozen=True)
class PipelineSchedule:
  """`actions[k]`: cell k's actions in order. `device_of[k]`: the device (an index) cell
  k runs on, and `device_orders[d]`: the (cell, action) pairs device d runs, in order,
  as one loop. By default every cell has a device of its own (device_of[k] = k).
  Several cells on one device (interleaved virtual stages, round-robin placement)
  need the device's order; `on_devices` derives one from the simulated timeline."""
  name: str
  num_cells: int
  num_units: int  # U = M·S: micro-batches × token slices
  actions: tuple[tuple[Action, ...], ...]
  device_of: tuple[int, ...] = ()
  device_orders: tuple[tuple[tuple[int, Action], ...], ...] = ()
  slices: int = 1  # S: unit u is slice u mod S of micro-batch u // S

  def __post_init__(self):
    if not self.device_of:
      object.__setattr__(self, "device_of", tuple(range(self.num_cells)))
    if not self.device_orders:
      if len(set(self.device_of)) != len(self.device_of):
        raise ScheduleError(f"{self.name}: cells share devices {list(self.device_of)}; "
                            "give each device's order (device_orders, or on_devices)")
      object.__setattr__(self, "device_orders", tuple(
          tuple((k, a) for a in self.actions[k]) for k in range(len(self.actions))))
    self._check_each_cell_runs_each_action_once()
    self._check_slices_in_order()
    self._check_devices_run_their_cells_in_order()
    self._check_links_carry_the_same_order()
    self.execution_order()  # raises ScheduleError on a deadlock

  @property
  def num_devices(self) -> int:
    return len(self.device_orders)

  @property
  def micro_batches(self) -> int:
    """M: the micro-batches the units are slices of (U / S)."""
    return self.num_units // self.slices

  def label(self, action: Action) -> str:
    """'F3', or with token slices 'F<m>.<j>' (micro-batch m, slice j)."""
    if self.slices == 1:
      return str(action)
    m, j = divmod(action.unit, self.slices)
    return f"{_LETTERS[action.phase]}{m}.{j}"

  def _error(self, k: int, position: int, why: str) -> ScheduleError:
    """`why`, with cell k's list printed and its action at `position` marked."""
    listed = " ".join(f">{self.label(a)}<" if i == position else self.label(a)
                      for i, a in enumerate(self.actions[k]))
    return ScheduleError(f"{self.name}: cell {k} {why}\n  cell {k}: {listed}")

  def _check_slices_in_order(self) -> None:
    """Each cell runs a micro-batch's slices' forwards in slice order and their
    backwards in reverse (module docstring)."""
    s = self.slices
    if not is_slice_count(s) or self.num_units % s:
      raise ScheduleError(f"{self.name}: num_token_slices={s} must be an int >= 1 dividing "
                          f"the {self.num_units} units")
    if s == 1:
      return
    for k, cell_actions in enumerate(self.actions):
      done: set[Action] = set()
      for i, action in enumerate(cell_actions):
        m, j = divmod(action.unit, s)
        if action.phase == FORWARD and j > 0 and forward(action.unit - 1) not in done:
          raise self._error(k, i, f"runs {self.label(action)} before F{m}.{j - 1}: a slice "
                                  "reads the cache its micro-batch's earlier slices leave")
        if (action.phase == BACKWARD and j < s - 1
            and backward(action.unit + 1) not in done):
          raise self._error(k, i, f"runs {self.label(action)} before B{m}.{j + 1}: the "
                                  "gradient of a slice's cache comes from the later slices")
        done.add(action)

  def _check_each_cell_runs_each_action_once(self) -> None:
    if len(self.actions) != self.num_cells or len(self.device_of) != self.num_cells:
      raise ScheduleError(f"{self.name}: {len(self.actions)} action lists and "
                          f"{len(self.device_of)} devices for {self.num_cells} cells")
    last = self.num_units - 1
    for k, cell_actions in enumerate(self.actions):
      seen: set[Action] = set()
      for i, action in enumerate(cell_actions):
        if not 0 <= action.unit <= last or action in seen:
          raise self._error(k, i, f"must run F0..F{last} and B0..B{last} once each; "
                                  f"{action} is {'repeated' if action in seen else 'unknown'}")
        seen.add(action)
        if action.phase == BACKWARD and forward(action.unit) not in seen:
          raise self._error(k, i, f"runs {action} before F{action.unit}")
      if len([a for a in seen if a.phase != WEIGHT_GRADIENT]) != 2 * self.num_units:
        raise ScheduleError(f"{self.name}: cell {k} must run F0..F{last} and B0..B{last} "
                            f"once each; it runs {' '.join(map(str, cell_actions))}")
      groups = _WeightGroups.of(cell_actions)
      if groups.orphan is not None:
        action = cell_actions[groups.orphan]
        raise self._error(k, groups.orphan,
                          f"runs {action} with no backward of its own to finish: "
                          f"B{action.unit} has not run, or an earlier W computed its "
                          "weight gradients")
      if groups.groups and groups.left:
        raise self._error(k, len(cell_actions) - 1,
                          "ends with backwards whose weight gradients no W computes")

  def _check_devices_run_their_cells_in_order(self) -> None:
    for d, order in enumerate(self.device_orders):
      for k in {k for k, _ in order}:
        if self.device_of[k] != d or tuple(a for c, a in order if c == k) != self.actions[k]:
          raise ScheduleError(f"{self.name}: device {d}'s order does not run cell {k}'s "
                              "actions as listed")
    if sum(len(o) for o in self.device_orders) != sum(len(a) for a in self.actions):
      raise ScheduleError(f"{self.name}: the devices' orders leave out actions")

  def link_orders(self, k: int) -> tuple[list[int], list[int], list[int], list[int]]:
    """For the link between cells k and k+1: the units of cell k's forwards
    (sent), cell k+1's forwards (received), cell k+1's backwards (sent back) and
    cell k's backwards (received), each in list order."""
    def order(cell: int, phase: str) -> list[int]:
      return [a.unit for a in self.actions[cell] if a.phase == phase]
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
              f"units {' '.join(map(str, b))} against "
              f"{' '.join(map(str, a))}; hand-offs are matched first in, first out")

  def dependencies(self, k: int, action: Action) -> list[tuple[int, Action]]:
    """The (cell, action) pairs of other cells that `action` of cell k needs first."""
    m = action.unit
    if action.phase == FORWARD:
      return [(k - 1, forward(m))] if k > 0 else []
    if action.phase == WEIGHT_GRADIENT:
      return []  # its own backward comes earlier in its list
    return [(k + 1, backward(m))] if k + 1 < self.num_cells else []

  def execution_order(self) -> list[tuple[int, Action]]:
    """Every (cell, action) once, each after what it needs and after the actions
    listed before it on its device (a check that the loops cannot deadlock; the
    simulator's order).

    Raises ScheduleError naming the cells that wait on each other if there is none.
    """
    position = [0] * self.num_devices
    done: set[tuple[int, Action]] = set()
    order: list[tuple[int, Action]] = []
    total = sum(len(cell) for cell in self.device_orders)
    while len(order) < total:
      progressed = False
      for d, device_order in enumerate(self.device_orders):
        while position[d] < len(device_order):
          entry = device_order[position[d]]
          if not all(dep in done for dep in self.dependencies(*entry)):
            break
          done.add(entry)
          order.append(entry)
          position[d] += 1
          progressed = True
      if not progressed:
        waiting = [f"cell {order[position[d]][0]} at {order[position[d]][1]}"
                   for d, order in enumerate(self.device_orders) if position[d] < len(order)]
        raise ScheduleError(f"{self.name}: deadlock, no cell can go on ({', '.join(waiting)})")
    return order

  def defers(self, k: int) -> bool:
    """Whether cell k computes weight gradients in W actions of their own."""
    return any(a.phase == WEIGHT_GRADIENT for a in self.actions[k])

  def weight_groups(self, k: int) -> dict[int, list[int]]:
    """Per W action of cell k (by unit): the units whose weight
    gradients it computes, the backwards since the previous W up to its own."""
    return _WeightGroups.of(self.actions[k]).groups

  def simulate(self, forward_time: Times = 1.0, backward_time: Times = 1.0,
               weight_time: Times = 1.0, transfer_time: float = 0.0,
               cores: float | None = None
               ) -> dict[tuple[int, Action], tuple[float, float]]:
    """(start, end) of every action, one call at a time per device: the planned
    timeline the measured one is compared with, and the planner's step.

    Times are per unit, one value or one per cell: the forward, the backward's
    input gradients, and the weight gradients, which a cell that defers them runs in
    its W actions (a W of n units takes n·weight_time) and the others inside
    their backward. `transfer_time` is added to every hand-off between devices.
    `cores`: where fewer than the devices compute at once at full speed (devices
    sharing a host's cores), n > cores devices with an action ready each run at
    cores / n of their speed, as an operating system shares the cores among busy
    processes; None or at least the devices: every device at full speed.
    """
    f, b, w = (_per_cell(t, self.num_cells, name) for t, name in (
        (forward_time, "forward_time"), (backward_time, "backward_time"),
        (weight_time, "weight_time")))
    groups = [self.weight_groups(k) for k in range(self.num_cells)]

    def duration(k: int, action: Action) -> float:
      if action.phase == FORWARD:
        return f[k]
      if action.phase == BACKWARD:
        return b[k] + (0.0 if groups[k] else w[k])
      return w[k] * len(groups[k][action.unit])

    def ready_at(k: int, action: Action, free: float) -> float:
      d = self.device_of[k]
      return max([free] + [times[dep][1] + (transfer_time if self.device_of[dep[0]] != d
                                            else 0.0)
                           for dep in self.dependencies(k, action)])

    times: dict[tuple[int, Action], tuple[float, float]] = {}
    if cores is None or cores >= self.num_devices:
      free = [0.0] * self.num_devices
      for k, action in self.execution_order():
        start = ready_at(k, action, free[self.device_of[k]])
        times[(k, action)] = (start, start + duration(k, action))
        free[self.device_of[k]] = start + duration(k, action)
      return times
    return self._shared_simulation(duration, ready_at, cores, times)

  def _shared_simulation(self, duration, ready_at, cores: float, times: dict
                         ) -> dict[tuple[int, Action], tuple[float, float]]:
    """`simulate` with the devices' busy ones sharing `cores` (processor sharing): the
    clock advances to the next action end or start; in between each of the n busy
    devices does min(1, cores / n) seconds of work per second."""
    orders = self.device_orders
    position = [0] * self.num_devices
    remaining = [duration(*order[0]) if order else 0.0 for order in orders]
    started: list[float | None] = [None] * self.num_devices
    now = 0.0
    total = sum(len(order) for order in orders)
    while len(times) < total:
      for d, order in enumerate(orders):  # when can each device's next action start?
        if position[d] < len(order) and started[d] is None and all(
            dep in times for dep in self.dependencies(*order[position[d]])):
          started[d] = ready_at(*order[position[d]], now)
      running = [d for d in range(self.num_devices)
                 if started[d] is not None and started[d] <= now]
      waiting = [started[d] for d in range(self.num_devices)
                 if started[d] is not None and started[d] > now]
      if not running:
        if not waiting:
          self.execution_order()  # raises ScheduleError naming the deadlock
        now = min(waiting)
        continue
      rate = min(1.0, cores / len(running))
      step = min([remaining[d] / rate for d in running] + [w - now for w in waiting])
      now += step
      for d in running:
        remaining[d] -= step * rate
        if remaining[d] <= 1e-12:
          times[orders[d][position[d]]] = (started[d], now)
          position[d] += 1
          started[d] = None
          if position[d] < len(orders[d]):
            remaining[d] = duration(*orders[d][position[d]])
    return times

  def bubble(self, forward_time: Times = 1.0, backward_time: Times = 1.0,
             weight_time: Times = 1.0, transfer_time: float = 0.0) -> float:
    """Planned idle fraction of the devices over the step (see `simulate`)."""
    return idle_fraction(self.simulate(forward_time, backward_time, weight_time,
                                       transfer_time), self.num_devices)

  def _most_held(self, k: int, change: Callable[[Action], int]) -> int:
    """The highest running total of `change(action)` over cell k's list: the most
    units it holds at once of what `change` counts in (+) and out (−)."""
    held = most = 0
    for action in self.actions[k]:
      held += change(action)
      most = max(most, held)
    return most

  def max_in_flight(self, k: int) -> int:
    """The most units cell k holds between their forward and their backward: what
    its activation memory (inputs kept for re-materialization, or the whole forward
    without it) is proportional to."""
    return self._most_held(k, lambda a: {FORWARD: 1, BACKWARD: -1}.get(a.phase, 0))

  def max_cached(self, k: int) -> int:
    """With token slices, the most micro-batches cell k keeps a cache for (from the
    forward of their first slice to the backward of it); 0 without."""
    if self.slices == 1:
      return 0
    return self._most_held(k, lambda a: 0 if a.unit % self.slices else
                           {FORWARD: 1, BACKWARD: -1}.get(a.phase, 0))

  def max_awaiting_weights(self, k: int) -> int:
    """The most units cell k holds between their backward and the W that computes
    their weight gradients (each keeps its projections' inputs and output gradients
    until then)."""
    groups = self.weight_groups(k)
    return self._most_held(k, lambda a: (1 if a.phase == BACKWARD and groups else
                                         -len(groups[a.unit]) if a.phase == WEIGHT_GRADIENT
                                         else 0))

  def max_held(self, k: int) -> int:
    """The most units cell k holds from their forward until it is done with them
    (their W where the cell defers weight gradients, else their backward): the count
    the zero-bubble paper bounds by 1F1B's."""
    groups = self.weight_groups(k)
    return self._most_held(k, lambda a: (1 if a.phase == FORWARD else
                                         -len(groups[a.unit]) if a.phase == WEIGHT_GRADIENT
                                         else 0 if groups else -1))

  def _rebuilt(self, device_orders: Sequence[Sequence[tuple[int, Action]]]
               ) -> PipelineSchedule:
    """This schedule with other device orders (the cells' lists follow from them)."""
    return PipelineSchedule(self.name, self.num_cells, self.num_units,
                            cell_lists(device_orders, self.num_cells),
                            self.device_of, tuple(tuple(o) for o in device_orders),
                            self.slices)

  def with_weight_gradients(self, group: int, cells: Sequence[int]) -> PipelineSchedule:
    """This schedule with a W after every `group`-th backward of each of `cells` (the
    cells that defer their weight gradients) and after its last backward."""
    if group <= 1 or not cells:
      return self
    cells = set(cells)
    last_backward = {k: [a for a in self.actions[k] if a.phase == BACKWARD][-1]
                     for k in cells}
    since = dict.fromkeys(cells, 0)
    orders = []
    for device_order in self.device_orders:
      row = []
      for k, action in device_order:
        row.append((k, action))
        if k in cells and action.phase == BACKWARD:
          since[k] += 1
          if since[k] == group or action == last_backward[k]:
            row.append((k, weight_gradient(action.unit)))
            since[k] = 0
      orders.append(row)
    return self._rebuilt(orders)

  def on_devices(self, device_of: Sequence[int]) -> PipelineSchedule:
    """These cell lists with cell k on device device_of[k]; a device with several
    cells runs their actions in the order they start in the simulated timeline
    (which is a valid execution order, so the device loops cannot deadlock)."""
    device_of = tuple(device_of)
    if device_of == self.device_of:
      return self
    if len(device_of) != self.num_cells:
      raise ScheduleError(f"{self.name}: {len(device_of)} devices for {self.num_cells} cells")
    free = PipelineSchedule(self.name, self.num_cells, self.num_units, self.actions,
                            slices=self.slices)
    times = free.simulate()
    orders: list[list[tuple[float, int, int, Action]]] = [[] for _ in range(max(device_of) + 1)]
    for k, cell_actions in enumerate(self.actions):
      for i, action in enumerate(cell_actions):
        orders[device_of[k]].append((times[(k, action)][0], k, i, action))
    return PipelineSchedule(self.name, self.num_cells, self.num_units, self.actions,
                            device_of, tuple(tuple((k, a) for _, k, _, a in sorted(order))
                                             for order in orders), self.slices)

  def format_table(self, forward_time: int = 1, backward_time: int = 1,
                   weight_time: int = 1) -> str:
    """One row per cell, one column per unit of simulated time ('..' idle)."""
    times = self.simulate(forward_time, backward_time, weight_time)
    width = int(max(end for _, end in times.values()))
    label_width = max(2, *(len(self.label(a)) for cell in self.actions for a in cell))
    rows = []
    for k in range(self.num_cells):
      cells = ["." * label_width] * width
      for action in self.actions[k]:
        start, end = times[(k, action)]
        for t in range(int(start), int(end)):
          cells[t] = self.label(action).ljust(label_width)
      rows.append(f"cell {k}  " + " ".join(cells))
    return "\n".join(rows)

  def __str__(self) -> str:
    return "\n".join(f"cell {k}: {' '.join(map(self.label, a))}"
                     for k, a in enumerate(self.actions))

  def device_action_lists(self) -> list[list[str]]:
    """Each device's actions in torch.distributed.pipelining's compact form: cell
    (torch's stage), then F, I (the input-gradient backward of a cell that defers its
    weight gradients), B (a whole backward) or W, then the unit: '0F0', '1I3',
    '0W2'. A W covering several backwards (weight_gradient_group > 1) is written as
    one W per unit, which is what torch's W means."""
    rows = []
    for order in self.device_orders:
      row = []
      for k, action in order:
        if action.phase == WEIGHT_GRADIENT:
          row += [f"{k}W{m}" for m in self.weight_groups(k)[action.unit]]
        else:
          letter = "I" if action.phase == BACKWARD and self.defers(k) else str(action)[0]
          row.append(f"{k}{letter}{action.unit}")
      rows.append(row)
    return rows

  def to_csv(self) -> str:
    """device_action_lists, one device per line, comma-separated (torch's
    `_dump_csv` layout)."""
    return "".join(",".join(row) + "\n" for row in self.device_action_lists())


def gpipe(num_cells: int, num_micro_batches: int, num_token_slices: int = 1
          ) -> PipelineSchedule:
  """Fill-drain: every cell runs F0..F(U−1), then B(U−1)..B0 (the newest first, whose
  output gradient arrives first), over the U = M·S units (micro-batches × slices)."""
  s = num_token_slices
  u = num_micro_batches * s
  cell = tuple(forward(i) for i in range(u)) + tuple(backward(i) for i in reversed(range(u)))
  return PipelineSchedule("gpipe", num_cells, u, tuple(cell for _ in range(num_cells)),
                          slices=s)


def one_f_one_b(num_cells: int, num_micro_batches: int, num_token_slices: int = 1
                ) -> PipelineSchedule:
  """PipeDream-flush: cell k runs min(K−k, M) forwards, then alternates one backward
  and one forward while forwards remain, then runs the remaining backwards.

  Over token slices (S > 1; Seq1F1B's order): the forwards in unit order, the
  backwards micro-batch by micro-batch, each one's slices newest first, and a warm-up
  of min(S + K−k−1, M·S) forwards."""
  s = num_token_slices
  units = num_micro_batches * s
  backwards = [m * s + j for m in range(num_micro_batches) for j in reversed(range(s))]
  actions = []
  for k in range(num_cells):
    warmup = min(num_cells - k - 1 + s, units)
    cell = [forward(i) for i in range(warmup)]
    next_forward = warmup
    for i in backwards:
      cell.append(backward(i))
      if next_forward < units:
        cell.append(forward(next_forward))
        next_forward += 1
    actions.append(tuple(cell))
  return PipelineSchedule("1f1b", num_cells, units, tuple(actions), slices=s)


def interleaved_1f1b(num_cells: int, num_micro_batches: int,
                     virtual_stages: int) -> PipelineSchedule:
  """Megatron-LM's interleaved 1F1B (Narayanan et al. 2021): K = D·V cells, cell k on
  device k mod D, so each device holds V cells ("model chunks") spread along the
  pipeline. The M micro-batches go in R = max(1, ⌊M/D⌋) rounds of near-equal size
  (the first M mod R one larger; each at least D where M ≥ D: Megatron's rounds of D
  when D divides M, PyTorch's when R divides M, any M here). Device d runs each
  round's forwards chunk after chunk, min(2(D−d−1) + (V−1)·P, M·V) of them first (P:
  the first round's size), then one forward and one backward in turn (backwards
  from the last chunk down), then the remaining backwards. The bubble shrinks V
  times, to (D−1)/V per device in units of a whole stage's F+B, at V times the
  hand-offs; device d holds up to that warm-up count + 1 chunk micro-batches in
  flight."""
  rounds = _Rounds.of("interleaved_1f1b", num_cells, num_micro_batches, virtual_stages)
  orders = []
  for d in range(rounds.devices):
    f, b = rounds.forwards(d), rounds.backwards(d)
    warmup = min(2 * (rounds.devices - d - 1) + (virtual_stages - 1) * rounds.first,
                 rounds.total)
    order = f[:warmup]
    for i in range(rounds.total - warmup):
      order += [f[warmup + i], b[i]]
    orders.append(tuple(order + b[rounds.total - warmup:]))
  return rounds.schedule(orders)


def interleaved_zero_bubble(num_cells: int, num_micro_batches: int,
                            virtual_stages: int) -> PipelineSchedule:
  """Interleaved zero bubble (Qi et al. 2024's ZB-1P over interleaved stages; PyTorch's
  ScheduleInterleavedZeroBubble): interleaved_1f1b's placement and rounds with every
  backward split into B and W. Device d warms up with min((V−1)·P + D−d−1, M·V)
  forwards (one per hop, not two: a B waits for no W downstream), then runs a
  forward and a B in turn, and from its (d+1)-th B on each B is followed by the W of
  the oldest backward still awaiting one; the cool-down runs the remaining B, each
  with a W, then the remaining W."""
  rounds = _Rounds.of("interleaved_zb", num_cells, num_micro_batches, virtual_stages)
  orders = []
  for d in range(rounds.devices):
    f, b = rounds.forwards(d), rounds.backwards(d)
    warmup = min((virtual_stages - 1) * rounds.first + rounds.devices - d - 1, rounds.total)
    order = f[:warmup]
    for i, (cell, action) in enumerate(b):
      if i < rounds.total - warmup:
        order.append(f[warmup + i])
      order.append((cell, action))
      if i >= d:  # the W of the oldest backward awaiting one
        order.append((b[i - d][0], weight_gradient(b[i - d][1].unit)))
    order += [(cell, weight_gradient(a.unit)) for cell, a in b[max(len(b) - d, 0):]]
    orders.append(tuple(order))
  return rounds.schedule(orders)


@dataclasses.dataclass(frozen=True)
class _Rounds:
  """Interleaved placement's micro-batch rounds: K = D·V cells, cell k on device
  k mod D, the M micro-batches in R = max(1, ⌊M/D⌋) rounds of near-equal size (the
  first M mod R one larger); a device runs each round's forwards chunk after chunk
  and its backwards from the last chunk down."""
  name: str
  cells: int
  devices: int
  micro_batches: int
  sizes: tuple[int, ...]  # each round's micro-batches

  @classmethod
  def of(cls, name: str, num_cells: int, num_micro_batches: int, virtual_stages: int
         ) -> _Rounds:
    v = virtual_stages
    if v < 2 or num_cells % v:
      raise ScheduleError(f"{name} needs virtual_stages >= 2 dividing num_cells "
                          f"(K = devices × V); got K={num_cells}, V={v}")
    d_count = num_cells // v
    return cls(name, num_cells, d_count, num_micro_batches,
               tuple(near_equal.sizes(num_micro_batches, max(1, num_micro_batches // d_count))))

  @property
  def first(self) -> int:
    """P: the first (largest) round's size."""
    return self.sizes[0]

  @property
  def total(self) -> int:
    """A device's forwards (and backwards): M per chunk."""
    return self.micro_batches * self.cells // self.devices

  def _order(self, d: int, chunks: Sequence[int], make: Callable[[int], Action]
             ) -> list[tuple[int, Action]]:
    out, start = [], 0
    for size in self.sizes:
      out += [(chunk * self.devices + d, make(start + i)) for chunk in chunks
              for i in range(size)]
      start += size
    return out

  def forwards(self, d: int) -> list[tuple[int, Action]]:
    return self._order(d, range(self.cells // self.devices), forward)

  def backwards(self, d: int) -> list[tuple[int, Action]]:
    return self._order(d, list(reversed(range(self.cells // self.devices))), backward)

  def schedule(self, orders: Sequence[tuple[tuple[int, Action], ...]]) -> PipelineSchedule:
    return PipelineSchedule(self.name, self.cells, self.micro_batches,
                            cell_lists(orders, self.cells),
                            placement(self.name, self.cells, self.cells // self.devices),
                            tuple(orders))


def zero_bubble_h1(num_cells: int, num_micro_batches: int,
                   weight_cells: Sequence[int]) -> PipelineSchedule:
  """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024): 1F1B with each
  backward split into B (input gradients, on the critical path) and W (weight
  gradients; in the cells of `weight_cells`, the others run both in B).

  Cell k runs 1F1B's order (K−k forwards, then a backward and a forward in turn) with
  the W of micro-batch i − k right after the backward of micro-batch i, and its last k
  W actions at the end. A later cell thus postpones k weight gradients: in the
  cool-down, where 1F1B idles waiting for the next backward, it runs them. The bubble
  drops from (K−1)(F+B+W) to (K−1)(F+B−W) per device; every cell holds at most K
  micro-batches between forward and W, 1F1B's peak (cell 0's).
  """
  weight_cells = set(weight_cells)
  actions = []
  for k, cell in enumerate(one_f_one_b(num_cells, num_micro_batches).actions):
    actions.append(_with_lagging_weights(cell, k, num_micro_batches) if k in weight_cells
                   else cell)
  return PipelineSchedule("zb_h1", num_cells, num_micro_batches, tuple(actions))



def zero_bubble_v(num_cells: int, num_micro_batches: int) -> PipelineSchedule:
  """ZB-V (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, section 6): D =
  K/2 devices, device d holding cells d and K−1−d, so the forward runs down the
  devices and back up (a V) and the last cell's loss is on device 0; every backward
  split into B (input gradients) and W (weight gradients, one W per B). Device d:

    warm-up   2(D−d)−1 forwards of its first cell; d times a forward of its second
              cell and one of its first; D−d times F, B and W of its second cell
    steady    a forward of its first cell (while any remain), B and W of its first
              cell, F, B and W of its second, until both cells ran every forward
    cool-down d times B of its first cell and of its second; D−d times B of its first
              cell and its oldest W; then the remaining W, its second cell's first

  At M < 2D−1 the order is M = 2D−1's without the units from M on. With F = B = W a
  device idles about half of zb_h1's (K−1)(F+B−W) over its two cells, and holds at
  most 2D units of its cells (1F1B's peak: D units of a cell twice its size)."""
  if num_cells < 2 or num_cells % 2:
    raise ScheduleError(f"zbv puts two cells on each device (a V): num_cells must be even "
                        f"and >= 2, got {num_cells}")
  d_count, m = num_cells // 2, num_micro_batches
  n = max(2 * d_count - 1, m)
  orders = []
  for d in range(d_count):
    first, second = d, num_cells - 1 - d
    count = dict.fromkeys(((c, p) for c in (first, second)
                           for p in (FORWARD, BACKWARD, WEIGHT_GRADIENT)), 0)
    order: list[tuple[int, Action]] = []

    def add(cell: int, *phases: str, order=order, count=count) -> None:
      for phase in phases:
        order.append((cell, Action(phase, count[(cell, phase)])))
        count[(cell, phase)] += 1

    for _ in range(2 * (d_count - d) - 1):
      add(first, FORWARD)
    for _ in range(d):
      add(second, FORWARD)
      add(first, FORWARD)
    for _ in range(d_count - d):
      add(second, FORWARD, BACKWARD, WEIGHT_GRADIENT)
    while count[(second, FORWARD)] < count[(first, FORWARD)] or count[(first, FORWARD)] < n:
      if count[(first, FORWARD)] < n:
        add(first, FORWARD)
      add(first, BACKWARD, WEIGHT_GRADIENT)
      add(second, FORWARD, BACKWARD, WEIGHT_GRADIENT)
    for _ in range(d):
      add(first, BACKWARD)
      add(second, BACKWARD)
    for _ in range(d_count - d):
      add(first, BACKWARD, WEIGHT_GRADIENT)
    while count[(second, WEIGHT_GRADIENT)] < count[(second, BACKWARD)]:
      add(second, WEIGHT_GRADIENT)
    while count[(first, WEIGHT_GRADIENT)] < count[(first, BACKWARD)]:
      add(first, WEIGHT_GRADIENT)
    orders.append(tuple((k, a) for k, a in order if a.unit < m))
  return PipelineSchedule("zbv", num_cells, m, cell_lists(orders, num_cells),
                          placement("zbv", num_cells), tuple(orders))

def _with_lagging_weights(cell: Sequence[Action], lag: int, num_micro_batches: int
                          ) -> tuple[Action, ...]:
  """cell's actions with the W of micro-batch i − lag right after the backward of
  micro-batch i, and the last `lag` W actions at the end."""
  out = []
  for action in cell:
    out.append(action)
    i = action.unit
    if action.phase == BACKWARD and i >= lag:
      out.append(weight_gradient(i - lag))
  out += [weight_gradient(i) for i in range(max(num_micro_batches - lag, 0),
                                            num_micro_batches)]
  return tuple(out)


SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zbv", "interleaved_zb")
# Those that split every backward into B and W and place the W actions themselves.
SPLIT_BACKWARD = ("zb_h1", "zbv", "interleaved_zb")


# The virtual stages V (cells per device) each schedule takes; any other: 1.
VIRTUAL_STAGES = {"interleaved_1f1b": ">= 2", "zbv": "2", "interleaved_zb": ">= 2"}


def takes_virtual_stages(name: str, virtual_stages: int) -> bool:
  """Whether schedule `name` runs V = `virtual_stages` cells per device
  (VIRTUAL_STAGES)."""
  rule = VIRTUAL_STAGES.get(name, "1")
  return virtual_stages >= 2 if rule == ">= 2" else virtual_stages == int(rule)


def placement(name: str, num_cells: int, virtual_stages: int = 1) -> tuple[int, ...]:
  """The device index of each cell under schedule `name` (placement as data, the one
  rule the pipeline, the planner and the chart take it from): zbv's V, cell k on
  device min(k, K−1−k); with V cells per device otherwise, round-robin, k mod K/V;
  else each cell its own device."""
  if name == "zbv":
    return tuple(min(k, num_cells - 1 - k) for k in range(num_cells))
  num_devices = max(num_cells // virtual_stages, 1)
  return tuple(k % num_devices for k in range(num_cells))


def deferring_cells(name: str, num_cells: int, weight_gradient_group: int,
                    recomputed: Sequence[bool]) -> list[int]:
  """The cells that run their weight gradients as W actions: every cell under the
  split-backward schedules (SPLIT_BACKWARD: zb_h1, zbv, interleaved_zb); with
  weight_gradient_group G > 1, the re-materialized ones (`recomputed[k]`)."""
  if name in SPLIT_BACKWARD:
    return list(range(num_cells))
  if weight_gradient_group > 1:
    return [k for k in range(num_cells) if recomputed[k]]
  return []


SLICED_SCHEDULES = ("gpipe", "1f1b")  # those that run token slices


@functools.lru_cache(maxsize=1024)
def build(name: str, num_cells: int, num_micro_batches: int, *, virtual_stages: int = 1,
          weight_gradient_group: int = 1, recomputed: tuple[bool, ...] = (),
          num_token_slices: int = 1, device_of: tuple[int, ...] = ()
          ) -> PipelineSchedule:
  """The schedule a pipeline runs (`PipeliningLayer.plan`; the planner predicts with
  the same): `make`'s, with the W actions of the cells that defer their weight
  gradients (`deferring_cells`: every cell under SPLIT_BACKWARD's schedules, which
  place them themselves;
  with weight_gradient_group G > 1 the re-materialized ones, `recomputed[k]`, after
  every G-th backward and the last), on the devices `device_of` (default: cell k on
  device k mod K/V). Kept: a search asks for the same ones many times.

  Raises ScheduleError naming what these cells and micro-batches cannot run.
  """
  recomputed = recomputed or (True,) * num_cells
  deferring = deferring_cells(name, num_cells, weight_gradient_group, recomputed)
  plan = make(name, num_cells, num_micro_batches, virtual_stages=virtual_stages,
              weight_cells=deferring, num_token_slices=num_token_slices)
  if name not in SPLIT_BACKWARD:
    plan = plan.with_weight_gradients(weight_gradient_group, deferring)
  return plan.on_devices(device_of or placement(name, num_cells, virtual_stages))


def is_slice_count(value: Any) -> bool:
  """Whether `value` is a number of token slices S: an int >= 1 (not a bool)."""
  return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def make(name: str, num_cells: int, num_micro_batches: int, *, virtual_stages: int = 1,
         weight_cells: Sequence[int] = (), num_token_slices: int = 1) -> PipelineSchedule:
  """The schedule called `name` (one of SCHEDULES) for K cells and M micro-batches.

  virtual_stages: V cells per device (interleaved_1f1b; zbv is 2); weight_cells: the
  cells that compute weight gradients in W actions of their own, which zb_h1 places
  itself (zbv: every cell; the others get them from `with_weight_gradients`);
  num_token_slices: S slices
  per micro-batch (SLICED_SCHEDULES only), units (m, j) as the module docstring says.
  """
  if name not in SCHEDULES:
    raise ScheduleError(f"unknown pipeline schedule {name!r}; valid: {sorted(SCHEDULES)}")
  if num_cells < 1 or num_micro_batches < 1:
    raise ScheduleError(f"a schedule needs num_cells >= 1 and num_micro_batches >= 1, got "
                        f"{num_cells} and {num_micro_batches}")
  if not is_slice_count(num_token_slices):
    raise ScheduleError(f"num_token_slices must be an int >= 1, got {num_token_slices!r}")
  if num_token_slices != 1 and name not in SLICED_SCHEDULES:
    raise ScheduleError(f"schedule {name!r} does not run token slices; with "
                        f"num_token_slices={num_token_slices} use one of {SLICED_SCHEDULES}")
  if name == "interleaved_1f1b":
    return interleaved_1f1b(num_cells, num_micro_batches, virtual_stages)
  if name == "zb_h1":
    return zero_bubble_h1(num_cells, num_micro_batches, weight_cells)
  if name == "zbv":
    return zero_bubble_v(num_cells, num_micro_batches)
  if name == "interleaved_zb":
    return interleaved_zero_bubble(num_cells, num_micro_batches, virtual_stages)
  return {"gpipe": gpipe, "1f1b": one_f_one_b}[name](num_cells, num_micro_batches,
                                                    num_token_slices)


def from_lists(name: str, actions: Sequence[Sequence[str]], num_token_slices: int = 1
               ) -> PipelineSchedule:
  """A schedule from per-cell lists of 'F<m>' / 'B<m>' / 'W<m>' strings (tests, custom
  orders); with num_token_slices S, <m> numbers units: unit u is slice u mod S of
  micro-batch u // S."""
  parsed = []
  phases = {letter: phase for phase, letter in _LETTERS.items()}
  for k, cell in enumerate(actions):
    row = []
    for text in cell:
      if text[:1] not in phases or not text[1:].isdigit():
        raise ScheduleError(f"{name}: cell {k}: bad action {text!r}; write F<m>, B<m> or W<m>")
      row.append(Action(phases[text[0]], int(text[1:])))
    parsed.append(tuple(row))
  num_micro = 1 + max((a.unit for row in parsed for a in row), default=-1)
  return PipelineSchedule(name, len(parsed), num_micro, tuple(parsed),
                          slices=num_token_slices)


def from_device_lists(name: str, rows: Sequence[Sequence[str]]) -> PipelineSchedule:
  """A schedule from each device's actions in torch.distributed.pipelining's compact
  form (`PipelineSchedule.device_action_lists`): row d is device d's order. Cells run
  on the device whose row holds them; a cell's I actions (input gradients) need its W
  actions, whose order must follow its backwards' (a W here covers the backwards
  since the previous W, up to its own). Validated like every schedule.

  Raises:
    ScheduleError: naming the line (device) and the entry at fault.
  """
  device_of: dict[int, int] = {}
  letters: dict[int, set[str]] = {}
  orders = []
  for d, row in enumerate(rows):
    order = []
    for text in (entry.strip() for entry in row):
      if not text:
        continue
      match = _COMPACT_ACTION.fullmatch(text)
      if match is None:
        raise ScheduleError(f"{name}: line {d + 1}: bad action {text!r}; write "
                            "<cell><F|I|B|W><unit>, e.g. 0F0 or 1I3")
      k, letter, m = int(match[1]), match[2], int(match[3])
      if device_of.setdefault(k, d) != d:
        raise ScheduleError(f"{name}: line {d + 1}: {text!r}: cell {k} is on line "
                            f"{device_of[k] + 1} already; a cell runs on one device")
      letters.setdefault(k, set()).add(letter)
      phase = {"F": FORWARD, "B": BACKWARD, "I": BACKWARD, "W": WEIGHT_GRADIENT}[letter]
      order.append((k, Action(phase, m)))
    orders.append(tuple(order))
  num_cells = len(device_of)
  if sorted(device_of) != list(range(num_cells)):
    raise ScheduleError(f"{name}: the cells are {sorted(device_of)}; number them "
                        f"0..{num_cells - 1}")
  for k, used in sorted(letters.items()):
    if "B" in used and used & {"I", "W"} or ("I" in used) != ("W" in used):
      raise ScheduleError(f"{name}: cell {k} runs {''.join(sorted(used))}: a cell either "
                          "runs whole backwards (B) or splits them (I and W)")
  actions = cell_lists(orders, num_cells)
  num_micro = 1 + max((a.unit for cell in actions for a in cell), default=-1)
  return PipelineSchedule(name, num_cells, num_micro, actions,
                          tuple(device_of[k] for k in range(num_cells)), tuple(orders))


def from_csv(name: str, text: str) -> PipelineSchedule:
  """from_device_lists of CSV text, one device per line (torch's `_load_csv` layout)."""
  return from_device_lists(name, list(csv.reader(text.splitlines())))
