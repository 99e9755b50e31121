"""Pipeline schedules as data, against rules checked by brute force and the paper's bubble."""

import itertools
import sys

import pytest

from lingvo_gpipe.core.gc_pause import cyclic_gc_paused
from lingvo_gpipe.pipeline import schedule
from lingvo_gpipe.pipeline.schedule import BACKWARD, FORWARD, WEIGHT_GRADIENT, ScheduleError

SIZES = list(itertools.product([1, 2, 3, 4, 8], [1, 2, 3, 4, 16]))


def depends_on(k: int, action, other_cell: int, other) -> bool:
  """The rule written out: a forward needs the previous cell's forward of its
  micro-batch; a backward needs its own forward and the next cell's backward."""
  m = action.unit
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
     r"cell 0 sends: units 1 0 against 0 1.*\n  cell 1: >F1< F0 B1 B0"),
    ([["F0", "F1", "B1", "B0"], ["F0", "F1", "B0", "B1"]],
     r"(?s)cell 0 receives on the backward link between cells 0 and 1 .* units 1 0 "
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
      assert actions[i - 1] == schedule.backward(actions[i].unit), text
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


def _python_calls(fn) -> int:
  """Python-level and builtin calls fn() makes: a count of work that does not depend
  on the machine's speed or load (an Action's __eq__ and __hash__ are Python code,
  so a list search over actions shows up as one call per element)."""
  count = 0

  def profile(_frame, event, _arg):
    nonlocal count
    count += event in ("call", "c_call")

  # A garbage collection inside fn() would count the finalizers it runs (of whatever
  # earlier tests left): collect first, and none during the count.
  with cyclic_gc_paused(collect_first=True):
    sys.setprofile(profile)
    try:
      fn()
    finally:
      sys.setprofile(None)
  return count


@pytest.mark.parametrize("name, cells, virtual_stages", [
    ("gpipe", 2, 1), ("1f1b", 2, 1), ("zb_h1", 4, 1), ("interleaved_1f1b", 4, 2)])
def test_making_and_validating_a_schedule_is_linear_in_micro_batches(name, cells,
                                                                     virtual_stages):
  """8 times the micro-batches cost 8 times the work (validation was once O(M²): it
  would cost 64 times), counted in calls rather than timed."""
  def make(m):
    return lambda: schedule.make(name, cells, m, virtual_stages=virtual_stages,
                                 weight_cells=range(cells))

  ratio = _python_calls(make(4000)) / _python_calls(make(500))
  assert 7.0 < ratio < 9.0, ratio


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
  with pytest.raises(ScheduleError, match=r"unknown pipeline schedule 'zigzag'; valid: \['1f1b', "
                     r"'gpipe', 'interleaved_1f1b', 'interleaved_zb', 'zb_h1', 'zbv'\]"):
    schedule.make("zigzag", 2, 4)


def test_actions_print_as_f_and_b():
  plan = schedule.one_f_one_b(2, 3)
  assert str(plan) == "cell 0: F0 F1 B0 F2 B1 B2\ncell 1: F0 B0 F1 B1 F2 B2"
  assert plan.actions[0][2].phase == BACKWARD


# -- schedules past fill-drain --------------------------------------------------------


def zb_h1(num_cells, num_micro):
  return schedule.make("zb_h1", num_cells, num_micro, weight_cells=range(num_cells))


def interleaved(num_devices, virtual_stages, num_micro):
  return schedule.make("interleaved_1f1b", num_devices * virtual_stages, num_micro,
                       virtual_stages=virtual_stages)


NEW_SCHEDULES = ([("zb_h1", k, m) for k, m in SIZES]
                 + [("interleaved", (d, v), m) for d in (1, 2, 3, 4) for v in (2, 3)
                    for m in (d, 2 * d, 3 * d, 8 * d)]
                 + [("zbv", 2 * d, m) for d in (1, 2, 3, 4) for m in (1, 2, d, 2 * d + 1, 8)]
                 + [("interleaved_zb", (d, v), m) for d in (1, 2, 3, 4) for v in (2, 3)
                    for m in (1, d, d + 1, 3 * d)])


def build(name, cells, num_micro):
  if name == "zbv":
    return schedule.make("zbv", cells, num_micro)
  if name == "interleaved_zb":
    return schedule.make(name, cells[0] * cells[1], num_micro, virtual_stages=cells[1])
  return zb_h1(cells, num_micro) if name == "zb_h1" else interleaved(*cells, num_micro)


@pytest.mark.parametrize("name, cells, num_micro", NEW_SCHEDULES)
def test_new_schedules_respect_every_dependency_and_each_device_its_order(name, cells,
                                                                          num_micro):
  plan = build(name, cells, num_micro)
  order = plan.execution_order()
  position = {entry: i for i, entry in enumerate(order)}
  for (k, action), (j, other) in itertools.product(order, order):
    if action.phase != WEIGHT_GRADIENT and depends_on(k, action, j, other):
      assert position[(j, other)] < position[(k, action)], (k, action, j, other)
  for k in range(plan.num_cells):  # each W after its own backward
    for m, group in plan.weight_groups(k).items():
      for i in group:
        assert position[(k, schedule.backward(i))] < position[(k, schedule.weight_gradient(m))]
  for d, device_order in enumerate(plan.device_orders):
    assert [e for e in order if plan.device_of[e[0]] == d] == list(device_order)
  weights = sum(len(plan.weight_groups(k)) for k in range(plan.num_cells))
  assert len(order) == len(set(order)) == 2 * plan.num_cells * num_micro + weights


@pytest.mark.parametrize("num_cells", [2, 3, 4, 8])
@pytest.mark.parametrize("num_micro", [8, 16, 32])
def test_zero_bubble_idles_k_minus_1_times_f_plus_b_minus_w(num_cells, num_micro):
  """The paper's ZB-H1: idle (K−1)(F+B−W) per device against 1F1B's (K−1)(F+B+W), for
  F = B = W (its setting) and M >= K."""
  f = b = w = 1.0
  work = num_micro * (f + b + w)
  want_zb = (num_cells - 1) * (f + b - w)
  want_1f1b = (num_cells - 1) * (f + b + w)
  assert zb_h1(num_cells, num_micro).bubble(f, b, w) == pytest.approx(want_zb / (work + want_zb))
  assert schedule.one_f_one_b(num_cells, num_micro).bubble(f, b, w) == pytest.approx(
      want_1f1b / (work + want_1f1b))


@pytest.mark.parametrize("num_cells, num_micro", SIZES)
def test_zero_bubble_holds_no_more_than_1f1b(num_cells, num_micro):
  """Per cell, at most K micro-batches from forward to W (1F1B's peak, cell 0's), and
  1F1B's K−k from forward to backward (the stash)."""
  plan, one_f = zb_h1(num_cells, num_micro), schedule.one_f_one_b(num_cells, num_micro)
  assert max(plan.max_held(k) for k in range(num_cells)) == max(
      one_f.max_held(k) for k in range(num_cells)) == min(num_cells, num_micro)
  for k in range(num_cells):
    assert plan.max_in_flight(k) == one_f.max_in_flight(k)
    assert plan.max_awaiting_weights(k) <= k + 1


@pytest.mark.parametrize("num_devices", [2, 4])
@pytest.mark.parametrize("virtual_stages", [2, 3])
@pytest.mark.parametrize("rounds", [2, 4])
def test_interleaving_divides_the_bubble_by_v(num_devices, virtual_stages, rounds):
  """Megatron-LM's interleaved bubble: (D−1)/V of a device's F+B per step, for cells
  of 1/V of a device's layers each, against 1F1B's D−1."""
  num_micro, v = rounds * num_devices, virtual_stages
  part = 1.0 / v
  idle = (num_devices - 1) * 3.0 / v
  got = interleaved(num_devices, v, num_micro).bubble(part, part, part)
  assert got == pytest.approx(idle / (3.0 * num_micro + idle))


@pytest.mark.parametrize("num_devices, virtual_stages, num_micro, round_size", [
    (2, 2, 4, 2), (2, 2, 8, 2), (4, 2, 8, 4), (4, 3, 16, 4), (3, 2, 9, 3),
    (2, 2, 2, 2), (4, 2, 4, 4),  # M = D: one round, PyTorch's warm-up (not all forwards)
    (4, 2, 10, 5), (2, 3, 3, 3), (4, 2, 3, 3),  # PyTorch's flexible rounds (R divides M)
    (4, 2, 9, 5), (3, 2, 7, 4)])  # any M: rounds of near-equal size (5 + 4, 4 + 3)
def test_interleaved_devices_hold_megatrons_warmup_plus_one(num_devices, virtual_stages,
                                                            num_micro, round_size):
  """Device d holds at most min(2(D−d−1) + (V−1)·P + 1, M·V) micro-batches of its
  cells between forward and backward (Megatron-LM's warm-up count + 1, P the first
  round's size: D where D divides M, as PyTorch's ScheduleInterleaved1F1B otherwise)."""
  plan = interleaved(num_devices, virtual_stages, num_micro)
  for d, device_order in enumerate(plan.device_orders):
    in_flight = most = 0
    for _, action in device_order:
      in_flight += 1 if action.phase == FORWARD else -1
      most = max(most, in_flight)
    warmup = 2 * (num_devices - d - 1) + (virtual_stages - 1) * round_size
    assert most == min(warmup + 1, num_micro * virtual_stages)
  assert plan.device_of == tuple(k % num_devices for k in range(plan.num_cells))


# PyTorch's ScheduleInterleaved1F1B for 2 devices, V=2 and 3 micro-batches (one round
# of P=3; warm-up (V−1)·P + 2(D−1−d): 5 on device 0, 3 on device 1), written out by
# hand in its compact form.
TORCH_INTERLEAVED_2X2X3 = ("0F0,0F1,0F2,2F0,2F1,2F2,2B0,2B1,2B2,0B0,0B1,0B2\n"
                           "1F0,1F1,1F2,3F0,3B0,3F1,3B1,3F2,3B2,1B0,1B1,1B2\n")


def test_interleaving_at_an_m_the_devices_do_not_divide_is_pytorchs_order():
  plan = schedule.make("interleaved_1f1b", 4, 3, virtual_stages=2)
  assert plan.to_csv() == TORCH_INTERLEAVED_2X2X3
  assert schedule.from_csv("torch", TORCH_INTERLEAVED_2X2X3).actions == plan.actions


@pytest.mark.parametrize("name", ["interleaved_1f1b", "interleaved_zb"])
@pytest.mark.parametrize("kwargs, message", [
    (dict(num_cells=4, num_micro_batches=4, virtual_stages=1), "virtual_stages >= 2"),
    (dict(num_cells=5, num_micro_batches=4, virtual_stages=2), "K=5, V=2"),
])
def test_bad_interleaving_is_named(name, kwargs, message):
  with pytest.raises(ScheduleError, match=f"{name} needs {message}|{message}"):
    schedule.make(name, **kwargs)


def test_weight_gradient_groups_are_the_backwards_since_the_previous_w():
  plan = schedule.from_lists("custom", [["F0", "F1", "F2", "B0", "B1", "W0", "B2", "W2"]])
  assert plan.weight_groups(0) == {0: [0], 2: [1, 2]}
  assert plan.max_awaiting_weights(0) == 2 and plan.max_held(0) == 3
  assert plan.max_in_flight(0) == 3


def test_the_simulator_takes_per_cell_times_and_hand_offs():
  """One micro-batch through two cells is a chain: F0, hand-off, F1, B1 (with its
  weight gradients), hand-off, B0; with W deferred on cell 0, its W follows."""
  plan = schedule.gpipe(2, 1)
  times = plan.simulate([1.0, 2.0], [3.0, 4.0], [0.5, 0.25], transfer_time=0.1)
  assert max(end for _, end in times.values()) == pytest.approx(
      1.0 + 0.1 + 2.0 + 4.25 + 0.1 + 3.5)
  deferred = plan.with_weight_gradients(2, [0])
  times = deferred.simulate([1.0, 2.0], [3.0, 4.0], [0.5, 0.25], transfer_time=0.1)
  assert times[(0, schedule.weight_gradient(0))] == pytest.approx((10.45, 10.95))
  with pytest.raises(ScheduleError, match="forward_time: 3 times for 2 cells"):
    plan.simulate([1.0, 2.0, 3.0])


def test_cells_sharing_a_device_run_in_simulated_start_order_and_never_overlap():
  plan = schedule.one_f_one_b(4, 6).on_devices([0, 1, 0, 1])
  assert plan.num_devices == 2
  times = plan.simulate(1.0, 2.0, 0.0)
  for order in plan.device_orders:
    spans = [times[entry] for entry in order]
    assert all(later[0] >= earlier[1] for earlier, later in zip(spans, spans[1:]))
  with pytest.raises(ScheduleError, match="cells share devices"):
    schedule.PipelineSchedule("custom", 2, 1, plan.actions[:2], device_of=(0, 0))


# torch.distributed.pipelining's Schedule1F1B for 2 stages and 3 micro-batches,
# written out by hand in its compact form.
TORCH_1F1B_2X3 = "0F0,0F1,0B0,0F2,0B1,0B2\n1F0,1B0,1F1,1B1,1F2,1B2\n"


def test_a_torch_action_list_reads_as_our_schedule_and_writes_back():
  read = schedule.from_csv("torch_1f1b", TORCH_1F1B_2X3)
  assert read.actions == schedule.one_f_one_b(2, 3).actions
  assert read.to_csv() == TORCH_1F1B_2X3
  zb = schedule.zero_bubble_h1(2, 3, weight_cells=[0, 1])  # cell 1's W lag one backward
  assert zb.device_action_lists() == [
      ["0F0", "0F1", "0I0", "0W0", "0F2", "0I1", "0W1", "0I2", "0W2"],
      ["1F0", "1I0", "1F1", "1I1", "1W0", "1F2", "1I2", "1W1", "1W2"]]


# ZB-V for 2 devices and 4 micro-batches (cells 0 and 3 on device 0, 1 and 2 on device
# 1), written out by hand from the rules of Qi et al. 2024, section 6 (as PyTorch's
# ScheduleZBVZeroBubble states them): warm-up 2(D−d)−1 forwards of the first cell, d
# pairs (second, first), D−d times F I W of the second; steady F, I, W of the first
# then of the second; cool-down d pairs of I, D−d times I and the oldest W of the
# first, the remaining W.
ZBV_2X4 = (
    "0F0,0F1,0F2,3F0,3I0,3W0,3F1,3I1,3W1,0F3,0I0,0W0,3F2,3I2,3W2,0I1,0W1,3F3,3I3,3W3,"
    "0I2,0W2,0I3,0W3\n"
    "1F0,2F0,1F1,2F1,2I0,2W0,1F2,1I0,1W0,2F2,2I1,2W1,1F3,1I1,1W1,2F3,2I2,2W2,1I2,2I3,"
    "1I3,1W2,2W3,1W3\n")


def test_zbv_is_the_papers_v_order_read_back_from_its_action_lists():
  zbv = schedule.make("zbv", 4, 4)
  assert zbv.to_csv() == ZBV_2X4
  read = schedule.from_csv("zbv", ZBV_2X4)
  assert (read.actions, read.device_of) == (zbv.actions, (0, 1, 1, 0))
  assert schedule.placement("zbv", 8) == (0, 1, 2, 3, 3, 2, 1, 0)


@pytest.mark.parametrize("num_devices, num_micro, zb_h1_bubble, zbv_bubble", [
    (4, 16, 0.059, 0.030), (8, 32, 0.068, 0.035)])
def test_zbv_halves_zb_h1s_bubble_and_holds_what_1f1b_holds(num_devices, num_micro,
                                                              zb_h1_bubble, zbv_bubble):
  """With F = B = W (PyTorch's figures for these sizes: zb_h1 5.9% and 6.8%, ZBV 3.0%
  and 3.5%), and each device holds at most 2D units of its two half-size cells: D of
  a whole stage, 1F1B's peak (cell 0's)."""
  zbv = schedule.make("zbv", 2 * num_devices, num_micro)
  assert zb_h1(num_devices, num_micro).bubble() == pytest.approx(zb_h1_bubble, abs=5e-4)
  assert zbv.bubble() == pytest.approx(zbv_bubble, abs=5e-4)
  one_f = schedule.one_f_one_b(num_devices, num_micro)
  for d in range(num_devices):
    cells = [k for k in range(zbv.num_cells) if zbv.device_of[k] == d]
    held = most = 0
    for _, action in zbv.device_orders[d]:  # forward to W, summed over the device's cells
      held += {FORWARD: 1, WEIGHT_GRADIENT: -1}.get(action.phase, 0)
      most = max(most, held)
    assert len(cells) == 2 and most <= 2 * one_f.max_in_flight(0) == 2 * num_devices


# PyTorch's ScheduleInterleavedZeroBubble (ZB-1P over interleaved stages) for 2
# devices, V=2 and 2 micro-batches, written out by hand from its rule: warm-up
# (V−1)·P + D−1−d forwards (3 and 2), then F and I in turn, from the (d+1)-th I on each
# followed by the W of the oldest I awaiting one, then the remaining I and W.
TORCH_INTERLEAVED_ZB_2X2X2 = ("0F0,0F1,2F0,2F1,2I0,2W0,2I1,2W1,0I0,0W0,0I1,0W1\n"
                              "1F0,1F1,3F0,3I0,3F1,3I1,3W0,1I0,3W1,1I1,1W0,1W1\n")


def test_interleaved_zero_bubble_is_pytorchs_order_and_has_zbvs_bubble():
  plan = schedule.make("interleaved_zb", 4, 2, virtual_stages=2)
  assert plan.to_csv() == TORCH_INTERLEAVED_ZB_2X2X2
  assert plan.device_of == (0, 1, 0, 1)
  for num_devices, num_micro, bubble in [(4, 16, 0.030), (8, 32, 0.035)]:
    got = schedule.make("interleaved_zb", 2 * num_devices, num_micro, virtual_stages=2)
    assert got.bubble() == pytest.approx(bubble, abs=5e-4)
    assert got.bubble() <= 0.6 * zb_h1(num_devices, num_micro).bubble()


def test_zbv_needs_an_even_number_of_cells():
  with pytest.raises(ScheduleError, match="num_cells must be even and >= 2, got 3"):
    schedule.make("zbv", 3, 4)


@pytest.mark.parametrize("plan", [
    schedule.gpipe(3, 4), schedule.one_f_one_b(4, 8), schedule.make("zbv", 6, 5),
    schedule.zero_bubble_h1(4, 8, weight_cells=[0, 1, 2]),
    schedule.interleaved_1f1b(4, 4, virtual_stages=2),
    schedule.one_f_one_b(2, 4).on_devices([0, 0])])
def test_device_action_lists_round_trip(plan):
  read = schedule.from_csv(plan.name, plan.to_csv())
  assert (read.actions, read.device_of, read.device_orders) == (
      plan.actions, plan.device_of, plan.device_orders)


def test_grouped_weight_gradients_are_written_one_per_micro_batch():
  grouped = schedule.one_f_one_b(2, 4).with_weight_gradients(2, [0])
  assert grouped.device_action_lists()[0][-3:] == ["0I3", "0W2", "0W3"]
  read = schedule.from_csv("grouped", grouped.to_csv())
  assert [len(g) for g in read.weight_groups(0).values()] == [1, 1, 1, 1]


@pytest.mark.parametrize("text, message", [
    ("0F0,0B0\n1F0,XX,1B0\n", r"line 2: bad action 'XX'; write <cell><F\|I\|B\|W><unit>"),
    ("0F0,1F0,0B0,1B0\n1F0\n", r"line 2: '1F0': cell 1 is on line 1 already"),
    ("0F0,0B0\n2F0,2B0\n", r"the cells are \[0, 2\]; number them 0..1"),
    ("0F0,0I0\n", r"cell 0 runs FI: a cell either runs whole backwards \(B\) or splits"),
    ("0F0,0B0,0W0\n", r"cell 0 runs BFW"),
    ("0B0,0F0\n", r"cell 0 runs B0 before F0"),
])
def test_a_malformed_action_list_is_named(text, message):
  with pytest.raises(ScheduleError, match=message):
    schedule.from_csv("custom", text)
