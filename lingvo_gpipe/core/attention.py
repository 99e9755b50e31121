"""Multi-head dot-product attention with padding and causal masks.

Shapes: B batch, T query time, S key/value time, D model dim, N heads, H per-head dim.
The per-head dimension H is a parameter of its own (not D / N), as in the GPipe
multilingual models, where 32 heads of 64 make a 2048-wide attention in a
1024-wide model.
"""

from __future__ import annotations

import math
from typing import Any

import tensorflow as tf

from lingvo_gpipe.core import base_layer, layers
from lingvo_gpipe.core.base_layer import BaseLayer, Params, weight_init
from lingvo_gpipe.core.hyperparams import ParamsError

# Added to the logits of masked positions; large but finite, so a fully masked row
# (a padded query) gives a uniform distribution instead of NaN.
_MASK_LOGIT = -1e9


def attention_bias(key_paddings: tf.Tensor | None, query_length: int | tf.Tensor,
                   causal: bool, query_offset: Any = 0) -> tf.Tensor | None:
  """Additive logits bias [B or 1, 1, T, S] from key paddings [B, S] and causality.

  key_paddings is 1.0 at padded positions. With `causal`, query t sees keys <= t,
  the queries being positions query_offset .. query_offset+T−1 of the keys' sequence
  (a token slice's; 0: the whole sequence). The bias is float32 whatever the
  paddings' dtype (-1e9 is beyond float16's range): the attention's softmax is
  computed in float32.
  """
  bias = None
  if key_paddings is not None:
    bias = tf.cast(key_paddings, tf.float32)[:, None, None, :] * _MASK_LOGIT
  if causal:
    length = layers.shape_list(key_paddings)[1] if key_paddings is not None else query_length
    future = 1.0 - tf.linalg.band_part(tf.ones([query_length, length]),
                                       tf.constant(-1, tf.int64),
                                       tf.cast(query_offset, tf.int64))
    causal_bias = future[None, None, :, :] * _MASK_LOGIT
    bias = causal_bias if bias is None else bias + causal_bias
  return bias


class MultiHeadAttention(BaseLayer):
  """softmax(Q·Kᵀ/√H + bias)·V over N heads, projected back to D.

  query [B, T, D], memory [B, S, D] (None: self-attention), bias [B|1, 1, T, S]
  → [B, T, D]. Q, K, V and output projections each have D·N·H weights (+ biases).
  The projections and both products run in the compute dtype; the logits' bias and
  softmax in float32 (mixed precision keeps the softmax float32).

  Self-attention on a token slice (`StepContext.token_slice`) of n tokens at `offset`
  attends to the keys and values of the sequence up to the slice's end: the slice's
  are added to the slice cache (keys transposed, [B, N, H, T], so that no step
  transposes the whole sequence's; values [B, N, T, H]; core/token_slices.py), the
  first offset + n positions read, and `bias` [B or 1, 1, n, offset + n] must cover
  those keys (causally: it alone hides the positions after the query).
  """

  @classmethod
  def Params(cls):  # noqa: N802
    p = super().Params()
    p.define("input_dim", 0, "Model dimension D.")
    p.define("num_heads", 0, "Number of heads N.")
    p.define("dim_per_head", 0, "Per-head dimension H (0: input_dim // num_heads).")
    p.define("atten_keep_prob", 1.0, "Keep probability of dropout on attention weights.")
    p.define("use_bias", True, "Biases on the projections.")
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    if p.input_dim <= 0 or p.num_heads <= 0:
      raise ParamsError(f"{self.path}: input_dim and num_heads must be positive, got "
                       f"{p.input_dim} and {p.num_heads}")
    head_dim = p.dim_per_head or p.input_dim // p.num_heads
    if head_dim <= 0:
      raise ParamsError(f"{self.path}: dim_per_head must be positive (or input_dim >= "
                       f"num_heads), got dim_per_head={p.dim_per_head}")
    self.head_dim = head_dim
    hidden = p.num_heads * head_dim
    for name in ("query", "key", "value"):
      self.create_child(name, layers.Linear.Params().set(
          input_dim=p.input_dim, output_dim=hidden, has_bias=p.use_bias))
    self.create_child("post", layers.Linear.Params().set(
        input_dim=hidden, output_dim=p.input_dim, has_bias=p.use_bias))
    self.create_child("atten_dropout", layers.Dropout.Params().set(
        keep_prob=p.atten_keep_prob, token_axis=2, key_axis=3))  # probs [B, N, T, S]

  def _split_heads(self, x: tf.Tensor) -> tf.Tensor:
    """[B, T, N·H] → [B, N, T, H]."""
    b, t, _ = layers.shape_list(x)
    x = tf.reshape(x, [b, t, self.params.num_heads, self.head_dim])
    return tf.transpose(x, [0, 2, 1, 3])

  def fprop(self, query: tf.Tensor, memory: tf.Tensor | None = None,
            bias: tf.Tensor | None = None) -> tf.Tensor:
    token_slice = base_layer.current_context().token_slice if memory is None else None
    memory = query if memory is None else memory
    q = self._split_heads(self.query(query)) * (1.0 / math.sqrt(self.head_dim))
    k = self._split_heads(self.key(memory))
    v = self._split_heads(self.value(memory))
    if token_slice is None:
      logits = tf.matmul(q, k, transpose_b=True)  # [B, N, T, S]
    else:  # the keys (kept transposed, [B, N, H, S]) and values of the slices before
      length = q.shape[2]  # the slice's tokens n (static)
      keys = token_slice.prefix(
          token_slice.extend(tf.transpose(k, [0, 1, 3, 2]), axis=3), 3, length)
      v = token_slice.prefix(token_slice.extend(v, axis=2), 2, length)
      logits = tf.matmul(q, keys)  # [B, N, n, offset + n]
    logits = layers.at_least_float32(logits)
    if bias is not None:
      logits += tf.cast(bias, logits.dtype)
    probs = self.atten_dropout(tf.cast(tf.nn.softmax(logits, axis=-1), v.dtype))
    context = tf.matmul(probs, v)  # [B, N, T, H]
    context = tf.transpose(context, [0, 2, 1, 3])
    b, t = layers.shape_list(context)[:2]
    context = tf.reshape(context, [b, t, self.params.num_heads * self.head_dim])
    if not query.shape.is_fully_defined():
      context = tf.ensure_shape(context, query.shape[:-1].concatenate(
          [self.params.num_heads * self.head_dim]))
    return self.post(context)


class AttentionBlock(BaseLayer):
  """Pre-norm residual attention: x + dropout(attention(layer_norm(x), memory)). [B, T, D]."""

  @classmethod
  def Params(cls):  # noqa: N802
    p = super().Params()
    p.define("atten", MultiHeadAttention.Params(), "The attention.")
    p.define("residual_keep_prob", 1.0, "Keep probability of dropout on the sublayer output.")
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    self.create_child("norm", layers.LayerNorm.Params().set(dim=p.atten.input_dim))
    self.create_child("atten", p.atten)
    self.create_child("dropout", layers.Dropout.Params().set(keep_prob=p.residual_keep_prob))

  def fprop(self, x: tf.Tensor, memory: tf.Tensor | None = None,
            bias: tf.Tensor | None = None) -> tf.Tensor:
    return x + self.dropout(self.atten(self.norm(x), memory, bias))


def depth_scaled_init(num_layers: int) -> Params:
  """Xavier scaled down by the number of layers (GPipe §5: deep Transformers train stably
  when the feed-forward initialization shrinks with depth)."""
  return weight_init("xavier", 1.0 / max(num_layers, 1))
