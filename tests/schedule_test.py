"""Pipeline schedules as data, against rules checked by brute force and the paper's bubble."""

import itertools

import pytest

from lingvo_gpipe.pipeline import schedule
from lingvo_gpipe.pipeline.schedule import BACKWARD, FORWARD, WEIGHT_GRADIENT, ScheduleError

SIZES = list(itertools.product([1, 2, 3, 4, 8], [1, 2, 3, 4, 16]))


def depends_on(k: int, action, other_cell: int, other) -> bool:
  """The rule written out: a forward needs the previous cell's forward of its
  micro-batch; a backward needs its own forward and the next cell's backward."""
  m = action.micro_batch
  if action.phase == FORWARD:
    return other_cell == k - 1 and other == schedule.forward(m)
  return ((other_cell == k and other == schedule.forward(m))
          or (other_cell == k + 1 and other == schedule.backward(m)))


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("num_cells, num_micro", SIZES)
def test_every_dependency_comes_first_and_each_cell_keeps_its_order(name, num_cells, num_micro):
  plan = schedule.make(name, num_cells, num_micro)
  order = plan.execution_order()
  assert len(order) == len(set(order)) == 2 * num_cells * num_micro
  position = {entry: i for i, entry in enumerate(order)}
  for (k, action), (j, other) in itertools.product(order, order):
    if depends_on(k, action, j, other):
      assert position[(j, other)] < position[(k, action)], (k, action, j, other)
  for k in range(num_cells):
    assert [a for c, a in order if c == k] == list(plan.actions[k])


@pytest.mark.parametrize("num_cells, num_micro", SIZES)
def test_both_schedules_have_the_fill_drain_bubble(num_cells, num_micro):
  """(K−1)/(M+K−1) (the GPipe paper) for equal cells, whatever the backward costs."""
  want = (num_cells - 1) / (num_micro + num_cells - 1)
  for name in ("gpipe", "1f1b"):
    for backward_time in (1.0, 2.0, 3.0):
      plan = schedule.make(name, num_cells, num_micro)
      assert plan.bubble(1.0, backward_time) == pytest.approx(want), (name, backward_time)


@pytest.mark.parametrize("num_cells, num_micro", SIZES)
def test_1f1b_holds_at_most_k_minus_k_micro_batches_gpipe_holds_m(num_cells, num_micro):
  gpipe, one_f = schedule.gpipe(num_cells, num_micro), schedule.one_f_one_b(num_cells, num_micro)
  for k in range(num_cells):
    assert gpipe.max_in_flight(k) == num_micro
    assert one_f.max_in_flight(k) == min(num_cells - k, num_micro)


def test_simulated_calls_never_overlap_on_a_device_and_wait_for_their_inputs():
  plan = schedule.one_f_one_b(4, 8)
  times = plan.simulate(1.0, 2.0)
  for k in range(4):
    spans = [times[(k, a)] for a in plan.actions[k]]
    assert all(later[0] >= earlier[1] for earlier, later in zip(spans, spans[1:]))
  for (k, action), (start, _) in times.items():
    for dep in plan.dependencies(k, action):
      assert start >= times[dep][1]


def test_the_docstring_tables_are_what_format_table_prints():
  doc = schedule.__doc__
  for name in ("gpipe", "1f1b", "zb_h1"):
    for row in schedule.make(name, 3, 4, weight_cells=range(3)).format_table().splitlines():
      assert row in doc, row


def test_a_deadlocked_order_is_refused_naming_the_waiting_cells():
  with pytest.raises(ScheduleError, match=r"deadlock.*cell 0 at B0.*cell 1 at F1"):
    schedule.from_lists("custom", [["F0", "B0", "F1", "B1"], ["F0", "F1", "B0", "B1"]])


@pytest.mark.parametrize("lists, message", [
    ([["F0", "F1", "B1", "B0"], ["F1", "F0", "B1", "B0"]],
     r"(?s)cell 1 receives on the forward link between cells 0 and 1 in another order than "
     r"cell 0 sends: micro-batches 1 0 against 0 1.*\n  cell 1: >F1< F0 B1 B0"),
    ([["F0", "F1", "B1", "B0"], ["F0", "F1", "B0", "B1"]],
     r"(?s)cell 0 receives on the backward link between cells 0 and 1 .* micro-batches 1 0 "
     r"against 0 1.*\n  cell 0: F0 F1 >B1< B0"),
])
def test_a_link_whose_ends_disagree_on_the_order_is_refused_naming_it(lists, message):
  """Hand-offs match first in, first out: such a schedule would swap micro-batches
  (or hang) at run time, so it is refused when built."""
  with pytest.raises(ScheduleError, match=message):
    schedule.from_lists("custom", lists)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("num_cells, num_micro, group", [(1, 4, 4), (3, 8, 3), (4, 5, 2)])
def test_weight_gradient_actions_end_every_group_of_backwards(name, num_cells, num_micro,
                                                              group):
  plan = schedule.make(name, num_cells, num_micro).with_weight_gradients(
      group, cells=range(num_cells - 1) if num_cells > 1 else [0])
  for k, actions in enumerate(plan.actions):
    text = " ".join(map(str, actions))
    backwards = [a for a in actions if a.phase == BACKWARD]
    weights = [i for i, a in enumerate(actions) if a.phase == WEIGHT_GRADIENT]
    if k == num_cells - 1 and num_cells > 1:
      assert not weights, text
      continue
    assert len(weights) == -(-num_micro // group), text  # ceil(M / G)
    for i in weights:  # each W follows the backward it names, the group's last
      assert actions[i - 1] == schedule.backward(actions[i].micro_batch), text
    assert actions[-1].phase == WEIGHT_GRADIENT and len(backwards) == num_micro
  assert plan.max_in_flight(0) == schedule.make(name, num_cells, num_micro).max_in_flight(0)


@pytest.mark.parametrize("lists, message", [
    ([["F0", "W0", "B0"]], r"(?s)runs W0 with no backward of its own to finish: B0 has "
                           r"not run.*>W0<"),
    ([["F0", "F1", "B0", "W0", "B1"]], r"ends with backwards whose weight gradients no W"),
    # W0 covers B1 and B0 (the backwards since the previous W, up to B0's)
    ([["F0", "F1", "B1", "B0", "W0", "W1"]], r"runs W1 with no backward of its own"),
])
def test_misplaced_weight_gradient_actions_are_named(lists, message):
  with pytest.raises(ScheduleError, match=message):
    schedule.from_lists("custom", lists)


def test_validation_is_linear_in_micro_batches():
  """30,000 micro-batches are checked in well under a second (it was O(M²))."""
  import time
  start = time.perf_counter()
  schedule.make("1f1b", 2, 30000)
  assert time.perf_counter() - start < 5.0


@pytest.mark.parametrize("lists, message", [
    ([["F0", "B0", "F1"]], "must run F0..F1 and B0..B1 once each"),
    ([["B0", "F0"]], "cell 0 runs B0 before F0"),
    ([["F0", "X0"]], "bad action 'X0'"),
    ([["F0", "F0", "B0"]], "F0 is repeated"),
])
def test_malformed_schedules_are_named(lists, message):
  with pytest.raises(ScheduleError, match=message):
    schedule.from_lists("custom", lists)


def test_unknown_schedule_names_the_valid_ones():
  with pytest.raises(ScheduleError, match=r"unknown pipeline schedule 'zigzag'; valid: "
                                          r"\['1f1b', 'gpipe', 'interleaved_1f1b', 'zb_h1'\]"):
    schedule.make("zigzag", 2, 4)


def test_actions_print_as_f_and_b():
  plan = schedule.one_f_one_b(2, 3)
  assert str(plan) == "cell 0: F0 F1 B0 F2 B1 B2\ncell 1: F0 B0 F1 B1 F2 B2"
  assert plan.actions[0][2].phase == BACKWARD
