"""The automatic plan against brute force over every split, and its cost model."""

import dataclasses
import itertools
import json
import shutil

import numpy as np
import pytest
from tiers import EXHAUSTIVE

from lingvo_gpipe.pipeline import layer_profiler, planner, step_model
from lingvo_gpipe.pipeline.layer_profiler import LayerCost
from lingvo_gpipe.pipeline.planner import Machine


def table(seed: int, num_layers: int = 6) -> list[LayerCost]:
  """Random costs at a micro-batch of 4: times in ms, bytes in MB-ish units."""
  rng = np.random.RandomState(seed)
  return [LayerCost(forward_s=float(rng.uniform(1, 5)), backward_s=float(rng.uniform(2, 9)),
                    weight_bytes=int(rng.randint(1, 20)), input_bytes=int(rng.randint(1, 4)),
                    kept_bytes=int(rng.randint(2, 12)), batch=4)
          for _ in range(num_layers)]


def all_splits(num_layers: int, num_cells: int):
  for cuts in itertools.combinations(range(1, num_layers), num_cells - 1):
    yield (*cuts, num_layers)


def remat(policy: str, k: int, num_cells: int) -> bool:
  return {"always": True, "never": False, "except_last": k < num_cells - 1}[policy]


def brute_force_split(costs, num_cells, micro_batch, held, recompute, slot_factor, cap):
  """The least largest cell time over every split whose cells fit, written out."""
  best, best_value = None, np.inf
  for splits in all_splits(len(costs), num_cells):
    bounds = list(zip([0, *splits[:-1]], splits))
    fits = all(planner.cell_memory(costs, s, e, micro_batch, held[k],
                                   remat(recompute, k, num_cells), slot_factor)
               <= cap for k, (s, e) in enumerate(bounds))
    forward, backward = planner.cell_times(costs, bounds, micro_batch, recompute)
    value = max(f + b for f, b in zip(forward, backward))
    if fits and value < best_value - 1e-12:
      best, best_value = splits, value
  return best, best_value


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("num_cells", [1, 2, 3, 4])
@pytest.mark.parametrize("recompute", ["always", "except_last", "never"])
def test_the_split_is_the_brute_force_optimum_under_a_memory_cap(seed, num_cells, recompute):
  costs = table(seed)
  held = [num_cells - k for k in range(num_cells)]  # 1F1B's

  def peak(splits):
    return max(planner.cell_memory(costs, s, e, 8, held[k], remat(recompute, k, num_cells),
                                   2.0)
               for k, (s, e) in enumerate(zip([0, *splits[:-1]], splits)))

  free_split, _ = brute_force_split(costs, num_cells, 8, held, recompute, 2.0, np.inf)
  peaks = sorted({peak(sp) for sp in all_splits(len(costs), num_cells)})
  excluded_the_free_optimum = False
  for cap in [np.inf] + peaks:
    want, want_value = brute_force_split(costs, num_cells, 8, held, recompute, 2.0, cap)
    got = planner.best_split(costs, num_cells, 8, held, recompute, 2.0, cap)
    if want is None:
      assert got is None
      continue
    bounds = list(zip([0, *got[:-1]], got))
    forward, backward = planner.cell_times(costs, bounds, 8, recompute)
    assert max(f + b for f, b in zip(forward, backward)) == pytest.approx(want_value)
    assert peak(got) <= cap
    excluded_the_free_optimum |= cap < peak(free_split)
  # Some cap left a plan that fits but not the unconstrained optimum (unless that
  # optimum is also the split needing the least memory).
  assert excluded_the_free_optimum or peak(free_split) == peaks[0]


ONE_CELL_PER_DEVICE = ("gpipe", "1f1b", "zb_h1")


@pytest.mark.parametrize("seed", range(4))
def test_the_search_is_the_brute_force_best_of_every_plan(seed):
  """Every (R, K, split, M, recompute, schedule) on 4 devices with batch 8, each
  predicted, the budget set between the smallest and the largest need so that it
  binds. Per configuration the planner takes the split the partitioner's objective
  picks (the least bottleneck, then the least total time; not necessarily the fastest
  simulated step), then the fastest configuration: written out here by enumeration.
  `predict` itself is checked against the paper's closed forms
  (test_prediction_of_equal_cells_is_the_papers_formula)."""
  costs = table(seed, num_layers=5)
  needs = []
  candidates = []
  for replicas in (1, 2, 4):
    for num_cells in range(1, 4 // replicas + 1):
      for m in [m for m in (1, 2, 4, 8) if (8 // replicas) % m == 0]:
        for recompute in ("always", "except_last", "never"):
          for name in ONE_CELL_PER_DEVICE:
            # G > 1 where a cell defers its weight gradients: re-materialized, not zb_h1
            groups = [g for g in planner.WEIGHT_GRADIENT_GROUPS if g <= m] if (
                recompute != "never" and name != "zb_h1") else [1]
            for g, splits in itertools.product(groups, all_splits(len(costs), num_cells)):
              p = planner.predict(costs, Machine(4, np.inf), replicas, splits, m, recompute,
                                  name, 8, weight_gradient_group=g)
              needs.append(max(p.peak_bytes))
              candidates.append(p)
  budget = float(np.percentile(needs, 30))
  machine = Machine(4, budget)
  got = planner.plan(costs, machine, 8, top=1, schedules=ONE_CELL_PER_DEVICE)[0]
  # Brute force: per (R, K, M, recompute, schedule) the least-bottleneck split that
  # fits, the least total time among those (the partitioner's objective), then the
  # fastest of those.
  best_per_config = {}
  for p in candidates:
    if max(p.peak_bytes) > budget:
      continue
    shape = p.shape
    key = (shape.num_replicas, shape.num_cells, shape.num_micro_batches, shape.recompute,
           shape.schedule, shape.weight_gradient_group)
    forward, backward = planner.cell_times(costs, shape.bounds, 8 // shape.num_replicas //
                                           shape.num_micro_batches, shape.recompute)
    value = (max(f + b for f, b in zip(forward, backward)), sum(forward) + sum(backward))
    if key not in best_per_config or value < best_per_config[key][0]:
      best_per_config[key] = (value, p)
  want = min((p for _, p in best_per_config.values()), key=lambda p: p.step_s)
  assert got.step_s == pytest.approx(want.step_s)
  assert max(got.peak_bytes) <= budget
  # The unconstrained fastest plan needs more than the budget.
  fastest = min(candidates, key=lambda p: p.step_s)
  assert max(fastest.peak_bytes) > budget or fastest.step_s == pytest.approx(got.step_s)


@pytest.mark.parametrize("schedule_name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("recompute", ["always", "except_last", "never"])
@pytest.mark.parametrize("replicas, num_cells, num_micro", [(1, 1, 1), (1, 3, 4), (2, 2, 2),
                                                            (1, 4, 8)])
def test_prediction_of_equal_cells_is_the_papers_formula(schedule_name, recompute, replicas,
                                                         num_cells, num_micro):
  """predict (the search's ranking) against closed forms written from the paper: K
  equal cells of F and B per micro-batch (each action with the machine's overhead on
  top) fill and drain in (M + K − 1)·(F + B) with either schedule; each cell holds its
  weights, their gradient sums, the sums' copy a backward adds into and the slots,
  one hand-off received ahead each way, and per micro-batch in flight (gpipe M, 1f1b
  K − k) its input when re-materialized (plus one recomputed forward) or everything
  its backward keeps; cell 0 also the replica's batch of inputs."""
  layer = LayerCost(forward_s=2e-3, backward_s=5e-3, weight_bytes=1000, input_bytes=64,
                    kept_bytes=300, batch=4)
  per_cell = 2
  costs = [layer] * (num_cells * per_cell)
  batch = 16 * replicas
  micro = batch // replicas // num_micro
  machine = Machine(4, np.inf, slot_factor=2.0, action_overhead_s=1e-4,
                    allreduce_bytes_per_s=1e6)
  splits = [per_cell * (k + 1) for k in range(num_cells)]
  got = planner.predict(costs, machine, replicas, splits, num_micro, recompute,
                        schedule_name, batch)
  scale = micro / layer.batch
  f = per_cell * layer.forward_s * scale
  b = per_cell * layer.backward_s * scale + (f if recompute == "always" else 0.0)
  want_step = (num_micro + num_cells - 1) * (f + b + 2 * 1e-4)
  if replicas > 1:
    want_step += 2 * (replicas - 1) / replicas * (len(costs) * 1000 / num_cells) / 1e6
  if recompute != "except_last":  # (its cells are unequal: no closed form here)
    assert got.step_s == pytest.approx(want_step, rel=1e-9)
    assert got.bubble == pytest.approx((num_micro + num_cells - 1 - num_micro) /
                                       (num_micro + num_cells - 1), rel=1e-9)
  # (replicas: the all-reduce's two gradient buffers too)
  weights = per_cell * 1000 * (3 + 2.0 + (2.0 if replicas > 1 else 0.0))
  kept = per_cell * 300 * scale
  for k, peak in enumerate(got.peak_bytes):
    held = num_micro if schedule_name == "gpipe" else min(num_cells - k, num_micro)
    remat = recompute == "always" or (recompute == "except_last" and k < num_cells - 1)
    activations = held * 64 * scale + kept if remat else held * kept
    inbox = 64 * scale * (2 if k < num_cells - 1 else 1)
    inputs = 64 * (batch // replicas) / layer.batch if k == 0 else 0.0
    assert peak == pytest.approx(weights + activations + inbox + inputs, rel=1e-9), k


def test_a_budget_nothing_fits_names_the_smallest_need():
  costs = table(0)
  with pytest.raises(planner.PlanError, match=r"no plan fits .* per device on 2 device\(s\); "
                                             r"the smallest any plan needs is"):
    planner.plan(costs, Machine(2, 1.0), 8)


def test_the_plan_prints_and_overrides_params():
  plans = planner.plan(table(1), Machine(2, np.inf), 8, top=3)
  assert len(plans) == 3 and plans[0].step_s <= plans[1].step_s <= plans[2].step_s
  text = planner.format_plans(plans)
  assert len(text.splitlines()) == 4 and "splits" in text.splitlines()[0]
  override = plans[0].shape.params_override()
  assert f"task.pipeline.num_cells={plans[0].shape.num_cells};" in override
  assert f"task.pipeline.splits={list(plans[0].shape.splits)};" in override


def test_measured_costs_count_bytes_from_shapes_and_are_cached(tmp_path):
  import tensorflow as tf

  from lingvo_gpipe.core import layers
  params = [layers.Linear.Params().set(name=f"fc{i}", input_dim=16 + 16 * i,
                                       output_dim=32 - 16 * i, activation="TANH")
            for i in range(2)]
  costs = layer_profiler.measure_layer_costs(params, tf.TensorSpec([8, 16], tf.float32),
                                             steps=2)
  assert [c.weight_bytes for c in costs] == [(16 * 32 + 32) * 4, (32 * 16 + 16) * 4]
  assert [c.input_bytes for c in costs] == [8 * 16 * 4, 8 * 32 * 4]
  # tanh(x·W + b) keeps its output for tanh's gradient and its input x for W's (the
  # input apart: in a cell it is the previous layer's output, counted there).
  assert costs[0].kept_bytes == 8 * 32 * 4 and costs[0].kept_input_bytes == 8 * 16 * 4
  # Its output is the tanh's: the next layer keeps it as its input, one buffer.
  assert costs[0].kept_output_bytes == 8 * 32 * 4 and costs[1].kept_input_bytes == 8 * 32 * 4
  assert step_model.inputs_kept_beyond_outputs(costs) == [0.0, 0.0]
  # Its deferred backward keeps x·W's x [8, 16] and the gradient of x·W [8, 32].
  assert [c.product_bytes for c in costs] == [(8 * 16 + 8 * 32) * 4, (8 * 32 + 8 * 16) * 4]
  # Seconds beyond an empty call's, fitted at 8 and 2 examples (a line that does not
  # fall with the batch), and a weight share that is a share.
  assert all(c.forward_s >= 0 and c.backward_s >= 0 and c.batch == 8 for c in costs)
  assert all(0 <= c.forward_fixed_s <= c.forward_s and 0 <= c.backward_fixed_s <= c.backward_s
             and 0 <= c.weight_share <= 1 for c in costs)
  path = str(tmp_path / "costs.json")
  calls = []

  def measure():
    calls.append(1)
    return costs

  assert layer_profiler.cached_layer_costs(path, ["model", 8], measure) == costs
  assert layer_profiler.cached_layer_costs(path, ["model", 8], measure) == costs
  assert len(calls) == 1
  layer_profiler.cached_layer_costs(path, ["model", 16], measure)
  assert len(calls) == 2


@pytest.mark.parametrize("text", ["nan", "inf", "-inf", "1e30", "0", "-4GB", "lots", "16XB"])
def test_a_device_memory_that_is_not_a_size_is_refused_by_name(text):
  with pytest.raises(ValueError, match=f"'{text}'"):
    planner.parse_bytes(text)


def test_memory_sizes_read_as_bytes():
  assert planner.parse_bytes("16GB") == planner.parse_bytes("16GiB") == 16 * 2**30
  assert planner.parse_bytes(" 512MiB ") == 512 * 2**20
  assert planner.parse_bytes("2e9") == 2e9
  assert planner.parse_bytes("1024TiB") == 2**50


def test_a_cost_cache_that_is_not_one_is_measured_around_and_left_as_it_was(tmp_path):
  costs = table(0, num_layers=2)
  warnings = []
  for name, content in [("garbage", "\x00{not json"), ("list", "[1, 2]")]:
    path = tmp_path / name
    path.write_text(content)
    got = layer_profiler.cached_layer_costs(str(path), ["m"], lambda: costs, warnings.append)
    assert got == costs
    assert path.read_text() == content  # maybe the user's file: not overwritten
    assert f"cost cache {path} ignored" in warnings[-1]
  # Our file, but this model's entry holds wrong types: measured again and replaced.
  path = tmp_path / "costs.json"
  layer_profiler.cached_layer_costs(str(path), ["m"], lambda: costs, warnings.append)
  stored = json.loads(path.read_text())
  (key,) = stored
  calls = []
  bad_entries = [[{"forward_s": "fast"}], "x", [], [dict(stored[key][0], batch=2.5)],
                 [dict(stored[key][0], kept_bytes=-1)], [dict(stored[key][0], batch=0)]]
  for i, bad in enumerate(bad_entries):
    path.write_text(json.dumps({key: bad}))
    got = layer_profiler.cached_layer_costs(
        str(path), ["m"], lambda: calls.append(1) or costs, warnings.append)
    assert got == costs and len(calls) == i + 1, bad
    assert "not usable" in warnings[-1]
    assert json.loads(path.read_text())[key] == stored[key]


def test_a_cache_in_folders_yet_to_be_made_is_saved_and_checked_for_its_layer_count(
    tmp_path):
  costs = table(0, num_layers=3)
  path = tmp_path / "not" / "yet" / "costs.json"
  calls = []

  def measure():
    calls.append(1)
    return costs

  assert layer_profiler.cached_layer_costs(str(path), ["m"], measure, num_layers=3) == costs
  assert path.exists()
  assert layer_profiler.cached_layer_costs(str(path), ["m"], measure, num_layers=3) == costs
  assert len(calls) == 1
  warnings = []
  layer_profiler.cached_layer_costs(str(path), ["m"], measure, warnings.append, num_layers=4)
  assert len(calls) == 2 and "3 records for 4 layers" in warnings[-1]


def test_the_planner_searches_every_schedule_and_no_duplicate_plans():
  plans = planner.plan(table(2), Machine(2, np.inf), 8, top=10000)
  shapes = [p.shape for p in plans]
  # Written out, not read from schedule.SCHEDULES: a schedule added there must be
  # searched (and this list updated) on purpose.
  assert {s.schedule for s in shapes} == {"gpipe", "1f1b", "zb_h1", "interleaved_1f1b", "zbv",
                                          "interleaved_zb"}
  for s, p in zip(shapes, plans):
    assert s.num_devices * s.num_replicas <= 2 and len(p.peak_bytes) == s.num_devices
    assert (s.virtual_stages > 1) == (s.schedule in ("interleaved_1f1b", "zbv",
                                                      "interleaved_zb"))
    assert s.virtual_stages == 2 or s.schedule != "zbv"
    # G > 1 only where a cell defers its weight gradients (re-materialized; not the
    # schedules that place their own W)
    assert s.weight_gradient_group == 1 or (s.recompute != "never" and s.schedule not in
                                            ("zb_h1", "zbv", "interleaved_zb"))
  assert {s.weight_gradient_group for s in shapes} == {1, 2, 4}
  keys = [(s.num_cells, dataclasses.replace(s, splits=())) for s in shapes]
  assert len(keys) == len(set(keys))
  assert "except_last" not in {s.recompute for s in shapes if s.num_cells == 1}


def test_a_tensor_between_two_layers_is_kept_once_if_either_keeps_it():
  """conv → batch norm → ReLU → conv, by hand: the norm keeps its input (the conv's
  output, which the conv does not keep), the ReLU its output, the last conv its input
  (the ReLU's output: held once). Every split's cells, as the planner's search counts
  them and as step_model does."""
  def layer(kept, kept_in, kept_out):
    return LayerCost(1.0, 2.0, weight_bytes=10, input_bytes=100, kept_bytes=kept,
                     batch=4, kept_input_bytes=kept_in, kept_output_bytes=kept_out)

  costs = [layer(0, 100, 0), layer(8, 100, 0), layer(100, 0, 100), layer(0, 100, 0)]
  assert step_model.inputs_kept_beyond_outputs(costs) == [0.0, 100.0, 0.0, 0.0]
  assert step_model.cell_kept_bytes(costs, 1) == 100 + (0 + 8 + 100 + 0) + 100
  assert step_model.cell_kept_bytes(costs[1:], 1) == 100 + 108  # its first keeps its input
  assert step_model.cell_kept_bytes(costs[2:], 1) == 100  # the ReLU's output, once
  machine = Machine(2, np.inf)
  for splits in [(4,), (1, 4), (2, 4), (3, 4)]:
    for recompute in ("never", "always"):
      shape = step_model.PlanShape(1, splits, 1, recompute, "gpipe")
      cells = step_model.cell_costs(costs, shape, 4, machine)
      for k, (s, e) in enumerate(shape.bounds):
        searched = planner.cell_memory(costs, s, e, 4, 1, recompute == "always", 1.0)
        alone = step_model.device_peaks(
            step_model.PlanShape(1, (e - s,), 1, recompute, "gpipe").make_schedule(),
            [cells[k]], 1.0, 0.0)[0]
        assert searched == pytest.approx(alone), (splits, k)
        assert cells[k].kept_bytes == step_model.cell_kept_bytes(costs[s:e], 1)


def test_a_task_not_pipelined_is_predicted_without_the_engines_activation_factor():
  """It trains with TensorFlow's own step: its activations are the layers' as
  profiled. The same model as one pipelined cell runs the engine: with the factor."""
  from lingvo_gpipe import model_registry, planning

  model_registry.load_param_files()
  plain = model_registry.get_params("demo.TinyConvNet")
  costs = table(3, num_layers=8)
  machine = Machine(1, np.inf, activation_factor=2.0)
  devices = ["/device:CPU:0"]
  shape, own = planning.predict_own(plain, costs, machine, devices, 8)
  assert shape == step_model.PlanShape(1, (8,), 1, "never", "gpipe")
  alike = dataclasses.replace(machine, activation_factor=1.0)
  assert own.peak_bytes == step_model.predict(costs, alike, shape, 8).peak_bytes
  one_cell = plain.copy()
  one_cell.task.pipeline.set(num_cells=1, num_micro_batches=1, recompute="never")
  shape, own = planning.predict_own(one_cell, costs, machine, devices, 8)
  assert own.peak_bytes == step_model.predict(costs, machine, shape, 8).peak_bytes
  assert own.peak_bytes[0] > step_model.predict(costs, alike, shape, 8).peak_bytes[0]


def test_replicas_share_the_cores_their_devices_share():
  """Two replicas of one device each on two logical CPUs that compute 1.0 at once run
  at half speed each: R=2's step at batch 16 is one replica's (batch 8) on a device
  alone twice over. With a core each, they run at full speed."""
  costs = table(4)
  shape = step_model.PlanShape(2, (6,), 1, "never", "gpipe")
  alone = step_model.predict(costs, Machine(1, np.inf, cores=None, allreduce_bytes_per_s=np.inf),
                             dataclasses.replace(shape, num_replicas=1), 8).step_s
  shared = Machine(2, np.inf, cores=1.0, allreduce_bytes_per_s=np.inf)
  assert step_model.predict(costs, shared, shape, 16).step_s == pytest.approx(2 * alone)
  own_cores = dataclasses.replace(shared, cores=2.0)
  assert step_model.predict(costs, own_cores, shape, 16).step_s == pytest.approx(alone)
  for machine in (shared, own_cores):  # (the search's bound too)
    plan = shape.make_schedule()
    cells = step_model.cell_costs(costs, shape, 16, machine)
    assert step_model.lower_bound_s(plan, cells, machine, 2) <= \
        step_model.predict(costs, machine, shape, 16).step_s + 1e-12


def test_a_plan_table_lists_each_step_once_whatever_its_schedule_is_called():
  """At K=1, M=1 gpipe and 1f1b are both one forward and one backward: one row, not
  two that run alike (a top three of the same step is no choice)."""
  plans = planner.plan(table(2), Machine(2, np.inf), 8, top=10000)
  ran = [(dataclasses.replace(p.shape, schedule=""), p.shape.make_schedule().device_orders,
          p.shape.make_schedule().device_of) for p in plans]
  assert len(ran) == len(set(ran))
  one_step = {p.shape.schedule for p in plans
              if p.shape.num_cells == 1 and p.shape.num_micro_batches == 1
              and p.shape.recompute == "never" and p.shape.num_replicas == 2}
  assert len(one_step & {"gpipe", "1f1b"}) == 1 and "zb_h1" in one_step  # (zb_h1: F, B, W)


def test_device_memory_of_zero_bubble_and_interleaved_by_hand():
  """zb_h1 keeps each backward's products until its W (cell 0 of 2 cells at M=4:
  two in flight, one awaiting), interleaved_1f1b sums a device's cells (4 cells on
  2 devices: device d holds cells d and d + 2) with one working set."""
  layer = LayerCost(forward_s=1e-3, backward_s=2e-3, weight_bytes=1000, input_bytes=10,
                    kept_bytes=100, batch=2, product_bytes=40)
  costs = [layer] * 4
  machine = Machine(2, np.inf, slot_factor=1.0)
  zb = planner.predict(costs, machine, 1, (2, 4), 4, "always", "zb_h1", 8)
  # By hand (schedule.py's rule: cell k runs W of i − k after B of i):
  #   cell 0: F0 F1 B0 W0 F2 B1 W1 F3 B2 W2 B3 W3  2 in flight, 1 awaiting its W
  #   cell 1: F0 B0 F1 B1 W0 F2 B2 W1 F3 B3 W2 W3  1 in flight, 2 awaiting
  weights, kept, products, inputs = 2 * 1000 * 4.0, 2 * 100, 2 * 40, 10 * 8 / 2
  assert zb.peak_bytes[0] == pytest.approx(
      weights + 2 * 10 + 1 * products + 2 * 10 + kept + inputs)
  assert zb.peak_bytes[1] == pytest.approx(weights + 1 * 10 + 2 * products + 10 + kept)
  inter = planner.predict(costs, machine, 1, (1, 2, 3, 4), 4, "never", "interleaved_1f1b", 8,
                          virtual_stages=2)
  # By hand (Megatron's rounds of D = 2 micro-batches, warm-up 4 on device 0, 2 on 1):
  #   device 0: cell 0 F0 F1, cell 2 F0 F1, cell 0 F2, cell 2 B0, cell 0 F3, cell 2 B1,
  #             cell 2 F2, cell 0 B0, cell 2 F3, cell 0 B1, cell 2 B2 B3, cell 0 B2 B3
  #   device 1: cell 1 F0 F1, cell 3 F0 B0 F1 B1, cell 1 F2 B0 F3 B1, cell 3 F2 B2 F3 B3,
  #             cell 1 B2 B3
  # so cells 0..3 hold at most 4, 3, 2, 1 micro-batches in flight.
  in_flight = [4, 3, 2, 1]
  for d in range(2):
    cells = [d, d + 2]
    held = sum(1000 * 4.0 + in_flight[k] * 100 + 10 + (10 if k < 3 else 0) for k in cells)
    assert inter.peak_bytes[d] == pytest.approx(held + (inputs if d == 0 else 0.0)), d


def test_shared_cores_stretch_the_step_as_processor_sharing_does():
  """Two devices on one core: a 1-cell-per-device gpipe step whose actions overlap
  runs them at half speed. With F = B = 1 at K = 2, M = 1 nothing overlaps (each
  action waits for the other cell's): the same 4 units as with two cores; at M = 2
  the overlapping middle runs at half speed."""
  layer = LayerCost(forward_s=1.0, backward_s=1.0, weight_bytes=0, input_bytes=0,
                    kept_bytes=0, batch=1)
  free = Machine(2, np.inf, action_overhead_s=0.0)
  shared = dataclasses.replace(free, cores=1)
  for m, alone, together in [(1, 4.0, 4.0), (2, 6.0, 8.0)]:
    for machine, want in [(free, alone), (shared, together)]:
      got = planner.predict([layer, layer], machine, 1, (1, 2), m, "never", "gpipe", m)
      assert got.step_s == pytest.approx(want), (m, machine.cores)


def test_a_cost_cache_path_that_can_never_be_one_is_refused_before_measuring(tmp_path):
  a_file = tmp_path / "file"
  a_file.write_text("")
  for path, why in [(tmp_path, "is a directory"), (a_file / "costs.json", "is not a folder")]:
    with pytest.raises(layer_profiler.CostCacheError, match=why):
      layer_profiler.cached_layer_costs(str(path), ["m"], lambda: pytest.fail("measured"))


@EXHAUSTIVE
def test_plan_mode_and_plan_auto_train_the_best_plan_and_refuse_a_budget_nothing_fits(
    tiny_lm_cost_cache, tmp_path):
  """--mode=plan prints the best plans and judges the params as given; --plan=auto
  trains with that best plan and writes its prediction beside the measurement;
  --plan=check keeps the params as given; a budget no plan fits exits 2 in both."""
  import json

  from conftest import run_trainer

  cache = tmp_path / "costs.json"
  shutil.copy(tiny_lm_cost_cache, cache)
  common = ("--model=lm.TransformerTiny", "--devices=cpu:2", f"--cost_cache={cache}")
  planned = run_trainer(*common, "--mode=plan", "--device_memory=64MiB")
  assert planned.returncode == 0, planned.stderr
  assert "splits" in planned.stdout and cache.exists()
  assert "The params as given (K=2, M=4, always, gpipe)" in planned.stdout
  best = json.loads(planned.stdout.strip().splitlines()[-1])
  assert best["devices"] == 2 and max(best["peak_bytes"]) <= 0.9 * 64 * 2**20
  assert best["own"]["fits"] and len(best["own"]["peak_bytes"]) == 2
  auto = run_trainer(*common, "--plan=auto", "--device_memory=64MiB", "--max_steps=4",
                     f"--logdir={tmp_path / 'auto'}")
  assert auto.returncode == 0, auto.stderr[-3000:]
  assert f"Plan: {best['params_override']}" in auto.stdout  # the plan --mode=plan printed
  assert "Plan check: step predicted" in auto.stdout
  found = json.loads((tmp_path / "auto" / "train" / "plan_check.json").read_text())
  override = dict(item.split("=") for item in best["params_override"].split(";"))
  assert found["shape"]["splits"] == json.loads(override["task.pipeline.splits"])
  assert found["shape"]["num_micro_batches"] == int(override["task.pipeline.num_micro_batches"])
  devices = len(found["shape"]["splits"]) // found["shape"]["virtual_stages"]
  assert len(found["predicted_peak_bytes"]) == devices
  assert found["predicted_step_s"] > 0 and found["measured_step_s"] > 0
  assert len(found["measured_action_s"]) == len(found["predicted_action_s"]) == 3
  params_txt = (tmp_path / "auto" / "params.txt").read_text()
  assert f"task.pipeline.splits : {override['task.pipeline.splits']}" in params_txt
  # --plan=check keeps the params as given: lm.TransformerTiny's 2 cells, 4 micro-batches.
  check = run_trainer(*common, "--plan=check", "--max_steps=4",
                      f"--logdir={tmp_path / 'check'}")
  assert check.returncode == 0, check.stderr[-3000:]
  found = json.loads((tmp_path / "check" / "train" / "plan_check.json").read_text())
  assert found["shape"]["num_micro_batches"] == 4 and len(found["shape"]["splits"]) == 2
  refused = run_trainer(*common, "--plan=auto", "--device_memory=1KiB",
                        f"--logdir={tmp_path / 'refused'}")
  assert refused.returncode == 2 and "--plan=auto: no plan fits" in refused.stderr
  assert not (tmp_path / "refused").exists()  # refused before anything was written
  refused = run_trainer(*common, "--mode=plan", "--device_memory=1KiB")
  assert refused.returncode == 2
  assert "no plan fits 922 B per device on 2 device(s); the smallest any plan needs is" \
      in refused.stderr
  assert "does NOT fit: " in refused.stdout and "over the budget 922 B on device" in \
      refused.stdout


@EXHAUSTIVE
def test_a_plan_trains_the_shape_it_predicted_with_the_layers_profiled_once(tiny_lm_cost_cache,
                                                                            tmp_path):
  """--plan=auto with the params' own weight_gradient_group=2 trains the plan's G (the
  plan sets every field it decides: a zb_h1 plan with the params' G=2 would be
  refused); --plan=check under partition_cost='measured' trains the split it
  predicted (read back from params.txt), from the planner's costs in the cache (the
  partitioner does not profile the layers again)."""
  from conftest import run_trainer

  cache = tmp_path / "costs.json"
  shutil.copy(tiny_lm_cost_cache, cache)
  common = ("--model=lm.TransformerTiny", "--devices=cpu:2", f"--cost_cache={cache}",
            "--max_steps=3")

  def trained(logdir) -> dict:
    text = (logdir / "params.txt").read_text()
    return {line.split(" : ")[0].strip(): line.split(" : ")[1].strip()
            for line in text.splitlines() if line.startswith("task.pipeline.")}

  auto = run_trainer(*common, "--plan=auto", f"--logdir={tmp_path / 'auto'}",
                     "--params_override=task.pipeline.weight_gradient_group=2")
  assert auto.returncode == 0, auto.stderr[-3000:]
  plan_line = [line for line in auto.stdout.splitlines() if line.startswith("Plan: ")][0]
  planned = dict(item.split("=", 1) for item in plan_line[len("Plan: "):].split(";"))
  got = trained(tmp_path / "auto")
  for key, value in planned.items():
    assert got[key].strip("'") == value, key  # (params.txt quotes strings)
  check = run_trainer(*common, "--plan=check", f"--logdir={tmp_path / 'check'}",
                      "--params_override=task.pipeline.partition_cost='measured'")
  assert check.returncode == 0, check.stderr[-3000:]
  assert "for the partition" not in check.stdout  # (base_task.with_partition_costs' log)
  found = json.loads((tmp_path / "check" / "train" / "plan_check.json").read_text())
  assert trained(tmp_path / "check")["task.pipeline.splits"] == str(found["shape"]["splits"])


def test_the_comparison_sets_prediction_beside_measurement():
  from lingvo_gpipe import planning
  from lingvo_gpipe.pipeline import step_model

  shape = step_model.PlanShape(1, (2, 4), 4, "always", "gpipe")
  prediction = step_model.Prediction(shape, 0.5, 0.2, (100.0, 300.0))
  planned = planning.Planned(None, prediction, Machine(2, np.inf))
  found = planning.compare(planned, [9.0, 0.4, 0.6, 0.55], (["CPU:0"], [480.0]))
  assert found["measured_step_s"] == 0.55  # the median after the first step
  assert found["step_error"] == pytest.approx(0.1)
  # one allocator for both devices: their predicted sum beside it
  assert found["peak_error"] == [pytest.approx(0.2)]
  assert "+10.0%" in planning.format_comparison(found)
  two = planning.compare(planned, [1.0, 0.5], (["GPU:0", "GPU:1"], [110.0, 270.0]))
  assert two["measured_step_s"] is None  # fewer than 3 steps
  assert two["peak_error"] == [pytest.approx(0.1), pytest.approx(-0.1)]
  # Two replicas of one cell on two devices sharing one allocator: both devices' peaks.
  replicated = step_model.Prediction(step_model.PlanShape(2, (4,), 1, "never", "gpipe"), 0.5,
                                     0.0, (100.0,))
  found = planning.compare(planning.Planned(None, replicated, Machine(2, np.inf)), [1.0],
                           (["CPU:0"], [260.0]))
  assert found["peak_error"] == [pytest.approx(0.3)]
  # What the input pipeline holds in the host's allocator counts where the devices
  # share it (logical CPUs), not on a GPU's.
  hosted = planning.compare(planned, [1.0], (["CPU:0"], [480.0]), host_bytes=80.0)
  assert hosted["peak_error"] == [pytest.approx(0.0)] and hosted["host_bytes"] == 80.0
  assert "with the input pipeline's" in planning.format_comparison(hosted)
  two = planning.compare(planned, [1.0], (["GPU:0", "GPU:1"], [110.0, 270.0]),
                         host_bytes=80.0)
  assert two["peak_error"] == [pytest.approx(0.1), pytest.approx(-0.1)]


def test_each_layer_input_is_traced_and_its_work_runs_on_the_device():
  """What calibration measures the model's own work with: each layer's input spec
  (traced, against the shapes by hand) and that layer's work, run. (The figures
  measured from it are checked against scripted timings in calibration_test.py; here
  only the concurrency rule of one device, which no timing decides.)"""
  import tensorflow as tf

  from lingvo_gpipe import calibration
  from lingvo_gpipe.core import layers

  assert calibration.concurrency(["/device:CPU:0"]) == float("inf")
  # The model's own work: each layer's input spec found by tracing, the layer run.
  params = [layers.Linear.Params().set(name=f"fc{i}", input_dim=16 + 16 * i,
                                       output_dim=32 - 16 * i) for i in range(2)]
  specs = layer_profiler.layer_input_specs(params, tf.TensorSpec([8, 16], tf.float32))
  assert [s.shape.as_list() for s in specs] == [[8, 16], [8, 32]]
  work = layer_profiler.layer_work(params[1], specs[1])("/device:CPU:0")
  assert np.isfinite(tf.function(work)().numpy())


def test_plan_mode_refuses_a_bad_budget_and_cache_path_in_one_line(tmp_path):
  from conftest import run_trainer

  plan = ("--model=lm.TransformerTiny", "--mode=plan", "--devices=cpu:2")
  # (1e30, inf and a file that is not a cache: parse_bytes and cached_layer_costs above)
  for flag, why in [("--device_memory=nan", "--device_memory: 'nan': a device's memory"),
                    (f"--cost_cache={tmp_path}", f"--cost_cache: cost cache '{tmp_path}' is a "
                                                 "directory")]:
    refused = run_trainer(*plan, flag)
    assert refused.returncode == 2, (flag, refused.stderr[-2000:])
    assert why in refused.stderr and "Traceback" not in refused.stderr, refused.stderr[-2000:]
    assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr


@pytest.mark.parametrize("kind", ["linear", "conv"])
def test_layer_working_sets_read_off_the_allocator_are_the_hand_count(kind, cpu_allocator_stats):
  """A backward allocates the gradients it returns and its own temporaries; counted by
  hand, in buffers the CPU allocator tracks (>= 256 KiB; smaller ones it leaves out,
  so the input gradient or bias are at most that under). Linear + relu [512, 1024] →
  [512, 1024]: relu's gradient, dx [512, 1024] and dW [1024, 1024] (db is small).
  Conv 3×3, 32 → 64 channels on [16, 64, 64, 32]: dx [16, 64, 64, 32] and dW
  [3, 3, 32, 64]. The fit through two batches leaves the weight gradient as the
  batch-independent part."""
  import tensorflow as tf

  from lingvo_gpipe.core import layers
  from lingvo_gpipe.pipeline import step_model

  if kind == "linear":
    params = layers.Linear.Params().set(name="fc", input_dim=1024, output_dim=1024,
                                        activation="RELU")
    spec = tf.TensorSpec([512, 1024], tf.float32)
    hand = 4 * (512 * 1024 + 512 * 1024 + 1024 * 1024)
    weight_gradient = 4 * 1024 * 1024
  else:
    params = layers.Conv2D.Params().set(name="conv", filter_shape=(3, 3, 32, 64))
    spec = tf.TensorSpec([16, 64, 64, 32], tf.float32)
    hand = 4 * (16 * 64 * 64 * 32 + 3 * 3 * 32 * 64)
    weight_gradient = 4 * 3 * 3 * 32 * 64
  cost = layer_profiler.measure_layer_costs([params], spec, steps=1)[0]
  assert hand - 2**18 <= cost.backward_work_bytes <= 1.25 * hand
  if kind == "linear":
    # The order of the backward's ops varies between runs (inter-op threads): relu's
    # gradient may be freed before dW is allocated, so a peak is up to one activation
    # buffer [b, 1024] under the hand count; at the small batch (128) that moves the
    # fitted intercept by up to 4/3 of one such buffer.
    small_buffer = 4 * 128 * 1024
    assert abs(cost.backward_work_fixed_bytes - weight_gradient) <= 4 / 3 * small_buffer + 1e4
    assert abs(step_model.layer_work_bytes(cost, 128) -
               (weight_gradient + (hand - weight_gradient) / 4)) <= small_buffer + 1e4


@pytest.mark.parametrize("schedule_name, num_cells, virtual_stages, group, slices", [
    ("gpipe", 2, 1, 1, 1), ("1f1b", 3, 1, 2, 1), ("zb_h1", 4, 1, 1, 1),
    ("interleaved_1f1b", 4, 2, 1, 1), ("1f1b", 2, 1, 2, 2), ("gpipe", 4, 1, 4, 1)])
def test_the_layer_the_chart_and_the_planner_simulate_the_same_step(
    cpu_devices, schedule_name, num_cells, virtual_stages, group, slices):
  """One shape: the pipeline layer's schedule is the planner's (schedule.build for
  both), and the planner's predicted loops (Prediction.schedule_s) are what the chart
  and the layer's bubble_planned simulate from the same per-cell action times
  (MeasuredTimeline.planned: PipelineSchedule.simulate of [F, B, W] per cell)."""
  from lingvo_gpipe.core import layers
  from lingvo_gpipe.pipeline.layer import PipeliningLayer
  from lingvo_gpipe.pipeline.step_model import PlanShape, predict

  shape = PlanShape(1, tuple(range(1, num_cells + 1)), 4, "except_last", schedule_name,
                    virtual_stages, group, slices)
  layer = PipeliningLayer.Params().set(
      name="same", splits=list(shape.splits), num_micro_batches=4, recompute="except_last",
      schedule=schedule_name, virtual_stages=virtual_stages, weight_gradient_group=group,
      num_token_slices=slices, devices=cpu_devices[:shape.num_devices],
      layers=[layers.Linear.Params().set(name=f"fc{i}", input_dim=4, output_dim=4)
              for i in range(num_cells)]).instantiate()
  assert layer.plan() == shape.make_schedule()
  costs = [LayerCost(forward_s=1e-3 * (i + 1), backward_s=2e-3, weight_bytes=64,
                     input_bytes=16, kept_bytes=32, batch=8, weight_share=0.4)
           for i in range(num_cells)]
  prediction = predict(costs, Machine(shape.num_devices, np.inf, action_overhead_s=0.0),
                       shape, 8)
  simulated = layer.plan().simulate(*prediction.action_s)
  assert max(end for _, end in simulated.values()) == pytest.approx(prediction.schedule_s)


def test_a_plan_with_less_margin_than_the_models_error_is_tight_not_fits():
  from lingvo_gpipe import planning
  from lingvo_gpipe.pipeline import step_model

  error = planner.MEMORY_MODEL_ERROR
  shape = step_model.PlanShape(1, (2, 4), 4, "always", "gpipe")
  setting = planning.Setting(("a", "b"), 1000.0, "")
  for need, word in [(1000.0 / (1 + error), "fits"), (1000.0 / (1 + error / 2), "tight"),
                     (1000.0, "tight"), (1001.0, "does NOT fit")]:
    assert planner.fit_word(need, 1000.0) == word, need
    said = planning.verdict(step_model.Prediction(shape, 1.0, 0.0, (need / 2, need)), setting)
    assert said.startswith(word) and "on device 1" in said and "1000 B" in said, said


@pytest.mark.parametrize("num_micro_batches, recompute", [(2, "never"), (8, "always")])
@EXHAUSTIVE
def test_a_whole_cells_step_stays_within_the_bound_the_planner_states(
    cpu_devices, num_micro_batches, recompute, cpu_allocator_stats):
  """The engine's own training step of one cell (four Linear [512, 512] + relu layers,
  Adam, stacked weights) at other M than the step memory was calibrated at (M = 1 and
  4, as the planner does, at the training batch its layer costs are measured at), its
  peak read off the allocator: measured ≤ predicted × (1 + planner.MEMORY_MODEL_ERROR),
  the bound `--mode=plan` states. (Batch 2048: micro-batches of 256 rows or more,
  buffers the CPU allocator sees without BFC. The prediction is 1.45-1.5× the
  measurement here: docs/benchmarks.md, "Planner", weight-heavy cells.)"""
  import gc

  import tensorflow as tf

  from lingvo_gpipe import calibration
  from lingvo_gpipe.core import layers, optimizers
  from lingvo_gpipe.pipeline import step_model

  device = cpu_devices[0]
  params = [layers.Linear.Params().set(name=f"fc{i}", input_dim=512, output_dim=512,
                                       activation="RELU") for i in range(4)]
  adam = optimizers.Adam.Params()
  batch = 2048
  spec = tf.TensorSpec([batch, 512], tf.float32)
  costs = layer_profiler.measure_layer_costs(params, spec, steps=1, device=device)
  memory = calibration.step_memory(device, params, spec, costs, adam, stack_variables=True)
  gc.collect()
  with tf.device(device):
    inputs = tf.random.normal([batch, 512])
  (model, _), run = calibration.training_step(device, params, inputs, num_micro_batches,
                                              adam, recompute)
  np.asarray(run())
  tf.config.experimental.reset_memory_stats("CPU:0")
  before = tf.config.experimental.get_memory_info("CPU:0")["current"]
  np.asarray(run())
  measured = tf.config.experimental.get_memory_info("CPU:0")["peak"] - before
  weights = sum(v.shape.num_elements() * 4 for v in model.trainable_variables)
  machine = Machine(1, np.inf, slot_factor=2.0, **dataclasses.asdict(memory))
  shape = step_model.PlanShape(1, (4,), num_micro_batches, recompute, "gpipe")
  # (the variables, slots and the batch were allocated before: the prediction less them)
  predicted = (step_model.predict(costs, machine, shape, batch).peak_bytes[0] -
               3 * weights - inputs.shape.num_elements() * 4)
  assert measured <= predicted * (1 + planner.MEMORY_MODEL_ERROR), (measured, predicted)


def test_tied_copies_hold_no_slots_and_variables_not_trained_are_held_once():
  """A softmax tied to an embedding measured alone: its stand-in for the embedding is
  tied bytes (a copy where it runs away from the owner: no optimizer slots); a batch
  norm's moving statistics, and a frozen one's gamma and beta, are held once, no
  slots, no gradients. The bound counts each as such (against a hand count)."""
  import tensorflow as tf

  from lingvo_gpipe.core import layers

  dim, classes = 16, 24
  params = [layers.BatchNorm.Params().set(name="bn", dim=dim),
            layers.BatchNorm.Params().set(name="bn_frozen", dim=dim, frozen=True),
            layers.Softmax.Params().set(name="softmax", input_dim=dim, num_classes=classes,
                                        tie_to="embedding/emb/emb")]
  costs = layer_profiler.measure_layer_costs(params, tf.TensorSpec([8, 4, dim], tf.float32),
                                             steps=1)
  assert [(c.weight_bytes, c.tied_bytes, c.frozen_bytes) for c in costs] == [
      (4 * 2 * dim, 0, 4 * 2 * dim), (0, 0, 4 * 4 * dim),
      (4 * (classes * dim + classes), 4 * classes * dim, 0)]
  # weights 1000 of which 100 a tied copy, 50 not trained; Adam's 2 slots, 2 copies:
  # 1000·5 − 2·100 + 50, and a save (factor 3.1) 3100 − 200 + 1.1·50
  assert step_model.peak_bytes(1000.0, 0.0, 0.0, 0.0, 5.0, 1.0, 3.1, tied_bytes=100.0,
                               frozen_bytes=50.0, slot_factor=2.0) == pytest.approx(4850.0)
  assert step_model.peak_bytes(1000.0, 0.0, 0.0, 0.0, 1.0, 1.0, 3.1, tied_bytes=100.0,
                               frozen_bytes=50.0, slot_factor=2.0) == pytest.approx(2955.0)


@pytest.mark.parametrize("flags,given,expected", [
    (["--mode=plan"], None, "true"), (["--plan=check"], None, "true"),
    (["--plan=auto"], "false", "false"), ([], None, None), (["--mode=eval", "--plan=check"],
                                                            None, None)])
def test_plans_count_small_allocations_unless_told_otherwise(flags, given, expected):
  """--mode=plan and --plan (in train modes) turn on the BFC allocator, whose counts
  include allocations under 256 KiB; a value the user set is kept; other runs are left
  as they are. (tools/trainer.py in a child: importing it defines absl flags.)"""
  printed = _printed_in_a_child(
      "import os, sys; sys.path.insert(0, '.'); from tools import trainer; "
      f"trainer._parse_flags(['trainer.py'] + {flags!r}); "
      "trainer._count_every_allocation_for_plans(); "
      "print(os.environ.get('TF_CPU_ALLOCATOR_USE_BFC'))", given)
  assert printed == str(expected)


def _printed_in_a_child(code: str, bfc: str | None) -> str:
  """What Python `code` prints, run in a child process from the repository, with
  TF_CPU_ALLOCATOR_USE_BFC=`bfc` (None: unset) as TensorFlow starts."""
  import os
  import subprocess
  import sys

  from conftest import REPO

  env = {k: v for k, v in os.environ.items() if k != "TF_CPU_ALLOCATOR_USE_BFC"}
  if bfc is not None:
    env["TF_CPU_ALLOCATOR_USE_BFC"] = bfc
  done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                        cwd=REPO, env=env, timeout=60)
  assert done.returncode == 0, done.stderr[-2000:]
  return done.stdout.strip()


@EXHAUSTIVE
def test_a_cold_plan_measures_in_a_child_process_and_a_warm_one_measures_nothing(tmp_path):
  """--plan with costs the cache lacks measures them in a child process (--mode=plan)
  and trains in its own, which the measuring left nothing in; the costs it wrote are
  what the next run reads, measuring nothing; without a cache (--cost_cache='') the
  child's temporary one is gone when the run ends."""
  from conftest import run_trainer

  cache = tmp_path / "costs.json"
  common = ("--model=demo.TinyConvNet", "--devices=cpu:2", "--plan=check", "--max_steps=2")
  cold = run_trainer(*common, f"--cost_cache={cache}", f"--logdir={tmp_path / 'cold'}")
  assert cold.returncode == 0, cold.stderr[-3000:]
  lines = cold.stdout.splitlines()
  assert "Measuring in a child process (--mode=plan)" in cold.stdout
  assert any(line.startswith("  Measuring the costs of the") for line in lines)
  assert not any(line.startswith("Measuring the costs of the") for line in lines)
  warm = run_trainer(*common, f"--cost_cache={cache}", f"--logdir={tmp_path / 'warm'}")
  assert warm.returncode == 0, warm.stderr[-3000:]
  assert "Measuring" not in warm.stdout
  scratch = tmp_path / "scratch"
  scratch.mkdir()
  none = run_trainer(*common, "--cost_cache=", f"--logdir={tmp_path / 'none'}",
                     env={"TMPDIR": str(scratch)})
  assert none.returncode == 0, none.stderr[-3000:]
  assert "  Measuring the costs of the" in none.stdout
  assert (tmp_path / "none" / "train" / "plan_check.json").exists()
  assert list(scratch.iterdir()) == []


@pytest.mark.parametrize("given", ["true", None])
def test_what_the_allocator_counts_is_asked_of_it_and_keys_the_cache(given):
  """The cost cache's key and the warning follow what the host's allocator counts, not
  the environment (which may be set after TensorFlow started). In a child: the
  allocator is chosen when TensorFlow starts."""
  printed = _printed_in_a_child(
      "import sys; sys.path.insert(0, '.'); "
      "from lingvo_gpipe.pipeline import memory; from lingvo_gpipe import planning; "
      "import os, tensorflow as tf; tf.constant(1.0) + 1; "  # (the allocator is made)
      "os.environ['TF_CPU_ALLOCATOR_USE_BFC'] = 'true'; "  # (too late)
      "print(memory.counts_small_allocations(), planning._host_counts())", given)
  counts = given == "true"
  assert printed == (f"{counts} every allocation" if counts else
                     f"{counts} allocations of 256 KiB and more, or none")


def test_planning_on_cpus_warns_where_the_allocator_leaves_small_allocations_out(
    monkeypatch):
  from lingvo_gpipe import planning
  from lingvo_gpipe.pipeline import memory

  for counts, devices, warned in [(False, ("/device:CPU:0",), True),
                                  (True, ("/device:CPU:0",), False),
                                  (False, ("/device:GPU:0",), False)]:
    monkeypatch.setattr(memory, "counts_small_allocations", lambda *_, c=counts: c)
    logged = []
    planning.warn_where_allocations_go_uncounted(
        planning.Setting(devices, 1e9, "", log=logged.append))
    assert any("does not count allocations under 256 KiB" in line for line in logged) == warned


@EXHAUSTIVE
def test_evals_between_steps_are_kept_out_of_the_plans_peak(tiny_lm_cost_cache, tmp_path):
  """train_and_eval with --plan=check: evals of a batch 8× the training's run between
  steps; the peak set beside the plan is the training's, as in the same run without
  evals (an eval's peak was charged to the plan: +78%)."""
  from conftest import run_trainer

  cache = tmp_path / "costs.json"
  shutil.copy(tiny_lm_cost_cache, cache)
  common = ("--model=lm.TransformerTiny", "--devices=cpu:2", f"--cost_cache={cache}",
            "--plan=check", "--max_steps=6")
  peaks = {}
  for mode, extra in (("train", ()), ("train_and_eval", (
      "--params_override=task.train.eval_interval_steps=2;eval_input.batch_size=256",))):
    done = run_trainer(*common, f"--mode={mode}", f"--logdir={tmp_path / mode}", *extra)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads((tmp_path / mode / "train" / "plan_check.json").read_text())
    peaks[mode] = found["measured_peak_bytes"][0] - found["host_bytes"]
  assert peaks["train_and_eval"] < 1.15 * peaks["train"], peaks


def test_a_check_of_cells_sharing_devices_is_refused_before_measuring(tmp_path):
  """The step model places one cell per device (K / V per replica): two cells on one
  device are refused in one line naming both counts, before anything is measured or
  written."""
  from conftest import run_trainer

  done = run_trainer("--model=lm.TransformerTiny", "--devices=cpu", "--plan=check",
                     f"--cost_cache={tmp_path / 'costs.json'}", f"--logdir={tmp_path / 'run'}")
  assert done.returncode == 2
  assert ("--plan=check: the params' 2 cells (virtual_stages=1, num_replicas=1) are "
          "predicted on 2 devices, one per cell; 1 given") in done.stderr
  assert "Measuring" not in done.stdout
  assert not (tmp_path / "costs.json").exists() and not (tmp_path / "run").exists()


@EXHAUSTIVE
def test_a_run_stopped_while_its_child_measures_leaves_no_temporary_cache(tmp_path):
  """SIGTERM to the trainer while its child measures the costs (--cost_cache=''): the
  child is stopped with it (exit 143) and the child's temporary cache folder is gone
  (the process ends without the trainer thread's cleanup)."""
  import os
  import signal
  import subprocess
  import sys

  from conftest import REPO

  scratch = tmp_path / "scratch"
  scratch.mkdir()
  trainer = subprocess.Popen(
      [sys.executable, str(REPO / "tools" / "trainer.py"), "--model=demo.TinyConvNet",
       "--devices=cpu:2", "--plan=check", "--cost_cache=", "--max_steps=2",
       f"--logdir={tmp_path / 'run'}"],
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
      env=dict(os.environ, TMPDIR=str(scratch), TF_CPP_MIN_LOG_LEVEL="2"))
  for line in trainer.stdout:
    if line.startswith("  Measuring the costs of the"):  # (the child is measuring)
      assert [p.name for p in scratch.glob("lingvo_gpipe_costs_*")]
      trainer.send_signal(signal.SIGTERM)
      break
  assert trainer.wait(timeout=60) == 143, trainer.stderr.read()[-2000:]
  assert list(scratch.glob("lingvo_gpipe_costs_*")) == []
  assert not (tmp_path / "run").exists()
