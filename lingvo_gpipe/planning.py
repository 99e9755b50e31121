"""Plans in the trainer: a run's own configuration predicted, or the best plan chosen
and applied (`tools/trainer.py --plan=check|auto`), and the prediction set beside
what the run measured, so that every such run checks the model.

A prediction needs each layer's costs (`layer_profiler.measure_layer_costs`, on the
cells' first device) and the machine's figures (`calibration.measure_machine`), both
kept in the cost cache, so a second run measures neither. `compare` puts the
predicted step and per-device peaks beside the measured ones: the step is the median
of the run's steps after the first; a device's peak is its allocator's peak since
the model was built, where it can be read (local devices; logical CPU devices share
one allocator, so there the figure is their total, set beside the sum of the
predicted peaks; workers of a cluster log their own, tools/worker.py --memory_log).
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import json
import os
import platform
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from lingvo_gpipe import calibration
from lingvo_gpipe.core.hyperparams import Params
from lingvo_gpipe.pipeline import layer_profiler, memory, planner, step_model
from lingvo_gpipe.pipeline.layer import PipeliningLayer, requested_cells
from lingvo_gpipe.tasks import base_task

COSTS_VERSION = ("layer costs v8 (two sizes, weight share, products, split backward, work "
                 "bytes, kept inputs and outputs, tied and frozen bytes)")
MACHINE_FIELDS = ("action_overhead_s", "update_s_per_byte", "link_latency_s",
                  "link_bytes_per_s", "cores", "weight_copies_one", "weight_copies",
                  "activation_factor", "save_copies")


@dataclasses.dataclass(frozen=True)
class Setting:
  """Where the plan runs: the devices (cells go to them in order), each one's budget
  in bytes (after the margin), and the cost cache ('' for none). With may_measure
  False, what the cache lacks raises NotMeasured instead of being measured."""
  devices: tuple[str, ...]
  memory_bytes: float
  cost_cache: str
  log: Callable[[str], None] = print
  may_measure: bool = True


class NotMeasured(Exception):
  """A cost the cache lacks, asked for with Setting.may_measure False."""


@dataclasses.dataclass(frozen=True)
class MainStack:
  """The task's main stack as the planner sees it (base_task.probe_main_stack): the
  nested input specs of its first layer (batch first), its layers' params, and the
  training batch size."""
  specs: Any
  layer_params: tuple[Any, ...]
  batch_size: int

  @classmethod
  def of(cls, params: Params) -> MainStack:
    specs, layer_params = base_task.probe_main_stack(params.task, params.train_input)
    return cls(specs, tuple(layer_params), tf.nest.flatten(specs)[0].shape[0])


def planned_batch(params: Params) -> str:
  """What a plan is for, in words: the training batch, or with length buckets the
  largest (the most tokens: the batch the memory must hold, and the one
  `probe_main_stack` sizes the plan by)."""
  train_input = params.train_input.instantiate()
  buckets = train_input.buckets
  if buckets is None:
    return f"batch {train_input.params.batch_size}"
  j = buckets.largest
  return (f"the largest of {len(buckets.upper_bounds)} length buckets: batch "
          f"{buckets.batch_sizes[j]} × {buckets.upper_bounds[j]} tokens")


def layer_costs(stack: MainStack, setting: Setting) -> list[layer_profiler.LayerCost]:
  """Each layer's costs, measured on the first device or read from the cache."""
  device = setting.devices[0]

  def measure() -> list[layer_profiler.LayerCost]:
    if not setting.may_measure:
      raise NotMeasured("the layers' costs")
    setting.log(f"Measuring the costs of the {len(stack.layer_params)} layers at batch "
                f"{stack.batch_size} on {device} ...")
    return layer_profiler.measure_layer_costs(stack.layer_params, stack.specs, device=device)

  if not setting.cost_cache:
    return measure()
  # The layers and their inputs, not the pipeline's settings: one entry serves every plan.
  # (and the allocator that counted their bytes: the default CPU one misses small ones)
  key = [COSTS_VERSION, [lp.to_text() for lp in stack.layer_params], stack.specs,
         platform.node(), tf.__version__, device, _host_counts()]
  return layer_profiler.cached_layer_costs(setting.cost_cache, key, measure,
                                           warn=setting.log,
                                           num_layers=len(stack.layer_params))


def machine(params: Params, stack: MainStack, costs: Sequence[layer_profiler.LayerCost],
            setting: Setting) -> step_model.Machine:
  """The devices' Machine: figures measured on them (calibration.py; how many compute
  at once with the model's most costly layer at a quarter of the batch) or read from
  the cache."""
  slot_factor = planner.slot_factor(params.task.train.optimizer)
  heaviest = max(range(len(costs)), key=lambda i: costs[i].step_s)

  def measure() -> dict:
    if not setting.may_measure:
      raise NotMeasured("the machine's figures")
    setting.log(f"Measuring the engine's cost per action, the update, the links and how "
                f"many of the {len(setting.devices)} devices compute at once ...")
    spec = layer_profiler.layer_input_specs(stack.layer_params, stack.specs)[heaviest]
    quarter = tf.nest.map_structure(
        lambda s: tf.TensorSpec([max(1, s.shape[0] // 4)] + s.shape[1:], s.dtype), spec)
    found = calibration.measure_machine(
        setting.devices, setting.memory_bytes, params.task.train.optimizer, slot_factor,
        work=layer_profiler.layer_work(stack.layer_params[heaviest], quarter),
        copies=lambda twin: calibration.step_memory(
            twin, stack.layer_params, stack.specs, costs, params.task.train.optimizer,
            params.task.pipeline.stack_variables), log=setting.log)
    hand_off = ("none (one device)" if len(setting.devices) < 2 else
                f"{found.link_latency_s * 1e3:.3f} ms + {found.link_bytes_per_s / 1e9:.3g} GB/s")
    setting.log(f"Measured: {found.action_overhead_s * 1e3:.3f} ms per action, update "
                f"{found.update_s_per_byte * 1e9:.3f} ns per weight byte, hand-off "
                f"{hand_off}, {found.cores:.3g} device(s) computing at once at full speed, a "
                f"step's weight-sized buffers {found.weight_copies:.2g}× the weights "
                f"({found.weight_copies_one:.2g}× at M=1), activations "
                f"{found.activation_factor:.2g}× the layers' alone, a save's "
                f"{found.save_copies:.2g}× the weights")
    return {name: getattr(found, name) for name in MACHINE_FIELDS}

  def decode(entry: Any) -> dict:
    if not isinstance(entry, dict) or set(entry) != set(MACHINE_FIELDS) or not all(
        isinstance(v, (int, float)) and v >= 0 for v in entry.values()):
      raise ValueError(f"not a record of {MACHINE_FIELDS}")
    return entry

  if setting.cost_cache:
    # (the layers and the first's inputs fix the heaviest layer's inputs: not traced
    # unless measured)
    key = ["machine v6", params.task.train.optimizer.to_text(),
           params.task.pipeline.stack_variables,
           [lp.to_text() for lp in stack.layer_params], stack.specs, heaviest,
           platform.node(), tf.__version__, list(setting.devices), _host_counts()]
    figures = layer_profiler.cached_record(setting.cost_cache, key, measure, setting.log,
                                           decode=decode, encode=lambda r: r)
  else:
    figures = measure()
  return step_model.Machine(num_devices=len(setting.devices),
                            memory_bytes=setting.memory_bytes, slot_factor=slot_factor,
                            allreduce_bytes_per_s=figures["link_bytes_per_s"], **figures)


def with_measured_costs(params: Params, costs: Sequence[layer_profiler.LayerCost]
                        ) -> Params:
  """`params` whose partitioner, asked to balance measured costs
  (partition_cost='measured') without being given them, balances the planner's
  (each layer's forward + backward seconds): the layers are profiled once per run,
  and the split the plan predicts is the one that trains."""
  pipeline = params.task.pipeline
  if pipeline.partition_cost != "measured" or pipeline.layer_costs:
    return params
  completed = params.copy()
  completed.task.pipeline.layer_costs = [c.step_s for c in costs]
  return completed.freeze() if params.is_frozen else completed


def own_shape(params: Params, devices: Sequence[str]) -> step_model.PlanShape:
  """The plan `params` run as they are: the pipeline's cells as its partitioner cuts
  them (built in a scratch graph: nothing is allocated). An unpipelined task is one
  cell, one micro-batch, without re-materialization."""
  task_params = base_task.with_partition_costs(params.task, params.train_input)
  probe = task_params.copy()
  probe.pipeline.devices = list(devices)
  with tf.Graph().as_default():
    stack = probe.instantiate().main_stack
  if not isinstance(stack, PipeliningLayer):
    return step_model.PlanShape(1, (len(stack.params.layers),), 1, "never", "gpipe")
  return step_model.PlanShape.from_pipeline(params.task.pipeline,
                                            [cell.end for cell in stack.cells])


def with_plan(params: Params, shape: step_model.PlanShape) -> Params:
  """`params` set to run `shape`: every task.pipeline field a plan decides
  (PlanShape.pipeline_fields, also what its --params_override says)."""
  planned = params.copy()
  planned.task.pipeline.set(**shape.pipeline_fields())
  return planned.freeze() if params.is_frozen else planned


@dataclasses.dataclass(frozen=True)
class Planned:
  """What `plan_run` decided: the params to run and what their step should take."""
  params: Params
  prediction: step_model.Prediction
  machine: step_model.Machine


@functools.cache  # (a process's allocator is chosen once, when TensorFlow starts)
def _host_counts() -> str:
  """A cost cache key part: what the host's allocator counts (bytes measured on CPUs,
  or on a CPU standing in for a worker's, are read off it)."""
  return ("every allocation" if memory.counts_small_allocations()
          else "allocations of 256 KiB and more, or none")


Measured = tuple[MainStack, list[layer_profiler.LayerCost], step_model.Machine]


def warn_where_allocations_go_uncounted(setting: Setting) -> None:
  """Warns (setting.log) where the devices are CPUs and the host's allocator leaves
  allocations out of its counts: the predicted peaks then leave them out too."""
  if any(layer_profiler.allocator_name(d) == memory.HOST_ALLOCATOR
         for d in setting.devices) and not memory.counts_small_allocations():
    setting.log("warning: this process's CPU allocator does not count allocations under "
                "256 KiB (TensorFlow's default one: TF_CPU_ALLOCATOR_USE_BFC was not true "
                "when TensorFlow started), so the predicted peaks leave them out; set "
                "TF_CPU_ALLOCATOR_USE_BFC=true before TensorFlow starts")


def measured(params: Params, setting: Setting) -> Measured:
  """What every prediction for `params` on the setting's devices starts from: the main
  stack, its layers' costs and the machine's figures (measured, or from the cache)."""
  stack = MainStack.of(params)
  costs = layer_costs(stack, setting)
  return stack, costs, machine(params, stack, costs, setting)


def from_cache(params: Params, setting: Setting) -> Measured | None:
  """`measured` where the setting's cost cache holds all it needs, else None (nothing
  is measured, logged or written to find out)."""
  try:
    return measured(params, dataclasses.replace(setting, may_measure=False,
                                                log=lambda _: None))
  except NotMeasured:
    return None


def plan_run(params: Params, setting: Setting, auto: bool,
             found_in_cache: Measured | None = None) -> Planned:
  """auto: the best plan for the devices (planner.plan) applied to `params`;
  otherwise `params` as they are. Either way with its prediction, and with its split
  (and, for partition_cost='measured', the planner's layer costs) written into the
  params returned: what trains is what was predicted. `found_in_cache`: `from_cache`'s
  answer, where the caller asked (the main stack is not probed twice: 9 s for a
  128-layer model).

  Raises:
    planner.PlanError: auto, and no plan fits the budget.
    ParamsError: the params' own configuration cannot be built on the devices.
  """
  if not auto:
    check_one_device_per_cell(params.task.pipeline, setting.devices)
  warn_where_allocations_go_uncounted(setting)
  stack, costs, found = found_in_cache or measured(params, setting)
  batch_size = stack.batch_size
  params = with_measured_costs(params, costs)
  if auto:
    shape = planner.plan(costs, found, batch_size, top=1)[0].shape
    setting.log(f"Plan: {shape.params_override()}")
    prediction = step_model.predict(costs, found, shape, batch_size)
  else:
    shape, prediction = predict_own(params, costs, found, setting.devices, batch_size)
  setting.log(f"Predicted: step {prediction.step_s * 1e3:.1f} ms, peak per device "
              f"{format_peaks(prediction.peak_bytes)}; {verdict(prediction, setting)}")
  # (an unpipelined task run as it is stays unpipelined: its shape is one cell)
  pipelined = auto or requested_cells(params.task.pipeline) > 0
  return Planned(with_plan(params, shape) if pipelined else params, prediction, found)


def check_one_device_per_cell(pipeline: Params, devices: Sequence[str]) -> None:
  """Raises planner.PlanError, before anything is measured, where the params' cells
  would share devices other than as virtual stages (K / V devices per replica): the
  step model places one cell per device (the engine runs such params, unpredicted)."""
  cells = requested_cells(pipeline)
  needed = pipeline.num_replicas * max(cells // max(pipeline.virtual_stages, 1), 1)
  if cells and needed > len(devices):
    raise planner.PlanError(
        f"the params' {cells} cells (virtual_stages={pipeline.virtual_stages}, "
        f"num_replicas={pipeline.num_replicas}) are predicted on {needed} devices, one per "
        f"cell; {len(devices)} given: give {needed} or more devices, or train them without "
        "--plan")


def predict_own(params: Params, costs: Sequence[layer_profiler.LayerCost],
                machine: step_model.Machine, devices: Sequence[str], batch_size: int
                ) -> tuple[step_model.PlanShape, step_model.Prediction]:
  """The plan `params` run as they are (own_shape) and its prediction. A task that is
  not pipelined trains with TensorFlow's own step, not the engine's: its activations
  are the layers' as profiled (a step of them under one tape), without the factor the
  calibration measured for the engine's steps (Machine.activation_factor: 1.15 for
  demo.TinyConvNet's layers, whose plain step peaked at 12.6-15.0 MiB in all, under
  the 16.0 MiB its layers count without the factor)."""
  shape = own_shape(params, devices)
  if requested_cells(params.task.pipeline) == 0:
    machine = dataclasses.replace(machine, activation_factor=1.0)
  return shape, step_model.predict(costs, machine, shape, batch_size)


def verdict(prediction: step_model.Prediction, setting: Setting) -> str:
  """Whether the plan's busiest device fits the budget: 'fits' with a margin of at
  least the memory model's measured error (planner.MEMORY_MODEL_ERROR), 'tight'
  with less, else by how much it does not."""
  need = max(prediction.peak_bytes)
  device = prediction.peak_bytes.index(need)
  margin = setting.memory_bytes - need
  budget = f"budget {planner.format_bytes(setting.memory_bytes)}"
  if margin < 0:
    return (f"does NOT fit: {planner.format_bytes(-margin)} over the {budget} on device "
            f"{device}")
  word = planner.fit_word(need, setting.memory_bytes)
  return (f"{word}: {planner.format_bytes(margin)} ({margin / setting.memory_bytes:.0%}) "
          f"left of the {budget} on device {device}")


def format_peaks(peaks: Sequence[float]) -> str:
  return "[" + ", ".join(f"{p / 2**20:.1f}" for p in peaks) + "] MiB"


def allocator_peaks(devices: Sequence[str]) -> tuple[list[str], list[float]] | None:
  """(the local allocators, their peak bytes since `reset_allocator_peaks`), or None
  where they cannot be read (remote devices; a CPU without TensorFlow's BFC allocator,
  TF_CPU_ALLOCATOR_USE_BFC=true)."""
  names = _allocators(devices)
  if names is None:
    return None
  try:
    return names, [float(tf.config.experimental.get_memory_info(n)["peak"]) for n in names]
  except (ValueError, tf.errors.OpError):
    return None


def most_of(*peaks: tuple[list[str], list[float]] | None
            ) -> tuple[list[str], list[float]] | None:
  """`allocator_peaks` read at several times, each allocator's most (None: unread)."""
  read = [p for p in peaks if p is not None]
  if not read:
    return None
  names = read[0][0]
  return names, [max(values[i] for _, values in read) for i in range(len(names))]


def reset_allocator_peaks(devices: Sequence[str]) -> None:
  """The local allocators' peaks reset, after what the planning left for the garbage
  collector is freed (its tf.functions hold their variables in reference cycles: a
  calibration's weights would otherwise count in the run's peak, and stay)."""
  gc.collect()
  for name in _allocators(devices) or []:
    try:
      tf.config.experimental.reset_memory_stats(name)
    except (ValueError, tf.errors.OpError):
      return


def _allocators(devices: Sequence[str]) -> list[str] | None:
  """The local allocators the devices use: logical CPU devices share CPU:0's; each
  GPU its own. None when any device is remote."""
  names = []
  for d in devices:
    if tf.DeviceSpec.from_string(d).job not in (None, "localhost"):
      return None
    name = layer_profiler.allocator_name(d)
    if name not in names:
      names.append(name)
  return names


def compare(planned: Planned, step_seconds: Sequence[float],
            peaks: tuple[list[str], list[float]] | None,
            timestamps: Sequence[Any] = (), host_bytes: float | None = None) -> dict:
  """The prediction beside the measurement: {"predicted_step_s", "measured_step_s"
  (median of the steps after the first; None with fewer than 3), "step_error"
  (measured / predicted − 1), "predicted_peak_bytes" (per device),
  "measured_peak_bytes" (per local allocator, None where unreadable),
  "peak_error" (per allocator, against the sum of the devices' predictions it
  holds and, for the host's allocator, `host_bytes`: what the input pipeline holds
  there, measured as the trainer built it; "host_bytes"), "shape"}; with the last
  step's `timestamps` (a pipeline's measured
  timeline) also the loops' span and each cell's mean action seconds, predicted
  and measured ("*_schedule_s", "*_action_s": [F, B, W] lists per cell), which say
  which term of the model is off."""
  prediction = planned.prediction
  steady = list(step_seconds[1:])
  measured = float(np.median(steady)) if len(steady) >= 2 else None
  out = {"shape": dataclasses.asdict(prediction.shape),
         "predicted_step_s": prediction.step_s, "measured_step_s": measured,
         "step_error": measured / prediction.step_s - 1 if measured else None,
         "predicted_peak_bytes": list(prediction.peak_bytes),
         "measured_peak_bytes": None, "peak_error": None}
  if timestamps:
    from lingvo_gpipe.pipeline import timeline

    measured_timeline = timeline.MeasuredTimeline.from_fetched(
        [np.asarray(t) for t in timestamps])
    out.update(predicted_schedule_s=prediction.schedule_s,
               measured_schedule_s=measured_timeline.duration,
               predicted_action_s=[list(a) for a in prediction.action_s],
               measured_action_s=[list(a) for a in measured_timeline.action_times()])
  if peaks is not None:
    names, values = peaks
    # every replica's devices, in the order the devices were given
    per_device = list(prediction.peak_bytes) * prediction.shape.num_replicas
    predicted = [sum(per_device)] if len(names) == 1 else per_device[:len(names)]
    if host_bytes and memory.HOST_ALLOCATOR in names:
      predicted[names.index(memory.HOST_ALLOCATOR)] += host_bytes
      out["host_bytes"] = host_bytes
    out.update(allocators=names, measured_peak_bytes=values,
               peak_error=[m / p - 1 for m, p in zip(values, predicted)])
  return out


def format_comparison(found: dict) -> str:
  step = (f"step predicted {found['predicted_step_s'] * 1e3:.1f} ms, measured "
          + (f"{found['measured_step_s'] * 1e3:.1f} ms ({found['step_error']:+.1%})"
             if found["measured_step_s"] else "n/a (fewer than 3 steps)"))
  peak = f"peak per device predicted {format_peaks(found['predicted_peak_bytes'])}"
  if found["measured_peak_bytes"] is not None:
    errors = ", ".join(f"{e:+.1%}" for e in found["peak_error"])
    host = (f" with the input pipeline's {found['host_bytes'] / 2**20:.1f} MiB on the host"
            if found.get("host_bytes") else "")
    peak += (f", measured {format_peaks(found['measured_peak_bytes'])} on "
             f"{', '.join(found['allocators'])} ({errors}{host})")
  else:
    peak += ", measured n/a here (remote devices: tools/worker.py --memory_log; CPU: "
    peak += "TF_CPU_ALLOCATOR_USE_BFC=true)"
  return f"Plan check: {step}; {peak}"


def write_comparison(train_dir: str, found: dict, step: int) -> str:
  """Writes `found` to <train_dir>/plan_check.json and as TensorBoard scalars
  (plan/predicted_step_s, plan/measured_step_s, plan/predicted_peak_bytes/device_d,
  plan/measured_peak_bytes/<allocator>) and text; returns the JSON file's path."""
  path = os.path.join(train_dir, "plan_check.json")
  with open(path + ".tmp", "w") as f:
    json.dump(found, f, indent=1)
  os.replace(path + ".tmp", path)
  writer = tf.summary.create_file_writer(train_dir)
  with writer.as_default():
    tf.summary.scalar("plan/predicted_step_s", found["predicted_step_s"], step=step)
    if found["measured_step_s"] is not None:
      tf.summary.scalar("plan/measured_step_s", found["measured_step_s"], step=step)
    for d, value in enumerate(found["predicted_peak_bytes"]):
      tf.summary.scalar(f"plan/predicted_peak_bytes/device_{d}", value, step=step)
    for name, value in zip(found.get("allocators", []), found["measured_peak_bytes"] or []):
      tf.summary.scalar(f"plan/measured_peak_bytes/{name.replace(':', '_')}", value,
                        step=step)
    tf.summary.text("plan/check", format_comparison(found), step=step)
  writer.flush()
  return path
