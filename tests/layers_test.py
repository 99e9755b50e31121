"""Layers against numpy references."""

import math

import numpy as np
import pytest
import tensorflow as tf
from numerics import REORDERED, assert_close

from lingvo_gpipe.core import base_layer, layers
from lingvo_gpipe.core.base_layer import weight_init

RNG = np.random.RandomState(0)


def same_pad(x: np.ndarray, k: int, s: int) -> np.ndarray:
  """TF's SAME padding of NHWC `x` for a k×k window at stride s."""
  pads = []
  for size in x.shape[1:3]:
    total = max((math.ceil(size / s) - 1) * s + k - size, 0)
    pads.append((total // 2, total - total // 2))
  return np.pad(x, [(0, 0), pads[0], pads[1], (0, 0)])


def np_conv(x, w, s):
  k, _, cin, cout = w.shape
  xp = same_pad(x, k, s)
  b, h, wd = x.shape[0], math.ceil(x.shape[1] / s), math.ceil(x.shape[2] / s)
  out = np.zeros([b, h, wd, cout])
  for i in range(h):
    for j in range(wd):
      patch = xp[:, i * s:i * s + k, j * s:j * s + k, :]
      out[:, i, j, :] = np.einsum("bhwc,hwco->bo", patch, w)
  return out


def np_depthwise(x, w, s):
  k, _, cin, mult = w.shape
  xp = same_pad(x, k, s)
  b, h, wd = x.shape[0], math.ceil(x.shape[1] / s), math.ceil(x.shape[2] / s)
  out = np.zeros([b, h, wd, cin * mult])
  for i in range(h):
    for j in range(wd):
      patch = xp[:, i * s:i * s + k, j * s:j * s + k, :]
      out[:, i, j, :] = np.einsum("bhwc,hwcm->bcm", patch, w).reshape(b, -1)
  return out


def build(p):
  return p.instantiate()


def test_linear_matches_numpy_with_activation():
  layer = build(layers.Linear.Params().set(input_dim=5, output_dim=3, activation="RELU"))
  layer.b.assign(RNG.randn(3).astype(np.float32))
  x = RNG.randn(4, 2, 5).astype(np.float32)
  want = np.maximum(x @ layer.w.numpy() + layer.b.numpy(), 0)
  assert_close(layer(x).numpy(), want)
  assert_close(layer(x[:, 0]).numpy(), want[:, 0])


@pytest.mark.parametrize("stride", [1, 2])
def test_conv2d_matches_numpy(stride):
  layer = build(layers.Conv2D.Params().set(filter_shape=(3, 3, 2, 4), filter_stride=(stride,) * 2))
  x = RNG.randn(2, 7, 6, 2).astype(np.float32)
  assert_close(layer(x).numpy(), np_conv(x, layer.w.numpy(), stride))


def test_depthwise_separable_conv_matches_numpy():
  layer = build(layers.DepthwiseSeparableConv2D.Params().set(
      kernel_size=3, input_dim=3, output_dim=5, depth_multiplier=2, stride=2))
  x = RNG.randn(2, 8, 8, 3).astype(np.float32)
  depthwise = np_depthwise(x, layer.depthwise_w.numpy(), 2)
  want = np.einsum("bhwc,co->bhwo", depthwise, layer.pointwise_w.numpy()[0, 0])
  assert_close(layer(x).numpy(), want)


def test_pooling_and_global_pooling_match_numpy():
  x = RNG.randn(2, 4, 6, 3).astype(np.float32)
  blocks = x.reshape(2, 2, 2, 3, 2, 3)
  for kind, reduce in [("MAX", np.max), ("AVG", np.mean)]:
    pool = build(layers.Pooling.Params().set(pooling_type=kind))
    # Max is exact; a mean's sum of four may run in any order (assert_close's scale).
    assert_close(pool(x).numpy(), reduce(blocks, axis=(2, 4)),
                 ulps=0 if kind == "MAX" else REORDERED)
    glob = build(layers.GlobalPooling.Params().set(pooling_type=kind))
    assert_close(glob(x).numpy(), reduce(x, axis=(1, 2)))


def test_batch_norm_train_eval_and_moving_stats():
  layer = build(layers.BatchNorm.Params().set(dim=3, decay=0.9, epsilon=1e-3))
  layer.gamma.assign([1.0, 2.0, 0.5])
  layer.beta.assign([0.0, 1.0, -1.0])
  x = (RNG.randn(4, 5, 3) * 3 + 2).astype(np.float32)
  mean, var = x.mean(axis=(0, 1)), x.var(axis=(0, 1))
  with base_layer.step_context(training=True, layer_stats=[]) as ctx:
    y = layer(x).numpy()
  want = (x - mean) / np.sqrt(var + 1e-3) * layer.gamma.numpy() + layer.beta.numpy()
  assert_close(y, want)
  np.testing.assert_allclose(layer.moving_mean.numpy(), 0.0)  # not updated by fprop
  base_layer.apply_layer_stats(ctx.layer_stats)
  assert_close(layer.moving_mean.numpy(), 0.1 * mean)
  assert_close(layer.moving_variance.numpy(), 0.9 + 0.1 * var)
  y_eval = layer(x).numpy()  # no context: inference with the moving statistics
  want_eval = ((x - layer.moving_mean.numpy()) / np.sqrt(layer.moving_variance.numpy() + 1e-3)
               * layer.gamma.numpy() + layer.beta.numpy())
  assert_close(y_eval, want_eval)


def test_batch_norm_stats_of_parts_combine_to_whole_batch():
  layer = build(layers.BatchNorm.Params().set(dim=2, decay=0.0))
  x = (RNG.randn(10, 2) * [1.0, 5.0] + [3.0, -2.0]).astype(np.float32)
  with base_layer.step_context(training=True, layer_stats=[]) as ctx:
    for part in (x[:3], x[3:7], x[7:]):  # unequal parts, as uneven micro-batches
      layer(part)
  base_layer.apply_layer_stats(ctx.layer_stats)
  assert_close(layer.moving_mean.numpy(), x.mean(0))
  assert_close(layer.moving_variance.numpy(), x.var(0))


def test_layer_norm_matches_numpy():
  layer = build(layers.LayerNorm.Params().set(dim=6))
  layer.scale.assign(RNG.rand(6).astype(np.float32))
  x = RNG.randn(3, 4, 6).astype(np.float32)
  want = ((x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-6)
          * layer.scale.numpy())
  assert_close(layer(x).numpy(), want)


def test_dropout_is_reproducible_and_keyed_by_step_and_position():
  layer = build(layers.Dropout.Params().set(keep_prob=0.7))
  x = tf.ones([64, 128])
  assert layer(x) is x  # not training: identity

  def mask(step, offset=0, rows=64):
    with base_layer.step_context(training=True, step=tf.constant(step, tf.int64),
                                 example_offset=offset):
      return layer(x[:rows]).numpy()

  first = mask(5)
  np.testing.assert_array_equal(first, mask(5))  # a recompute draws the same mask
  assert not np.array_equal(first, mask(6))
  # A part of the batch at offset o draws rows o.. of the whole batch's mask, so
  # micro-batches draw different masks and any split reproduces the unsplit batch.
  for offset, rows in [(8, 16), (3, 5), (63, 1)]:
    np.testing.assert_array_equal(mask(5, offset, rows), first[offset:offset + rows])
  assert not np.array_equal(first[:16], first[16:32])
  assert set(np.unique(first)) <= {0.0, np.float32(1 / 0.7)}
  assert abs((first > 0).mean() - 0.7) < 0.02
  other = build(layers.Dropout.Params().set(name="other", keep_prob=0.7))
  with base_layer.step_context(training=True, step=5):
    assert not np.array_equal(first, other(x).numpy())  # layers draw their own masks


@pytest.mark.parametrize("dtype", [tf.float32, tf.float16, tf.bfloat16, tf.float64])
def test_position_keyed_uniform_matches_one_long_draw(dtype):
  """Rows at offsets that start mid-block (3·5 elements a row) equal those rows of the
  whole draw, for every float dtype (float64 takes two Philox words an element)."""
  seed = tf.constant([3, 4], tf.int64)
  whole = layers.position_keyed_uniform([10, 3, 5], seed, 0, dtype).numpy()
  for offset, rows in [(0, 10), (1, 2), (7, 3), (9, 1)]:
    part = layers.position_keyed_uniform([rows, 3, 5], seed, offset, dtype).numpy()
    np.testing.assert_array_equal(part, whole[offset:offset + rows])
  whole = whole.astype(np.float32)
  assert 0.4 < whole.mean() < 0.6 and whole.min() >= 0 and whole.max() < 1


@pytest.mark.parametrize("dtype", [tf.float32, tf.float64])
@pytest.mark.parametrize("full_shape, token_axis", [([3, 2, 7, 5], 2), ([2, 9, 3], 1)])
def test_token_window_uniform_is_the_window_of_the_whole_draw(dtype, full_shape, token_axis):
  """A token window (runs starting mid-block, rows from offset 1 of the stream) equals
  that window of position_keyed_uniform's draw of the whole sequences."""
  seed = tf.constant([5, 6], tf.int64)
  whole = np.moveaxis(layers.position_keyed_uniform(full_shape, seed, 1, dtype).numpy(),
                      token_axis, 0)
  length = full_shape[token_axis]
  for offset, n in [(0, length), (1, 3), (length - 2, 2), (length - 1, 1)]:
    window = layers.token_window_uniform(full_shape, seed, 1, token_axis, tf.constant(offset),
                                         n, dtype).numpy()
    np.testing.assert_array_equal(np.moveaxis(window, token_axis, 0),
                                  whole[offset:offset + n])


def test_token_window_uniform_refuses_more_runs_than_its_limit():
  with pytest.raises(ValueError, match=f"over 65 > {layers.MAX_WINDOW_DRAWS} runs"):
    layers.token_window_uniform([65, 4, 2], tf.constant([1, 2], tf.int64), 0, 1,
                                tf.constant(0), 2)


def test_embedding_and_softmax_xent_with_label_smoothing():
  emb = build(layers.Embedding.Params().set(vocab_size=7, embedding_dim=4,
                                            scale_sqrt_depth=True))
  ids = np.array([[1, 6], [0, 0]])
  np.testing.assert_allclose(emb(ids).numpy(), emb.emb.numpy()[ids] * 2.0, rtol=1e-6)

  softmax = build(layers.Softmax.Params().set(input_dim=4, num_classes=5, label_smoothing=0.1))
  x = RNG.randn(3, 4).astype(np.float32)
  labels = np.array([0, 4, 2])
  logits = softmax(x).numpy()
  assert_close(logits, x @ softmax.w.numpy())
  log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  targets = np.full([3, 5], 0.1 / 5)
  targets[np.arange(3), labels] += 0.9
  assert_close(softmax.xent_loss(logits, labels).numpy(), -(targets * log_probs).sum(-1))


def test_softmax_logit_clipping():
  softmax = build(layers.Softmax.Params().set(input_dim=2, num_classes=2, logits_abs_max=1.5))
  softmax.w.assign([[100.0, -100.0], [0.0, 0.0]])
  np.testing.assert_allclose(softmax(np.array([[1.0, 0.0]], np.float32)).numpy(), [[1.5, -1.5]])



def test_clip_to_has_clip_by_values_gradient():
  """The same values and the same gradient as tf.clip_by_value, at the limits, inside,
  outside and at NaN, inside a tf.function as a cell traces it."""
  import tensorflow as tf

  x = tf.constant([-3.0, -1.5, -0.2, 0.0, 1.5, 2.0, np.nan, np.inf])
  dy = tf.constant([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0])

  @tf.function
  def both(x):
    with tf.GradientTape(persistent=True) as tape:
      tape.watch(x)
      ours, theirs = layers.clip_to(x, 1.5), tf.clip_by_value(x, -1.5, 1.5)
    return ours, theirs, tape.gradient(ours, x, dy), tape.gradient(theirs, x, dy)

  ours, theirs, our_grad, their_grad = both(x)
  np.testing.assert_array_equal(ours.numpy(), theirs.numpy())
  np.testing.assert_array_equal(our_grad.numpy(), their_grad.numpy())


def test_sequential_chains_layers():
  p = layers.Sequential.Params().set(layers=[
      layers.Linear.Params().set(name="a", input_dim=3, output_dim=4, activation="TANH"),
      layers.Linear.Params().set(name="b", input_dim=4, output_dim=2)])
  seq = build(p)
  x = RNG.randn(5, 3).astype(np.float32)
  a, b = seq.layers
  want = np.tanh(x @ a.w.numpy() + a.b.numpy()) @ b.w.numpy() + b.b.numpy()
  assert_close(seq(x).numpy(), want)
  assert [c.path for c in seq.children()] == ["sequential/a", "sequential/b"]


def test_initializers_are_seeded_and_follow_their_method():
  p = layers.Linear.Params().set(input_dim=200, output_dim=300, random_seed=7)
  a, b = build(p), build(p)
  np.testing.assert_array_equal(a.w.numpy(), b.w.numpy())  # reproducible builds
  c = build(p.copy().set(random_seed=8))
  assert not np.array_equal(a.w.numpy(), c.w.numpy())
  limit = math.sqrt(6 / 500)
  assert np.abs(a.w.numpy()).max() <= limit and np.abs(a.w.numpy()).max() > 0.95 * limit
  g = build(p.copy().set(params_init=weight_init("gaussian", 0.02)))
  assert abs(g.w.numpy().std() - 0.02) < 0.001
  s = build(p.copy().set(params_init=weight_init("gaussian_sqrt_fanin", 1.0)))
  assert abs(s.w.numpy().std() - 1 / math.sqrt(200)) < 0.003
  u = build(p.copy().set(params_init=weight_init("uniform", 0.5)))
  assert np.abs(u.w.numpy()).max() <= 0.5
  k = build(p.copy().set(params_init=weight_init("constant", 0.25)))
  np.testing.assert_array_equal(k.w.numpy(), 0.25)
  with pytest.raises(ValueError, match="unknown init method 'bogus'"):
    build(p.copy().set(params_init=weight_init("bogus")))


@pytest.mark.parametrize("make, message", [
    (lambda: layers.Linear.Params().set(input_dim=0, output_dim=2), "input_dim must be positive"),
    (lambda: layers.Conv2D.Params().set(filter_shape=(3, 3, 1)), "filter_shape"),
    (lambda: layers.Pooling.Params().set(pooling_type="MIN"), "MAX or AVG"),
    (lambda: layers.Dropout.Params().set(keep_prob=0.0), "keep_prob"),
    (lambda: layers.Activation.Params().set(activation="ELU5"), "unknown activation"),
    (lambda: layers.Softmax.Params().set(input_dim=2, num_classes=2, label_smoothing=1.0),
     "label_smoothing"),
])
def test_bad_layer_params_raise_clear_errors(make, message):
  with pytest.raises(ValueError, match=message):
    make().instantiate()
