"""Dynamic loss scaling: float16 gradients that neither underflow nor overflow.

float16 keeps 10 bits of mantissa and a range of 6e-8 .. 65504: a backward pass in
it flushes the small gradients of a deep model to zero. The loss is multiplied by a
scale S before the backward (the pipeline seeds each micro-batch's backward with
S·w_m instead of w_m, so every hand-off and stashed gradient carries S), and the
summed float32 gradients are divided by S once, before the optimizer sees them.

    step:  gradients of S·loss → /S → all finite?
             yes: apply the update; after `growth_interval` such steps in a row, S ×= 2
             no:  skip the update (variables, slots and global step unchanged); S /= 2

S and the count of good steps are variables: checkpointed with the run (a resumed
run goes on with the scale it had) and written to TensorBoard (`loss_scale`). A
gradient that is still not finite at S = `min_scale` is not an overflow the scale can
cure: the trainer stops as it does for a non-finite loss.

bfloat16 has float32's exponent range and needs none (`mode='auto'` turns scaling on
only where some layer computes in float16). Keras's LossScaleOptimizer and torch's
GradScaler use the same rule (initial 2^15, growth every 2000 steps).
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from lingvo_gpipe.core import base_layer
from lingvo_gpipe.core.hyperparams import Params, ParamsError

MODES = ("auto", "dynamic", "off")


def loss_scale_params() -> Params:
  """task.train.loss_scale: when and how the loss is scaled."""
  p = Params()
  p.define("mode", "auto", f"One of {MODES}. auto: dynamic where some layer computes in "
           "float16 (fprop_dtype), off otherwise (float32 and bfloat16 need none).")
  p.define("initial_scale", 2.0 ** 15, "S at the first step.")
  p.define("growth_interval", 2000, "Double S after this many finite steps in a row.")
  p.define("min_scale", 1.0, "A gradient still not finite at this S stops the run (it "
           "is not an overflow that scaling cures).")
  return p


def check_loss_scale_params(p: Params, path: str = "task.train.loss_scale") -> None:
  """Raises ParamsError naming the first value no run accepts."""
  if p.mode not in MODES:
    raise ParamsError(f"{path}.mode must be one of {MODES}, got {p.mode!r}")
  if not isinstance(p.growth_interval, int) or isinstance(p.growth_interval, bool) \
      or p.growth_interval < 1:
    raise ParamsError(f"{path}.growth_interval must be an int >= 1, got "
                      f"{p.growth_interval!r}")
  for key in ("initial_scale", "min_scale"):
    value = getattr(p, key)
    if not isinstance(value, (int, float)) or not 0 < value < float("inf"):
      raise ParamsError(f"{path}.{key} must be a finite number > 0, got {value!r}")
  if p.initial_scale < p.min_scale:
    raise ParamsError(f"{path}.initial_scale ({p.initial_scale}) must be >= min_scale "
                      f"({p.min_scale})")


def computes_in_float16(layer: base_layer.BaseLayer) -> bool:
  """Whether `layer` or a layer below it computes in float16."""
  return any(sublayer.fprop_dtype == tf.float16 for sublayer in layer.walk())


class DynamicLossScale(tf.Module):
  """S and the count of finite steps since it last changed (see the module doc)."""

  def __init__(self, params: Params):
    super().__init__(name="loss_scale")
    check_loss_scale_params(params)
    self.params = params
    self.scale = tf.Variable(float(params.initial_scale), dtype=tf.float32, trainable=False,
                             name="loss_scale")
    self.good_steps = tf.Variable(0, dtype=tf.int64, trainable=False,
                                  name="loss_scale_good_steps")

  def update(self, finite: tf.Tensor, applies: tf.Tensor | None = None) -> tf.Tensor:
    """After a step whose gradients were `finite` (bool []) or not: S doubled after
    growth_interval finite steps in a row, halved (not below min_scale) after a
    non-finite one; nothing changes where `applies` (bool []) is false (a step after
    one that stopped the run). Returns the new S."""
    good = self.good_steps + 1
    grow = tf.logical_and(finite, good >= self.params.growth_interval)
    scale = tf.where(finite, tf.where(grow, self.scale * 2.0, self.scale),
                     tf.maximum(self.scale * 0.5, self.params.min_scale))
    good_steps = tf.where(tf.logical_and(finite, tf.logical_not(grow)), good,
                          tf.constant(0, tf.int64))
    if applies is not None:
      scale = tf.where(applies, scale, self.scale)
      good_steps = tf.where(applies, good_steps, self.good_steps)
    self.good_steps.assign(good_steps)
    self.scale.assign(scale)
    return scale


def make(params: Params, model: Any) -> DynamicLossScale | None:
  """The loss scale `params` ask for with `model` (a layer or a task): a
  DynamicLossScale, or None when scaling is off."""
  check_loss_scale_params(params)
  if params.mode == "off" or (params.mode == "auto" and not computes_in_float16(model)):
    return None
  return DynamicLossScale(params)


def scaled_gradients(gradients: list[Any], scale: tf.Tensor | None) -> list[Any]:
  """Each gradient (a tensor, IndexedSlices or None) times `scale` (None: unchanged)."""
  if scale is None:
    return list(gradients)

  def times(g: Any) -> Any:
    if g is None:
      return None
    if isinstance(g, tf.IndexedSlices):
      return tf.IndexedSlices(g.values * tf.cast(scale, g.values.dtype), g.indices,
                              g.dense_shape)
    return g * tf.cast(scale, g.dtype)

  return [times(g) for g in gradients]
