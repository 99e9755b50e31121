"""The suite's float tolerance (tests/numerics.py) is loose enough for another summation
order and strict enough to catch the engine's likely mistakes.

Reference: gpipe_test's 8-layer model (no dropout, so micro-batches can be run
unpartitioned one by one), the whole batch's gradients by GradientTape. Each
micro-batch's own gradients, combined as the engine must (weighted by its examples),
agree within the tolerance; the same parts combined with the mistakes an engine can
make (equal weights for uneven micro-batches, a micro-batch left out, one counted
twice) do not, and neither does a systematic relative error of 2^-10 (8192 ulps).
"""

import numpy as np
import pytest
import tensorflow as tf
from gpipe_test import BATCH, STEP, PairLayer, inputs, loss_of, pipelined_loss_and_grads, with_loss
from numerics import REORDERED, assert_all_close, assert_close, relative_difference, tolerance

from lingvo_gpipe.core import base_layer, layers
from lingvo_gpipe.pipeline import layer as gpipe
from lingvo_gpipe.pipeline.layer import micro_batch_sizes

NUM_MICRO_BATCHES = 4  # 13 examples: 4, 3, 3, 3


def model_params(cls, **pipeline):
  return cls.Params().set(name="stack", random_seed=11, layers=[
      PairLayer.Params().set(name=f"pair{i}", keep_prob=1.0) for i in range(8)], **pipeline)


def gradients_of(model, x, skip, target):
  with tf.GradientTape() as tape:
    with base_layer.step_context(training=True, step=tf.constant(STEP, tf.int64)):
      loss = loss_of(model(x, skip), target)
  return [g.numpy() for g in tape.gradient(loss, model.trainable_variables)]


@pytest.fixture(scope="module")
def parts():
  """(whole-batch gradients, [(examples, gradients) per micro-batch])."""
  model = model_params(layers.Sequential).instantiate()
  x, skip, target = inputs()
  whole = gradients_of(model, x, skip, target)
  per_micro_batch, start = [], 0
  for size in micro_batch_sizes(BATCH, NUM_MICRO_BATCHES):
    end = start + size
    per_micro_batch.append((size, gradients_of(model, x[start:end], skip[start:end],
                                               target[start:end])))
    start = end
  return whole, per_micro_batch


def combine(per_micro_batch, weights):
  return [sum(w * grads[i] for w, (_, grads) in zip(weights, per_micro_batch))
          for i in range(len(per_micro_batch[0][1]))]


def test_the_engine_and_the_right_combination_pass(parts, cpu_devices):
  whole, per_micro_batch = parts
  assert_all_close(combine(per_micro_batch, [n / BATCH for n, _ in per_micro_batch]), whole)
  model = model_params(gpipe.PipeliningLayer, num_cells=4, num_micro_batches=NUM_MICRO_BATCHES,
                       devices=cpu_devices).instantiate()
  _, grads = pipelined_loss_and_grads(model, with_loss(model))
  assert_all_close(grads, whole)


@pytest.mark.parametrize("mistake", ["equal weights", "left out", "counted twice"])
def test_the_engines_likely_mistakes_fail(parts, mistake):
  whole, per_micro_batch = parts
  weights = [n / BATCH for n, _ in per_micro_batch]
  if mistake == "equal weights":  # 1/M for 4, 3, 3, 3 examples
    weights = [1 / NUM_MICRO_BATCHES] * NUM_MICRO_BATCHES
  elif mistake == "left out":
    weights[-1] = 0.0
  else:
    weights[0] *= 2
  wrong = combine(per_micro_batch, weights)
  eps = float(np.finfo(np.float32).eps)
  worst = max(relative_difference(g, w) / eps for g, w in zip(wrong, whole))  # in ulps
  assert worst > 100 * REORDERED, (mistake, worst)  # fails by two orders of magnitude
  with pytest.raises(AssertionError):
    assert_all_close(wrong, whole)


def test_a_systematic_error_of_2_to_the_minus_10_fails():
  """Rounding errors of a reordered sum come with both signs and mostly cancel; a
  systematic relative error of 2^-10 is ~8000 ulps of float32 and must fail."""
  want = np.random.RandomState(0).randn(64, 64).astype(np.float32)
  with pytest.raises(AssertionError):
    assert_close(want * np.float32(1 + 2**-10), want)
  assert_close(want * np.float32(1 + 2**-20), want)  # 8 ulps: another order could do it


def test_tolerance_is_absolute_at_the_reference_scale():
  want = np.array([1.0, -1e-3, 0.0], np.float32)
  eps = float(np.finfo(np.float32).eps)
  assert tolerance(want) == pytest.approx(REORDERED * eps)
  # an element made small by cancellation may be off by ulps of the largest one
  assert_close(want + np.array([0, 4 * eps, 4 * eps], np.float32), want)
  assert tolerance(np.zeros(3, np.float32)) == pytest.approx(REORDERED * eps)
  assert tolerance(np.ones(2, np.float64), dtype=np.float32) == pytest.approx(REORDERED * eps)
