"""Transformer stacks for GPipe: a decoder-only language model and an encoder-decoder.

Both are flat lists of layers that a `Sequential` runs and a `PipeliningLayer` cuts
into cells. What flows between layers is a tuple, so that any cut is valid:

  LM:      ids [B, T] int, paddings [B, T]
           → embedding → (x [B, T, D], paddings) → L × TransformerLmLayer → logits [B, T, V]
  Enc-dec: src_ids [B, S], src_paddings [B, S], tgt_ids [B, T], tgt_paddings [B, T]
           → embedding → (src [B, S, D], src_paddings, tgt [B, T, D], tgt_paddings)
           → L × encoder layer (updates src) → encoder final norm
           → L × decoder layer (updates tgt, attends to src) → logits [B, T, V]

The embedding is the first layer (so it sits on the first cell) and the softmax
projection the last (on the last cell). Paddings are 1.0 at padded positions.
Deep-model stability (GPipe §5): the feed-forward initialization is scaled down by
the number of layers, and logits can be clipped (`logits_abs_max`).
"""

from __future__ import annotations

import math
from typing import Any

import tensorflow as tf

from lingvo_gpipe.core import attention, layers, token_slices
from lingvo_gpipe.core.base_layer import BaseLayer, InstantiableParams, current_context
from lingvo_gpipe.core.hyperparams import ParamsError


def sinusoid_positions(length: tf.Tensor | int, dim: int, offset: Any = 0) -> tf.Tensor:
  """The Transformer's fixed position signal [length, dim] (sin on even, cos on odd)
  of positions offset .. offset+length−1."""
  positions = tf.cast(tf.range(length, dtype=tf.int64) + tf.cast(offset, tf.int64),
                      tf.float32)[:, None]
  half = dim // 2
  rates = tf.exp(tf.range(half, dtype=tf.float32) * (-math.log(10000.0) / max(half - 1, 1)))
  angles = positions * rates[None, :]
  signal = tf.concat([tf.sin(angles), tf.cos(angles)], axis=1)
  if dim % 2:
    signal = tf.pad(signal, [[0, 0], [0, 1]])
  return signal


class TransformerLayer(BaseLayer):
  """Self-attention, optional cross-attention, then feed-forward; pre-norm residuals.

  `transform(x [B, T, D], paddings [B, T], memory [B, S, D], memory_paddings [B, S])`
  → [B, T, D]. Subclasses adapt it to the tuple their stack carries.
  """

  @classmethod
  def Params(cls):  # noqa: N802
    p = super().Params()
    p.define("input_dim", 0, "Model dimension D.")
    p.define("hidden_dim", 0, "Feed-forward hidden dimension.")
    p.define("num_heads", 0, "Attention heads N.")
    p.define("dim_per_head", 0, "Per-head dimension H (0: input_dim // num_heads).")
    p.define("causal", False, "Queries only see keys at or before their position.")
    p.define("cross_attention", False, "Attend to the encoder output after self-attention.")
    p.define("residual_keep_prob", 1.0, "Keep probability of dropout on sublayer outputs.")
    p.define("atten_keep_prob", 1.0, "Keep probability of dropout on attention weights.")
    p.define("relu_keep_prob", 1.0, "Keep probability of dropout in the feed-forward layer.")
    p.define("ff_init", None, "Initializer of the feed-forward weights (None: Linear's); "
             "see attention.depth_scaled_init.")
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    atten = attention.MultiHeadAttention.Params().set(
        input_dim=p.input_dim, num_heads=p.num_heads, dim_per_head=p.dim_per_head,
        atten_keep_prob=p.atten_keep_prob)
    block = attention.AttentionBlock.Params().set(atten=atten,
                                                  residual_keep_prob=p.residual_keep_prob)
    self.create_child("self_atten", block)
    if p.cross_attention:
      self.create_child("cross_atten", block.copy())
    self.create_child("ff", layers.FeedForwardBlock.Params().set(
        input_dim=p.input_dim, hidden_dim=p.hidden_dim, residual_keep_prob=p.residual_keep_prob,
        relu_keep_prob=p.relu_keep_prob, projection_init=p.ff_init))

  def transform(self, x: tf.Tensor, paddings: tf.Tensor, memory: tf.Tensor | None = None,
                memory_paddings: tf.Tensor | None = None) -> tf.Tensor:
    p = self.params
    token_slice = current_context().token_slice
    if token_slice is None:
      bias = attention.attention_bias(paddings, layers.shape_list(x)[1], p.causal)
    else:  # x: a slice of the sequence; the keys are the whole sequence so far
      if not p.causal or p.cross_attention:
        raise ValueError(f"{self.path}: token slices need causal self-attention only")
      length = x.shape[1]  # the slice's tokens n (static)
      # [B, offset + n]: the key paddings of the sequence up to the slice's end
      key_paddings = token_slice.prefix(token_slice.extend(paddings, axis=1), 1, length)
      bias = attention.attention_bias(key_paddings, length, True,
                                      query_offset=token_slice.offset)
    x = self.self_atten(x, None, bias)
    if p.cross_attention:
      x = self.cross_atten(x, memory, attention.attention_bias(memory_paddings, None, False))
    return self.ff(x)


class TransformerLmLayer(TransformerLayer):
  """(x [B, T, D], paddings [B, T]) → (x', paddings); causal self-attention.

  Runs on token slices (core/token_slices.py): its cache holds the key paddings
  [B, T], the attention's keys [B, N, H, T] and values [B, N, T, H] of the slices before.
  """

  token_slicing = token_slices.CAUSAL

  @classmethod
  def Params(cls):  # noqa: N802
    return super().Params().set(causal=True)

  def fprop(self, x: tf.Tensor, paddings: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    return self.transform(x, paddings), paddings


class TransformerEncoderLayer(TransformerLayer):
  """(src, src_paddings, tgt, tgt_paddings) → the same with src transformed."""

  def fprop(self, src, src_paddings, tgt, tgt_paddings):
    return self.transform(src, src_paddings), src_paddings, tgt, tgt_paddings


class TransformerDecoderLayer(TransformerLayer):
  """(src, src_paddings, tgt, tgt_paddings) → the same with tgt transformed.

  Causal self-attention over tgt, then cross-attention to src (the encoder output).
  """

  @classmethod
  def Params(cls):  # noqa: N802
    return super().Params().set(causal=True, cross_attention=True)

  def fprop(self, src, src_paddings, tgt, tgt_paddings):
    return src, src_paddings, self.transform(tgt, tgt_paddings, src, src_paddings), tgt_paddings


class TokenEmbedding(BaseLayer):
  """ids [B, T] → emb(ids)·√D + positions, dropped out. One table for every use."""

  @classmethod
  def Params(cls):  # noqa: N802
    p = super().Params()
    p.define("vocab_size", 0, "Vocabulary size V.")
    p.define("embedding_dim", 0, "Model dimension D.")
    p.define("input_keep_prob", 1.0, "Keep probability of dropout on the embeddings.")
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    for key in ("vocab_size", "embedding_dim"):
      value = getattr(p, key)
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ParamsError(f"{self.path}: {key} must be an int >= 1, got {value!r}")
    self.create_child("emb", layers.Embedding.Params().set(
        vocab_size=p.vocab_size, embedding_dim=p.embedding_dim, scale_sqrt_depth=True,
        params_init=layers.weight_init("gaussian", p.embedding_dim ** -0.5)))
    self.create_child("dropout", layers.Dropout.Params().set(keep_prob=p.input_keep_prob))

  token_slicing = token_slices.TOKENWISE

  def embed(self, ids: tf.Tensor) -> tf.Tensor:
    """ids [B, T] → [B, T, D]; on a token slice, the positions are the slice's."""
    x = self.emb(ids)
    token_slice = current_context().token_slice
    positions = sinusoid_positions(tf.shape(ids)[1], self.params.embedding_dim,
                                   token_slice.offset if token_slice else 0)  # float32
    x += tf.cast(positions, x.dtype)[None]
    return self.dropout(x)


class LmEmbedding(TokenEmbedding):
  """(ids [B, T] int, paddings [B, T]) → (x [B, T, D], paddings)."""

  def fprop(self, ids, paddings):
    return self.embed(ids), paddings


class EncDecEmbedding(TokenEmbedding):
  """(src_ids, src_paddings, tgt_ids, tgt_paddings) → (src, src_paddings, tgt, tgt_paddings).

  Source and target share the table (one multilingual subword vocabulary).
  """

  def fprop(self, src_ids, src_paddings, tgt_ids, tgt_paddings):
    return self.embed(src_ids), src_paddings, self.embed(tgt_ids), tgt_paddings


class EncoderFinalNorm(BaseLayer):
  """Layer-normalizes the encoder output src; the tuple passes on otherwise."""

  @classmethod
  def Params(cls):  # noqa: N802
    p = super().Params()
    p.define("input_dim", 0, "Model dimension D.")
    return p

  def __init__(self, params):
    super().__init__(params)
    self.create_child("norm", layers.LayerNorm.Params().set(dim=self.params.input_dim))

  def fprop(self, src, src_paddings, tgt, tgt_paddings):
    return self.norm(src), src_paddings, tgt, tgt_paddings


class SoftmaxLogits(BaseLayer):
  """Final layer norm and projection to the vocabulary: → logits [B, T, V].

  As an LM layer it takes (x, paddings); after a decoder, the enc-dec tuple (uses tgt).
  """

  token_slicing = token_slices.TOKENWISE

  @classmethod
  def Params(cls):  # noqa: N802
    p = super().Params()
    p.define("input_dim", 0, "Model dimension D.")
    p.define("vocab_size", 0, "Vocabulary size V.")
    p.define("logits_abs_max", None, "Clip logits to ±this (GPipe's deep-model stability).")
    p.define("tie_to", None, "The path (or its end) of the embedding table [V, D] the "
             "projection is tied to (layers.Softmax.tie_to); None: a weight of its own.")
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    self.create_child("norm", layers.LayerNorm.Params().set(dim=p.input_dim))
    self.create_child("softmax", layers.Softmax.Params().set(
        input_dim=p.input_dim, num_classes=p.vocab_size, logits_abs_max=p.logits_abs_max,
        tie_to=p.tie_to))

  def fprop(self, *carry: tf.Tensor) -> tf.Tensor:
    x = carry[0] if len(carry) == 2 else carry[2]
    return self.softmax(self.norm(x))


# The embedding table a tied softmax reads: layer 'embedding', child 'emb', variable 'emb'.
TIED_EMBEDDING = "embedding/emb/emb"


def _layer_params(cls, p_common: dict, num_layers_for_init: int, **extra):
  return cls.Params().set(ff_init=attention.depth_scaled_init(num_layers_for_init),
                          **p_common, **extra)


def lm_stack(vocab_size: int, model_dim: int, hidden_dim: int, num_heads: int,
             num_layers: int, dim_per_head: int = 0, residual_keep_prob: float = 1.0,
             atten_keep_prob: float = 1.0, relu_keep_prob: float = 1.0,
             logits_abs_max: float | None = None,
             tie_embedding_softmax: bool = False) -> InstantiableParams:
  """Sequential params of a decoder-only LM: embedding, num_layers layers, softmax
  (tie_embedding_softmax: the softmax projects with the embedding table, transposed)."""
  common = dict(input_dim=model_dim, hidden_dim=hidden_dim, num_heads=num_heads,
                dim_per_head=dim_per_head, residual_keep_prob=residual_keep_prob,
                atten_keep_prob=atten_keep_prob, relu_keep_prob=relu_keep_prob)
  stack = [LmEmbedding.Params().set(name="embedding", vocab_size=vocab_size,
                                    embedding_dim=model_dim,
                                    input_keep_prob=residual_keep_prob)]
  stack += [_layer_params(TransformerLmLayer, common, num_layers, name=f"layer_{i:03d}")
            for i in range(num_layers)]
  stack.append(SoftmaxLogits.Params().set(name="logits", input_dim=model_dim,
                                          vocab_size=vocab_size,
                                          logits_abs_max=logits_abs_max,
                                          tie_to=TIED_EMBEDDING if tie_embedding_softmax
                                          else None))
  return layers.Sequential.Params().set(name="stack", layers=stack)


def encoder_decoder_stack(vocab_size: int, model_dim: int, hidden_dim: int, num_heads: int,
                          num_layers: int, dim_per_head: int = 0,
                          residual_keep_prob: float = 1.0, atten_keep_prob: float = 1.0,
                          relu_keep_prob: float = 1.0,
                          logits_abs_max: float | None = None,
                          tie_embedding_softmax: bool = False) -> InstantiableParams:
  """Sequential params of T(L, H, A): L encoder and L decoder layers, shared embedding
  (tie_embedding_softmax: also the softmax's projection, transposed)."""
  common = dict(input_dim=model_dim, hidden_dim=hidden_dim, num_heads=num_heads,
                dim_per_head=dim_per_head, residual_keep_prob=residual_keep_prob,
                atten_keep_prob=atten_keep_prob, relu_keep_prob=relu_keep_prob)
  depth = 2 * num_layers
  stack = [EncDecEmbedding.Params().set(name="embedding", vocab_size=vocab_size,
                                        embedding_dim=model_dim,
                                        input_keep_prob=residual_keep_prob)]
  stack += [_layer_params(TransformerEncoderLayer, common, depth, name=f"encoder_{i:03d}")
            for i in range(num_layers)]
  stack.append(EncoderFinalNorm.Params().set(name="encoder_norm", input_dim=model_dim))
  stack += [_layer_params(TransformerDecoderLayer, common, depth, name=f"decoder_{i:03d}")
            for i in range(num_layers)]
  stack.append(SoftmaxLogits.Params().set(name="logits", input_dim=model_dim,
                                          vocab_size=vocab_size,
                                          logits_abs_max=logits_abs_max,
                                          tie_to=TIED_EMBEDDING if tie_embedding_softmax
                                          else None))
  return layers.Sequential.Params().set(name="stack", layers=stack)
