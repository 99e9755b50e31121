"""Optimizers and learning-rate schedules against numpy references; slots live with their
variable."""

import math

import numpy as np
import pytest
import tensorflow as tf
from numerics import assert_close

from lingvo_gpipe.core import lr_schedules, optimizers

RNG = np.random.RandomState(1)


def np_sgd(w, grads, lr, mu, nesterov):
  a = np.zeros_like(w)
  for g in grads:
    a = mu * a + g
    w = w - lr * (g + mu * a if nesterov else a)
  return w


def np_rmsprop(w, grads, lr, rho, mu, eps):
  ms, mom = np.ones_like(w), np.zeros_like(w)
  for g in grads:
    ms = rho * ms + (1 - rho) * g * g
    mom = mu * mom + lr * g / np.sqrt(ms + eps)
    w = w - mom
  return w


def np_adam(w, grads, lr, b1, b2, eps):
  m, v = np.zeros_like(w), np.zeros_like(w)
  for t, g in enumerate(grads, start=1):
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    w = w - lr * np.sqrt(1 - b2 ** t) / (1 - b1 ** t) * m / (np.sqrt(v) + eps)
  return w


def np_adafactor(w, grads, lr, factored, beta1=0.0, d=1.0, eps1=1e-30, eps2=1e-3):
  vr = np.zeros(w.shape[:-1])
  vc = np.zeros(w.shape[:-2] + w.shape[-1:])
  v = np.zeros_like(w)
  m = np.zeros_like(w)
  for t, g in enumerate(grads, start=1):
    beta2 = 1 - t ** -0.8
    g2 = g * g + eps1
    if factored:
      vr = beta2 * vr + (1 - beta2) * g2.mean(-1)
      vc = beta2 * vc + (1 - beta2) * g2.mean(-2)
      v_hat = np.outer(vr, vc) / vr.mean()
    else:
      v = beta2 * v + (1 - beta2) * g2
      v_hat = v
    u = g / np.sqrt(v_hat)
    u = u / max(1.0, np.sqrt((u * u).mean()) / d)
    if beta1:
      m = beta1 * m + (1 - beta1) * u
      u = m
    w = w - lr * max(eps2, np.sqrt((w * w).mean())) * u
  return w


CASES = [
    ("sgd", optimizers.SGD.Params().set(learning_rate=0.1, momentum=0.0),
     lambda w, g: np_sgd(w, g, 0.1, 0.0, False)),
    ("momentum", optimizers.SGD.Params().set(learning_rate=0.1, momentum=0.9),
     lambda w, g: np_sgd(w, g, 0.1, 0.9, False)),
    ("nesterov", optimizers.SGD.Params().set(learning_rate=0.1, momentum=0.9, nesterov=True),
     lambda w, g: np_sgd(w, g, 0.1, 0.9, True)),
    ("rmsprop", optimizers.RMSProp.Params().set(learning_rate=0.05, decay=0.9, momentum=0.9,
                                                epsilon=0.1),
     lambda w, g: np_rmsprop(w, g, 0.05, 0.9, 0.9, 0.1)),
    ("adam", optimizers.Adam.Params().set(learning_rate=0.01, beta1=0.9, beta2=0.98,
                                          epsilon=1e-7),
     lambda w, g: np_adam(w, g, 0.01, 0.9, 0.98, 1e-7)),
    ("adafactor_factored", optimizers.Adafactor.Params().set(learning_rate=0.1,
                                                             min_dim_size_to_factor=4),
     lambda w, g: np_adafactor(w, g, 0.1, True)),
    ("adafactor_momentum", optimizers.Adafactor.Params().set(learning_rate=0.1, factored=False,
                                                             beta1=0.9),
     lambda w, g: np_adafactor(w, g, 0.1, False, beta1=0.9)),
]


@pytest.mark.parametrize("name, params, reference", CASES, ids=[c[0] for c in CASES])
def test_update_matches_numpy(name, params, reference):
  w0 = RNG.randn(6, 5)
  grads = [RNG.randn(6, 5) for _ in range(4)]
  var = tf.Variable(w0.astype(np.float64), name=f"w_{name}")
  opt = params.instantiate()
  opt.create_slots([var])
  step_fn = tf.function(lambda g, step: opt.apply_gradients([g], [var], step))
  for step, g in enumerate(grads):
    step_fn(tf.constant(g), tf.constant(step, tf.int64))
  # float64 variables, but the learning rate is a float32 scalar: agreement is to
  # float32's precision (of lr times the update, far below the weights' ulps).
  assert_close(var.numpy(), reference(w0, grads), dtype=np.float32)


def test_global_norm_clipping_and_reported_norm():
  a, b = tf.Variable([1.0, 1.0]), tf.Variable([0.0])
  opt = optimizers.SGD.Params().set(learning_rate=1.0, momentum=0.0,
                                    clip_gradient_norm=1.0).instantiate()
  opt.create_slots([a, b])
  ga, gb = np.array([3.0, 0.0]), np.array([4.0])
  _, norm = opt.apply_gradients([tf.constant(ga), tf.constant(gb)], [a, b], 0)
  assert math.isclose(float(norm), 5.0, rel_tol=1e-6)
  np.testing.assert_allclose(a.numpy(), [1.0 - 0.6, 1.0], rtol=1e-6)
  np.testing.assert_allclose(b.numpy(), [-0.8], rtol=1e-6)


def _device_index(name: str) -> tuple[str, int]:
  spec = tf.DeviceSpec.from_string(name)
  return spec.device_type, spec.device_index


@pytest.mark.parametrize("params", [c[1] for c in CASES[1:]], ids=[c[0] for c in CASES[1:]])
def test_slots_and_updates_live_on_the_variable_device(params, cpu_devices):
  variables = []
  for i, device in enumerate(cpu_devices[:2]):
    with tf.device(device):
      variables.append(tf.Variable(tf.ones([8, 8]), name=f"v{i}"))
  opt = params.instantiate()
  opt.create_slots(variables)
  for var in variables:
    slots = opt.slots_of(var)
    assert slots, "this optimizer should keep slots"
    for slot in slots.values():
      assert _device_index(slot.device) == _device_index(var.device)
  assert _device_index(variables[1].device) == ("CPU", 1)

  fn = tf.function(lambda gs: opt.apply_gradients(gs, variables, tf.constant(0, tf.int64)))
  graph = fn.get_concrete_function([tf.TensorSpec([8, 8])] * 2).graph
  # The updates are calls (one per chunk of variables, variable_chunks.py) whose body
  # writes the variables and slots passed in; a call's body runs on the call's device.
  external = {id(internal): ext for ext, internal in graph.captures}
  updated = set()
  for op in graph.get_operations():
    if op.type != "StatefulPartitionedCall":
      continue
    for handle in (external[id(t)] for t in op.inputs if id(t) in external):
      assert _device_index(op.device) == _device_index(handle.device), op.name
      updated.add(id(handle))
  for var in variables:
    for v in [var, *opt.slots_of(var).values()]:
      assert id(v.handle) in updated, v.name
  writes = [node for f in graph.as_graph_def().library.function for node in f.node_def
            if node.op in ("AssignVariableOp", "AssignSubVariableOp")
            or node.op.startswith("ResourceApply")]
  assert writes


def test_schedules_match_their_formulas():
  steps = np.arange(0, 120)
  rsqrt = lr_schedules.LinearWarmupRsqrtDecay.Params().set(warmup_steps=10).instantiate()
  s = np.maximum(steps, 1)
  np.testing.assert_allclose(rsqrt.value(steps).numpy(),
                             np.minimum(s / 10, np.sqrt(10 / s)), rtol=1e-6)
  # Cosine without warmup against Keras' own implementation (computed another way).
  cosine = lr_schedules.CosineDecay.Params().set(total_steps=100, min_ratio=0.1).instantiate()
  keras = tf.keras.optimizers.schedules.CosineDecay(1.0, decay_steps=100, alpha=0.1)
  np.testing.assert_allclose(cosine.value(steps).numpy(),
                             [float(keras(int(t))) for t in steps], rtol=1e-5, atol=1e-6)
  warm = lr_schedules.CosineDecay.Params().set(warmup_steps=10, total_steps=110).instantiate()
  np.testing.assert_allclose(warm.value(steps[:10]).numpy(), (steps[:10] + 1) / 10, rtol=1e-6)
  np.testing.assert_allclose(warm.value(60).numpy(), 0.5, rtol=1e-5)
  expo = lr_schedules.ExponentialDecay.Params().set(decay_rate=0.97, decay_steps=24).instantiate()
  np.testing.assert_allclose(expo.value(steps).numpy(), 0.97 ** (steps // 24), rtol=1e-6)
  smooth = lr_schedules.ExponentialDecay.Params().set(decay_rate=0.5, decay_steps=10,
                                                   staircase=False).instantiate()
  np.testing.assert_allclose(smooth.value(steps).numpy(), 0.5 ** (steps / 10), rtol=1e-5)
  with pytest.raises(ValueError, match="total_steps must be >= 11"):
    lr_schedules.CosineDecay.Params().set(warmup_steps=10, total_steps=10).instantiate()


def test_the_old_class_paths_of_schedules_still_load():
  """params.txt files written before the rename name lingvo_gpipe.core.schedules.*."""
  p = optimizers.SGD.Params()
  p.set_from_text("lr_schedule.cls", "lingvo_gpipe.core.schedules.CosineDecay")
  assert p.lr_schedule.cls is lr_schedules.CosineDecay
