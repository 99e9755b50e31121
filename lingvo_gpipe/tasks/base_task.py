"""A task: a model, its loss and metrics, and how to train it.

`task(batch)` runs the forward pass and returns metrics: a dict of
name → (value, weight) scalars. `metrics['loss'][0]` is what training minimizes;
weights let eval average metrics correctly over batches. The training settings live
in `params.train`, so that one Params tree describes the whole run.
"""

from __future__ import annotations

import tensorflow as tf

from lingvo_gpipe.core import base_layer, optimizers
from lingvo_gpipe.core.hyperparams import Params

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


class BaseTask(base_layer.BaseLayer):
  """Base class of tasks."""

  @classmethod
  def Params(cls):  # noqa: N802
    p = super().Params()
    p.define("train", train_params(), "Training settings.")
    p.random_seed = 1234
    return p

  def fprop(self, batch: dict[str, tf.Tensor]) -> Metrics:
    raise NotImplementedError
