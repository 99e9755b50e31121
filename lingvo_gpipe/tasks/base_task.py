"""A task: a model, its loss and metrics, and how to train it.

`task(batch)` runs the forward pass and returns metrics: a dict of
name → (value, weight) scalars. `metrics['loss'][0]` is what training minimizes;
weights let eval average metrics correctly over batches. The training settings live
in `params.train`, so that one Params tree describes the whole run.
"""

from __future__ import annotations

import tensorflow as tf

from lingvo_gpipe.core import base_layer, gpipe, layers, optimizers
from lingvo_gpipe.core.hyperparams import InstantiableParams, Params

Metrics = dict[str, tuple[tf.Tensor, tf.Tensor]]


def train_params() -> Params:
  """Training settings shared by every task."""
  p = Params()
  p.define("optimizer", optimizers.SGD.Params(), "Optimizer params (with its lr schedule).")
  p.define("max_steps", 1000, "Train until the global step reaches this.")
  p.define("save_interval_steps", 100, "Write a checkpoint every this many steps.")
  p.define("max_checkpoints_to_keep", 5, "Older checkpoints are deleted.")
  p.define("summary_interval_steps", 10, "Write TensorBoard scalars every this many steps.")
  p.define("log_interval_steps", 10, "Print progress every this many steps.")
  p.define("eval_interval_steps", 0,
           "In train_and_eval mode, evaluate every this many steps (0: only at the end).")
  return p


def pipeline_params() -> Params:
  """GPipe settings of a task; pipelining is on when num_cells > 0 or splits is set."""
  defaults = gpipe.PipeliningLayer.Params()
  p = Params()
  for name in ("num_cells", "num_micro_batches", "splits", "devices", "round_robin_devices",
               "recompute", "partition_cost", "input_specs", "layer_costs",
               "memory_cap_bytes", "bytes_per_param"):
    p.define(name, defaults.get(name), defaults.description(name))
  p.define("num_replicas", 1, "R: data-parallel replicas of the pipeline, replica r's cells "
           "on devices r·K … r·K+K−1, gradients averaged by collective all-reduce "
           "(core/hybrid.py); the batch is split into R equal shards.")
  return p


class BaseTask(base_layer.BaseLayer):
  """Base class of tasks."""

  @classmethod
  def Params(cls):  # noqa: N802
    p = super().Params()
    p.define("train", train_params(), "Training settings.")
    p.define("pipeline", pipeline_params(),
             "GPipe: cut the task's main layer stack into cells (off by default).")
    p.random_seed = 1234
    return p

  input_device: str | None = None  # where the batch goes: the first cell's device

  @property
  def pipelined(self) -> bool:
    return bool(self.params.pipeline.num_cells or self.params.pipeline.splits)

  def create_stack(self, name: str, params: InstantiableParams) -> base_layer.BaseLayer:
    """Creates the task's main layer stack: as given, or pipelined per params.pipeline.

    A pipelined stack must be a `Sequential`; it becomes a `PipeliningLayer` over the
    same layers with the same names, so checkpoints move between the two.
    """
    if not self.pipelined:
      return self.create_child(name, params)
    if not issubclass(params.cls, layers.Sequential):
      raise ValueError(f"{self.path}: task.pipeline is set but {name} is a "
                       f"{params.cls.__name__}, not a Sequential stack of layers")
    pipelined = gpipe.PipeliningLayer.Params().set(
        name=params.name, layers=params.layers, random_seed=params.random_seed,
        dtype=params.dtype, params_init=params.params_init)
    for key, value in self.params.pipeline.iter_params():
      if key != "num_replicas":  # the trainer's business: it builds one task per replica
        pipelined.set(**{key: value})
    stack = self.create_child(name, pipelined)
    self.input_device = stack.cell_devices[0]
    return stack

  def fprop(self, batch: dict[str, tf.Tensor]) -> Metrics:
    raise NotImplementedError
