"""Peak activation memory of one training step, from TensorFlow's allocator counts.

    activation bytes = peak bytes in use during the step − bytes in use just before it

(weights, optimizer slots and the input batch are in use before). Call it on a step
that has run once already, so that tracing and slot creation are not counted.

On CPU the counts need TensorFlow's BFC allocator (the one GPUs use): set
TF_CPU_ALLOCATOR_USE_BFC=true in the environment before TensorFlow starts (the
default CPU allocator keeps no counts on some CPUs: get_memory_info raises). All
logical CPU devices share that one allocator, so with cells on logical CPUs the
figure is the total over the cells.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any, NamedTuple

import tensorflow as tf

# The allocator of the host's CPU: the input pipeline's (logical CPU devices share it).
HOST_ALLOCATOR = "CPU:0"


def step_activation_bytes(run_step: Callable[[], Any], device: str = "CPU:0") -> dict:
  """Runs `run_step()` once (it must block until the step is done, e.g. by calling
  .numpy() on a result) and returns {'activation_bytes', 'peak_bytes',
  'baseline_bytes'} for `device`."""
  gc.collect()
  usage, _ = usage_during(run_step, device)
  return {"activation_bytes": usage.peak - usage.before, "peak_bytes": usage.peak,
          "baseline_bytes": usage.before}


class Usage(NamedTuple):
  """Bytes in use on an allocator just before a call, at its peak while the call
  ran, and just after it."""
  before: int
  peak: int
  after: int


def usage_during(run: Callable[[], Any], allocator: str) -> tuple[Usage, Any]:
  """(`Usage` of `allocator` around `run()`, what run() returned): the one place the
  allocator's counts are read around a call (`run` must block until its work is
  done)."""
  before = tf.config.experimental.get_memory_info(allocator)["current"]
  tf.config.experimental.reset_memory_stats(allocator)
  result = run()
  after = tf.config.experimental.get_memory_info(allocator)
  return Usage(before, after["peak"], after["current"]), result


def held_by(build: Callable[[], Any], allocator: str) -> tuple[Any, int | None]:
  """(what `build()` returned, the bytes it left in use on `allocator`: what it made
  and keeps), the bytes None where the allocator keeps no counts. The trainer's input
  pipeline is measured so: its source tensors stay in the host's allocator through
  the run, beside the cells' where the devices are logical CPUs."""
  try:
    before = tf.config.experimental.get_memory_info(allocator)["current"]
  except (ValueError, tf.errors.OpError):
    return build(), None
  result = build()
  return result, tf.config.experimental.get_memory_info(allocator)["current"] - before


def counts_small_allocations(allocator: str = HOST_ALLOCATOR) -> bool:
  """Whether `allocator`'s counts (get_memory_info) include an allocation of 4 KiB:
  TensorFlow's BFC allocator's do; the default CPU allocator's leave out those under
  256 KiB on some CPUs, or cannot be read at all. Which one a process has is fixed
  when TensorFlow starts (TF_CPU_ALLOCATOR_USE_BFC): this asks the allocator, not the
  environment, which may have been set too late."""
  try:
    before = tf.config.experimental.get_memory_info(allocator)["current"]
    with tf.device(allocator):
      held = tf.fill([1024], 1.0)  # 4 KiB, allocated now and held until read
    after = tf.config.experimental.get_memory_info(allocator)["current"]
  except (ValueError, tf.errors.OpError):
    return False
  del held
  return after - before >= 4096
