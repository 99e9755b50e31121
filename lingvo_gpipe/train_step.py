"""One synchronous training step, shared by the trainer and the benchmarks.

  batch → R shards (one per data-parallel replica; R = 1 without hybrid parallelism)
  → per replica, the whole shard's metrics and gradients:
      pipelined   PipeliningLayer.forward_backward: the schedule's cell calls, the
                  head's loss per micro-batch on the last device, gradients summed
      otherwise   the task's forward on the whole shard, tf.gradients
  → gradients averaged across replicas (collective all-reduce)
  → if the loss and the gradient norm are finite: each optimizer's update, batch-norm
    moving statistics from every forward's statistics, global step + 1; then whether
    every variable a checkpoint saves (replica 0's, its optimizer slots) is still
    finite: a finite gradient times a huge learning rate can still overflow
  → scalars, and the measured schedule's timestamps (fetched at summary steps).

A model is anything shaped like a task (tasks/base_task.py): `pipeline` (a
PipeliningLayer or None), `stack_inputs(batch)`, `head_inputs(batch)`,
`head(outputs, head_inputs)` and `__call__(batch)` → metrics. `StackWithLoss` makes one
from a layer and a loss function (benchmarks, tests).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from lingvo_gpipe.core import base_layer, loss_scale, stacked_variables, variable_chunks
from lingvo_gpipe.pipeline import device_loop, hybrid, timeline
from lingvo_gpipe.pipeline.device_loop import Metrics
from lingvo_gpipe.pipeline.layer import PipelineError, PipeliningLayer


@tf.autograph.experimental.do_not_convert  # plain Python on static values
def loss_and_gradients(model: Any, batch: Any, variables: Sequence[tf.Variable]
                       ) -> tuple[Metrics, list[tf.Tensor]]:
  """The whole batch's metrics and the gradient of its loss for each of `variables`
  (zeros for a variable the loss does not use). Call inside a training StepContext."""
  pipeline = model.pipeline
  if pipeline is None:
    metrics = model(batch)
    loss = metrics["loss"][0]
    scale = base_layer.current_context().loss_scale
    if scale is not None:
      loss = loss * tf.cast(scale, loss.dtype)
    grads = tf.gradients(loss, list(variables),
                         unconnected_gradients=tf.UnconnectedGradients.ZERO)
    if scale is not None:
      grads = loss_scale.scaled_gradients(grads, 1.0 / scale)
    return metrics, grads
  with tf.GradientTape() as tape:
    inputs = model.stack_inputs(batch)
  if tape.watched_variables():
    names = [v.name for v in tape.watched_variables()]
    raise PipelineError(f"the pipeline's inputs are computed with variables {names}; a "
                        "pipeline trains only its cells and the head after it: make those "
                        "layers the pipeline's first layers")
  result = pipeline.forward_backward(inputs, model.head, model.head_inputs(batch))
  return result.metrics, result.gradients_for(variables)


class TrainStep:
  """Builds the step's graph when called inside a tf.function (see the module doc).

    step = TrainStep(model, optimizer, global_step)          # one model (input_device=
                                                             # where its batch goes)
    step = TrainStep(replicas, optimizers, global_step)      # hybrid.Replicas, one each
    fn = tf.function(step)
    outputs, timestamps = fn(batch)   # outputs: loss, metrics, learning_rate,
                                      # grad_norm, finite (loss and gradient norm),
                                      # update_finite (the variables after the update),
                                      # loss_scale (S of this step, if scaled);
                                      # timestamps: per device, its actions' times
    timeline.MeasuredTimeline.from_fetched([t.numpy() for t in timestamps])

  `optimizers[r]` updates replica r's variables (each optimizer's slots live with its
  variables). Replica 0 records the timestamps; `plan` is the schedule its cells were
  given (None when not pipelined). `scale`: the run's DynamicLossScale (None: the
  loss is not scaled).
  """

  def __init__(self, replicas: hybrid.Replicas | Any, optimizers: Sequence[Any] | Any,
               global_step: tf.Variable, input_device: str | None = None,
               scale: loss_scale.DynamicLossScale | None = None):
    if not isinstance(replicas, hybrid.Replicas):  # one model
      device = input_device or getattr(replicas, "input_device", None)
      replicas = hybrid.Replicas([replicas], [device])
    if not isinstance(optimizers, Sequence):
      optimizers = [optimizers]
    if len(optimizers) != replicas.num_replicas:
      raise ValueError(f"{len(optimizers)} optimizers for {replicas.num_replicas} replicas")
    self.replicas = replicas
    self.optimizers = list(optimizers)
    self.global_step = global_step
    self.scale = scale
    pipeline = getattr(replicas.replicas[0], "pipeline", None)
    self.plan = pipeline.plan() if pipeline is not None else None

  @tf.autograph.experimental.do_not_convert  # plain Python on static values
  def steps(self, batches: Sequence[Any]
            ) -> list[tuple[dict[str, tf.Tensor], list[tf.Tensor]]]:
    """len(batches) steps in one traced function, each `__call__`'s outputs in order:
    one client call for several steps (task.train.steps_per_call). Once a step would
    stop a run (a loss, gradient norm or update not finite, beyond what dynamic loss
    scaling skips), the steps after it still run but update nothing, so the state is
    the one the stopping step left, as if it had been called alone."""
    results = []
    proceed = tf.constant(True)
    for batch in batches:
      outputs, timestamps = self(batch, proceed)
      results.append((outputs, timestamps))
      proceed = tf.logical_and(proceed, self._run_goes_on(outputs))
    return results

  def _run_goes_on(self, outputs: dict[str, tf.Tensor]) -> tf.Tensor:
    """Whether a run goes on after a step with these outputs: it was finite and so is
    its update, or its gradient overflowed at a loss scale that can still halve
    (the trainer's `_overflow_skipped`)."""
    goes_on = tf.logical_and(outputs["finite"], outputs["update_finite"])
    if "loss_scale" in outputs:
      skipped = tf.logical_and(tf.math.is_finite(outputs["loss"]),
                               outputs["loss_scale"] > self.scale.params.min_scale)
      goes_on = tf.logical_or(goes_on, tf.logical_and(tf.logical_not(outputs["finite"]),
                                                      skipped))
    return goes_on

  @tf.autograph.experimental.do_not_convert  # plain Python on static values
  def __call__(self, batch: Any, proceed: tf.Tensor | None = None
               ) -> tuple[dict[str, tf.Tensor], list[tf.Tensor]]:
    """One step on `batch`. `proceed` (bool scalar; None: True): when false, the step
    runs but updates nothing and reports itself not finite (`steps`)."""
    step = self.global_step.read_value()
    scale = self.scale.scale.read_value() if self.scale is not None else None
    replicas = self.replicas
    per_replica, grads = [], []
    with base_layer.step_context(training=True, step=step, layer_stats=[],
                                 spans=[], loss_scale=scale) as ctx:
      for r, shard in enumerate(replicas.shard(batch)):
        with replicas.replica_context(r, shard), base_layer.step_context(
            spans=ctx.spans if r == 0 else None):
          metrics, replica_grads = loss_and_gradients(
              replicas.replicas[r], shard, replicas.trainable_variables[r])
        per_replica.append(metrics)
        grads.append(replica_grads)
    # Weighted by each replica's loss weight (an LM's tokens differ between shards).
    grads = replicas.all_reduce_gradients(grads, [m["loss"][1] for m in per_replica])
    metrics = device_loop.weighted_mean(per_replica)
    loss = metrics["loss"][0]
    timestamps = timeline.fetches(ctx.spans)
    grad_norm = variable_chunks.global_norm(grads[0], replicas.trainable_variables[0])
    finite = tf.logical_and(tf.math.is_finite(loss), tf.math.is_finite(grad_norm))
    if proceed is not None:
      finite = tf.logical_and(finite, proceed)

    # The update happens only where `finite`: inside each chunk of the optimizer's
    # update (a tf.cond around the whole update captured every variable and slot once
    # more, and was a quarter of the time tracing a 128-layer step).
    for optimizer, g, variables in zip(self.optimizers, grads, replicas.trainable_variables):
      lr, _ = optimizer.apply_gradients(g, variables, step, grad_norm, condition=finite)

    def apply_stats() -> tf.Tensor:
      replicas.apply_layer_stats(ctx.layer_stats)
      return tf.constant(True)

    tf.cond(finite, apply_stats, lambda: tf.constant(False))
    self.global_step.assign_add(tf.cast(finite, tf.int64))
    if self.scale is not None:
      self.scale.update(finite, applies=proceed)
    # Read after the updates (automatic control dependencies order the calls that
    # take the same variables); where the step was skipped, nothing changed.
    update_finite = tf.logical_or(tf.logical_not(finite),
                                  variable_chunks.all_finite(self.checkpointed_variables()))
    lr = tf.where(finite, lr, tf.constant(float("nan"), lr.dtype))
    out = {name: value for name, (value, _) in metrics.items()}
    out.update(learning_rate=lr, grad_norm=grad_norm, finite=finite,
               update_finite=update_finite)
    if scale is not None:
      out["loss_scale"] = scale
    return out, timestamps

  def checkpointed_variables(self) -> list[tf.Variable]:
    """Replica 0's variables and its optimizer's slots: what a checkpoint saves (the
    other replicas equal them)."""
    return list(self.replicas.replicas[0].variables) + list(self.optimizers[0].variables)


def non_finite_variables(variables: Sequence[tf.Variable]) -> list[str]:
  """The names of the floating-point variables holding an inf or a NaN (eagerly; for
  the error message once `variable_chunks.all_finite` said so); for a stacked
  variable, those of its rows that do."""
  floats = [v for v in variables if v.dtype.is_floating]
  weights = stacked_variables.weights_of(floats)
  finite = stacked_variables.per_weight(weights, floats, [np.isfinite(v.numpy()) for v in floats])
  return [w.name for w, ok in zip(weights, finite) if not ok.all()]


class StackWithLoss(tf.Module):
  """A layer (a PipeliningLayer or not) and a loss, shaped like a task for TrainStep.

  batch: {"inputs": the layer's nested inputs [B, ...] (a tuple is passed as
  positional arguments), any other key: batch-major tensors for the loss};
  loss_fn(outputs, {other keys}) → metrics {name: (value, weight)} with 'loss', the
  loss a mean over what its weight counts.
  """

  def __init__(self, stack: base_layer.BaseLayer,
               loss_fn: Callable[[Any, dict[str, tf.Tensor]], Metrics]):
    super().__init__(name=f"{stack.name}_with_loss")
    self.stack = stack
    self._loss_fn = loss_fn

  @property
  def pipeline(self) -> PipeliningLayer | None:
    return self.stack if isinstance(self.stack, PipeliningLayer) else None

  @property
  def input_device(self) -> str | None:
    """Where the batch goes: the first cell's device when pipelined."""
    return self.pipeline.cell_devices[0] if self.pipeline is not None else None

  def stack_inputs(self, batch: dict[str, Any]) -> Any:
    return batch["inputs"]

  def head_inputs(self, batch: dict[str, Any]) -> dict[str, tf.Tensor]:
    return {k: v for k, v in batch.items() if k != "inputs"}

  def head(self, outputs: Any, head_inputs: dict[str, tf.Tensor]) -> Metrics:
    with tf.device(getattr(self.stack, "output_device", None)):
      return self._loss_fn(outputs, head_inputs)

  def __call__(self, batch: dict[str, Any]) -> Metrics:
    inputs = self.stack_inputs(batch)
    outputs = base_layer.call_with(self.stack, inputs)
    return self.head(outputs, self.head_inputs(batch))

  def walk(self):
    """The layers below (for Replicas.apply_layer_stats)."""
    return self.stack.walk()
