"""The run checked as a whole before anything is written: `preflight(params, mode, devices)`.

The trainer binary calls it after reading the params and setting up the devices, and
before it creates the logdir, takes its lock or builds a model. It raises the first
ParamsError (exit 2: one line naming the key, the value and what is valid) of:

  types       every leaf of the kind its default declares (Params.check_types: a
              number where a number is taken, a bool where a bool, a str where a str)
  dtypes      every `*dtype` param: None, a dtype's name or a tf.DType; never a number
              or a bool (tf.as_dtype takes TensorFlow's enum numbers: 14 is bfloat16)
  inputs      every input the mode reads, made (not read): train_input for training,
              eval_input for evaluation (its own checks, e.g. a sequence length its
              data cannot give, and missing prepared data)
  pipeline    task.pipeline's values (check_pipeline_params), its micro-batches and
              replicas against the training batch, its token slices against the
              sequence length of the training batch (slices ≤ tokens, given lengths
              summing to it), its cells against the devices
  train       task.train's values (check_train_params)
  init        task.train.init_from_keras of a fresh run (not `resuming`): the saved
              Keras model loads, and each Keras unit finds its layer there with
              weights of its shapes (in a scratch graph: the run's variables are not
              touched)
  keras       a task with Keras units traced once in training (scratch graph): what a
              Keras layer does only in call (make a weight, add a loss, assign a
              weight) is refused here too, and a stack whose output the task's head
              cannot take (a Keras body's width against task.softmax.input_dim)

What needs the model itself (splits against its layers, a layer that cannot run on
token slices) is still found when the model is built, before anything is written.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from lingvo_gpipe.core import base_layer
from lingvo_gpipe.core.from_keras import load_saved_keras_weights
from lingvo_gpipe.core.hyperparams import Params, ParamsError
from lingvo_gpipe.core.keras_layer import Keras
from lingvo_gpipe.pipeline import hybrid
from lingvo_gpipe.pipeline.layer import (
  PipelineError,
  assign_devices,
  check_pipeline_params,
  requested_cells,
  token_slice_lengths,
)
from lingvo_gpipe.tasks.base_task import check_train_params, probe_task

TRAIN_MODES = ("train", "train_and_eval")
EVAL_MODES = ("eval", "train_and_eval")
SERVING_MODES = ("export", "decode")  # read the eval input for shapes and vocabulary


def preflight(params: Params, mode: str, devices: Sequence[str] = (),
              resuming: bool = False) -> None:
  """Raises ParamsError naming the first value of `params` the run in `mode` on
  `devices` (the cells' devices, in order) would refuse later; `resuming`: the logdir
  holds a checkpoint (the run restores it, and a fresh run's settings are not read)."""
  params.check_types()
  check_dtypes(params)
  train_spec = None
  made = {}
  if mode in TRAIN_MODES or mode == "plan":
    made["train_input"] = _made("train_input", params.train_input)
    train_specs = made["train_input"].batch_specs()  # (checks its length buckets)
    train_spec = made["train_input"].batch_spec()
  if mode in EVAL_MODES + SERVING_MODES and params.eval_input is not None:
    made["eval_input"] = _made("eval_input", params.eval_input)
  task = params.task
  _check_data_against_model(task, made)
  if "pipeline" in task:
    check_pipeline_params(task.pipeline, "task.pipeline")
    if train_spec is not None:
      check_batch_splits(params)
      for spec in train_specs:  # every length bucket's tokens
        _check_slices_against_tokens(task.pipeline, spec)
    pipeline = task.pipeline
    if mode in SERVING_MODES:
      # Serving builds one replica on --export_devices, whatever devices and replicas
      # training ran on (exporter.inference_params).
      pipeline = pipeline.copy().set(num_replicas=1, devices=list(devices))
    _check_cells_against_devices(pipeline, devices)
  if "train" in task and mode in TRAIN_MODES:
    check_train_params(task.train)
    check_calls_against_buckets(task.train, train_specs)
    _trace_keras_units(task, train_spec)
    if task.train.init_from_keras and not resuming:
      with probe_task(task, train_spec) as (probe, _):
        load_saved_keras_weights(task.train.init_from_keras, probe.main_stack)


def check_calls_against_buckets(train: Params, train_specs: list[Any]) -> None:
  """Several steps in one call take batches of one shape: refuses steps_per_call > 1
  with length buckets."""
  if train.steps_per_call > 1 and len(train_specs) > 1:
    raise ParamsError(
        f"task.train.steps_per_call={train.steps_per_call} needs batches of one shape, and "
        f"the train input has {len(train_specs)} length buckets "
        "(train_input.bucket_upper_bounds): set steps_per_call=1 or drop the buckets")


def _trace_keras_units(task_params: Params, batch_spec: Any) -> None:
  """A task with Keras units (core/keras_layer.py) is traced once in training,
  unpipelined, in a scratch graph: what a Keras layer shows only when called (a weight
  made, a loss added, a weight assigned) is refused before anything is written, as its
  build-time refusals are, and so is a stack output the head cannot take (a Keras
  body's shapes are Keras's, not the params'). batch_spec: the training batch's."""
  if not any(key.endswith("cls") and value is Keras for key, value in task_params.flatten()):
    return
  with probe_task(task_params, batch_spec) as (task, batch), base_layer.step_context(
      training=True, step=tf.constant(0, tf.int64), layer_stats=[]):
    outputs = base_layer.call_with(task.main_stack, task.stack_inputs(batch))
    shapes = [t.shape.as_list() for t in tf.nest.flatten(outputs)]
    width = shapes[0][-1] if shapes and shapes[0] else None
    softmax = task_params.get("softmax") if "softmax" in task_params else None
    wanted = softmax.get("input_dim") if softmax is not None and "input_dim" in softmax \
        else None
    if isinstance(wanted, int) and width is not None and wanted != width:
      raise ParamsError(f"task.softmax.input_dim={wanted}, but the main stack's output "
                        f"{shapes[0]} is {width} wide; valid: task.softmax.input_dim={width} "
                        "(or a stack whose last layer gives that width)")
    try:
      task.head(outputs, task.head_inputs(batch))
    except (ValueError, tf.errors.InvalidArgumentError) as e:
      raise ParamsError(f"task: its head cannot take the main stack's output (shapes "
                        f"{shapes}): {str(e).strip().splitlines()[0][:300]}") from None


def check_dtypes(params: Params) -> None:
  """Every leaf whose key ends in 'dtype' holds None, a dtype's name or a tf.DType;
  an `fprop_dtype` one of base_layer.FPROP_DTYPES (`resolve_fprop_dtype`, what the
  layer checks when it is built)."""
  for key, value in params.flatten():
    leaf = key.rsplit(".", 1)[-1]
    if not leaf.endswith("dtype") or value is None:
      continue
    if leaf == "fprop_dtype":
      base_layer.resolve_fprop_dtype(value, key.rsplit(".", 1)[0])
      continue
    if isinstance(value, tf.dtypes.DType):
      continue
    if isinstance(value, str):
      try:
        tf.as_dtype(value)
        continue
      except TypeError:
        pass
    raise ParamsError(f"{key}={value!r} is not a dtype; valid: a dtype's name such as "
                      "'float32', a tf.DType, or None (not a number or a bool)")


def _check_data_against_model(task_params: Params, inputs: dict[str, Any]) -> None:
  """Each input's ids and labels (its `id_space_size`, where it knows one) fit the
  model's sizes (the task's `id_bounds`): a softmax smaller than the vocabulary would
  train on labels past its logits, an embedding smaller would fail inside a cell."""
  cls = task_params.get("cls") if "cls" in task_params else None
  bounds = cls.id_bounds(task_params) if hasattr(cls, "id_bounds") else {}
  for name, made in inputs.items():
    size = made.id_space_size()
    if size is None:
      continue
    keys = made.batch_spec()
    for key, bound in bounds.items():
      if bound.bound < size and key in keys:
        raise ParamsError(
            f"{bound.param}={bound.bound} is smaller than {name}'s {size} ids and "
            f"labels ({key} goes to {bound.what}); valid: {bound.param} >= {size}")


def _made(key: str, input_params: Params) -> Any:
  """The input generator `input_params` describes, made (its checks run), or a
  ParamsError naming `key`."""
  try:
    return input_params.instantiate()
  except ParamsError as e:
    message = str(e)
    raise ParamsError(message if message.startswith(key) else f"{key}: {message}") from None


def check_batch_splits(params: Params) -> None:
  """Refuses a training batch that cannot be split into the replicas and micro-batches
  the params ask for, from the params alone, so that nothing is built first (the
  schedule of M micro-batches is made when the pipeline is built: M = 10^9 would take
  hours before the batch refused it).

  Raises:
    hybrid.HybridError, layer.PipelineError: ValueErrors naming the keys and what
      would be valid.
  """
  train_input = params.train_input
  if "bucket_batch_sizes" in train_input and train_input.bucket_batch_sizes is not None:
    batches = {f"train_input.bucket_batch_sizes[{j}]": size
               for j, size in enumerate(train_input.bucket_batch_sizes)}
  else:
    batches = {"train_input.batch_size": train_input.batch_size}
  pipeline = params.task.pipeline
  num_replicas = pipeline.num_replicas
  if not isinstance(num_replicas, int) or num_replicas < 1:
    raise hybrid.HybridError(f"task.pipeline.num_replicas must be >= 1, got {num_replicas!r}")
  for key, batch in batches.items():
    if not isinstance(batch, int) or isinstance(batch, bool):
      continue  # the input refuses it, naming the key, when it is made
    if batch % num_replicas:
      raise hybrid.HybridError(
          f"{key}={batch} is not divisible by task.pipeline.num_replicas="
          f"{num_replicas}; use a multiple of {num_replicas}")
    num_micro_batches = pipeline.num_micro_batches
    per_replica = batch // num_replicas
    if (requested_cells(pipeline) and isinstance(num_micro_batches, int)
        and num_micro_batches > per_replica):  # (>= 1: check_pipeline_params)
      shared = f" / {num_replicas} replicas" if num_replicas > 1 else ""
      raise PipelineError(
          f"task.pipeline.num_micro_batches={num_micro_batches} does not fit a batch of "
          f"{per_replica} ({key}={batch}{shared}); valid: 1..{per_replica}")


def _check_slices_against_tokens(pipeline: Params, spec: Any) -> None:
  """Token slices against the training batch's tokens (axis 1 of its [B, T, ...]
  tensors, where they agree on one T)."""
  if requested_cells(pipeline) and pipeline.num_token_slices > 1:
    tokens = {t.shape[1] for t in tf.nest.flatten(spec) if t.shape.rank and t.shape.rank >= 2}
    if len(tokens) == 1 and None not in tokens:
      token_slice_lengths(pipeline, tokens.pop(), "task.pipeline")


def _check_cells_against_devices(pipeline: Params, devices: Sequence[str]) -> None:
  """The cells placed as the build will place them (`hybrid.replica_devices`, then
  `layer.assign_devices`): too few devices is refused here, not after the logdir."""
  cells = requested_cells(pipeline)
  if not cells or not devices:
    return
  placed_on = list(pipeline.devices) or list(devices)
  replicas = pipeline.num_replicas if "num_replicas" in pipeline else 1
  if replicas > 1:
    try:
      slices = hybrid.replica_devices(pipeline, replicas, placed_on)
    except hybrid.HybridError as e:
      raise hybrid.HybridError(f"task.pipeline.num_replicas: {e}") from None
  else:
    slices = [placed_on]
  for replica in slices:
    assign_devices(pipeline, cells, replica, "task.pipeline")
