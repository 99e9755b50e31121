"""Basic layers: projection, convolutions, pooling, normalization, dropout, embedding,
softmax with cross-entropy, and a sequential container.

Shape notation in docstrings: B batch, H/W spatial, C channels, D features, T time.
Images are NHWC.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from lingvo_gpipe.core import base_layer, stacked_variables, token_slices
from lingvo_gpipe.core.base_layer import BaseLayer, weight_init
from lingvo_gpipe.core.hyperparams import ParamsError
from lingvo_gpipe.core.keras_layer import Keras  # noqa: F401 (g.layers.Keras)

ACTIVATIONS: dict[str, Callable[[tf.Tensor], tf.Tensor]] = {
    "NONE": tf.identity,
    "RELU": tf.nn.relu,
    "RELU6": tf.nn.relu6,
    "GELU": tf.nn.gelu,
    "TANH": tf.tanh,
    "SIGMOID": tf.sigmoid,
    "SWISH": tf.nn.silu,
}


def activation_fn(name: str) -> Callable[[tf.Tensor], tf.Tensor]:
  if name not in ACTIVATIONS:
    raise ParamsError(f"unknown activation {name!r}; valid: {sorted(ACTIVATIONS)}")
  return ACTIVATIONS[name]


def shape_list(x: tf.Tensor) -> list[int | tf.Tensor]:
  """x's shape: Python ints where static, scalar tensors where not.

  A fully static shape then adds no op to the graph: tracing a pipelined step builds
  every layer M times (forward, recompute, backward), and the tf.shape/slice ops
  of dynamic shapes were a third of a Transformer layer's graph.
  """
  static = x.shape.as_list()
  if None not in static:
    return static
  dynamic = tf.shape(x)
  return [dynamic[i] if d is None else d for i, d in enumerate(static)]


def _matmul(inputs: tf.Tensor, weight: tf.Tensor, rows: tf.TensorShape | None = None
            ) -> tf.Tensor:
  """[n, I] · [I, O] in the inputs' dtype (the weight read cast to it: mixed precision
  keeps float32 master weights). Where the StepContext collects weight products (and
  the weight is a variable), the product is recorded and no gradient reaches the
  variable through it: the caller computes that part of the variable's gradient
  (StepContext), from the recorded inputs, which are in the compute dtype. `rows`:
  the static shape the n rows were flattened from (WeightProduct.rows)."""
  products = base_layer.current_context().weight_products
  if (products is None or not isinstance(weight, (tf.Variable, stacked_variables.RowVariable))
      or not weight.trainable):
    return _matmul_cast(inputs, weight)
  out = _matmul_cast(inputs, tf.stop_gradient(weight.read_value()))
  return products.record(weight, inputs, out, rows)


def _matmul_cast(inputs: tf.Tensor, weight: Any) -> tf.Tensor:
  """inputs [n, I] · weight [I, O] cast to the inputs' dtype. Where that is a cast
  (mixed precision), the gradient is written out so that the backward casts the
  weight again instead of keeping the cast copy: TensorFlow's gradient of the
  matmul kept every layer's half-dtype weight copy per micro-batch in flight (with
  recompute='never', 32 MiB a micro-batch for bench/remat_memory.py's 32 blocks)."""
  weight = tf.convert_to_tensor(weight)
  if weight.dtype == inputs.dtype:
    return tf.matmul(inputs, weight)

  @tf.custom_gradient
  def matmul(x, w):
    def grad(dy):
      dx = tf.matmul(dy, tf.cast(w, x.dtype), transpose_b=True)
      return dx, tf.cast(tf.matmul(x, dy, transpose_a=True), w.dtype)

    return tf.matmul(x, tf.cast(w, x.dtype)), grad

  return matmul(inputs, weight)


def project(inputs: tf.Tensor, weight: tf.Tensor) -> tf.Tensor:
  """[..., I] · [I, O] → [..., O] as one 2-D matmul, in the inputs' dtype.

  Not tf.einsum('...i,io->...o'): TF 2.21's einsum gradient for the weight
  materializes the broadcast product [..., I, O] before reducing it (1 GiB per
  256×1024 layer at 1024 tokens; docs/benchmarks_history.md, "Re-materialization memory
  (2026-11-22, rerun 2026-11-23)").
  The re-materialization memory test (`tests/pipeline_memory_test.py`) would catch it.
  """
  if inputs.shape.rank == 2:
    return _matmul(inputs, weight)
  dims = shape_list(inputs)
  out = _matmul(tf.reshape(inputs, [-1, dims[-1]]), weight, rows=inputs.shape[:-1])
  out = tf.reshape(out, dims[:-1] + [weight.shape[-1]])
  if inputs.shape.is_fully_defined():
    return out
  # Keep the static shape that reshape with a tensor shape loses.
  return tf.ensure_shape(out, inputs.shape[:-1].concatenate(weight.shape[-1:]))


def project_transposed(inputs: tf.Tensor, weight: Any) -> tf.Tensor:
  """[..., I] · [O, I]ᵀ → [..., O] as one 2-D matmul in the inputs' dtype (a tied
  softmax's embedding table read as its projection). Its weight gradient is computed
  with the input gradient (no weight product is recorded for a split backward's W)."""
  weight = tf.convert_to_tensor(weight)
  if weight.dtype != inputs.dtype:
    weight = tf.cast(weight, inputs.dtype)
  dims = shape_list(inputs)
  out = tf.matmul(tf.reshape(inputs, [-1, dims[-1]]), weight, transpose_b=True)
  out = tf.reshape(out, dims[:-1] + [weight.shape[0]])
  if inputs.shape.is_fully_defined():
    return out
  return tf.ensure_shape(out, inputs.shape[:-1].concatenate(weight.shape[:1]))


def _check_positive(layer: BaseLayer, **values: Any) -> None:
  for key, value in values.items():
    if value is None or value <= 0:
      raise ParamsError(f"{layer.path}: {key} must be positive, got {value!r}")


class Linear(BaseLayer):
  """y = activation(x · W + b). Input [..., input_dim] → output [..., output_dim]."""

  token_slicing = token_slices.TOKENWISE

  @classmethod
  def Params(cls):  # noqa: N802
    p = super().Params()
    p.define("input_dim", 0, "Size of the last input dimension.")
    p.define("output_dim", 0, "Size of the last output dimension.")
    p.define("activation", "NONE", f"One of {sorted(ACTIVATIONS)}.")
    p.define("has_bias", True, "Whether to add a bias.")
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    _check_positive(self, input_dim=p.input_dim, output_dim=p.output_dim)
    self._act = activation_fn(p.activation)
    self.create_variable("w", [p.input_dim, p.output_dim])
    if p.has_bias:
      self.create_variable("b", [p.output_dim], init=weight_init("constant", 0.0))

  def fprop(self, inputs: tf.Tensor) -> tf.Tensor:
    out = project(inputs, self.w)
    if self.params.has_bias:
      out = out + self.to_fprop_dtype(self.b)
    return self._act(out)


class Conv2D(BaseLayer):
  """2-D convolution. [B, H, W, C_in] → [B, H', W', C_out]."""

  @classmethod
  def Params(cls):  # noqa: N802
    p = super().Params()
    p.define("filter_shape", (3, 3, 0, 0), "(height, width, in_channels, out_channels).")
    p.define("filter_stride", (1, 1), "(height, width) strides.")
    p.define("padding", "SAME", "SAME or VALID.")
    p.define("activation", "NONE", f"One of {sorted(ACTIVATIONS)}.")
    p.define("has_bias", False, "Whether to add a bias (off when batch norm follows).")
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    if len(p.filter_shape) != 4 or min(p.filter_shape) <= 0:
      raise ParamsError(f"{self.path}: filter_shape must be 4 positive ints, got {p.filter_shape}")
    if p.padding not in ("SAME", "VALID"):
      raise ParamsError(f"{self.path}: padding must be SAME or VALID, got {p.padding!r}")
    self._act = activation_fn(p.activation)
    self.create_variable("w", p.filter_shape)
    if p.has_bias:
      self.create_variable("b", [p.filter_shape[3]], init=weight_init("constant", 0.0))

  def fprop(self, inputs: tf.Tensor) -> tf.Tensor:
    p = self.params
    out = tf.nn.conv2d(inputs, self.to_fprop_dtype(self.w), strides=[1, *p.filter_stride, 1],
                       padding=p.padding)
    if p.has_bias:
      out = out + self.to_fprop_dtype(self.b)
    return self._act(out)


class DepthwiseSeparableConv2D(BaseLayer):
  """Depthwise k×k conv then pointwise 1×1 conv. [B, H, W, C_in] → [B, H', W', C_out]."""

  @classmethod
  def Params(cls):  # noqa: N802
    p = super().Params()
    p.define("kernel_size", 3, "Height and width of the depthwise window.")
    p.define("input_dim", 0, "Input channels.")
    p.define("output_dim", 0, "Output channels.")
    p.define("depth_multiplier", 1, "Depthwise output channels per input channel.")
    p.define("stride", 1, "Stride of the depthwise conv.")
    p.define("dilation_rate", 1, "Dilation of the depthwise conv (with stride 1).")
    p.define("padding", "SAME", "SAME or VALID.")
    p.define("activation", "NONE", f"One of {sorted(ACTIVATIONS)}.")
    p.define("has_bias", False, "Whether to add a bias after the pointwise conv.")
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    _check_positive(self, kernel_size=p.kernel_size, input_dim=p.input_dim,
                    output_dim=p.output_dim, depth_multiplier=p.depth_multiplier,
                    stride=p.stride)
    self._act = activation_fn(p.activation)
    k = p.kernel_size
    self.create_variable("depthwise_w", [k, k, p.input_dim, p.depth_multiplier])
    self.create_variable("pointwise_w", [1, 1, p.input_dim * p.depth_multiplier, p.output_dim])
    if p.has_bias:
      self.create_variable("b", [p.output_dim], init=weight_init("constant", 0.0))

  def fprop(self, inputs: tf.Tensor) -> tf.Tensor:
    p = self.params
    out = tf.nn.separable_conv2d(inputs, self.to_fprop_dtype(self.depthwise_w),
                                 self.to_fprop_dtype(self.pointwise_w),
                                 strides=[1, p.stride, p.stride, 1], padding=p.padding,
                                 dilations=[p.dilation_rate, p.dilation_rate])
    if p.has_bias:
      out = out + self.to_fprop_dtype(self.b)
    return self._act(out)


class Pooling(BaseLayer):
  """Max or average pooling. [B, H, W, C] → [B, H', W', C]."""

  @classmethod
  def Params(cls):  # noqa: N802
    p = super().Params()
    p.define("window_shape", (2, 2), "(height, width) of the window.")
    p.define("window_stride", (2, 2), "(height, width) strides.")
    p.define("pooling_type", "MAX", "MAX or AVG.")
    p.define("padding", "SAME", "SAME or VALID.")
    return p

  def __init__(self, params):
    super().__init__(params)
    if self.params.pooling_type not in ("MAX", "AVG"):
      raise ParamsError(f"{self.path}: pooling_type must be MAX or AVG, "
                       f"got {self.params.pooling_type!r}")

  def fprop(self, inputs: tf.Tensor) -> tf.Tensor:
    p = self.params
    return tf.nn.pool(inputs, window_shape=p.window_shape, pooling_type=p.pooling_type,
                      strides=p.window_stride, padding=p.padding)


class GlobalPooling(BaseLayer):
  """Mean or max over the spatial axes. [B, H, W, C] → [B, C]."""

  @classmethod
  def Params(cls):  # noqa: N802
    p = super().Params()
    p.define("pooling_type", "AVG", "MAX or AVG.")
    return p

  def __init__(self, params):
    super().__init__(params)
    if self.params.pooling_type not in ("MAX", "AVG"):
      raise ParamsError(f"{self.path}: pooling_type must be MAX or AVG, "
                       f"got {self.params.pooling_type!r}")

  def fprop(self, inputs: tf.Tensor) -> tf.Tensor:
    reduce = tf.reduce_max if self.params.pooling_type == "MAX" else tf.reduce_mean
    return reduce(inputs, axis=[1, 2])


class Activation(BaseLayer):
  """An element-wise nonlinearity; shape unchanged."""

  token_slicing = token_slices.TOKENWISE

  @classmethod
  def Params(cls):  # noqa: N802
    p = super().Params()
    p.define("activation", "RELU", f"One of {sorted(ACTIVATIONS)}.")
    return p

  def __init__(self, params):
    super().__init__(params)
    self._act = activation_fn(self.params.activation)

  def fprop(self, inputs: tf.Tensor) -> tf.Tensor:
    return self._act(inputs)


class BatchNorm(BaseLayer):
  """Batch normalization over all axes but the last. [..., dim] → [..., dim].

  Training normalizes with the statistics of the batch this forward pass sees (one
  micro-batch under pipelining) and reports (count, mean, M2) per channel. The
  moving averages are updated once per step by `update_from_stats`, from the
  statistics of all forward passes of the step combined (Chan et al.'s parallel
  variance), i.e. from the whole mini-batch. Variance is the biased (1/n) one.
  Statistics and normalization are computed in float32 whatever the compute dtype
  (a bfloat16 sum over a batch loses the small terms); the output is in it.

  `frozen`: gamma and beta are not trained and the moving averages normalize in
  training too, never updated (Keras's BatchNormalization with trainable=False, the
  usual way to fine-tune on a pretrained backbone).
  """

  params_outside_kind = ("keras_saved_as",)  # (where a weights file holds its weights)

  @classmethod
  def Params(cls):  # noqa: N802
    p = super().Params()
    p.define("dim", 0, "Number of channels (last dimension).")
    p.define("decay", 0.99, "Moving average decay.")
    p.define("epsilon", 1e-3, "Added to the variance.")
    p.define("frozen", False, "True: gamma and beta not trained, the moving averages used "
             "in training too and never updated (a frozen Keras BatchNormalization).")
    p.define("keras_saved_as", "", "Made from a Keras BatchNormalization (g.from_keras): "
             "where a weights file of that Keras model holds its weights (e.g. "
             "'layers/batch_normalization_1'; task.train.init_from_keras).")
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    _check_positive(self, dim=p.dim)
    if not 0.0 <= p.decay < 1.0:
      raise ParamsError(f"{self.path}: decay must be in [0, 1), got {p.decay}")
    self.create_variable("gamma", [p.dim], init=weight_init("constant", 1.0),
                         trainable=not p.frozen)
    self.create_variable("beta", [p.dim], init=weight_init("constant", 0.0),
                         trainable=not p.frozen)
    self.create_variable("moving_mean", [p.dim], init=weight_init("constant", 0.0),
                         trainable=False)
    self.create_variable("moving_variance", [p.dim], init=weight_init("constant", 1.0),
                         trainable=False)

  def fprop(self, inputs: tf.Tensor) -> tf.Tensor:
    p = self.params
    x = at_least_float32(inputs)
    if base_layer.current_context().training and not p.frozen:
      axes = list(range(x.shape.rank - 1))
      mean, variance = tf.nn.moments(x, axes=axes)
      count = tf.cast(tf.reduce_prod(tf.shape(x)[:-1]), x.dtype)
      self.report_stats({"count": tf.stop_gradient(count), "mean": tf.stop_gradient(mean),
                         "m2": tf.stop_gradient(variance * count)})
    else:
      mean, variance = self.moving_mean, self.moving_variance
    out = tf.nn.batch_normalization(x, tf.cast(mean, x.dtype), tf.cast(variance, x.dtype),
                                    tf.cast(self.beta, x.dtype), tf.cast(self.gamma, x.dtype),
                                    p.epsilon)
    return tf.cast(out, inputs.dtype)

  def update_from_stats(self, stats_list: list[dict]) -> list[Any]:
    counts = tf.stack([s["count"] for s in stats_list])  # [S]
    means = tf.stack([s["mean"] for s in stats_list])  # [S, dim]
    m2s = tf.stack([s["m2"] for s in stats_list])  # [S, dim]
    total = tf.reduce_sum(counts)
    mean = tf.reduce_sum(counts[:, None] * means, axis=0) / total
    m2 = tf.reduce_sum(m2s + counts[:, None] * tf.square(means - mean), axis=0)
    variance = m2 / total
    decay = self.params.decay
    return [
        self.moving_mean.assign(decay * self.moving_mean + (1.0 - decay) * mean),
        self.moving_variance.assign(decay * self.moving_variance + (1.0 - decay) * variance),
    ]


class LayerNorm(BaseLayer):
  """Layer normalization over the last axis. [..., dim] → [..., dim].

  Computed in float32 whatever the compute dtype; the output is in it. In a half
  dtype its gradient is written out (`half_layer_norm`) so that the backward keeps
  only the half-dtype input, not float32 copies of it: what a fused layer-norm
  kernel does, and what lets mixed precision halve a pre-norm block's activations."""

  token_slicing = token_slices.TOKENWISE

  @classmethod
  def Params(cls):  # noqa: N802
    p = super().Params()
    p.define("dim", 0, "Size of the last dimension.")
    p.define("epsilon", 1e-6, "Added to the variance.")
    return p

  def __init__(self, params):
    super().__init__(params)
    _check_positive(self, dim=self.params.dim)
    self.create_variable("scale", [self.params.dim], init=weight_init("constant", 1.0))
    self.create_variable("bias", [self.params.dim], init=weight_init("constant", 0.0))

  def fprop(self, inputs: tf.Tensor) -> tf.Tensor:
    if inputs.dtype in base_layer.HALF_DTYPES:
      return half_layer_norm(inputs, tf.convert_to_tensor(self.scale),
                             tf.convert_to_tensor(self.bias), self.params.epsilon)
    mean, variance = tf.nn.moments(inputs, axes=[-1], keepdims=True)
    normed = (inputs - mean) * tf.math.rsqrt(variance + self.params.epsilon)
    return normed * tf.cast(self.scale, inputs.dtype) + tf.cast(self.bias, inputs.dtype)


def _normalized(x: tf.Tensor, epsilon: float) -> tuple[tf.Tensor, tf.Tensor]:
  """x [..., D] in float32 → ((x − mean) · rstd [..., D], rstd [..., 1]), statistics
  over the last axis in float32."""
  x = tf.cast(x, tf.float32)
  mean, variance = tf.nn.moments(x, axes=[-1], keepdims=True)
  rstd = tf.math.rsqrt(variance + epsilon)
  return (x - mean) * rstd, rstd


def half_layer_norm(x: tf.Tensor, scale: tf.Tensor, bias: tf.Tensor,
                    epsilon: float) -> tf.Tensor:
  """Layer norm of x [..., D] in a half dtype with float32 statistics and arithmetic;
  scale, bias [D] float32 (or half, as a half-precision export stores them: read in
  float32 all the same) → [..., D] in x's dtype.

  The backward recomputes the normalized input from x instead of keeping float32
  copies (TensorFlow's own gradient of the float32 arithmetic would keep x, x − mean
  and the normalized x in float32: 3 float32 tensors of x's size per layer norm):
    n = (x − mean)·rstd,  dn = dy·scale
    dx = rstd · (dn − mean(dn) − n · mean(dn · n)),  dscale = Σ dy·n,  dbias = Σ dy
  (sums over every axis but the last). Equal to TensorFlow's gradient of the same
  float32 arithmetic (`tests/mixed_precision_test.py`)."""

  @tf.custom_gradient
  def norm(x, scale, bias):
    normed, _ = _normalized(x, epsilon)
    scale32, bias32 = tf.cast(scale, tf.float32), tf.cast(bias, tf.float32)

    def grad(dy):
      normed, rstd = _normalized(x, epsilon)
      dy = tf.cast(dy, tf.float32)
      batch_axes = list(range(dy.shape.rank - 1))
      dnormed = dy * scale32
      dx = rstd * (dnormed - tf.reduce_mean(dnormed, axis=-1, keepdims=True)
                   - normed * tf.reduce_mean(dnormed * normed, axis=-1, keepdims=True))
      return (tf.cast(dx, x.dtype), tf.cast(tf.reduce_sum(dy * normed, axis=batch_axes),
                                            scale.dtype),
              tf.cast(tf.reduce_sum(dy, axis=batch_axes), bias.dtype))

    return tf.cast(normed * scale32 + bias32, x.dtype), grad

  return norm(x, scale, bias)


def clip_to(x: tf.Tensor, limit: float) -> tf.Tensor:
  """`tf.clip_by_value(x, -limit, limit)` with the same gradient (dy where x lies in
  [-limit, limit], else 0, NaN included), computed without the zeros tensor of x's
  shape that TensorFlow's own gradient makes: Grappler folds that (up to 10 MB) into
  a constant the backward's function holds between steps (core/tf_internals.py,
  item 17)."""
  @tf.custom_gradient
  def clip(x):
    def grad(dy):
      inside = tf.logical_and(x >= -limit, x <= limit)
      return tf.where(inside, dy, tf.constant(0, dy.dtype))
    return tf.clip_by_value(x, -limit, limit), grad
  return clip(x)


def at_least_float32(x: tf.Tensor) -> tf.Tensor:
  """x in float32 if it is in a half dtype (bfloat16, float16), else as it is: the
  dtype of the parts of a mixed-precision model that stay float32 (statistics, softmax)."""
  return tf.cast(x, tf.float32) if x.dtype in base_layer.HALF_DTYPES else x


# The Philox counter layout relied on: tf_internals.py item 9 (and the test it names).
_PHILOX = 1  # tf.random.Algorithm.PHILOX
_PHILOX_WORDS_PER_COUNTER = 4  # one counter step yields four 32-bit words
# 32-bit words one element of a draw takes (tf_internals item 9): two for float64
_PHILOX_WORDS_PER_ELEMENT = {tf.float64: 2}


def _philox_uniform(key: tf.Tensor, start: Any, num: Any, dtype: tf.DType) -> tf.Tensor:
  """Uniform [0, 1) [num]: elements start .. start+num−1 of the Philox stream of `key`
  (what StatelessRandomUniformV2 draws from counter 0), without drawing those before
  `start`: Philox's counter starts at the block holding it (each counter step yields
  four 32-bit words: four float32, float16 or bfloat16 elements, two float64 ones)."""
  start = tf.cast(start, tf.int64)
  per_block = _PHILOX_WORDS_PER_COUNTER // _PHILOX_WORDS_PER_ELEMENT.get(tf.as_dtype(dtype), 1)
  skip = start % per_block
  counter = tf.stack([tf.cast(start // per_block, tf.uint64), tf.constant(0, tf.uint64)])
  flat = tf.raw_ops.StatelessRandomUniformV2(
      shape=tf.reshape(tf.cast(num, tf.int64) + skip, [1]), key=key, counter=counter,
      alg=_PHILOX, dtype=dtype)
  return flat[skip:]


def _philox_key(seed: tf.Tensor) -> tf.Tensor:
  key, _ = tf.raw_ops.StatelessRandomGetKeyCounter(seed=seed)
  return key


def position_keyed_uniform(shape: tf.Tensor, seed: tf.Tensor, row_offset: tf.Tensor,
                           dtype: tf.DType = tf.float32) -> tf.Tensor:
  """Uniform [0, 1) of `shape` [R, ...]: rows row_offset .. row_offset+R-1 of one stream.

  The stream for `seed` is what StatelessRandomUniformV2 (Philox) would draw for a
  tensor of unbounded rows; this returns the slice at `row_offset` without drawing
  the rows before it (`_philox_uniform`). So a batch split into parts at any offsets
  draws exactly the values of the unsplit batch.
  """
  shape = tf.cast(shape, tf.int64)
  start = tf.cast(row_offset, tf.int64) * tf.reduce_prod(shape[1:])
  return tf.reshape(_philox_uniform(_philox_key(seed), start, tf.reduce_prod(shape), dtype),
                    shape)


# Separate draws a token window may take (one per index before its token axis);
# past this, the whole sequence's mask is drawn and cut (tracing many small draws
# costs more than it saves).
MAX_WINDOW_DRAWS = 64


def token_window_uniform(full_shape: Sequence[int], seed: tf.Tensor, row_offset: Any,
                         token_axis: int, token_offset: Any, length: int,
                         dtype: tf.DType = tf.float32) -> tf.Tensor:
  """position_keyed_uniform(full_shape, seed, row_offset) cut to positions
  token_offset .. token_offset+length−1 along `token_axis` (a token slice's window of
  the whole sequence's draw), drawing only the window: one contiguous run of the
  stream per index of the dimensions before the token axis (at most
  MAX_WINDOW_DRAWS of them). full_shape: static [R, ..., T, ...].
  Returns [R, ..., length, ...]."""
  token_axis = token_axis % len(full_shape)
  outer = math.prod(full_shape[:token_axis])
  if outer > MAX_WINDOW_DRAWS:
    raise ValueError(f"a token window over {outer} > {MAX_WINDOW_DRAWS} runs of the stream")
  full_length, inner = full_shape[token_axis], math.prod(full_shape[token_axis + 1:])
  key = _philox_key(seed)
  first = (tf.cast(row_offset, tf.int64) * math.prod(full_shape[1:]) +
           tf.cast(token_offset, tf.int64) * inner)
  runs = [_philox_uniform(key, first + o * full_length * inner, length * inner, dtype)
          for o in range(outer)]
  window = list(full_shape[:token_axis]) + [length] + list(full_shape[token_axis + 1:])
  return tf.reshape(tf.concat(runs, 0) if len(runs) > 1 else runs[0], window)


def keep_mask(shape: tf.Tensor, seed: tf.Tensor, row_offset: Any, keep_prob: Any,
              dtype: tf.DType) -> tf.Tensor:
  """1 where an element is kept, 0 where dropped, in `dtype`, of `shape` [R, ...]:
  rows row_offset .. row_offset+R-1 of the stream of `seed` (position_keyed_uniform).

  The uniform draw is float32 for the half dtypes (float64 for float64), so a
  bfloat16 model drops exactly the elements its float32 twin drops (a bfloat16
  uniform has 8 bits: keep_prob would be rounded)."""
  return _kept(position_keyed_uniform(shape, seed, row_offset, dtype=_draw_dtype(dtype)),
               keep_prob, dtype)


def _kept(uniform: tf.Tensor, keep_prob: Any, dtype: tf.DType) -> tf.Tensor:
  """1 in `dtype` where `uniform` < keep_prob, else 0."""
  return tf.cast(uniform < tf.cast(keep_prob, uniform.dtype), dtype)


def _draw_dtype(dtype: tf.DType) -> tf.DType:
  return tf.float64 if dtype == tf.float64 else tf.float32


def dropout_seed(layer: BaseLayer, purpose: str = "dropout") -> tf.Tensor:
  """Stateless seed [2] from (layer, purpose, global step) of the current StepContext.

  A recomputed forward pass of the same step gets the same seed; another step,
  layer or purpose (e.g. each drop-path of a cell) gets another one.
  """
  step = tf.cast(base_layer.current_context().step, tf.int64)
  return tf.stack([base_layer.seed_tensor(layer, purpose), step])


class Dropout(BaseLayer):
  """Inverted dropout with stateless, position-keyed masks; identity outside training.

  The mask of an example depends on (layer, step, the example's position in the
  mini-batch) only. Hence a re-materialized forward pass draws the mask of the first
  one, micro-batches draw different masks, and pipelining with any number of
  micro-batches draws the masks of unpartitioned training. Inputs are batch-major.
  """

  token_slicing = token_slices.TOKENWISE

  @classmethod
  def Params(cls):  # noqa: N802
    p = super().Params()
    p.define("keep_prob", 1.0, "Probability of keeping an element, in (0, 1].")
    p.define("noise_shape_broadcast_dims", None,
             "Axes along which the mask is shared (e.g. [1] for all time steps).")
    p.define("token_axis", 1, "The sequence axis of the inputs: on a token slice "
             "(core/token_slices.py) the mask is the whole sequence's, cut along it.")
    p.define("key_axis", None, "An axis of the inputs over the positions a causal "
             "query sees (an attention's keys), or None: on a token slice the inputs "
             "hold the sequence's first positions along it, up to the slice's end.")
    return p

  def __init__(self, params):
    super().__init__(params)
    if not 0.0 < self.params.keep_prob <= 1.0:
      raise ParamsError(f"{self.path}: keep_prob must be in (0, 1], got {self.params.keep_prob}")

  def fprop(self, inputs: tf.Tensor) -> tf.Tensor:
    p = self.params
    ctx = base_layer.current_context()
    if not ctx.training or p.keep_prob == 1.0:
      return inputs
    rank = inputs.shape.rank
    broadcast = sorted({axis % rank for axis in p.noise_shape_broadcast_dims or []})
    row_offset = 0 if 0 in broadcast else ctx.example_offset
    token_slice = ctx.token_slice
    if token_slice is None or p.token_axis % rank in broadcast:
      shape = tf.unstack(tf.shape(inputs))
      for axis in broadcast:
        shape[axis] = 1
      keep = keep_mask(tf.stack(shape), dropout_seed(self), row_offset, p.keep_prob,
                       inputs.dtype)
    else:
      keep = self._slice_keep_mask(inputs, row_offset, broadcast, token_slice)
    return inputs * keep / p.keep_prob

  def _slice_keep_mask(self, inputs: tf.Tensor, row_offset: Any, broadcast: Sequence[int],
                       token_slice: Any) -> tf.Tensor:
    """The keep mask of `inputs` [R, ..., n, ...] on a token slice of n tokens (along
    token_axis; along key_axis, if any, the sequence's first offset + n positions):
    the whole sequences' mask (each element keeps the draw of its token's position)
    cut to the slice. Where the dimensions before the token axis are static and at
    most MAX_WINDOW_DRAWS in product, only the slice's rows of the stream are drawn
    (token_window_uniform; along the key axis all T keys, then cut), else the whole
    mask. broadcast: the mask's broadcast axes, non-negative."""
    p = self.params
    rank = inputs.shape.rank
    token_axis = p.token_axis % rank
    key_axis = (p.key_axis % rank if p.key_axis is not None and p.key_axis % rank not in
                broadcast else None)
    length = inputs.shape[token_axis]
    full = [token_slice.full_length if axis in (token_axis, key_axis) else
            1 if axis in broadcast else d for axis, d in enumerate(inputs.shape.as_list())]
    seed = dropout_seed(self)
    if None not in full and math.prod(full[:token_axis]) <= MAX_WINDOW_DRAWS:
      keep = _kept(token_window_uniform(full, seed, row_offset, token_axis, token_slice.offset,
                                        length, _draw_dtype(inputs.dtype)),
                   p.keep_prob, inputs.dtype)
    else:
      shape = tf.stack([tf.shape(inputs)[axis] if d is None else d
                        for axis, d in enumerate(full)])
      keep = token_slice.window(keep_mask(shape, seed, row_offset, p.keep_prob, inputs.dtype),
                                token_axis, length)
    return token_slice.prefix(keep, key_axis, length) if key_axis is not None else keep


class Embedding(BaseLayer):
  """Looks up ids. int ids [...] → [..., embedding_dim]."""

  token_slicing = token_slices.TOKENWISE

  @classmethod
  def Params(cls):  # noqa: N802
    p = super().Params()
    p.define("vocab_size", 0, "Number of ids.")
    p.define("embedding_dim", 0, "Size of each embedding vector.")
    p.define("scale_sqrt_depth", False, "Multiply outputs by sqrt(embedding_dim).")
    p.params_init = weight_init("gaussian", 1.0)
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    _check_positive(self, vocab_size=p.vocab_size, embedding_dim=p.embedding_dim)
    self.create_variable("emb", [p.vocab_size, p.embedding_dim])

  def fprop(self, ids: tf.Tensor) -> tf.Tensor:
    out = self.to_fprop_dtype(tf.gather(self.emb, ids))  # rows gathered, then cast
    if self.params.scale_sqrt_depth:
      out = out * (self.params.embedding_dim ** 0.5)
    return out


def softmax_cross_entropy(logits: tf.Tensor, class_ids: tf.Tensor,
                          label_smoothing: float = 0.0) -> tf.Tensor:
  """Per-example cross-entropy. logits [..., C], int class_ids [...] → [...].

  With label smoothing ε the target puts 1-ε on the label and ε/C on every class.
  """
  logits = at_least_float32(logits)  # the loss is float32 whatever the compute dtype
  num_classes = logits.shape[-1]
  targets = tf.one_hot(class_ids, num_classes, dtype=logits.dtype)
  if label_smoothing:
    targets = targets * (1.0 - label_smoothing) + label_smoothing / num_classes
  return tf.nn.softmax_cross_entropy_with_logits(labels=targets, logits=logits)


class Softmax(BaseLayer):
  """Projection to class logits plus cross-entropy. [..., input_dim] → [..., num_classes].

  The projection runs in the compute dtype; the logits (bias, clipping) and the
  cross-entropy are float32 whatever it is: the loss and its softmax stay float32."""

  token_slicing = token_slices.TOKENWISE

  @classmethod
  def Params(cls):  # noqa: N802
    p = super().Params()
    p.define("input_dim", 0, "Size of the last input dimension.")
    p.define("num_classes", 0, "Number of classes.")
    p.define("label_smoothing", 0.0, "Label smoothing ε in [0, 1).")
    p.define("logits_abs_max", None, "If set, logits are clipped to ±this value.")
    p.define("tie_to", None, "Tied weights: the path, below an enclosing layer (e.g. "
             "'embedding/emb/emb' in a stack), of an embedding table [num_classes, "
             "input_dim] built before this layer, used as the projection transposed "
             "(logits = x·Eᵀ + b) instead of a weight of its own: one variable for both "
             "(Press & Wolf 2017).")
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    _check_positive(self, input_dim=p.input_dim, num_classes=p.num_classes)
    if not 0.0 <= p.label_smoothing < 1.0:
      raise ParamsError(f"{self.path}: label_smoothing must be in [0, 1), "
                       f"got {p.label_smoothing}")
    if p.tie_to:
      self.tie_variable("emb", p.tie_to, [p.num_classes, p.input_dim])
    else:
      self.create_variable("w", [p.input_dim, p.num_classes])
    self.create_variable("b", [p.num_classes], init=weight_init("constant", 0.0))

  def fprop(self, inputs: tf.Tensor) -> tf.Tensor:
    if self.params.tie_to:
      logits = at_least_float32(project_transposed(inputs, self.emb))
    else:
      logits = at_least_float32(project(inputs, self.w))
    logits = logits + tf.cast(self.b, logits.dtype)
    if self.params.logits_abs_max is not None:
      logits = clip_to(logits, self.params.logits_abs_max)
    return logits

  def xent_loss(self, logits: tf.Tensor, class_ids: tf.Tensor) -> tf.Tensor:
    """Per-example cross-entropy [...] with this layer's label smoothing."""
    return softmax_cross_entropy(logits, class_ids, self.params.label_smoothing)


class Sequential(BaseLayer):
  """Runs `layers` in order; a tuple output is passed on as positional arguments."""

  @classmethod
  def Params(cls):  # noqa: N802
    p = super().Params()
    p.define("layers", [], "Params of the layers, in order.")
    return p

  def __init__(self, params):
    super().__init__(params)
    if not self.params.layers:
      raise ParamsError(f"{self.path}: Sequential needs at least one layer")
    self.create_children("layers", self.params.layers)

  def fprop(self, *inputs: Any) -> Any:
    outputs: Any = inputs
    for layer in self.layers:
      outputs = base_layer.call_with(layer, outputs)
    return outputs


class FeedForwardBlock(BaseLayer):
  """The Transformer's feed-forward sublayer with a residual connection (pre-norm).

  x [..., input_dim] → x + dropout(W2 · act(W1 · layer_norm(x)))  [..., input_dim]
  """

  token_slicing = token_slices.TOKENWISE

  @classmethod
  def Params(cls):  # noqa: N802
    p = super().Params()
    p.define("input_dim", 0, "Model dimension.")
    p.define("hidden_dim", 0, "Hidden (filter) dimension.")
    p.define("activation", "RELU", f"One of {sorted(ACTIVATIONS)}.")
    p.define("residual_keep_prob", 1.0, "Keep probability of dropout on the sublayer output.")
    p.define("relu_keep_prob", 1.0, "Keep probability of dropout on the hidden activations.")
    p.define("projection_init", None, "Initializer of both projections (None: Linear's).")
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    _check_positive(self, input_dim=p.input_dim, hidden_dim=p.hidden_dim)
    self.create_child("norm", LayerNorm.Params().set(dim=p.input_dim))
    inner = Linear.Params().set(input_dim=p.input_dim, output_dim=p.hidden_dim,
                                activation=p.activation)
    outer = Linear.Params().set(input_dim=p.hidden_dim, output_dim=p.input_dim)
    if p.projection_init is not None:
      inner.params_init = outer.params_init = p.projection_init
    self.create_child("inner", inner)
    self.create_child("relu_dropout", Dropout.Params().set(keep_prob=p.relu_keep_prob))
    self.create_child("outer", outer)
    self.create_child("dropout", Dropout.Params().set(keep_prob=p.residual_keep_prob))

  def fprop(self, inputs: tf.Tensor) -> tf.Tensor:
    hidden = self.relu_dropout(self.inner(self.norm(inputs)))
    return inputs + self.dropout(self.outer(hidden))
