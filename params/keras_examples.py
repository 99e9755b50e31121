"""Keras models pipelined as they are: a convnet (keras.Sequential) and a Transformer LM
(a functional model of keras.layers.MultiHeadAttention blocks), each turned into a
Params stack by `g.from_keras` (docs/keras.md)."""

import keras
from lingvo_gpipe_params import demo, lm

import lingvo_gpipe as g


def conv_net(image_size: int = 32, features: int = 64) -> keras.Sequential:
  """images [B, S, S, 3] → features [B, features]."""
  def conv_bn_relu(channels: int, name: str) -> list:
    return [keras.layers.Conv2D(channels, 3, padding="same", use_bias=False, name=name),
            keras.layers.BatchNormalization(name=f"{name}_bn"),
            keras.layers.Activation("relu", name=f"{name}_relu")]

  return keras.Sequential([
      keras.Input((image_size, image_size, 3)),
      *conv_bn_relu(16, "conv1"), keras.layers.MaxPooling2D(name="pool1"),
      *conv_bn_relu(32, "conv2"), keras.layers.MaxPooling2D(name="pool2"),
      *conv_bn_relu(64, "conv3"), keras.layers.GlobalAveragePooling2D(name="global_pool"),
      keras.layers.Dropout(0.1, name="dropout"),
      keras.layers.Dense(features, activation="relu", name="features"),
  ], name="keras_conv_net")


@g.register
class KerasConvNet(demo.TinyConvNet):
  """`conv_net()`, a keras.Sequential, pipelined over 2 cells with 4 micro-batches:
  demo.TinyConvNet's data, softmax and training with its body written in Keras."""

  def task(self):
    p = super().task().set(name="keras_conv_net")
    p.body = g.from_keras(conv_net())
    p.softmax.input_dim = 64
    p.pipeline.set(num_cells=2, num_micro_batches=4, round_robin_devices=True)
    return p


@keras.saving.register_keras_serializable(package="lingvo_gpipe_examples")
class PositionEmbedding(keras.layers.Layer):
  """ids [B, T] → token embedding + learned position embedding [B, T, dim], T <=
  max_length: the one layer here Keras does not ship."""

  def __init__(self, vocab_size: int, dim: int, max_length: int, **kwargs):
    super().__init__(**kwargs)
    self.vocab_size, self.dim, self.max_length = vocab_size, dim, max_length

  def build(self, input_shape):
    del input_shape  # any length up to max_length
    self.tokens = self.add_weight(shape=(self.vocab_size, self.dim), name="tokens",
                                  initializer=keras.initializers.RandomNormal(stddev=0.02))
    self.positions = self.add_weight(shape=(self.max_length, self.dim), name="positions",
                                     initializer=keras.initializers.RandomNormal(stddev=0.02))

  def call(self, ids):
    length = keras.ops.shape(ids)[-1]
    return keras.ops.take(self.tokens, ids, axis=0) + self.positions[:length]

  def get_config(self):
    return {**super().get_config(), "vocab_size": self.vocab_size, "dim": self.dim,
            "max_length": self.max_length}


def transformer_lm(vocab_size: int, length: int, dim: int = 64, heads: int = 4,
                   hidden: int = 256, num_layers: int = 2, max_length: int = 128
                   ) -> keras.Model:
  """ids [B, T] → logits [B, T, vocab_size] (T <= max_length; built for T = length):
  pre-norm blocks of causal
  self-attention and a feed-forward net, each around a residual Add (from_keras cuts
  the model at the residual stream: one unit per attention and per feed-forward)."""
  ids = keras.Input((length,), dtype="int32")
  x = PositionEmbedding(vocab_size, dim, max_length, name="embed")(ids)
  for i in range(num_layers):
    a = keras.layers.LayerNormalization(name=f"attention{i}_norm")(x)
    a = keras.layers.MultiHeadAttention(heads, dim // heads, name=f"attention{i}")(
        a, a, use_causal_mask=True)
    x = keras.layers.Add(name=f"attention{i}_residual")([x, a])
    f = keras.layers.LayerNormalization(name=f"ff{i}_norm")(x)
    f = keras.layers.Dense(hidden, activation="relu", name=f"ff{i}_inner")(f)
    f = keras.layers.Dense(dim, name=f"ff{i}_outer")(f)
    x = keras.layers.Add(name=f"ff{i}_residual")([x, f])
  x = keras.layers.LayerNormalization(name="final_norm")(x)
  return keras.Model(ids, keras.layers.Dense(vocab_size, name="logits")(x),
                     name="keras_transformer_lm")


@g.register
class KerasTransformerLm(lm.TransformerTiny):
  """`transformer_lm()`, a functional Keras model, as an LM pipelined over 2 cells with
  4 micro-batches: lm.TransformerTiny's corpus, pipeline and training with its stack
  written in Keras. The task passes (ids, paddings): the model takes the ids (causal
  attention keeps right padding out of every real position, and the loss skips padded
  positions)."""

  def task(self):
    corpus = self.train_input().instantiate()
    p = super().task().set(name="keras_transformer_lm")
    p.stack = g.from_keras(transformer_lm(corpus.vocab.size, corpus.params.sequence_length),
                           name="stack")
    p.stack.layers[0].num_inputs = 1  # the ids, not the paddings
    return p
