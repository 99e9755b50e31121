"""A task: a model, its loss and metrics, and how to train it.

`task(batch)` runs the forward pass and returns metrics: a dict of
name → (value, weight) scalars. `metrics['loss'][0]` is what training minimizes;
weights let eval average metrics correctly over batches. The training settings live
in `params.train`, so that one Params tree describes the whole run.

A task is three parts, so that a pipeline can run the last one per micro-batch on
its last device (train_step.py):

  stack_inputs(batch)          → the main stack's inputs (no variables here)
  main_stack                   the main layer stack (a PipeliningLayer when pipelined)
  head(outputs, head_inputs)   → metrics, from the stack's outputs and
                                 head_inputs(batch) (labels, paddings)

The head's loss must be a mean over what its weight counts (examples, tokens), so
that the weighted mean over micro-batches is the whole batch's loss.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import numpy as np
import tensorflow as tf

from lingvo_gpipe.core import base_layer, layers, loss_scale, optimizers
from lingvo_gpipe.core.hyperparams import InstantiableParams, Params, ParamsError
from lingvo_gpipe.pipeline.layer import (
  NEEDS_INPUT_SPECS,
  PipeliningLayer,
  check_pipeline_params,
  measured_costs,
  requested_cells,
)

Metrics = dict[str, tuple[tf.Tensor, tf.Tensor]]


TRACE_BUCKETS = ("up_front", "when_needed")


def train_params() -> Params:
  """Training settings shared by every task."""
  p = Params()
  p.define("optimizer", optimizers.SGD.Params(), "Optimizer params (with its lr schedule).")
  p.define("max_steps", 1000, "Train until the global step reaches this.")
  p.define("save_interval_steps", 100, "Write a checkpoint every this many steps.")
  p.define("max_checkpoints_to_keep", 5, "Older checkpoints are deleted.")
  p.define("loss_scale", loss_scale.loss_scale_params(), "Dynamic loss scaling (on by "
           "default where a layer computes in float16; core/loss_scale.py).")
  p.define("summary_interval_steps", 10, "Write TensorBoard scalars every this many steps.")
  p.define("log_interval_steps", 10, "Print progress every this many steps.")
  p.define("eval_interval_steps", 0,
           "In train_and_eval mode, evaluate every this many steps (0: only at the end).")
  p.define("steps_per_call", 1, "Training steps run by one call of the traced step "
           "(Keras's steps_per_execution): the client's round trip to the devices is "
           "paid once per call, which matters where steps are short. A call ends early at "
           "a checkpoint, an eval, a profile's edge or max_steps; summaries and progress "
           "lines still see every step; a step that stops the run (not finite) stops the "
           "call's later steps from updating. Needs batches of one shape (no length "
           "buckets).")
  p.define("trace_buckets", "up_front", "With length buckets (the train input's "
           f"bucket_upper_bounds), when each bucket's step is traced: one of "
           f"{TRACE_BUCKETS}. 'up_front': all before the first step (start-up pays for "
           "every bucket, and a bucket that cannot be built fails before anything is "
           "written); 'when_needed': each at its first batch (a faster start, then a "
           "stall mid-run per bucket).")
  p.define("init_from_keras", "", "A Keras model saved whole (`model.save('m.keras')`: "
           "each Keras unit and batch norm from the saved layer of its name) or its "
           "weights file (`model.save_weights('m.weights.h5')`: each from the place "
           "from_keras recorded for its layer) whose weights a fresh run starts from "
           "instead of its initializers, checked by name and shape before anything is "
           "written. A resumed run restores its checkpoint and ignores it.")
  return p


def pipeline_params() -> Params:
  """GPipe settings of a task; pipelining is on when num_cells > 0 or splits is set.

  Every param PipeliningLayer defines beyond a layer's own (name, dtype, init, seed)
  and its `layers` (the task's main stack), so a new pipeline param is exposed here
  without a list to keep in step."""
  defaults = PipeliningLayer.Params()
  own = {name for name, _ in base_layer.BaseLayer.Params().iter_params()} | {"layers"}
  p = Params()
  for name, value in defaults.iter_params():
    if name not in own:
      p.define(name, value, defaults.description(name))
  p.define("num_replicas", 1, "R: data-parallel replicas of the pipeline, replica r's cells "
           "on devices r·K … r·K+K−1, gradients averaged by collective all-reduce "
           "(pipeline/hybrid.py); the batch is split into R equal shards.")
  return p


def check_train_params(p: Params) -> None:
  """Raises ParamsError naming the first `task.train` value no run accepts (the
  optimizer checks its own params when it is built)."""
  at_least = {"max_steps": 0, "save_interval_steps": 1, "max_checkpoints_to_keep": 1,
              "steps_per_call": 1,
              "summary_interval_steps": 1, "log_interval_steps": 1, "eval_interval_steps": 0}
  for key, minimum in at_least.items():
    value = getattr(p, key)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
      meaning = " (0: only at the end)" if key == "eval_interval_steps" else ""
      raise ParamsError(f"task.train.{key} must be an int >= {minimum}{meaning}, got {value!r}")
  if p.trace_buckets not in TRACE_BUCKETS:
    raise ParamsError(f"task.train.trace_buckets must be one of {TRACE_BUCKETS}, got "
                      f"{p.trace_buckets!r}")
  loss_scale.check_loss_scale_params(p.loss_scale)


def with_partition_costs(task_params: Params, input_params: Params,
                         log: Callable[[str], None] | None = None) -> Params:
  """`task_params` completed with what the partitioner needs, from `input_params` (the
  training input), so that every `partition_cost` works from the command line:

  - 'flops' or 'measured' without `input_specs`: the specs of `stack_inputs(batch)`
    (nested, batch size included), found by building the task unpipelined in a scratch
    graph (nothing is allocated);
  - 'measured' without `layer_costs`: each layer's forward + backward seconds, profiled
    here and now on this machine (`pipeline.layer.measured_costs`: each layer is
    built and run alone, a few times), recorded as its `layer_costs`.

  Otherwise `task_params` itself (and the input is not built). `log` hears when layers
  are profiled (seconds of silence otherwise).
  """
  pipeline = task_params.pipeline
  if pipeline.partition_cost not in NEEDS_INPUT_SPECS or not requested_cells(pipeline):
    return task_params
  completed = task_params.copy()
  specs, layers_params = probe_main_stack(task_params, input_params)
  if pipeline.input_specs is None:
    completed.pipeline.input_specs = specs
  if pipeline.partition_cost == "measured" and not pipeline.layer_costs:
    if log is not None:
      log("Measuring each layer's forward and backward time for the partition ...")
    completed.pipeline.layer_costs = measured_costs(layers_params,
                                                    completed.pipeline.input_specs)
  return completed.freeze() if task_params.is_frozen else completed


def unpipelined(task_params: Params) -> Params:
  """A copy of `task_params` whose main stack runs its layers one after another on one
  device (no cells, no replicas): the same forward, traced as plain ops (a pipeline's
  cells run inside its device loops' functions)."""
  copy = task_params.copy()
  if "pipeline" in copy:
    copy.pipeline.set(num_cells=0, splits=[], num_replicas=1)
  return copy


@contextlib.contextmanager
def probe_task(task_params: Params, batch_spec: Any) -> Iterator[tuple[Any, Any]]:
  """Within: (the task of `task_params` unpipelined, built in a scratch graph, a batch
  of `batch_spec` as placeholders). Nothing is allocated or run; what the task and its
  stack do to that batch is only traced."""
  with tf.Graph().as_default():
    task = unpipelined(task_params).instantiate()
    batch = tf.nest.map_structure(lambda s: tf.compat.v1.placeholder(s.dtype, s.shape),
                                  batch_spec)
    yield task, batch


def probe_main_stack(task_params: Params, input_params: Params) -> tuple[Any, list]:
  """(nested tf.TensorSpec of `stack_inputs(batch)` for the batches of `input_params`,
  the params of the main stack's layers, each with the compute dtype it inherits)."""
  with probe_task(task_params, input_params.instantiate().batch_spec()) as (task, batch):
    inputs = task.stack_inputs(batch)
    specs = tf.nest.map_structure(lambda t: tf.TensorSpec(t.shape, t.dtype), inputs)
    dtype = task.main_stack.fprop_dtype
    return specs, [base_layer.inherit_fprop_dtype(lp, dtype)
                   for lp in task.main_stack.params.layers]


class IdBound(NamedTuple):
  """Every value of a batch key must lie in [0, bound): the model's size `param`
  (e.g. 'task.stack.layers[3].vocab_size') says so, and `what` says what it sizes."""
  bound: int
  param: str
  what: str

  def describe(self) -> str:
    return f"{self.param}={self.bound} ({self.what})"


def vocabulary_bounds(task_params: Params, input_keys: tuple[str, ...],
                      label_keys: tuple[str, ...]) -> dict[str, IdBound]:
  """The IdBounds of a text task: `input_keys` bounded by its stack's first vocabulary
  (the embedding), `label_keys` by its last (the softmax). A vocabulary is a native
  layer's `vocab_size`, or a Keras unit's (`_keras_vocabulary`: an embedding's rows, or
  the width of the Dense that ends the stack)."""
  layers = task_params.get("stack").get("layers") if "stack" in task_params else None
  final = f"stack.layers[{len(layers) - 1}].layer" if layers else None
  # (param, size, what it sizes as the input's / as the output's, output only)
  sizes: list[tuple[str, int, str, str, bool]] = []
  for key, value in task_params.flatten():
    if not key.startswith("stack."):
      continue
    if key.endswith(".vocab_size") and isinstance(value, int) and not isinstance(value, bool):
      sizes.append((f"task.{key}", value, "the embedding's rows", "the softmax's classes",
                    False))
    elif key.endswith(".layer") and isinstance(value, dict):
      found = _keras_vocabulary(value)
      if found is not None and (not found[2] or key == final):
        field, size, is_output = found
        what = "the logits' width" if is_output else "the Keras embedding's rows"
        sizes.append((f"task.{key}'s {field}", size, what, what, is_output))
  inputs = [entry for entry in sizes if not entry[4]]
  bounds = {}
  if inputs:
    param, size, what, _, _ = inputs[0]
    bounds.update({k: IdBound(size, param, what) for k in input_keys})
  if sizes:
    param, size, _, what, _ = sizes[-1]
    bounds.update({k: IdBound(size, param, what) for k in label_keys})
  return bounds


# Keras embeddings and the config fields holding their vocabulary (keras_hub's too:
# its ReversibleEmbedding has vocabulary_size where Keras's own has input_dim).
_KERAS_EMBEDDINGS = {"Embedding": ("input_dim",),
                     "ReversibleEmbedding": ("input_dim", "vocabulary_size"),
                     "TokenAndPositionEmbedding": ("vocabulary_size",)}


def _keras_vocabulary(config: dict) -> tuple[str, int, bool] | None:
  """(config field, size, whether it sizes the output) of the vocabulary a Keras
  unit's serialized config holds, or None: an embedding's rows (a known embedding
  class, or any layer whose config has an int `vocab_size` or `vocabulary_size`, the
  first found inside a block), or a final `Dense`'s `units` (logits)."""
  inner = config.get("config", {})
  name = config.get("class_name")
  fields = list(_KERAS_EMBEDDINGS.get(name, ()))
  for field in [*fields, "vocab_size", "vocabulary_size"]:
    size = inner.get(field)
    if isinstance(size, int) and not isinstance(size, bool):
      return field, size, False
  for layer in inner.get("layers", []) if isinstance(inner.get("layers"), list) else []:
    found = _keras_vocabulary(layer) if isinstance(layer, dict) else None
    if found is not None and not found[2]:
      return found
  if name == "Dense" and isinstance(inner.get("units"), int):
    return "units", inner["units"], True
  return None


class BadBatchError(ValueError):
  """A batch holds an id or label outside what the model can take (IdBound)."""


def check_batch_ids(batch: dict[str, Any], bounds: dict[str, IdBound], input_name: str,
                    step: int | None = None) -> None:
  """Raises BadBatchError at the first key of `batch` whose values leave its IdBound,
  naming the value, the key, the input and the model's size. Reads the batch's
  int tensors on the host (ids and labels: [B] or [B, T], small)."""
  for key, bound in bounds.items():
    if key not in batch:
      continue
    values = np.asarray(batch[key])
    if not values.size:
      continue
    low, high = int(values.min()), int(values.max())
    if low >= 0 and high < bound.bound:
      continue
    bad = low if low < 0 else high
    at = f" at step {step}" if step is not None else ""
    raise BadBatchError(
        f"{input_name} gave {key} {bad}{at}, outside [0, {bound.bound}) that "
        f"{bound.describe()} can take: the model is too small for the data (or the data "
        "is not this model's); size the model for the data's vocabulary or classes")


class BaseTask(base_layer.BaseLayer):
  """Base class of tasks."""

  @classmethod
  def id_bounds(cls, task_params: Params) -> dict[str, IdBound]:
    """{batch key: IdBound} of the ids and labels this task's model can take (none
    here); the trainer checks every batch against them and pre-flight the inputs'
    own vocabulary or class count."""
    del task_params
    return {}

  @classmethod
  def Params(cls):  # noqa: N802
    p = super().Params()
    p.define("train", train_params(), "Training settings.")
    p.define("pipeline", pipeline_params(),
             "GPipe: cut the task's main layer stack into cells (off by default).")
    p.random_seed = 1234
    return p

  input_device: str | None = None  # where the batch goes: the first cell's device

  def __init__(self, params):
    super().__init__(params)
    check_train_params(self.params.train)
    check_pipeline_params(self.params.pipeline, "task.pipeline")
    if not isinstance(self.params.pipeline.num_replicas, int) or \
        self.params.pipeline.num_replicas < 1:
      raise ParamsError("task.pipeline.num_replicas must be an int >= 1, got "
                        f"{self.params.pipeline.num_replicas!r}")

  @property
  def pipelined(self) -> bool:
    return requested_cells(self.params.pipeline) > 0

  def create_stack(self, name: str, params: InstantiableParams) -> base_layer.BaseLayer:
    """Creates the task's main layer stack: as given, or pipelined per params.pipeline.

    A pipelined stack must be a `Sequential`; it becomes a `PipeliningLayer` over the
    same layers with the same names, so checkpoints move between the two.
    """
    self._stack_name = name
    if not self.pipelined:
      return self.create_child(name, params)
    if not issubclass(params.cls, layers.Sequential):
      raise ParamsError(f"{self.path}: task.pipeline is set but {name} is a "
                       f"{params.cls.__name__}, not a Sequential stack of layers")
    pipelined = PipeliningLayer.Params().set(
        name=params.name, layers=params.layers, random_seed=params.random_seed,
        dtype=params.dtype, fprop_dtype=params.fprop_dtype, params_init=params.params_init)
    for key, value in self.params.pipeline.iter_params():
      if key != "num_replicas":  # the trainer's business: it builds one task per replica
        pipelined.set(**{key: value})
    stack = self.create_child(name, pipelined)
    self.input_device = stack.cell_devices[0]
    return stack

  @property
  def main_stack(self) -> base_layer.BaseLayer:
    """The main layer stack (made by create_stack)."""
    return getattr(self, self._stack_name)

  @property
  def pipeline(self) -> PipeliningLayer | None:
    """The main stack when it is pipelined, else None."""
    stack = self.main_stack
    return stack if isinstance(stack, PipeliningLayer) else None

  @property
  def output_device(self) -> str | None:
    """Where the head runs: the last cell's device when pipelined."""
    return getattr(self.main_stack, "output_device", None)

  def stack_inputs(self, batch: dict[str, tf.Tensor]) -> Any:
    """The main stack's inputs (a tuple is passed as positional arguments)."""
    raise NotImplementedError

  def head_inputs(self, batch: dict[str, tf.Tensor]) -> dict[str, tf.Tensor]:
    """The batch-major tensors [B, ...] the head needs besides the stack's outputs."""
    raise NotImplementedError

  def head(self, outputs: Any, head_inputs: dict[str, tf.Tensor]) -> Metrics:
    """Metrics of the stack's outputs: {name: (value, weight)}, 'loss' included."""
    raise NotImplementedError

  def fprop(self, batch: dict[str, tf.Tensor]) -> Metrics:
    inputs = self.stack_inputs(batch)
    outputs = base_layer.call_with(self.main_stack, inputs)
    return self.head(outputs, self.head_inputs(batch))

  # -- serving (serving.py builds a SavedModel's functions from these) ----------------

  def serving_functions(self, model: Any, input_generator: Any,
                        options: Any) -> dict[str, Any]:
    """{signature name: tf.function with an input signature (`serving.traced`)}: what
    a SavedModel of this task serves. `model` (the serving.ServingModel being built)
    is where a function's lookup tables are tracked; `input_generator` (the eval
    input) says the shapes and vocabulary; `options` are serving.ServingOptions."""
    raise NotImplementedError(f"{type(self).__name__} defines no serving functions")

  def serve_stack(self, inputs: Any) -> Any:
    """The main stack's inference forward: inputs as `stack_inputs` gives them, with
    any batch size B → outputs [B, ...]. Pipelined, a forward-only pipeline over
    task.pipeline.num_micro_batches micro-batches (PipeliningLayer.infer); otherwise
    the stack on its device. A token slice in the StepContext (a generate step) is
    kept."""
    with base_layer.step_context(training=False, step=tf.constant(0, tf.int64)):
      pipeline = self.pipeline
      if pipeline is not None:
        structure = inputs if isinstance(inputs, tuple) else (inputs,)
        return pipeline.infer(*structure,
                              num_micro_batches=self.params.pipeline.num_micro_batches)
      return base_layer.call_with(self.main_stack, inputs)
