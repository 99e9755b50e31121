"""The partitioner against brute force over every contiguous partition."""

import itertools

import numpy as np
import pytest
import tensorflow as tf
from tiers import EXHAUSTIVE

from lingvo_gpipe.core import layers
from lingvo_gpipe.pipeline import layer_profiler, partition


def brute_force(costs, num_cells, memory=None, cap=np.inf):
  """Smallest bottleneck over all contiguous partitions into num_cells cells (or None)."""
  memory = memory if memory is not None else [0.0] * len(costs)
  best = None
  for cuts in itertools.combinations(range(1, len(costs)), num_cells - 1):
    bounds = list(zip((0, *cuts), (*cuts, len(costs))))
    if any(sum(memory[s:e]) > cap for s, e in bounds):
      continue
    bottleneck = max(sum(costs[s:e]) for s, e in bounds)
    best = bottleneck if best is None else min(best, bottleneck)
  return best


def check_cells(cells, num_layers, num_cells):
  assert len(cells) == num_cells
  assert cells[0].start == 0 and cells[-1].end == num_layers
  assert all(a.end == b.start and a.start < a.end for a, b in zip(cells, cells[1:]))
  assert abs(sum(c.cost_share for c in cells) - 1.0) < 1e-9


@pytest.mark.parametrize("trial", range(60))
def test_bottleneck_equals_brute_force(trial):
  rng = np.random.RandomState(trial)
  num_layers = rng.randint(1, 10)
  num_cells = rng.randint(1, num_layers + 1)
  costs = (rng.randint(0, 20, num_layers) if trial % 2 else rng.exponential(size=num_layers))
  cells = partition.balance(costs, num_cells)
  check_cells(cells, num_layers, num_cells)
  assert max(c.cost for c in cells) == pytest.approx(brute_force(list(costs), num_cells))


@pytest.mark.parametrize("trial", range(30))
def test_memory_cap_is_respected_and_bottleneck_still_optimal(trial):
  rng = np.random.RandomState(100 + trial)
  num_layers = rng.randint(2, 10)
  num_cells = rng.randint(1, num_layers + 1)
  costs = list(rng.exponential(size=num_layers))
  memory = list(rng.uniform(1, 10, num_layers))
  cap = rng.uniform(max(memory), sum(memory))
  want = brute_force(costs, num_cells, memory, cap)
  if want is None:
    with pytest.raises(partition.PartitionError, match="at least .* cells under the memory cap"):
      partition.balance(costs, num_cells, memory=memory, memory_cap=cap)
    return
  cells = partition.balance(costs, num_cells, memory=memory, memory_cap=cap)
  check_cells(cells, num_layers, num_cells)
  assert all(c.memory <= cap + 1e-9 for c in cells)
  assert max(c.cost for c in cells) == pytest.approx(want)


def test_a_layer_larger_than_the_cap_is_named():
  with pytest.raises(partition.PartitionError, match="layer big needs 50 .* cap 20"):
    partition.balance([1, 1, 1], 2, memory=[5, 50, 5], memory_cap=20,
                      layer_names=["a", "big", "c"])


def test_bad_requests_are_named():
  with pytest.raises(partition.PartitionError, match="cannot cut 3 layers into 4 cells"):
    partition.balance([1, 2, 3], 4)
  with pytest.raises(partition.PartitionError, match="must be >= 1, got 0"):
    partition.balance([1, 2, 3], 0)
  with pytest.raises(partition.PartitionError, match="finite and >= 0"):
    partition.balance([1, -2, 3], 2)


def test_the_band_search_is_exact_when_one_layer_dominates_or_costs_are_zero():
  """Costs where the band is odd (one huge layer; all zero, where the first limit is
  0): the split is still the brute-force optimum."""
  for costs, num_cells in [([1, 1, 1, 1, 100, 1, 1, 1], 3), ([0, 0, 0, 0], 2),
                           ([0, 0, 5, 0, 0], 4), ([3, 0, 0, 0, 0, 0, 0, 3], 2)]:
    cells = partition.balance(costs, num_cells)
    assert [(c.start, c.end) for c in cells] == list(zip(
        [0, *[c.end for c in cells[:-1]]], [*[c.end for c in cells[:-1]], len(costs)]))
    assert all(c.start < c.end for c in cells) and len(cells) == num_cells
    assert max(c.cost for c in cells) == pytest.approx(brute_force(costs, num_cells))


def test_per_cell_times_and_a_start_dependent_fit_against_brute_force():
  """The solver's general form (the planner's): a layer's time differs per cell, and
  whether a cell fits depends on k and on its first layer."""
  rng = np.random.RandomState(3)
  for _ in range(20):
    num_layers, num_cells = rng.randint(2, 8), rng.randint(1, 4)
    num_cells = min(num_cells, num_layers)
    times = rng.exponential(size=(num_cells, num_layers))
    first_cost = rng.uniform(0, 5, num_layers + 1)
    limit = rng.uniform(2, 8)

    def fits(k, starts, ends, first_cost=first_cost, limit=limit):
      return (k + 1) * first_cost[starts] + (ends - starts) <= limit

    best, best_value = None, np.inf
    for cuts in itertools.combinations(range(1, num_layers), num_cells - 1):
      bounds = list(zip((0, *cuts), (*cuts, num_layers)))
      if all(fits(k, s, e) for k, (s, e) in enumerate(bounds)):
        value = max(times[k, s:e].sum() for k, (s, e) in enumerate(bounds))
        if value < best_value - 1e-12:
          best, best_value = (*cuts, num_layers), value
    got = partition.min_bottleneck_split(times, num_cells, fits)
    if best is None:
      assert got is None
      continue
    bounds = list(zip((0, *got[:-1]), got))
    assert all(fits(k, s, e) for k, (s, e) in enumerate(bounds))
    assert max(times[k, s:e].sum() for k, (s, e) in enumerate(bounds)) == pytest.approx(
        best_value)


def test_a_fit_that_forces_long_cells_widens_the_band_until_a_split_is_found():
  """Unit costs, K=4 over 8 layers: the first limit is twice 2; a fit that makes the
  first cell five layers long needs a cell of 5, beyond it."""
  def fits(k, starts, ends):
    return (k != 0) | (ends - starts == 5)

  assert partition.min_bottleneck_split(np.ones(8), 4, fits) == (5, 6, 7, 8)
  assert partition.min_bottleneck_split(np.ones(8), 4, lambda k, s, e: e - s > 2) is None


def test_among_equal_bottlenecks_the_least_total_time_wins():
  """A layer costs 3 in cells 0 and 1 and 2 in the last (as in a planner's last cell
  that does not re-materialize): (2, 4, 5) and (1, 2, 5) both have bottleneck 6, the
  second costs 12 in all against 14."""
  times = np.array([[3.0] * 5, [3.0] * 5, [2.0] * 5])
  assert partition.min_bottleneck_split(times, 3) == (1, 2, 5)


@pytest.mark.parametrize("times, num_cells, message", [
    ([1.0, float("nan")], 1, "finite and >= 0"), ([1.0, float("inf")], 1, "finite"),
    ([1.0, -1.0], 2, "finite and >= 0"), ([1.0, 2.0], 3, "cannot cut 2 layers into 3"),
    ([1.0, 2.0], 0, "into 0 cells"), ([[1.0, 2.0]] * 3, 2, r"shape \[3, 2\]")])
def test_the_solver_refuses_what_it_cannot_solve(times, num_cells, message):
  with pytest.raises(partition.PartitionError, match=message):
    partition.min_bottleneck_split(times, num_cells)


def test_memory_that_is_not_a_size_is_refused():
  with pytest.raises(partition.PartitionError, match="finite values >= 0"):
    partition.balance([1, 1], 1, memory=[1, float("nan")], memory_cap=5)
  with pytest.raises(partition.PartitionError, match="cap must be > 0, got nan"):
    partition.balance([1, 1], 1, memory=[1, 1], memory_cap=float("nan"))


def test_large_partition_is_exact_against_a_dp():
  rng = np.random.RandomState(7)
  costs = rng.exponential(size=300)
  cells = partition.balance(costs, 16)
  # O(K·L²) dynamic program as the reference.
  prefix = np.concatenate([[0], np.cumsum(costs)])
  best = np.full((17, 301), np.inf)
  best[0, 0] = 0
  for k in range(1, 17):
    for end in range(k, 301):
      starts = np.arange(k - 1, end)
      best[k, end] = np.min(np.maximum(best[k - 1, starts], prefix[end] - prefix[starts]))
  assert max(c.cost for c in cells) == pytest.approx(best[16, 300])


@EXHAUSTIVE
def test_profiled_costs_rank_layers_by_work():
  # 2.1 GFLOPs forward against 8 MFLOPs: only the order is asserted (times are noisy),
  # and a gap this wide survives a loaded machine.
  params = [layers.Linear.Params().set(name="big", input_dim=256, output_dim=4096),
            layers.Linear.Params().set(name="small", input_dim=4096, output_dim=1)]
  costs = [c.step_s for c in layer_profiler.measure_layer_costs(
      params, tf.TensorSpec([1024, 256]), steps=5)]
  assert len(costs) == 2 and costs[0] > costs[1] > 0
