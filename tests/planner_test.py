"""The automatic plan against brute force over every split, and its cost model."""

import itertools

import numpy as np
import pytest

from lingvo_gpipe.pipeline import planner
from lingvo_gpipe.pipeline.planner import LayerCost, Machine


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


def brute_force_split(costs, num_cells, micro_batch, held, recompute, slot_factor, cap):
  """The least largest cell time over every split whose cells fit, written out."""
  best, best_value = None, np.inf
  for splits in all_splits(len(costs), num_cells):
    bounds = list(zip([0, *splits[:-1]], splits))
    fits = all(planner.cell_memory(costs, s, e, micro_batch, held[k], recompute, slot_factor)
               <= cap for k, (s, e) in enumerate(bounds))
    forward, backward = planner.cell_times(costs, bounds, micro_batch, recompute)
    value = max(f + b for f, b in zip(forward, backward))
    if fits and value < best_value - 1e-12:
      best, best_value = splits, value
  return best, best_value


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("num_cells", [1, 2, 3, 4])
@pytest.mark.parametrize("recompute", [True, False])
def test_the_split_is_the_brute_force_optimum_under_a_memory_cap(seed, num_cells, recompute):
  costs = table(seed)
  held = [num_cells - k for k in range(num_cells)]  # 1F1B's

  def peak(splits):
    return max(planner.cell_memory(costs, s, e, 8, held[k], recompute, 2.0)
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


@pytest.mark.parametrize("seed", range(4))
def test_the_search_is_the_brute_force_best_of_every_plan(seed):
  """Every (R, K, split, M, recompute, schedule) on 4 devices with batch 8, each
  predicted: the search returns the fastest that fits, with the budget set between
  the smallest and the largest need so that it binds."""
  costs = table(seed, num_layers=5)
  needs = []
  candidates = []
  for replicas in (1, 2, 4):
    for num_cells in range(1, 4 // replicas + 1):
      for m in [m for m in (1, 2, 4, 8) if (8 // replicas) % m == 0]:
        for recompute in planner.RECOMPUTE:
          for name in planner.SCHEDULES:
            for splits in all_splits(len(costs), num_cells):
              p = planner.predict(costs, Machine(4, np.inf), replicas, splits, m, recompute,
                                  name, 8)
              needs.append(max(p.peak_bytes))
              candidates.append(p)
  budget = float(np.percentile(needs, 30))
  machine = Machine(4, budget)
  got = planner.plan(costs, machine, 8, top=1)[0]
  # Brute force: per (R, K, M, recompute, schedule) the least-bottleneck split that
  # fits (the partitioner's objective), then the fastest of those.
  best_per_config = {}
  for p in candidates:
    if max(p.peak_bytes) > budget:
      continue
    key = (p.num_replicas, p.num_cells, p.num_micro_batches, p.recompute, p.schedule)
    bounds = list(zip([0, *p.splits[:-1]], p.splits))
    forward, backward = planner.cell_times(costs, bounds, 8 // p.num_replicas //
                                           p.num_micro_batches, p.recompute == "always")
    bottleneck = max(f + b for f, b in zip(forward, backward))
    if key not in best_per_config or bottleneck < best_per_config[key][0] - 1e-12:
      best_per_config[key] = (bottleneck, p)
  want = min((p for _, p in best_per_config.values()), key=lambda p: p.step_s)
  assert got.step_s == pytest.approx(want.step_s)
  assert max(got.peak_bytes) <= budget
  # The unconstrained fastest plan needs more than the budget.
  fastest = min(candidates, key=lambda p: p.step_s)
  assert max(fastest.peak_bytes) > budget or fastest.step_s == pytest.approx(got.step_s)


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
  override = plans[0].params_override()
  assert f"task.pipeline.num_cells={plans[0].num_cells};" in override
  assert f"task.pipeline.splits={list(plans[0].splits)};" in override


def test_measured_costs_count_bytes_from_shapes_and_are_cached(tmp_path):
  import tensorflow as tf

  from lingvo_gpipe.core import layers
  params = [layers.Linear.Params().set(name=f"fc{i}", input_dim=16 + 16 * i,
                                       output_dim=32 - 16 * i, activation="TANH")
            for i in range(2)]
  costs = planner.measure_layer_costs(params, tf.TensorSpec([8, 16], tf.float32), steps=2)
  assert [c.weight_bytes for c in costs] == [(16 * 32 + 32) * 4, (32 * 16 + 16) * 4]
  assert [c.input_bytes for c in costs] == [8 * 16 * 4, 8 * 32 * 4]
  # tanh(x·W + b) keeps at least its output for tanh's gradient and x for W's.
  assert costs[0].kept_bytes >= (8 * 16 + 8 * 32) * 4
  assert all(c.forward_s > 0 and c.backward_s >= 0 and c.batch == 8 for c in costs)
  path = str(tmp_path / "costs.json")
  calls = []

  def measure():
    calls.append(1)
    return costs

  assert planner.cached_layer_costs(path, ["model", 8], measure) == costs
  assert planner.cached_layer_costs(path, ["model", 8], measure) == costs
  assert len(calls) == 1
  planner.cached_layer_costs(path, ["model", 16], measure)
  assert len(calls) == 2


def test_plan_mode_prints_a_plan_the_trainer_runs_and_refuses_a_budget_nothing_fits(tmp_path):
  import json

  from conftest import run_trainer

  cache = tmp_path / "costs.json"
  planned = run_trainer("--model=lm.TransformerTiny", "--mode=plan", "--devices=cpu:2",
                        "--device_memory=64MiB", f"--cost_cache={cache}")
  assert planned.returncode == 0, planned.stderr
  assert "splits" in planned.stdout and cache.exists()
  best = json.loads(planned.stdout.strip().splitlines()[-1])
  assert best["devices"] == 2 and max(best["peak_bytes"]) <= 0.9 * 64 * 2**20
  trained = run_trainer("--model=lm.TransformerTiny", "--devices=cpu:2",
                        f"--logdir={tmp_path / 'run'}", "--max_steps=2",
                        f"--params_override={best['params_override']}")
  assert trained.returncode == 0, trained.stderr
  refused = run_trainer("--model=lm.TransformerTiny", "--mode=plan", "--devices=cpu:2",
                        "--device_memory=1KiB", f"--cost_cache={cache}")
  assert refused.returncode == 2
  assert "no plan fits 922 B per device on 2 device(s); the smallest any plan needs is" \
      in refused.stderr
