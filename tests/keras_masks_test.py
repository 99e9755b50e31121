"""Keras models whose layers read masks: KerasHub-shaped backbones taking
{"token_ids", "padding_mask"} (GPT-2's tied embedding among them), and implicit Keras
masks (Embedding(mask_zero=True), Masking) carried across cells. Each against Keras's
own step: the same model and weights, unpartitioned, under a GradientTape."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import engine_loss_and_grads
from keras_test import STEP, keras_paths, mse, pipelined
from lingvo_gpipe_params import lm
from numerics import assert_close, tolerance
from tiers import quick_sample

import lingvo_gpipe as g
from lingvo_gpipe import train_step
from lingvo_gpipe.core import hyperparams, stacked_variables

keras_hub = pytest.importorskip("keras_hub")  # (make install puts it in; docs/keras.md)

VOCAB, LENGTH, WIDTH, BATCH = 23, 6, 8, 8


def gpt2_shaped(tied: bool = True, num_layers: int = 2, vocab: int = VOCAB,
                max_length: int = LENGTH) -> keras.Model:
  """KerasHub's GPT2Backbone, small, with its LM head: {"token_ids", "padding_mask"}
  [B, T] → logits [B, T, VOCAB]. Token and position embeddings added, decoder blocks
  taking the padding mask by keyword, a final norm, and the output projection the
  token embedding reversed (tied, as GPT-2's) or a Dense."""
  ids = keras.Input((None,), dtype="int32", name="token_ids")
  padding_mask = keras.Input((None,), dtype="int32", name="padding_mask")
  tokens = keras.layers.ReversibleEmbedding(vocab, WIDTH, name="token_embedding")
  h = tokens(ids)
  h = keras.layers.Add(name="embeddings_add")([
      h, keras_hub.layers.PositionEmbedding(max_length, name="position_embedding")(h)])
  for i in range(num_layers):
    h = keras_hub.layers.TransformerDecoder(16, 2, name=f"transformer_layer_{i}")(
        h, decoder_padding_mask=padding_mask)
  h = keras.layers.LayerNormalization(name="layer_norm")(h)
  logits = tokens(h, reverse=True) if tied else keras.layers.Dense(vocab, name="logits")(h)
  return keras.Model({"token_ids": ids, "padding_mask": padding_mask}, logits)


def text_batch(seed: int) -> dict:
  """ids, labels [B, T]; paddings [B, T] (1 = padded) at random places, the first
  token always real: so that the padding mask changes what real tokens see."""
  ids = tf.random.stateless_uniform([BATCH, LENGTH], [seed, 1], 1, VOCAB, tf.int32)
  labels = tf.random.stateless_uniform([BATCH, LENGTH], [seed, 2], 0, VOCAB, tf.int32)
  padded = tf.random.stateless_uniform([BATCH, LENGTH], [seed, 3]) < 0.35
  paddings = tf.cast(tf.concat([tf.zeros([BATCH, 1], tf.bool), padded[:, 1:]], 1),
                     tf.float32)
  return {"inputs": (ids, paddings), "labels": labels, "paddings": paddings}


def token_xent(logits, head_inputs):
  """The mean cross-entropy over real tokens (weight: their count)."""
  xent = tf.nn.sparse_softmax_cross_entropy_with_logits(
      head_inputs["labels"], tf.cast(logits, tf.float32))
  real = 1.0 - head_inputs["paddings"]
  count = tf.reduce_sum(real)
  return {"loss": (tf.reduce_sum(xent * real) / count, count)}


def keras_lm_step(model: keras.Model, data: dict, padding_mask: bool = True):
  """Keras's step on the backbone: (loss, {weight path: gradient})."""
  ids, paddings = data["inputs"]
  mask = tf.cast(paddings < 0.5, tf.int32) if padding_mask else tf.ones_like(ids)
  with tf.GradientTape() as tape:
    logits = model({"token_ids": ids, "padding_mask": mask}, training=True)
    loss = token_xent(logits, data)["loss"][0]
  weights = model.trainable_weights
  grads = tape.gradient(loss, [w.value for w in weights])
  return loss.numpy(), {w.path: gr.numpy() for w, gr in zip(weights, grads)}


def assert_steps_agree(stack, model, data, loss_fn, keras_step) -> float:
  """The engine's loss and gradients of `stack` are Keras's (`keras_step`), one per
  Keras trainable weight; returns the loss. A gradient that is zero in exact
  arithmetic (an attention's key bias: softmax ignores a shift) is the rounding of
  terms the size of the model's largest gradients, so it is compared at their scale."""
  want_loss, want = keras_step(model, data)
  loss, grads = engine_loss_and_grads(stack, train_step.StackWithLoss(stack, loss_fn),
                                      data, STEP)
  paths = keras_paths(stack, model)
  weights = stacked_variables.trainable_weights(stack)
  assert len(weights) == len(grads) == len(want)
  assert_close(loss, want_loss)
  largest = max(float(np.max(np.abs(w))) for w in want.values())
  for variable, grad in zip(weights, grads):
    reference = want[paths[variable.ref()]]
    if np.max(np.abs(reference)) < 1e-6 * largest:  # (a cancelled zero)
      assert np.max(np.abs(grad)) <= tolerance(largest, dtype=np.float32), variable.name
    else:
      assert_close(grad, reference)
  return want_loss


BACKBONE_CASES = [("gpipe", 2, 1, "always"), ("1f1b", 2, 1, "never"),
                  ("zb_h1", 2, 1, "never"), ("zbv", 4, 2, "always"),
                  ("1f1b", 4, 1, "never"), ("gpipe", 1, 1, "always")]


@pytest.mark.parametrize("schedule,num_cells,virtual_stages,recompute", quick_sample(
    BACKBONE_CASES, quick=[("1f1b", 2, 1, "never"), ("zbv", 4, 2, "always")]))
def test_a_gpt2_shaped_backbone_trains_tied_with_its_padding_mask_as_keras_does(
    cpu_devices, schedule, num_cells, virtual_stages, recompute):
  """{"token_ids", "padding_mask"} → the stack's (ids, paddings): each decoder gets
  1 - paddings by its keyword, and the reversed token embedding reads the first one's
  table (a tied copy when on another cell): Keras's loss and gradients."""
  keras.utils.set_random_seed(21)
  model = gpt2_shaped()
  body = g.from_keras(model)
  units = [(p.name, p.get("tie_to"), p.get("padding_mask")) for p in body.layers]
  assert units == [("token_embedding", None, None),
                   ("position_embedding_to_embeddings_add", None, None),
                   ("transformer_layer_0", None, "decoder_padding_mask"),
                   ("transformer_layer_1", None, "decoder_padding_mask"),
                   ("layer_norm", None, None),
                   ("token_embedding_call1", "token_embedding", None)]
  stack = pipelined(model, num_cells=num_cells, num_micro_batches=2, schedule=schedule,
                    virtual_stages=virtual_stages, recompute=recompute,
                    devices=cpu_devices[:num_cells // virtual_stages])
  assert stack.num_params() == model.count_params()
  data = text_batch(22)
  loss = assert_steps_agree(stack, model, data, token_xent, keras_lm_step)
  # (The mask matters: without it Keras's own loss differs.)
  assert abs(keras_lm_step(model, data, padding_mask=False)[0] - loss) > 10 * tolerance(
      loss, dtype=np.float32)


@g.register
class Gpt2Lm(lm.TransformerTiny):
  """`gpt2_shaped()`, tied, as a LanguageModelTask's stack over 2 cells: the synthetic
  corpus's (ids, paddings) become its {"token_ids", "padding_mask"}."""

  def task(self):
    vocab = self.train_input().instantiate().vocab.size
    p = super().task().set(name="gpt2_lm")
    p.stack = g.from_keras(gpt2_shaped(vocab=vocab, max_length=32), name="stack")
    return p


def test_a_tied_backbone_trains_in_the_trainer_and_serves_keras_scores(tmp_path):
  """GPT-2's idiom through the trainer (K=2, the embedding and its reversed use in
  different cells), exported: its served `score` is Keras's own forward of the same
  model holding the trained weights, and its `generate` answers."""
  from keras_test import example_params  # noqa: PLC0415

  from lingvo_gpipe import exporter  # noqa: PLC0415
  from lingvo_gpipe.core.from_keras import keras_units  # noqa: PLC0415
  from lingvo_gpipe.core.keras_layer import Keras  # noqa: PLC0415
  from lingvo_gpipe.tasks import serving  # noqa: PLC0415
  from lingvo_gpipe.trainer import Trainer  # noqa: PLC0415

  params = example_params("keras_masks_test.Gpt2Lm")
  vocab = params.task.stack.layers[0].layer["config"]["input_dim"]
  bounds = params.task.cls.id_bounds(params.task)  # (the reversed embedding: the labels')
  assert bounds["ids"].bound == bounds["labels"].bound == vocab == (
      params.train_input.instantiate().id_space_size())
  trainer = Trainer(params, str(tmp_path), log=lambda _: None)
  trainer.train(2)
  stack = trainer.task.main_stack
  assert stack.cell_layers(1)[-1].params.tie_to == "token_embedding"
  model = gpt2_shaped(vocab=vocab, max_length=32)
  sources = keras_units(model)
  weights = {w.path: w for w in model.weights}
  for unit in stack.walk():
    if isinstance(unit, Keras) and not unit.params.tie_to:
      for name, path in unit.keras_weight_paths(sources[unit.name]).items():
        weights[path].assign(tf.convert_to_tensor(getattr(unit, name)))
  path = exporter.export(params, str(tmp_path), model_name="keras_masks_test.Gpt2Lm",
                         options=serving.ServingOptions(max_decode_length=16),
                         log=lambda _: None)
  batch = next(iter(params.eval_input.instantiate().dataset()))
  ids, paddings = batch["ids"], tf.cast(batch["paddings"], tf.float32)
  loaded = tf.saved_model.load(path)
  served = loaded.signatures["score"](ids=ids, paddings=paddings)["token_log_probs"]
  logits = model({"token_ids": ids, "padding_mask": tf.cast(paddings < 0.5, tf.int32)})
  log_probs = tf.nn.log_softmax(logits)
  # token t's log p(ids[t] | ids[<t]) is read from position t - 1's logits.
  want = tf.gather(log_probs[:, :-1], ids[:, 1:], batch_dims=2) * (1.0 - paddings[:, 1:])
  assert_close(served.numpy()[:, 1:], want.numpy())
  prefix = ids[:, :3]
  generated = loaded.signatures["generate"](
      prefix_ids=prefix, max_new_tokens=tf.constant(2), temperature=tf.constant(0.0),
      seed=tf.constant(7, tf.int64))["ids"].numpy()
  # Greedy: the first token generated is the argmax of Keras's logits after the prefix.
  first = tf.argmax(model({"token_ids": prefix, "padding_mask": tf.ones_like(prefix)})[
      :, -1], axis=-1, output_type=tf.int32)
  np.testing.assert_array_equal(generated[:, 0], first.numpy())
  with pytest.raises(tf.errors.InvalidArgumentError, match=rf"score: ids.*{vocab}"):
    loaded.signatures["score"](ids=tf.constant([[1, vocab]]), paddings=tf.zeros([1, 2]))


def masked_classifier(kind: str) -> keras.Model:
  """ids [B, T] (0 = padding) → [B, 2] through a mask Keras makes and its layers read:
  'embedding': Embedding(mask_zero=True) → self-attention block (MultiHeadAttention
  reads the mask) → GlobalAveragePooling1D (averages the kept positions) → Dense;
  'lstm': Embedding(mask_zero=True) → LSTM (skips masked steps) → Dense, a Sequential;
  'masking': features [B, T, 3] (all zero at padding) → Masking → Dense → the
  attention block → pooling → Dense."""
  ids = keras.Input((LENGTH,), dtype="int32")
  if kind == "lstm":
    return keras.Sequential([
        keras.Input((LENGTH,), dtype="int32"),
        keras.layers.Embedding(VOCAB, WIDTH, mask_zero=True, name="embed"),
        keras.layers.LSTM(WIDTH, name="lstm"), keras.layers.Dense(2, name="out")])
  if kind == "masking":
    ids = keras.Input((LENGTH, 3))
    h = keras.layers.Masking(0.0, name="masking")(ids)
    h = keras.layers.Dense(WIDTH, name="embed")(h)
  else:
    h = keras.layers.Embedding(VOCAB, WIDTH, mask_zero=True, name="embed")(ids)
  a = keras.layers.MultiHeadAttention(2, 4, name="attention")(h, h)
  h = keras.layers.Add(name="residual")([h, a])
  h = keras.layers.GlobalAveragePooling1D(name="pool")(h)
  return keras.Model(ids, keras.layers.Dense(2, name="out")(h))


def masked_batch(seed: int, kind: str, padded: bool = True) -> dict:
  """ids [B, T] with zeros (Keras's padding) at random places, the first token kept
  (none zero when not `padded`); for 'masking', features [B, T, 3] of the ids, zero
  where the id is."""
  ids = tf.random.stateless_uniform([BATCH, LENGTH], [seed, 1], 1, VOCAB, tf.int32)
  zero = tf.random.stateless_uniform([BATCH, LENGTH], [seed, 2]) < 0.4
  zero = tf.concat([tf.zeros([BATCH, 1], tf.bool), zero[:, 1:]], 1) & padded
  ids = tf.where(zero, 0, ids)
  inputs = (tf.cast(ids, tf.float32)[..., None] * [1.0, 0.5, -1.0] / VOCAB
            if kind == "masking" else ids)
  return {"inputs": inputs, "target": tf.random.stateless_normal([BATCH, 2], [seed, 3])}


def keras_mse_step(model: keras.Model, data: dict):
  with tf.GradientTape() as tape:
    loss = tf.reduce_mean(tf.square(model(data["inputs"], training=True) - data["target"]))
  weights = model.trainable_weights
  grads = tape.gradient(loss, [w.value for w in weights])  # (an embedding's: sparse)
  return loss.numpy(), {w.path: tf.convert_to_tensor(gr).numpy()
                        for w, gr in zip(weights, grads)}


MASK_CASES = [("embedding", "1f1b", 2), ("embedding", "zb_h1", 4), ("embedding", "gpipe", 1),
              ("lstm", "gpipe", 2),
              ("lstm", "1f1b", 3), ("masking", "gpipe", 2), ("masking", "zb_h1", 4)]


@pytest.mark.parametrize("kind,schedule,num_cells", quick_sample(
    MASK_CASES, quick=[("embedding", "1f1b", 2), ("lstm", "gpipe", 2)]))
def test_a_keras_mask_is_carried_across_cells_as_keras_applies_it(cpu_devices, kind,
                                                                  schedule, num_cells):
  """The mask a layer makes (Embedding(mask_zero=True), Masking) travels beside the
  activations to every later unit that reads it: Keras's loss and gradients wherever
  the cuts fall, and not those of the model without its mask."""
  keras.utils.set_random_seed(23)
  model = masked_classifier(kind)
  body = g.from_keras(model)
  carrying = [(p.name, p.get("keras_mask_in"), p.get("keras_mask_out")) for p in body.layers]
  assert any(mask_out for _, _, mask_out in carrying)
  stack = pipelined(model, num_cells=num_cells, num_micro_batches=2, schedule=schedule,
                    devices=cpu_devices[:num_cells])
  loss = assert_steps_agree(stack, model, masked_batch(24, kind), mse, keras_mse_step)
  # (The mask matters: the same batch without padding gives Keras another loss.)
  unmasked = keras_mse_step(model, masked_batch(24, kind, padded=False))[0]
  assert abs(unmasked - loss) > 10 * tolerance(loss, dtype=np.float32)


def test_a_trainable_batch_norm_where_a_mask_is_carried_is_refused_in_one_line():
  ids = keras.Input((LENGTH,), dtype="int32")
  h = keras.layers.Embedding(VOCAB, WIDTH, mask_zero=True)(ids)
  h = keras.layers.BatchNormalization(name="bn")(h)
  model = keras.Model(ids, keras.layers.Dense(2)(keras.layers.GlobalAveragePooling1D()(h)))
  with pytest.raises(hyperparams.ParamsError, match=r"Keras layer 'bn' \(BatchNormalization"
                     r"\) trains in a model whose units carry a mask"):
    g.from_keras(model)


def test_a_padding_mask_passed_positionally_is_refused_in_one_line():
  ids = keras.Input((None,), dtype="int32", name="token_ids")
  mask = keras.Input((None,), dtype="int32", name="padding_mask")
  h = keras.layers.Embedding(VOCAB, WIDTH)(ids)
  h = keras_hub.layers.TransformerDecoder(16, 2, name="dec")(h, None, mask)
  model = keras.Model({"token_ids": ids, "padding_mask": mask}, h)
  with pytest.raises(hyperparams.ParamsError, match=r"layer 'dec' takes the padding mask "
                     r"as a positional argument; pass it by keyword"):
    g.from_keras(model)

