"""What a device loop's state costs per action: tensors passed through a While and a Case.

A device's loop (`pipeline/device_loop.py`) is a functional While whose body runs one
Case branch per action. Every loop variable enters the body and leaves it, and every
tensor the Case takes and returns enters and leaves the branch that runs: an argument,
an Identity and a result each time, whether the action touches it or not. This times
that plumbing alone, with no work in the branches (one thread, like a one-thread
worker), in four loops of --iterations iterations over 6 branches:

  while_only   N float tensors carried by the While; the Case takes 2
  case         N float tensors and N TensorArrays through the While and the Case; each
               branch updates one tensor and writes one array
  packed       the same state packed into one Optional (`tf.experimental.Optional`,
               what `device_loop._packed` does): the branch unpacks it, updates, packs

and reports microseconds per iteration (median of --repeats calls) for each N of
--sizes, and per carried tensor: the slope between the smallest and the largest N (an
array counts as a tensor).

  python bench/loop_state_cost.py --sizes 4,64 --iterations 2000

The last line printed is JSON: {"<loop>_n<N>_us_per_iteration": ..., "while_us_per_tensor":
..., "case_us_per_tensor": ..., "packed_us_per_tensor": ...}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

tf.get_logger().setLevel("ERROR")  # (each loop is a tf.function of its own: no retracing)

from lingvo_gpipe.core import tf_internals  # noqa: E402

BRANCHES = 6


def _loop(kind: str, n: int, iterations: int) -> tf.types.experimental.PolymorphicFunction:
  """The traced loop of `kind` carrying n tensors (and n TensorArrays but for
  while_only) → a function of x float32 [8]."""
  with_lists = kind != "while_only"

  def state() -> tuple[list[tf.Tensor], list[tf.TensorArray]]:
    return ([tf.zeros([8]) for _ in range(n)],
            [tf.TensorArray(tf.float32, size=4, element_shape=[8])
             for _ in range(n if with_lists else 0)])

  def update(b: int, tensors: list, lists: list) -> tuple[list, list]:
    tensors, lists = list(tensors), list(lists)
    tensors[b % len(tensors)] += 1.0
    if lists:
      lists[b % len(lists)] = lists[b % len(lists)].write(b % 4, tensors[0])
    return tensors, lists

  @tf.function(autograph=False)
  def run(x: tf.Tensor) -> tf.Tensor:
    initial = state()
    outside = initial if kind == "while_only" else ([], [])
    inside = ([tf.zeros([8]) for _ in range(2)], []) if kind == "while_only" else initial
    if kind == "packed":
      inside = tf.experimental.Optional.from_value(tuple(tf.nest.flatten(initial)))

    def body(i, carried_outside, carried_inside, total):
      def branch(b: int):
        def run_branch():
          if kind == "packed":
            tensors, lists = tf.nest.pack_sequence_as(
                initial, list(carried_inside.get_value()))
            updated = update(b, tensors, lists)
            return (tf.experimental.Optional.from_value(tuple(tf.nest.flatten(updated))),
                    total + x)
          return update(b, *carried_inside), total + x
        return run_branch
      carried_inside, total = tf_internals.unlowered(lambda: tf.switch_case(
          tf.math.floormod(i, BRANCHES), [branch(b) for b in range(BRANCHES)]))
      return i + 1, carried_outside, carried_inside, total

    _, _, _, total = tf_internals.unlowered(lambda: tf.while_loop(
        lambda i, *_: i < iterations, body, (tf.constant(0), outside, inside, x)))
    return total
  return run


def us_per_iteration(kind: str, n: int, iterations: int, repeats: int) -> float:
  run = _loop(kind, n, iterations)
  x = tf.ones([8])
  run(x).numpy()  # trace and the first call's set-up
  seconds = []
  for _ in range(repeats):
    start = time.perf_counter()
    run(x).numpy()
    seconds.append(time.perf_counter() - start)
  return statistics.median(seconds) / iterations * 1e6


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--sizes", default="4,64", help="tensors carried (N), two or more")
  parser.add_argument("--iterations", type=int, default=2000)
  parser.add_argument("--repeats", type=int, default=7)
  args = parser.parse_args()
  tf.config.threading.set_inter_op_parallelism_threads(1)
  tf.config.threading.set_intra_op_parallelism_threads(1)
  sizes = sorted(int(n) for n in args.sizes.split(","))
  if len(sizes) < 2:
    parser.error(f"--sizes needs two sizes or more for a slope, got {args.sizes!r}")
  result: dict = {"bench": "loop_state_cost", "machine": f"{platform.machine()} "
                  f"{os.cpu_count()} cores, TF {tf.__version__}", "threads": "1, 1"}
  for kind in ("while_only", "case", "packed"):
    us = {}
    for n in sizes:
      us[n] = us_per_iteration(kind, n, args.iterations, args.repeats)
      result[f"{kind}_n{n}_us_per_iteration"] = round(us[n], 1)
      print(f"{kind:10s} N={n:4d}: {us[n]:7.1f} µs per iteration", flush=True)
    per_n = 1 if kind == "while_only" else 2  # tensors (and arrays) per unit of N
    slope = (us[sizes[-1]] - us[sizes[0]]) / (per_n * (sizes[-1] - sizes[0]))
    result[f"{kind.replace('_only', '')}_us_per_tensor"] = round(slope, 2)
  print(json.dumps(result))


if __name__ == "__main__":
  main()
