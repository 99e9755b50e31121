"""Optimizers whose state lives beside each variable.

GPipe's memory argument needs each device to hold only its own cells' weights *and*
their optimizer state. Keras 3 optimizers create slot variables on the default
device, not their variable's (`tests/optimizers_test.py` checks ours do the
latter), so these optimizers create every slot inside
`tf.device(variable.device)` and compute every update there too.

SGD, momentum, RMSProp and Adam apply TensorFlow's fused training kernels
(ResourceApply*): they update the variable and its slots in place, with no
variable-sized temporaries. Written as separate assign ops, the updates of all
variables may run at once and hold several weight-sized temporaries each, which for
a re-materialized pipeline was the step's peak memory.

An optimizer is built from Params, tracks its slots (so a `tf.train.Checkpoint`
holding it saves them), and applies one synchronous update:

  opt = p.instantiate()
  opt.create_slots(variables)            # eagerly, before tracing a train step
  lr, grad_norm = opt.apply_gradients(grads, variables, step)

`step` is the 0-based index of the update being applied.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from lingvo_gpipe.core import lr_schedules, stacked_variables, variable_chunks
from lingvo_gpipe.core.hyperparams import Instantiable, InstantiableParams, ParamsError


def _refuse_rows(variables: Sequence[Any]) -> None:
  """Raises on a row of a stacked variable: an optimizer updates the stack whole."""
  rows = [v.name for v in variables if isinstance(v, stacked_variables.RowVariable)]
  if rows:
    raise ValueError(
        f"{len(rows)} rows of stacked variables given to the optimizer ({rows[0]}, ...): "
        "pass the model's trainable_variables (the stacks), not "
        "stacked_variables.trainable_weights (one entry per weight)")


def _slot_key(var: tf.Variable) -> str:
  """Checkpoint-safe key for a variable: its name without the ':0' suffix."""
  return re.sub(r":\d+$", "", var.name)


class Optimizer(Instantiable, tf.Module):
  """Base class: learning rate × schedule, global-norm clipping, per-variable slots."""

  @classmethod
  def Params(cls) -> InstantiableParams:  # noqa: N802
    p = super().Params()
    p.define("learning_rate", 0.1, "Base learning rate; the schedule multiplies it.")
    p.define("lr_schedule", lr_schedules.Constant.Params(), "Learning-rate schedule params.")
    p.define("clip_gradient_norm", 0.0,
             "If > 0, gradients are scaled so their global norm is at most this.")
    return p

  def __init__(self, params: InstantiableParams):
    super().__init__(params, name=type(self).__name__.lower())
    if params.learning_rate < 0:
      raise ParamsError(f"learning_rate must be >= 0, got {params.learning_rate}")
    if params.clip_gradient_norm < 0:
      raise ParamsError(f"clip_gradient_norm must be >= 0, got {params.clip_gradient_norm}")
    self.params = params
    self.lr_schedule = params.lr_schedule.instantiate()
    self.slots: dict[str, dict[str, tf.Variable]] = {}
    # A stacked variable's slots, by its key: found by tf.Module (self.variables), not
    # checkpointed (their rows are, in self.slots).
    object.__setattr__(self, "_stacked_slots", {})

  def _slot_shapes(self, var: tf.Variable) -> dict[str, tuple[list[int], float]]:
    """{slot name: (shape, initial value)} for `var`."""
    return {}

  def slot_shapes(self, var: tf.Variable) -> dict[str, tuple[list[int], float]]:
    """{slot name: (shape, initial value)} of the slots `create_slots` makes for `var`
    (the planner's memory model counts them): a stacked variable's [n, *shape] are
    its rows' slots stacked (per-weight statistics, e.g. Adafactor's factors, are
    per row)."""
    stack = stacked_variables.stack_of(var)
    if stack is None:
      return self._slot_shapes(var)
    return {name: ([len(stack.rows), *shape], init)
            for name, (shape, init) in self._slot_shapes(stack.rows[0]).items()}

  def create_slots(self, variables: Sequence[tf.Variable]) -> None:
    """Creates the slots of each variable on that variable's device (idempotent).

    A stacked variable (stacked_variables) gets stacked slots, one variable per slot
    kind; each of its rows' slots is a row of those, checkpointed under the row's key
    as an unstacked variable's slot is.
    """
    _refuse_rows(variables)
    # Gathered in a plain dict and assigned once: each insertion into the tracked
    # dict tf.Module makes of self.slots copies it (quadratic in the slots; 4 s of
    # a 512-layer model's start).
    new_slots: dict[str, dict[str, Any]] = {}
    for var in variables:
      key = _slot_key(var)
      if key in self.slots or key in new_slots or key in self._stacked_slots:
        continue
      stack = stacked_variables.stack_of(var)
      shapes = self.slot_shapes(var)
      with tf.device(var.device):
        slots = {name: tf.Variable(tf.fill(shape, tf.cast(init, var.dtype)), trainable=False,
                                   name=f"{key}/{name}")
                 for name, (shape, init) in shapes.items()}
      if stack is None:
        new_slots[key] = slots
        continue
      self._stacked_slots[key] = slots
      rows_of = {name: stack.rows_like(slot, name).rows for name, slot in slots.items()}
      for i, row in enumerate(stack.rows):
        new_slots[_slot_key(row)] = {name: rows[i] for name, rows in rows_of.items()}
    if new_slots:
      self.slots = {**self.slots, **new_slots}

  def slots_of(self, var: tf.Variable) -> dict[str, tf.Variable]:
    key = _slot_key(var)
    return self._stacked_slots[key] if key in self._stacked_slots else self.slots[key]

  def learning_rate(self, step: tf.Tensor) -> tf.Tensor:
    return self.params.learning_rate * self.lr_schedule.value(step)

  def apply_gradients(self, grads: Sequence[tf.Tensor], variables: Sequence[tf.Variable],
                      step: tf.Tensor, grad_norm: tf.Tensor | None = None,
                      condition: tf.Tensor | None = None) -> tuple[tf.Tensor, tf.Tensor]:
    """Clips, then updates each variable on its own device.

    Args:
      grads: one gradient per variable.
      variables: the variables, each with slots from `create_slots`.
      step: 0-based index of this update (drives the schedule and bias corrections).
      grad_norm: the global norm of `grads`, if the caller has it already.
      condition: if given, a bool scalar: the variables and slots change only where
        it is true (checked inside each chunk's update).

    Returns:
      (learning rate used, global gradient norm before clipping).
    """
    if len(grads) != len(variables):
      raise ValueError(f"{len(grads)} gradients for {len(variables)} variables")
    _refuse_rows(variables)
    grads = [tf.convert_to_tensor(g) for g in grads]
    if grad_norm is None:
      grad_norm = variable_chunks.global_norm(grads, variables)
    clip = self.params.clip_gradient_norm
    # tf.clip_by_global_norm's factor, applied inside each chunk's update.
    grad_scale = clip / tf.maximum(grad_norm, clip) if clip > 0 else None
    lr = self.learning_rate(step)
    # The step's scalars (learning rate, bias corrections...) once per device and
    # dtype; the updates one call per chunk of variables of one shape
    # (variable_chunks), not a dozen ops per variable.
    scalars: dict[tuple[str, tf.DType], dict[str, tf.Tensor]] = {}
    for chunk in variable_chunks.chunks(variables):
      first = variables[chunk[0]]
      stacked = stacked_variables.stack_of(first) is not None
      with tf.device(first.device):
        key = (first.device, first.dtype)
        if key not in scalars:
          scalars[key] = self._step_scalars(tf.cast(lr, first.dtype), step, first.dtype)
        self._update_chunk([variables[i] for i in chunk],
                           [self.slots_of(variables[i]) for i in chunk],
                           [grads[i] for i in chunk], scalars[key],
                           None if grad_scale is None else tf.cast(grad_scale, first.dtype),
                           condition, stacked)
    return lr, grad_norm

  @variable_chunks.chunk_function
  def _update_chunk(self, variables, slots, grads, scalars, grad_scale, condition, stacked):
    """Updates variables of one device, shape and dtype (traced once per chunk size),
    where `condition` (None: always); `stacked`: they are VariableStacks' variables."""
    def update() -> tf.Tensor:
      for var, var_slots, grad in zip(variables, slots, grads):
        grad = tf.cast(grad, var.dtype)
        if grad_scale is not None:
          grad = grad * grad_scale
        self._update(var, grad, var_slots, scalars, stacked)
      return tf.constant(True)

    if condition is None:
      update()
    else:
      tf.cond(condition, update, lambda: tf.constant(False))

  def _step_scalars(self, lr: tf.Tensor, step: tf.Tensor, dtype: tf.DType
                    ) -> dict[str, tf.Tensor]:
    """The scalars of this update that every variable of `dtype` on the current
    device shares: at least the learning rate "lr"."""
    return {"lr": lr}

  def _update(self, var, grad, slots, scalars, stacked: bool) -> None:
    """Updates `var` (stacked: a VariableStack's variable [n, *shape], whose rows are
    the weights: per-weight statistics are taken per row)."""
    raise NotImplementedError


class SGD(Optimizer):
  """Plain or momentum SGD (TF1 form): a = μ·a + g; w -= lr·a (Nesterov: lr·(g + μ·a))."""

  @classmethod
  def Params(cls):  # noqa: N802
    p = super().Params()
    p.define("momentum", 0.9, "Momentum μ; 0 for plain SGD.")
    p.define("nesterov", False, "Use Nesterov momentum.")
    return p

  def _slot_shapes(self, var):
    return {"momentum": (var.shape.as_list(), 0.0)} if self.params.momentum else {}

  def _step_scalars(self, lr, step, dtype):
    return {"lr": lr, "momentum": tf.cast(self.params.momentum, dtype)}

  def _update(self, var, grad, slots, scalars, stacked):
    if not self.params.momentum:
      tf.raw_ops.ResourceApplyGradientDescent(var=var.handle, alpha=scalars["lr"], delta=grad)
      return
    tf.raw_ops.ResourceApplyMomentum(var=var.handle, accum=slots["momentum"].handle,
                                     lr=scalars["lr"], grad=grad,
                                     momentum=scalars["momentum"],
                                     use_nesterov=self.params.nesterov)


class RMSProp(Optimizer):
  """RMSProp with momentum as in TF1's RMSPropOptimizer (the AmoebaNet paper's).

  ms = ρ·ms + (1-ρ)·g²;  mom = μ·mom + lr·g / sqrt(ms + ε);  w -= mom.
  ms starts at 1, as in TF1, so the first steps are not huge.
  """

  @classmethod
  def Params(cls):  # noqa: N802
    p = super().Params()
    p.define("decay", 0.9, "Decay ρ of the mean square.")
    p.define("momentum", 0.9, "Momentum μ.")
    p.define("epsilon", 1.0, "ε inside the square root (AmoebaNet used 1.0).")
    return p

  def _slot_shapes(self, var):
    shape = var.shape.as_list()
    return {"ms": (shape, 1.0), "mom": (shape, 0.0)}

  def _step_scalars(self, lr, step, dtype):
    p = self.params
    return {"lr": lr, "rho": tf.cast(p.decay, dtype), "momentum": tf.cast(p.momentum, dtype),
            "epsilon": tf.cast(p.epsilon, dtype)}

  def _update(self, var, grad, slots, scalars, stacked):
    tf.raw_ops.ResourceApplyRMSProp(var=var.handle, ms=slots["ms"].handle,
                                    mom=slots["mom"].handle, grad=grad, **scalars)


class Adam(Optimizer):
  """Adam (Kingma & Ba, Algorithm 1 with the "ε-hat" form), t = step + 1:

  m = β1·m + (1-β1)·g;  v = β2·v + (1-β2)·g²;
  w -= lr · sqrt(1-β2^t) / (1-β1^t) · m / (sqrt(v) + ε).
  """

  @classmethod
  def Params(cls):  # noqa: N802
    p = super().Params()
    p.define("beta1", 0.9, "Decay of the first moment.")
    p.define("beta2", 0.98, "Decay of the second moment.")
    p.define("epsilon", 1e-9, "ε added to sqrt(v̂).")
    return p

  def _slot_shapes(self, var):
    shape = var.shape.as_list()
    return {"m": (shape, 0.0), "v": (shape, 0.0)}

  def _step_scalars(self, lr, step, dtype):
    p = self.params
    t = tf.cast(step, dtype) + 1.0
    beta1, beta2 = tf.cast(p.beta1, dtype), tf.cast(p.beta2, dtype)
    return {"lr": lr, "beta1": beta1, "beta2": beta2, "beta1_power": tf.pow(beta1, t),
            "beta2_power": tf.pow(beta2, t), "epsilon": tf.cast(p.epsilon, dtype)}

  def _update(self, var, grad, slots, scalars, stacked):
    tf.raw_ops.ResourceApplyAdam(var=var.handle, m=slots["m"].handle, v=slots["v"].handle,
                                 grad=grad, **scalars)


class Adafactor(Optimizer):
  """Adafactor (Shazeer & Stern, 2018), the optimizer of large Transformers.

  For a weight of rank ≥ 2 whose last two dims are both ≥ min_dim_size_to_factor,
  the second moment is kept factored: a row mean vr [..., R] and a column mean
  vc [..., C] instead of v [..., R, C], which is what makes the optimizer state of a
  multi-billion-parameter model small. With t = step + 1:

    β2_t = 1 - t^(-decay_exponent);  g2 = g² + ε1
    v ≈ vr ⊗ vc / mean(vr);  u = g / sqrt(v);  u /= max(1, rms(u) / clipping_threshold)
    m = β1·m + (1-β1)·u  (only if β1 > 0)
    w -= lr · max(ε2, rms(w)) · u   (the scale factor only if multiply_by_parameter_scale)
  """

  @classmethod
  def Params(cls):  # noqa: N802
    p = super().Params()
    p.define("beta1", 0.0, "Momentum; 0 keeps no first moment.")
    p.define("decay_exponent", 0.8, "β2_t = 1 - t^(-decay_exponent).")
    p.define("clipping_threshold", 1.0, "Update clipping threshold d (0 disables).")
    p.define("epsilon1", 1e-30, "Added to g².")
    p.define("epsilon2", 1e-3, "Lower bound of the parameter scale.")
    p.define("multiply_by_parameter_scale", True, "Scale the step by rms(w).")
    p.define("factored", True, "Factor second moments of rank >= 2 weights.")
    p.define("min_dim_size_to_factor", 128, "Factor only if both last dims are this big.")
    return p

  def _is_factored(self, shape: list[int]) -> bool:
    p = self.params
    return (p.factored and len(shape) >= 2
            and min(shape[-2:]) >= p.min_dim_size_to_factor)

  def _slot_shapes(self, var):
    shape = var.shape.as_list()
    slots = {}
    if self._is_factored(shape):
      slots["vr"] = (shape[:-1], 0.0)
      slots["vc"] = (shape[:-2] + shape[-1:], 0.0)
    else:
      slots["v"] = (shape, 0.0)
    if self.params.beta1 > 0:
      slots["m"] = (shape, 0.0)
    return slots

  def _step_scalars(self, lr, step, dtype):
    t = tf.cast(step, dtype) + 1.0
    return {"lr": lr, "beta2": 1.0 - tf.pow(t, -self.params.decay_exponent)}

  def _update(self, var, grad, slots, scalars, stacked):
    p = self.params
    lr, beta2 = scalars["lr"], scalars["beta2"]
    grad_sq = tf.square(grad) + p.epsilon1
    if "vr" in slots:
      vr = slots["vr"].assign(beta2 * slots["vr"]
                              + (1.0 - beta2) * tf.reduce_mean(grad_sq, axis=-1))
      vc = slots["vc"].assign(beta2 * slots["vc"]
                              + (1.0 - beta2) * tf.reduce_mean(grad_sq, axis=-2))
      row_factor = tf.math.rsqrt(vr / tf.reduce_mean(vr, axis=-1, keepdims=True))
      col_factor = tf.math.rsqrt(vc)
      update = grad * row_factor[..., :, None] * col_factor[..., None, :]
    else:
      v = slots["v"].assign(beta2 * slots["v"] + (1.0 - beta2) * grad_sq)
      update = grad * tf.math.rsqrt(v)
    # Per weight: over all its axes, or a stack row's (all but the first).
    axes = list(range(1, var.shape.rank)) if stacked else None
    if p.clipping_threshold > 0:
      rms = tf.sqrt(tf.reduce_mean(tf.square(update), axis=axes, keepdims=stacked))
      update = update / tf.maximum(rms / p.clipping_threshold, 1.0)
    if p.beta1 > 0:
      update = slots["m"].assign(p.beta1 * slots["m"] + (1.0 - p.beta1) * update)
    step_size = lr
    if p.multiply_by_parameter_scale:
      step_size = lr * tf.maximum(
          tf.sqrt(tf.reduce_mean(tf.square(var), axis=axes, keepdims=stacked)), p.epsilon2)
    var.assign_sub(step_size * update)
