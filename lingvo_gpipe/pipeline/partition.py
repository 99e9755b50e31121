"""Cutting a sequence of layers into K contiguous cells with the smallest bottleneck.

A pipeline runs at the pace of its slowest stage, so the partition that matters
minimizes the *largest* cell cost (GPipe's paper minimizes the variance of the cell
costs; torchgpipe settles for a heuristic). `balance` finds the exact optimum:

  The optimal bottleneck is the cost of some run of consecutive layers. A greedy
  pass decides in O(L) whether a bottleneck T is feasible (fill each cell while it
  stays ≤ T); feasibility is monotone in T, so a binary search over the sorted
  distinct run costs finds the smallest feasible one. Cost: O(L² log L) numpy work,
  well under a second for the 1663-layer Transformer.

An optional per-cell memory cap is a second constraint of the same kind (a cell's
memory is the sum of its layers'); a layer that alone exceeds the cap is an error
that names it.

Costs come from parameter counts or FLOP estimates (`model_stats`, no allocation), or
from a short measured run (`profile_layer_costs`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from lingvo_gpipe.core import base_layer
from lingvo_gpipe.core.hyperparams import ParamsError


class PartitionError(ParamsError):
  """A partition that cannot be made; the message says which value is at fault."""


@dataclasses.dataclass(frozen=True)
class Cell:
  """Layers [start, end) and what they cost."""
  start: int
  end: int
  cost: float
  cost_share: float
  memory: float = 0.0


def _greedy_cells(costs: np.ndarray, memory: np.ndarray, bottleneck: float,
                  memory_cap: float) -> list[tuple[int, int]] | None:
  """Fewest cells with cost ≤ bottleneck and memory ≤ memory_cap each, or None."""
  bounds, start, cost, mem = [], 0, 0.0, 0.0
  for i, (c, m) in enumerate(zip(costs, memory)):
    if c > bottleneck or m > memory_cap:
      return None
    if cost + c > bottleneck or mem + m > memory_cap:
      bounds.append((start, i))
      start, cost, mem = i, 0.0, 0.0
    cost += c
    mem += m
  bounds.append((start, len(costs)))
  return bounds


def _split_to(bounds: list[tuple[int, int]], num_cells: int) -> list[tuple[int, int]]:
  """Splits multi-layer cells until there are `num_cells` (costs are ≥ 0, so the
  bottleneck and every cell's memory can only go down)."""
  bounds = list(bounds)
  while len(bounds) < num_cells:
    widest = max(range(len(bounds)), key=lambda i: bounds[i][1] - bounds[i][0])
    start, end = bounds[widest]
    bounds[widest:widest + 1] = [(start, end - 1), (end - 1, end)]
  return bounds


def balance(costs: Sequence[float], num_cells: int, memory: Sequence[float] | None = None,
            memory_cap: float | None = None, layer_names: Sequence[str] | None = None
            ) -> list[Cell]:
  """Contiguous cells minimizing the largest cell cost (exact).

  Args:
    costs: cost of each layer, ≥ 0.
    num_cells: K, 1 ≤ K ≤ len(costs).
    memory: memory of each layer (e.g. bytes of weights and optimizer state).
    memory_cap: the most memory one cell may hold.
    layer_names: names for error messages.

  Returns:
    K cells covering the layers in order.
  """
  costs_arr = np.asarray(costs, dtype=np.float64)
  num_layers = len(costs_arr)
  names = list(layer_names) if layer_names is not None else [f"#{i}" for i in range(num_layers)]
  if num_cells < 1:
    raise PartitionError(f"number of cells must be >= 1, got {num_cells}")
  if num_cells > num_layers:
    raise PartitionError(f"cannot cut {num_layers} layers into {num_cells} cells "
                         f"(at most {num_layers})")
  if np.any(costs_arr < 0) or not np.all(np.isfinite(costs_arr)):
    raise PartitionError(f"layer costs must be finite and >= 0, got {list(costs)}")
  mem_arr = (np.zeros(num_layers) if memory is None
             else np.asarray(memory, dtype=np.float64))
  cap = np.inf if memory_cap is None else float(memory_cap)
  if memory_cap is not None:
    too_big = [i for i in range(num_layers) if mem_arr[i] > cap]
    if too_big:
      i = too_big[0]
      raise PartitionError(f"layer {names[i]} needs {mem_arr[i]:.4g} of memory, more than the "
                           f"per-cell cap {cap:.4g}; raise the cap or split the layer")
    needed = len(_greedy_cells(np.zeros(num_layers), mem_arr, 0.0, cap))
    if needed > num_cells:
      raise PartitionError(f"the layers need at least {needed} cells under the memory cap "
                           f"{cap:.4g}, but only {num_cells} were asked for")

  prefix = np.concatenate([[0.0], np.cumsum(costs_arr)])
  i, j = np.triu_indices(num_layers + 1, k=1)
  candidates = np.unique(prefix[j] - prefix[i])
  lo, hi = 0, len(candidates) - 1  # the total cost (the last candidate) is feasible
  while lo < hi:
    mid = (lo + hi) // 2
    bounds = _greedy_cells(costs_arr, mem_arr, candidates[mid], cap)
    if bounds is not None and len(bounds) <= num_cells:
      hi = mid
    else:
      lo = mid + 1
  bounds = _split_to(_greedy_cells(costs_arr, mem_arr, candidates[lo], cap), num_cells)
  total = float(prefix[-1]) or 1.0
  return [Cell(s, e, float(prefix[e] - prefix[s]), float(prefix[e] - prefix[s]) / total,
               float(mem_arr[s:e].sum())) for s, e in bounds]


def cells_from_splits(splits: Sequence[int], costs: Sequence[float]) -> list[Cell]:
  """Cells from explicit `splits`: the end index of each cell, increasing, last = L."""
  num_layers = len(costs)
  splits = list(splits)
  if not splits:
    raise PartitionError("splits is empty; give the end index of each cell")
  previous = 0
  for index in splits:
    if not isinstance(index, int) or index <= previous or index > num_layers:
      raise PartitionError(
          f"bad splits {splits}: each entry is a cell's end index, strictly increasing, "
          f"in 1..{num_layers} (got {index!r} after {previous})")
    previous = index
  if splits[-1] != num_layers:
    raise PartitionError(f"bad splits {splits}: the last cell must end at the number of "
                         f"layers, {num_layers}")
  prefix = np.concatenate([[0.0], np.cumsum(np.asarray(costs, dtype=np.float64))])
  total = float(prefix[-1]) or 1.0
  starts = [0, *splits[:-1]]
  return [Cell(s, e, float(prefix[e] - prefix[s]), float(prefix[e] - prefix[s]) / total)
          for s, e in zip(starts, splits)]


def profile_layer_costs(layer_params: Sequence[Any], input_specs: Any, steps: int = 3
                        ) -> list[float]:
  """Median measured seconds of forward + backward per layer, on the default device.

  Builds each layer for real (this allocates), feeds it random inputs of the shapes
  the previous layer produced, and times `steps` runs after one warm-up.
  """
  def random_like(spec):
    if spec.dtype.is_floating:
      return tf.random.normal(spec.shape, dtype=spec.dtype)
    return tf.zeros(spec.shape, spec.dtype)

  inputs = tf.nest.map_structure(random_like, input_specs)
  costs = []
  for p in layer_params:
    layer = p.copy().instantiate()

    @tf.function
    def run(x, layer=layer):
      with base_layer.step_context(training=True, layer_stats=[]):
        with tf.GradientTape() as tape:
          tape.watch(tf.nest.flatten(x))
          out = base_layer.call_with(layer, x)
          total = tf.add_n([tf.reduce_sum(t) for t in tf.nest.flatten(out)
                            if t.dtype.is_floating])
        tape.gradient(total, layer.trainable_variables)
      return out

    outputs = run(inputs)
    times = []
    for _ in range(steps):
      start = time.perf_counter()
      tf.nest.map_structure(lambda t: t.numpy(), run(inputs))
      times.append(time.perf_counter() - start)
    costs.append(float(np.median(times)))
    inputs = outputs
  return costs
