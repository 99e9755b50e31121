"""Learning-rate schedules: multipliers of an optimizer's base learning rate.

Each schedule is built from Params and maps the global step (the 0-based index of
the update about to be applied) to a float multiplier; it works on Python numbers
and on scalar tensors alike.
"""

from __future__ import annotations

import math

import tensorflow as tf

from lingvo_gpipe.core.hyperparams import Instantiable, InstantiableParams, ParamsError


class LearningRateSchedule(Instantiable):
  """Base: the constant multiplier 1 (`Constant`)."""

  def __init__(self, params: InstantiableParams):
    super().__init__(params)
    self.params = params

  def value(self, step: tf.Tensor) -> tf.Tensor:
    return tf.ones_like(tf.cast(step, tf.float32))


class Constant(LearningRateSchedule):
  """The constant multiplier 1: the base learning rate throughout."""


def _check_steps(name: str, value: int, minimum: int) -> None:
  if value < minimum:
    raise ParamsError(f"{name} must be >= {minimum}, got {value}")


class LinearWarmupRsqrtDecay(LearningRateSchedule):
  """min(s / warmup, sqrt(warmup / s)) with s = max(step, 1): the Transformer schedule.

  Rises linearly to 1 at `warmup_steps`, then decays as 1/sqrt(step).
  """

  @classmethod
  def Params(cls):  # noqa: N802
    p = super().Params()
    p.define("warmup_steps", 4000, "Steps of linear warmup.")
    return p

  def __init__(self, params):
    super().__init__(params)
    _check_steps("warmup_steps", params.warmup_steps, 1)

  def value(self, step):
    s = tf.maximum(tf.cast(step, tf.float32), 1.0)
    warmup = float(self.params.warmup_steps)
    return tf.minimum(s / warmup, tf.sqrt(warmup / s))


class CosineDecay(LearningRateSchedule):
  """Linear warmup to 1, then cosine decay from 1 to `min_ratio` at `total_steps`."""

  @classmethod
  def Params(cls):  # noqa: N802
    p = super().Params()
    p.define("warmup_steps", 0, "Steps of linear warmup (0 for none).")
    p.define("total_steps", 10000, "Step at which the multiplier reaches min_ratio.")
    p.define("min_ratio", 0.0, "Final multiplier.")
    return p

  def __init__(self, params):
    super().__init__(params)
    _check_steps("warmup_steps", params.warmup_steps, 0)
    _check_steps("total_steps", params.total_steps, params.warmup_steps + 1)

  def value(self, step):
    p = self.params
    step = tf.cast(step, tf.float32)
    progress = (step - p.warmup_steps) / float(p.total_steps - p.warmup_steps)
    progress = tf.clip_by_value(progress, 0.0, 1.0)
    cosine = p.min_ratio + (1.0 - p.min_ratio) * 0.5 * (1.0 + tf.cos(math.pi * progress))
    if p.warmup_steps == 0:
      return cosine
    warmup = tf.minimum((step + 1.0) / p.warmup_steps, 1.0)
    return tf.where(step < p.warmup_steps, warmup, cosine)


class ExponentialDecay(LearningRateSchedule):
  """decay_rate ** (step / decay_steps), floored to whole periods if `staircase`.

  The AmoebaNet paper's schedule: ×0.97 every 2.4 epochs, staircase.
  """

  @classmethod
  def Params(cls):  # noqa: N802
    p = super().Params()
    p.define("decay_rate", 0.97, "Multiplier per decay period, in (0, 1].")
    p.define("decay_steps", 1000, "Steps per decay period.")
    p.define("staircase", True, "Decay in whole periods.")
    return p

  def __init__(self, params):
    super().__init__(params)
    _check_steps("decay_steps", params.decay_steps, 1)
    if not 0.0 < params.decay_rate <= 1.0:
      raise ParamsError(f"decay_rate must be in (0, 1], got {params.decay_rate}")

  def value(self, step):
    periods = tf.cast(step, tf.float32) / float(self.params.decay_steps)
    if self.params.staircase:
      periods = tf.floor(periods)
    return tf.pow(float(self.params.decay_rate), periods)
