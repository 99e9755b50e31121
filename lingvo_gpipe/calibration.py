"""The machine figures a plan's prediction needs, measured on the devices it runs on
(`step_model.Machine`): the device loop's own cost per action, the optimizer update's
seconds per weight byte, and a hand-off's latency and bytes per second.

Each is the median of a few runs of a small step built for the purpose, less what it
does not measure (an empty call), on the first device (the link: from the first to
the second; the concurrency: on all of them at once). A few seconds in all.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from lingvo_gpipe import train_step
from lingvo_gpipe.core import (
  base_layer,
  layers,
  optimizers,
  stacked_variables,
  tf_internals,
  variable_chunks,
)
from lingvo_gpipe.pipeline import layer_profiler, memory, step_model
from lingvo_gpipe.pipeline.layer import PipeliningLayer


def _call_times_s(fn: Callable[[], Any], runs: int = 7) -> list[float]:
  """Wall seconds of each of `runs` calls of fn(), its result fetched, after one warm-up
  call (layer_profiler.call_seconds)."""
  return layer_profiler.call_seconds(fn, runs, warm_up=True)


def _median_call_s(fn: Callable[[], Any], runs: int = 7) -> float:
  """Median wall seconds of fn(), its result fetched, after one warm-up call."""
  return float(np.median(_call_times_s(fn, runs)))


def _spread_s(times: Sequence[float]) -> float:
  """The median absolute deviation of `times`: how far one call's time strays."""
  return float(np.median(np.abs(np.asarray(times) - np.median(times))))


def action_overhead_s(device: str, few: int = 2, many: int = 18) -> float:
  """The device loop's seconds per action beyond its cell's call: a training step of
  one cell holding one 4-wide layer on `device` at `many` and at `few` micro-batches,
  the difference over the 2·(many − few) actions it adds."""

  sgd = optimizers.SGD.Params()
  _, at_many = _calibration_step(device, many, many, 4, 1, sgd)
  _, at_few = _calibration_step(device, few, many, 4, 1, sgd)
  extra = _median_call_s(at_many) - _median_call_s(at_few)
  return max(extra / (2 * (many - few)), 0.0)


def training_step(device: str, layer_params: Sequence[Any], inputs: Any,
                  num_micro_batches: int, optimizer_params: Any, recompute: str = "always",
                  stack_variables: bool = True) -> tuple[tuple[Any, Any], Callable[[], Any]]:
  """((the model, its optimizer), a function running one training step and returning
  its loss): one cell of the layers of `layer_params` on `device`, M micro-batches of
  the nested `inputs` [B, ...], the loss the mean square of every floating output,
  the optimizer of `optimizer_params` with learning rate 0 (the step changes
  nothing)."""

  with base_layer.stand_in_ties():  # a run of layers measured alone
    stack = PipeliningLayer.Params().set(
        name="calibration", num_cells=1, num_micro_batches=num_micro_batches,
        devices=[device], random_seed=1, stack_variables=stack_variables,
        recompute=recompute, layers=[p.copy() for p in layer_params]).instantiate()

  def loss(outputs: Any, _) -> dict:
    floating = [t for t in tf.nest.flatten(outputs) if t.dtype.is_floating]
    batch = tf.cast(tf.shape(floating[0])[0], tf.float32)
    return {"loss": (tf.add_n([tf.reduce_mean(tf.square(tf.cast(t, tf.float32)))
                               for t in floating]), batch)}

  model = train_step.StackWithLoss(stack, loss)
  optimizer = optimizer_params.copy().set(learning_rate=0.0).instantiate()
  optimizer.create_slots(model.trainable_variables)
  step = tf_internals.step_function(train_step.TrainStep(  # (as the trainer runs it)
      model, optimizer, tf.Variable(0, dtype=tf.int64), input_device=device))
  batch = {"inputs": inputs}
  return (model, optimizer), lambda: step(batch)[0]["loss"]


def _calibration_step(device: str, num_micro_batches: int, batch: int, width: int,
                      depth: int, optimizer_params: Any, stack_variables: bool = True
                      ) -> tuple[tuple[Any, Any], Callable[[], Any]]:
  """`training_step` of `depth` [width, width] Linear layers at `batch` rows."""
  with tf.device(device):
    inputs = tf.zeros([batch, width])
  return training_step(device, [layers.Linear.Params().set(name=f"fc{i}", input_dim=width,
                                                           output_dim=width)
                                for i in range(depth)],
                       inputs, num_micro_batches, optimizer_params,
                       stack_variables=stack_variables)


@dataclasses.dataclass(frozen=True)
class StepMemory:
  """How a training step of the model's own layers allocates beyond what the step
  model counts (`step_memory`): weight-sized buffers per weight byte at one
  micro-batch and at several, the factor on the activations' bytes, and a save's
  copies per weight byte."""
  weight_copies_one: float = 2.0
  weight_copies: float = 2.0
  activation_factor: float = 1.0
  save_copies: float = 0.0


def step_memory(device: str | None, layer_params: Sequence[Any], input_specs: Any,
                  costs: Sequence[Any], optimizer_params: Any, stack_variables: bool
                  ) -> StepMemory:
  """What a training step of the model's own layers, and a checkpoint save of them,
  allocate beyond the weights and their optimizer slots, read off the allocator of
  `device` (a local one: layer_profiler.local_twin) around steps of one cell of all
  `layer_params` (M = 1 without re-materialization, M = 4 with and without), each at
  two batches (one example per micro-batch, and `input_specs`' batch), set against
  what the step model counts for their activations (`costs`: the layers' LayerCosts
  at that batch): beyond(b) = copies · weights + factor · activations(b), solved
  from the two batches. The copies are what grows with the weights (the gradient
  sums and the copy a backward adds into, reads of stacked rows, the update's
  temporaries), never below the formula's 2; the factor, never below 1, what the
  layers measured alone leave out of the engine's steps. The save: a stacked
  variable's rows copied out to be saved each under its own key. The formula's
  StepMemory() where the allocator cannot be read or the model does not fit."""
  import os
  import tempfile


  allocator = layer_profiler.allocator_name(device)
  try:
    tf.config.experimental.reset_memory_stats(allocator)
  except (ValueError, tf.errors.OpError):
    return StepMemory()

  def peak_beyond(fn: Callable[[], Any]) -> float:
    usage, _ = memory.usage_during(fn, allocator)
    return usage.peak - usage.before

  def activations(num_micro_batches: int, recompute: str, batch: int) -> float:
    shape = step_model.PlanShape(1, (len(layer_params),), num_micro_batches, recompute,
                                 "gpipe")
    cells = step_model.cell_costs(costs, shape, batch, step_model.Machine(1, float("inf")))
    return step_model.device_peaks(shape.make_schedule(), cells, 0.0, 0.0)[0]

  def measured(num_micro_batches: int, recompute: str, batch: int) -> tuple[Any, float]:
    with tf.device(device):
      inputs = tf.nest.map_structure(layer_profiler.random_like,
                                     layer_profiler.with_batch(input_specs, batch))
    model, run = training_step(device, layer_params, inputs, num_micro_batches,
                               optimizer_params, recompute, stack_variables)
    np.asarray(run())  # traced; the slots exist now
    return model, max(peak_beyond(lambda: np.asarray(run())) for _ in range(2))

  batch = tf.nest.flatten(input_specs)[0].shape[0]
  copies = {1: 2.0, 4: 2.0}
  factor = 1.0
  try:
    for num_micro_batches, recompute in ((1, "never"), (4, "never"), (4, "always")):
      small, large = num_micro_batches, max(batch, num_micro_batches)
      (model, optimizer), at_small = measured(num_micro_batches, recompute, small)
      weights = sum(v.shape.num_elements() * v.dtype.size for v in model.trainable_variables)
      act_small = activations(num_micro_batches, recompute, small)
      slope = 1.0
      if large > small:
        act_large = activations(num_micro_batches, recompute, large)
        # A slope over activations small beside the weights is the allocator's noise
        # (its rounding, the order ops free buffers in) amplified: fitted only where
        # they grow by a quarter of the weights at least.
        if act_large - act_small >= 0.25 * weights:
          _, at_large = measured(num_micro_batches, recompute, large)
          slope = max((at_large - at_small) / (act_large - act_small), 1.0)
      factor = max(factor, slope)
      copies[num_micro_batches] = max(copies[num_micro_batches],
                                      (at_small - slope * act_small) / weights)
    checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer)

    def write(path: str) -> None:  # as the trainer saves (checkpoints.CheckpointStore)
      with stacked_variables.whole_stack_io():
        checkpoint.write(path)
    with tempfile.TemporaryDirectory() as folder:
      save = max(peak_beyond(lambda: write(os.path.join(folder, "c"))) for _ in range(2))
  except tf.errors.ResourceExhaustedError:
    return StepMemory()
  return StepMemory(copies[1], copies[4], factor, save / weights)


def update_s_per_byte(device: str, optimizer_params: Any, num_variables: int = 8,
                      shape: Sequence[int] = (512, 512)) -> float:
  """Seconds per weight byte of what a training step does after the backward on
  `device` (the gradients' global norm, the optimizer's update, the check that every
  variable stayed finite), over `num_variables` float32 variables of `shape`."""

  with tf.device(device):
    variables = [tf.Variable(tf.zeros(shape), name=f"calibration_{i}")
                 for i in range(num_variables)]
    grads = [tf.fill(shape, 1e-3) for _ in variables]
  optimizer = optimizer_params.copy().set(learning_rate=0.0).instantiate()
  optimizer.create_slots(variables)
  step = tf.constant(0, tf.int64)

  @tf.function(autograph=False)
  def update(grads):
    with tf.device(device):
      norm = variable_chunks.global_norm(grads, variables)
      optimizer.apply_gradients(grads, variables, step, norm, condition=tf.constant(True))
      return variable_chunks.all_finite(variables + list(optimizer.variables))

  @tf.function(autograph=False)
  def empty(grads):
    with tf.device(device):
      return tf.constant(True)

  seconds = _median_call_s(lambda: update(grads)) - _median_call_s(lambda: empty(grads))
  nbytes = num_variables * int(np.prod(shape)) * 4
  return max(seconds, 0.0) / nbytes


@dataclasses.dataclass(frozen=True)
class LinkFit:
  """A hand-off's latency and rate fitted to two sizes' times (`fit_link`); floored: the
  hand-off was faster than the timing resolves, and the rate is the fastest it could
  tell apart (a lower bound on the hand-off's)."""
  latency_s: float
  bytes_per_s: float
  floored: bool


def fit_link(sizes: Sequence[int], seconds: Sequence[float], resolution_s: float
             ) -> LinkFit:
  """The line through (size, seconds) at the two `sizes`: latency its value at 0 (never
  below 0), rate 1 / its slope. A slope the timing cannot resolve (below resolution_s
  over the sizes' difference: the larger hand-off took less extra time than a time
  measurement strays, 0 or less included) is floored there, so the rate stays finite:
  a lower bound on the hand-off's, which is faster."""
  if not resolution_s > 0:
    raise ValueError(f"resolution_s={resolution_s!r} is not a positive number of seconds")
  slope = (seconds[1] - seconds[0]) / (sizes[1] - sizes[0])
  least = resolution_s / (sizes[1] - sizes[0])
  floored = not slope >= least
  slope = least if floored else slope
  return LinkFit(max(seconds[0] - slope * sizes[0], 0.0), 1.0 / slope, floored)


def link(source: str, target: str, sizes: Sequence[int] = (2**16, 2**22),
         log: Callable[[str], None] = print) -> tuple[float, float]:
  """(latency seconds, bytes per second) of a hand-off from `source` to `target`:
  a float32 tensor of each size in bytes read on `source` and summed on `target`,
  less the same sum on `source`, and the line through the two (`fit_link`).

  The timing resolves no finer than the calls' times stray: at each size, the median
  absolute deviations of its calls on `target` and on `source` added (what the
  difference of their medians may be off by), the larger size's or the smaller's,
  whichever is more, and at least the clock's resolution. A hand-off faster than
  that, a same-device one say, gets the rate that resolution gives, and `log` says it
  was floored: a finite rate for the cost cache (JSON has no infinity), one at which
  the plan sees the hand-off about as free as it is."""
  seconds, spreads = [], []
  for nbytes in sizes:
    with tf.device(source):
      held = tf.Variable(tf.ones([nbytes // 4]), name="calibration_link")

    def summed_on(device: str, held=held) -> Callable[[], Any]:
      @tf.function(autograph=False)
      def fn():
        value = held.read_value()
        with tf.device(device):
          return tf.reduce_sum(tf.identity(value))
      return fn

    on_target, on_source = _call_times_s(summed_on(target)), _call_times_s(summed_on(source))
    seconds.append(max(float(np.median(on_target) - np.median(on_source)), 0.0))
    spreads.append(_spread_s(on_target) + _spread_s(on_source))
  resolution = max(max(spreads), time.get_clock_info("perf_counter").resolution)
  fit = fit_link(sizes, seconds, resolution)
  if fit.floored:
    log(f"Note: the hand-off from {source} to {target} is too fast to time (a "
        f"{sizes[1] - sizes[0]}-byte difference took {seconds[1] - seconds[0]:.3g} s, "
        f"within the timing's {resolution:.3g} s); its rate is floored at "
        f"{fit.bytes_per_s / 1e9:.3g} GB/s")
  return fit.latency_s, fit.bytes_per_s


def concurrency(devices: Sequence[str], work: Callable[[str], Callable[[], Any]] | None = None,
                runs: int = 9) -> float:
  """How many of `devices` compute at once at full speed (`Machine.cores`): the same
  work on every device at once takes `slowdown` times as long as on the first alone,
  so they compute as len(devices) / slowdown devices would (logical CPU devices and
  worker processes share the host's cores and memory bandwidth; accelerators do not:
  inf). How much they share depends on the work (a big matmul uses a core fully, a
  backward's small elementwise ops do not), so it should be the model's own:
  `work(device)` builds it on `device` and returns a function to call inside a
  tf.function (default: a chain of [384, 384] matmuls); the median of `runs`
  alternating runs (a host whose cores come and go hits both alike)."""
  if len(devices) < 2:
    return float("inf")
  calls = [(work or _matmul_chain)(d) for d in devices]

  def on(chosen: Sequence[int]) -> Callable[[], Any]:
    @tf.function(autograph=False)
    def fn():
      outs = []
      for i in chosen:
        with tf.device(devices[i]):
          outs.append(tf.reshape(tf.cast(calls[i](), tf.float32), []))
      with tf.device(devices[0]):
        return tf.add_n(outs)
    return fn

  alone, together = on([0]), on(list(range(len(devices))))
  for fn in (alone, together):  # traced, warmed up
    fn()
  ratios = []
  for _ in range(runs):
    (alone_s,), (together_s,) = (layer_profiler.call_seconds(f, 1) for f in (alone, together))
    ratios.append(alone_s / max(together_s, 1e-12))
  found = len(devices) * float(np.median(ratios))
  return float("inf") if found >= len(devices) else max(found, 1.0)


def _matmul_chain(device: str, size: int = 384, chain: int = 16) -> Callable[[], Any]:
  with tf.device(device):
    weight = tf.Variable(tf.random.normal([size, size], stddev=size**-0.5),
                         name="calibration_concurrency")

  def call():
    x = weight.read_value()
    for _ in range(chain):
      x = tf.matmul(x, weight)
    return tf.reduce_sum(x)

  return call


def measure_machine(devices: Sequence[str], memory_bytes: float, optimizer_params: Any,
                    slot_factor: float,
                    work: Callable[[str], Callable[[], Any]] | None = None,
                    copies: Callable[[str], StepMemory] | None = None,
                    log: Callable[[str], None] = print) -> step_model.Machine:
  """A Machine for `devices`, the figures measured on them as above (`work`: what
  `concurrency` runs; `copies(device)`: the model's `step_memory`, measured on the
  first device's local twin; the formula's without; `log`: notes on what was
  measured).

  Every figure is finite (the cost cache keeps them as JSON, which has no infinity):
  `cores` is at most len(devices), which the step model reads as concurrency's inf
  (every device at full speed); a lone device's link, which nothing ever crosses (no
  hand-off between devices, no all-reduce), the largest float in place of inf."""

  latency, rate = (link(devices[0], devices[1], log=log) if len(devices) > 1
                   else (0.0, sys.float_info.max))
  twin = layer_profiler.local_twin(devices[0])
  memory = copies(twin) if copies is not None and twin is not None else StepMemory()
  return step_model.Machine(
      num_devices=len(devices), memory_bytes=memory_bytes, slot_factor=slot_factor,
      action_overhead_s=action_overhead_s(devices[0]),
      update_s_per_byte=update_s_per_byte(devices[0], optimizer_params),
      link_latency_s=latency, link_bytes_per_s=rate,
      cores=min(concurrency(devices, work), float(len(devices))),
      allreduce_bytes_per_s=rate, **dataclasses.asdict(memory))
