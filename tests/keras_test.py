"""Keras layers in Params stacks and `from_keras` models: each against Keras itself (the
same model, same weights, unpartitioned, differentiated by a GradientTape)."""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import engine_loss_and_grads
from numerics import HALF_REORDERED, assert_close
from tiers import EXHAUSTIVE, quick_sample

import lingvo_gpipe as g
from lingvo_gpipe import train_step
from lingvo_gpipe.core import base_layer, hyperparams, layers, stacked_variables
from lingvo_gpipe.core.from_keras import keras_units
from lingvo_gpipe.core.keras_layer import Keras
from lingvo_gpipe.core.tf_internals import step_function
from lingvo_gpipe.pipeline.layer import PipeliningLayer

STEP = 3
BATCH = 8


def residual_model(width: int = 8, blocks: int = 3, dropout: float = 0.0) -> keras.Model:
  """Functional: Dense → `blocks` × (x + Dense(LayerNorm(x))) → Dense(2): from_keras
  cuts it into 2 + blocks units."""
  inputs = keras.Input((6,))
  h = keras.layers.Dense(width, name="embed")(inputs)
  for i in range(blocks):
    a = keras.layers.LayerNormalization(name=f"norm{i}")(h)
    a = keras.layers.Dense(width, activation="relu", name=f"ff{i}")(a)
    if dropout:
      a = keras.layers.Dropout(dropout, name=f"drop{i}")(a)
    h = keras.layers.Add(name=f"add{i}")([h, a])
  return keras.Model(inputs, keras.layers.Dense(2, name="out")(h))


def batch(seed: int = 0) -> dict:
  x = tf.random.stateless_normal([BATCH, 6], [seed, 1])
  return {"inputs": x, "target": tf.random.stateless_normal([BATCH, 2], [seed, 2])}


def mse(outputs, head_inputs):
  target = head_inputs["target"]
  loss = tf.reduce_mean(tf.square(tf.cast(outputs, tf.float32) - target))
  return {"loss": (loss, tf.cast(tf.shape(target)[0], tf.float32))}


def keras_loss_and_grads(model: keras.Model, data: dict, training: bool = True):
  """Keras's own step: the model on the whole batch under a GradientTape → (loss,
  {weight path: gradient})."""
  with tf.GradientTape() as tape:
    out = model(data["inputs"], training=training)
    loss = tf.reduce_mean(tf.square(out - data["target"]))
  grads = tape.gradient(loss, [v.value for v in model.trainable_weights])
  return loss.numpy(), {v.path: gr.numpy() for v, gr in zip(model.trainable_weights, grads)}


def assert_keras_gradients(stack: base_layer.BaseLayer, model: keras.Model,
                           data: dict) -> float:
  """The engine's step of `stack` (built from `model`, its weights loaded) on `data` has
  Keras's own loss and gradients (keras_loss_and_grads), one per Keras trainable weight;
  returns that loss."""
  want_loss, want = keras_loss_and_grads(model, data)
  loss, grads = engine_loss_and_grads(stack, train_step.StackWithLoss(stack, mse), data, STEP)
  paths = keras_paths(stack, model)
  weights = stacked_variables.trainable_weights(stack)
  assert len(weights) == len(grads) == len(want)
  assert_close(loss, want_loss)
  for variable, grad in zip(weights, grads):
    assert_close(grad, want[paths[variable.ref()]])
  return want_loss


def keras_paths(stack: base_layer.BaseLayer, model: keras.Model) -> dict:
  """{library variable ref: the Keras weight path it was loaded from}."""
  sources = keras_units(model)
  return {getattr(unit, name).ref(): path for unit in stack.walk() if isinstance(unit, Keras)
          for name, path in unit.keras_weight_paths(sources[unit.name]).items()}


def pipelined(model: keras.Model, **pipeline) -> PipeliningLayer:
  body = g.from_keras(model)
  stack = PipeliningLayer.Params().set(name="body", layers=body.layers,
                                       **pipeline).instantiate()
  g.load_keras_weights(stack, model)
  return stack


# Every schedule with both recompute policies (interleaved ones over 2 devices); K=1 and
# K=4 on 4 devices once each.
CASES = [(schedule, num_cells, virtual_stages, recompute)
         for schedule, num_cells, virtual_stages in [
             ("gpipe", 2, 1), ("1f1b", 2, 1), ("zb_h1", 2, 1), ("interleaved_1f1b", 4, 2),
             ("zbv", 4, 2), ("interleaved_zb", 4, 2)]
         for recompute in ("always", "never")] + [("gpipe", 1, 1, "always"),
                                                  ("1f1b", 4, 1, "never")]


# The quick tier: a split backward without recompute on a V, and 1F1B re-materialized.
@pytest.mark.parametrize("schedule,num_cells,virtual_stages,recompute", quick_sample(
    CASES, quick=[("zbv", 4, 2, "never"), ("1f1b", 2, 1, "always")]))
def test_a_pipelined_functional_model_has_keras_gradients(cpu_devices, schedule, num_cells,
                                                         virtual_stages, recompute):
  keras.utils.set_random_seed(1)
  model = residual_model(blocks=4)
  stack = pipelined(model, num_cells=num_cells, num_micro_batches=4, schedule=schedule,
                    virtual_stages=virtual_stages, recompute=recompute,
                    devices=cpu_devices[:num_cells // virtual_stages])
  assert_keras_gradients(stack, model, batch())


def dense_chain(width: int = 8, depth: int = 4) -> keras.Sequential:
  """Identical Dense layers (one kind for the pipeline: shared traces, stacked weights)."""
  return keras.Sequential(
      [keras.Input((6,)), keras.layers.Dense(width, activation="tanh", name="first"),
       *[keras.layers.Dense(width, activation="tanh", name=f"hidden{i}") for i in range(depth)],
       keras.layers.Dense(2, name="out")])


@pytest.mark.parametrize("scan_layers", quick_sample([False, True], quick=[True]))
def test_identical_keras_layers_share_traces_and_stacked_weights(cpu_devices, scan_layers):
  """Runs of one Keras layer kind: stacked weights (one stack per shape), one traced
  function (or a scan) per kind; gradients still Keras's."""
  keras.utils.set_random_seed(2)
  model = dense_chain()
  stack = pipelined(model, num_cells=2, num_micro_batches=2, schedule="1f1b",
                    scan_layers=scan_layers, devices=cpu_devices[:2])
  hidden = [unit for unit in stack.walk() if unit.name.startswith("hidden")]
  assert {base_layer.params_kind(unit.params) for unit in hidden} == {
      base_layer.params_kind(hidden[0].params)}
  assert all(isinstance(unit.kernel, stacked_variables.RowVariable) for unit in hidden)
  assert_keras_gradients(stack, model, batch(1))


def steps_match_keras_sgd(model: keras.Model, step, batches: list) -> None:
  """Per batch: Keras's own training step (GradientTape, keras.optimizers.SGD at 0.1) on
  `model`, and `step` (the engine's TrainStep, SGD at 0.1) on the same batch: the same
  loss."""
  keras_sgd = keras.optimizers.SGD(learning_rate=0.1)
  for data in batches:
    with tf.GradientTape() as tape:
      want_loss = tf.reduce_mean(tf.square(model(data["inputs"], training=True)
                                           - data["target"]))
    keras_sgd.apply_gradients(zip(tape.gradient(want_loss, model.trainable_weights),
                                  model.trainable_weights))
    outputs, _ = step(data)
    assert_close(outputs["loss"].numpy(), want_loss.numpy())


def test_training_steps_give_the_losses_and_weights_of_keras_sgd(cpu_devices):
  """Three SGD steps of the pipelined model (K=2, M=4) against Keras's own training
  step (GradientTape + keras.optimizers.SGD) on the same batches."""
  keras.utils.set_random_seed(3)
  model = residual_model()
  stack = pipelined(model, num_cells=2, num_micro_batches=4, schedule="1f1b",
                    devices=cpu_devices[:2])
  optimizer = g.optimizers.SGD.Params().set(learning_rate=0.1, momentum=0.0).instantiate()
  optimizer.create_slots(stack.trainable_variables)
  global_step = tf.Variable(0, dtype=tf.int64)
  step = step_function(train_step.TrainStep(train_step.StackWithLoss(stack, mse), optimizer,
                                            global_step))
  steps_match_keras_sgd(model, step, [batch(10 + i) for i in range(3)])
  paths = keras_paths(stack, model)
  keras_values = {v.path: v.numpy() for v in model.trainable_weights}
  for variable in stacked_variables.trainable_weights(stack):
    assert_close(tf.convert_to_tensor(variable.value() if isinstance(
        variable, stacked_variables.RowVariable) else variable).numpy(),
        keras_values[paths[variable.ref()]])


def attention_model(dropout: float) -> keras.Model:
  """x [B, 4, 8] → Dense → x + MultiHeadAttention(LayerNorm(x)) (with its own dropout)
  → Dense(2)."""
  inputs = keras.Input((4, 8))
  h = keras.layers.Dense(8, name="embed")(inputs)
  a = keras.layers.LayerNormalization(name="norm")(h)
  a = keras.layers.MultiHeadAttention(2, 4, dropout=dropout, name="attention")(a, a)
  h = keras.layers.Add(name="residual")([h, a])
  return keras.Model(inputs, keras.layers.Dense(2, name="out")(h))


def sequence_batch() -> dict:
  return {"inputs": tf.random.stateless_normal([BATCH, 4, 8], [5, 1]),
          "target": tf.random.stateless_normal([BATCH, 4, 2], [5, 2])}


def test_dropout_inside_a_keras_layer_draws_the_same_mask_when_recomputed(cpu_devices):
  """MultiHeadAttention's own dropout (a Keras seed generator) under re-materialization:
  the recomputed forward must draw the first forward's masks, so recompute=always has
  the gradients of recompute=never. (Its stateful generator alone would draw new masks
  in the recompute.)"""
  keras.utils.set_random_seed(4)
  model = attention_model(dropout=0.5)
  data = sequence_batch()
  results = {}
  for recompute in ("always", "never"):
    stack = pipelined(model, num_cells=2, num_micro_batches=2, recompute=recompute,
                      devices=cpu_devices[:2])
    results[recompute] = engine_loss_and_grads(
        stack, train_step.StackWithLoss(stack, mse), data, STEP)
  assert_close(results["always"][0], results["never"][0])
  for always, never in zip(results["always"][1], results["never"][1]):
    assert_close(always, never)
  # The masks are drawn: without dropout the loss is another.
  stack = pipelined(attention_model(dropout=0.0), num_cells=2, num_micro_batches=2,
                    devices=cpu_devices[:2])
  g.load_keras_weights(stack, model)
  loss, _ = engine_loss_and_grads(stack, train_step.StackWithLoss(stack, mse), data, STEP)
  assert abs(loss - results["always"][0]) > 1e-3 * abs(loss)


def conv_bn_model() -> keras.Sequential:
  """(The convolution has no bias, as before any batch norm: its gradient would be
  zero up to the rounding of terms that cancel, which no scale of its own bounds.)"""
  return keras.Sequential([
      keras.Input((6, 6, 3)), keras.layers.Conv2D(4, 3, use_bias=False, name="conv"),
      keras.layers.BatchNormalization(momentum=0.9, epsilon=1e-3, name="bn"),
      keras.layers.Activation("relu", name="relu"), keras.layers.Dropout(0.0, name="drop"),
      keras.layers.GlobalAveragePooling2D(name="pool"), keras.layers.Dense(2, name="out")])


def image_batch() -> dict:
  return {"inputs": tf.random.stateless_normal([BATCH, 6, 6, 3], [6, 1]),
          "target": tf.random.stateless_normal([BATCH, 2], [6, 2])}


def test_batch_normalization_becomes_the_librarys_and_keeps_keras_semantics(cpu_devices):
  """Keras BatchNormalization → layers.BatchNorm (momentum, epsilon kept): with one
  micro-batch, Keras's gradients; with two, moving averages after a step equal to those
  Keras computes from the whole batch."""
  keras.utils.set_random_seed(5)
  model = conv_bn_model()
  units = g.from_keras(model).layers
  assert [p.cls.__name__ for p in units] == [
      "Keras", "BatchNorm", "Keras", "Dropout", "Keras", "Keras"]
  assert (units[1].decay, units[1].epsilon, units[1].dim) == (0.9, 1e-3, 4)
  data = image_batch()
  want_loss, want = keras_loss_and_grads(model, data)  # (updates Keras's averages)
  stack = pipelined(model, num_cells=2, num_micro_batches=1, devices=cpu_devices[:2])
  # Keras's averages moved in that training call; ours start where Keras's started.
  bn = next(unit for unit in stack.walk() if isinstance(unit, layers.BatchNorm))
  bn.moving_mean.assign(tf.zeros([4]))
  bn.moving_variance.assign(tf.ones([4]))
  loss, grads = engine_loss_and_grads(stack, train_step.StackWithLoss(stack, mse), data, STEP)
  assert_close(loss, want_loss)
  names = {id(bn.gamma): "bn/gamma", id(bn.beta): "bn/beta"}
  paths = keras_paths(stack, model)
  for variable, grad in zip(stacked_variables.trainable_weights(stack), grads):
    key = names.get(id(variable)) or paths[variable.ref()]
    want_key = next(path for path in want if path.endswith(key))
    assert_close(grad, want[want_key])

  two = pipelined(model, num_cells=2, num_micro_batches=2, devices=cpu_devices[:2])
  bn = next(unit for unit in two.walk() if isinstance(unit, layers.BatchNorm))
  bn.moving_mean.assign(tf.zeros([4]))
  bn.moving_variance.assign(tf.ones([4]))
  optimizer = g.optimizers.SGD.Params().set(learning_rate=0.0, momentum=0.0).instantiate()
  optimizer.create_slots(two.trainable_variables)
  step_function(train_step.TrainStep(train_step.StackWithLoss(two, mse), optimizer,
                                     tf.Variable(0, dtype=tf.int64)))(data)
  keras_bn = model.get_layer("bn")
  keras_bn.moving_mean.assign(tf.zeros([4]))
  keras_bn.moving_variance.assign(tf.ones([4]))
  model(data["inputs"], training=True)
  assert_close(bn.moving_mean.numpy(), keras_bn.moving_mean.numpy())
  assert_close(bn.moving_variance.numpy(), keras_bn.moving_variance.numpy())


def frozen_model(which: str) -> keras.Model:
  """A fine-tuning set-up: `conv_bn`, conv_bn_model with its convolution and batch
  norm frozen; `nested`, a functional model around a frozen Sequential backbone (Dense,
  BatchNormalization: one unit) with a trainable head."""
  if which == "conv_bn":
    model = conv_bn_model()
    for name in ("conv", "bn"):
      model.get_layer(name).trainable = False
    return model
  backbone = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, name="dense"),
                               keras.layers.BatchNormalization(name="bn")], name="backbone")
  backbone.trainable = False
  inputs = keras.Input((6,))
  h = keras.layers.Dense(8, activation="tanh", name="adapter")(backbone(inputs))
  return keras.Model(inputs, keras.layers.Dense(2, name="out")(h))


@pytest.mark.parametrize("which", ["conv_bn", "nested"])
def test_frozen_layers_stay_as_keras_keeps_them_while_the_rest_trains(cpu_devices, which):
  """Three SGD steps (K=2, M=2) against Keras's own steps: the frozen weights are the
  library's non-trainable variables (no gradient, no optimizer slot, checkpointed), a
  frozen batch norm normalizes with its moving statistics and never updates them, and
  the losses and every weight after the steps are Keras's."""
  keras.utils.set_random_seed(7)
  model = frozen_model(which)
  for bn in model._flatten_layers(include_self=False):  # noqa: SLF001
    if isinstance(bn, keras.layers.BatchNormalization):  # statistics of a "pretrained" model
      bn.moving_mean.assign(tf.random.stateless_normal(bn.moving_mean.shape, [7, 1]))
      bn.moving_variance.assign(tf.random.stateless_uniform(bn.moving_variance.shape,
                                                            [7, 2], 0.5, 2.0))
  stack = pipelined(model, num_cells=2, num_micro_batches=2, schedule="1f1b",
                    devices=cpu_devices[:2])
  assert len(stacked_variables.trainable_weights(stack)) == len(model.trainable_weights)
  assert len(stack.variables) == len(model.weights)  # the frozen ones too: checkpointed
  frozen_before = [v.numpy() for v in model.non_trainable_weights]
  optimizer = g.optimizers.SGD.Params().set(learning_rate=0.1, momentum=0.0).instantiate()
  optimizer.create_slots(stack.trainable_variables)  # (what the trainer does)
  step = step_function(train_step.TrainStep(train_step.StackWithLoss(stack, mse), optimizer,
                                            tf.Variable(0, dtype=tf.int64)))
  steps_match_keras_sgd(model, step, [image_batch() if which == "conv_bn" else batch(20 + i)
                                      for i in range(3)])
  for before, after in zip(frozen_before, model.non_trainable_weights):
    np.testing.assert_array_equal(before, after.numpy())  # Keras kept them too
  keras_weights = {v.path: v for v in model.weights}
  sources = keras_units(model)
  pairs = [(getattr(unit, name), path) for unit in stack.walk() if isinstance(unit, Keras)
           for name, path in unit.keras_weight_paths(sources[unit.name]).items()]
  pairs += [(getattr(unit, name), next(path for path in keras_weights
                                        if path.endswith(f"{unit.name}/{name}")))
            for unit in stack.walk() if isinstance(unit, layers.BatchNorm)
            for name in ("gamma", "beta", "moving_mean", "moving_variance")]
  assert len(pairs) == len(keras_weights)
  for ours, path in pairs:
    assert_close(tf.convert_to_tensor(ours).numpy(), keras_weights[path].numpy(), err_msg=path)


@pytest.mark.parametrize("make", [lambda: residual_model(blocks=1), conv_bn_model])
def test_a_frozen_model_trains_nothing_whatever_its_layers_flags_say(make):
  """model.trainable = False, then a layer's own flag set back to True: Keras trains
  nothing (trainable_weights is empty), and neither does the stack (its head trained)."""
  model = make()
  model.trainable = False
  for layer in model.layers:
    layer.trainable = True
  assert model.trainable_weights == []
  stack = layers.Sequential.Params().set(name="b", layers=g.from_keras(model).layers
                                         ).instantiate()
  assert not stack.trainable_variables
  assert len(stack.variables) == len(model.weights)


@keras.saving.register_keras_serializable(package="lingvo_gpipe_tests")
class PrefixMix(keras.layers.Layer):
  """x [B, T, D] → x + scale · w · (the mean of x over each position's prefix, or over
  all positions when use_causal_mask=False), plus `bias` (a tensor or None: Keras takes
  no other positional constant)."""

  def build(self, input_shape):
    self.w = self.add_weight(shape=(input_shape[-1],), initializer="ones", name="w")

  def call(self, x, bias=None, scale=1.0, use_causal_mask=True):
    t = x.shape[1]
    mask = np.tril(np.ones((t, t), np.float32)) if use_causal_mask else np.ones((t, t),
                                                                                 np.float32)
    mix = keras.ops.einsum("st,btd->bsd", mask / mask.sum(1, keepdims=True), x)
    return x + scale * mix * self.w + (0.0 if bias is None else bias)


@keras.saving.register_keras_serializable(package="lingvo_gpipe_tests")
class Reversible(keras.layers.Layer):
  """x [B, T, D] → x · K, or x · Kᵀ with reverse=True (a tied embedding's two uses)."""

  def build(self, input_shape):
    self.kernel = self.add_weight(shape=(input_shape[-1], input_shape[-1]), name="kernel")

  def call(self, x, reverse=False):
    return keras.ops.matmul(x, keras.ops.transpose(self.kernel) if reverse else self.kernel)


def called_with_arguments_model() -> keras.Model:
  """Dense → PrefixMix(h, None, scale=2.0, use_causal_mask=False) → Reversible(h,
  reverse=True) → Dense(2), on [B, 4, 8]: each middle layer's node passes constants its
  unit must keep."""
  inputs = keras.Input((4, 8))
  h = keras.layers.Dense(8, name="embed")(inputs)
  h = PrefixMix(name="mix")(h, None, scale=2.0, use_causal_mask=False)
  h = Reversible(name="rev")(h, reverse=True)
  return keras.Model(inputs, keras.layers.Dense(2, name="out")(h))


def test_each_nodes_call_arguments_are_recorded_and_passed_at_each_call(cpu_devices):
  """The units keep their nodes' constants (positional and keyword) in their params,
  written to and read back from params text, and the pipeline (K=2, M=2) has Keras's
  loss and gradients; called without them the layers compute another loss."""
  keras.utils.set_random_seed(8)
  model = called_with_arguments_model()
  body = g.from_keras(model)
  by_name = {p.name: p for p in body.layers}
  assert (by_name["mix"].call_args, by_name["mix"].call_kwargs) == (
      [None], {"scale": 2.0, "use_causal_mask": False})
  assert (by_name["rev"].call_args, by_name["rev"].call_kwargs) == ([], {"reverse": True})
  for name in ("mix", "rev"):
    assert layers.Keras.Params().from_text(by_name[name].to_text()) == by_name[name]
  data = sequence_batch()
  stack = pipelined(model, num_cells=2, num_micro_batches=2, devices=cpu_devices[:2])
  want_loss = assert_keras_gradients(stack, model, data)
  for unit in body.layers:  # the same layers called with their inputs alone
    if unit.name in ("mix", "rev"):
      unit.set(call_args=[], call_kwargs={})
  plain = PipeliningLayer.Params().set(name="body", layers=body.layers, num_cells=2,
                                       num_micro_batches=2,
                                       devices=cpu_devices[:2]).instantiate()
  g.load_keras_weights(plain, model)
  other, _ = engine_loss_and_grads(plain, train_step.StackWithLoss(plain, mse), data, STEP)
  assert abs(other - want_loss) > 1e-3 * abs(want_loss)


def test_a_nodes_training_argument_gives_way_as_in_keras(cpu_devices):
  """Keras 3 passes a functional model's own `training` (fit: True) to every node that
  takes it, over the node's: `Dropout(0.9)(x, training=False)` drops in training. The
  units drop a node's `training` too. Keras's fine-tuning idiom, `backbone(x,
  training=False)` on a frozen backbone with batch norm, then has Keras's loss and
  gradients at K=2, M=2 (the frozen batch norm in inference mode either way)."""
  inputs = keras.Input((4,))
  dropped = keras.Model(inputs, keras.layers.Dropout(0.9)(inputs, training=False))
  assert (dropped(np.ones((4, 4), np.float32), training=True).numpy() == 0).any()
  keras.utils.set_random_seed(10)
  backbone = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, name="dense"),
                               keras.layers.BatchNormalization(name="bn")], name="backbone")
  backbone.trainable = False
  inputs = keras.Input((6,))
  h = keras.layers.Dense(8, activation="tanh", name="adapter")(backbone(inputs, training=False))
  model = keras.Model(inputs, keras.layers.Dense(2, name="out")(h))
  assert g.from_keras(model).layers[0].call_kwargs == {}
  assert len(model.trainable_weights) == 4  # the adapter's and the head's
  stack = pipelined(model, num_cells=2, num_micro_batches=2, devices=cpu_devices[:2])
  assert_keras_gradients(stack, model, batch(11))


def shared_layer_model() -> keras.Model:
  """Dense → a Dense `shared` applied twice (one weight set; tanh between) → Dense →
  Dense(2): Keras trains `shared` once, from both nodes' gradients."""
  inputs = keras.Input((6,))
  h = keras.layers.Dense(8, name="embed")(inputs)
  shared = keras.layers.Dense(8, name="shared")
  h = shared(keras.layers.Activation("tanh", name="act")(shared(h)))
  h = keras.layers.Dense(8, activation="tanh", name="after")(h)
  return keras.Model(inputs, keras.layers.Dense(2, name="out")(h))


SHARED_CASES = [("gpipe", 2, 1, "always"), ("1f1b", 2, 1, "never"),
                ("zb_h1", 2, 1, "always"), ("zbv", 4, 2, "never"), ("1f1b", 4, 1, "always"),
                ("gpipe", 1, 1, "never")]


@pytest.mark.parametrize("schedule,num_cells,virtual_stages,recompute", quick_sample(
    SHARED_CASES, quick=[("zbv", 4, 2, "never"), ("1f1b", 2, 1, "never")]))
def test_a_layer_called_at_two_nodes_is_one_weight_set_across_cells(
    cpu_devices, schedule, num_cells, virtual_stages, recompute):
  """A layer used at two nodes is a unit per node, the second tied to the first: one
  weight set (Keras's count), Keras's loss and gradients (the sum of both uses) when
  the nodes run in different cells, under each schedule family."""
  keras.utils.set_random_seed(13)
  model = shared_layer_model()
  body = g.from_keras(model)
  assert [(p.name, getattr(p, "tie_to", None)) for p in body.layers] == [
      ("embed", None), ("shared", None), ("act", None), ("shared_call1", "shared"),
      ("after", None), ("out", None)]
  stack = pipelined(model, num_cells=num_cells, num_micro_batches=2, schedule=schedule,
                    virtual_stages=virtual_stages, recompute=recompute,
                    devices=cpu_devices[:num_cells // virtual_stages])
  if num_cells == 2:  # (the two uses on different devices: a tied copy)
    assert [layer.name for layer in stack.cell_layers(0)] == ["embed", "shared", "act"]
  assert stack.num_params() == model.count_params()
  assert_keras_gradients(stack, model, batch(14))


def test_a_layer_used_inside_blocks_keeps_its_nodes_in_one_unit(cpu_devices):
  """A shared layer whose nodes sit inside residual blocks (not alone) keeps them in
  one unit: one layer, Keras's gradients at K=2."""
  keras.utils.set_random_seed(15)
  inputs = keras.Input((6,))
  h = keras.layers.Dense(8, name="embed")(inputs)
  shared = keras.layers.Dense(8, name="shared")
  for i in range(2):
    h = keras.layers.Add(name=f"add{i}")([h, shared(h)])
  model = keras.Model(inputs, keras.layers.Dense(2, name="out")(
      keras.layers.Dense(8, name="after")(h)))
  names = [p.name for p in g.from_keras(model).layers]
  assert names == ["embed", "shared_to_add1", "after", "out"]
  stack = pipelined(model, num_cells=2, num_micro_batches=2, devices=cpu_devices[:2])
  assert stack.num_params() == model.count_params()
  assert_keras_gradients(stack, model, batch(16))


def test_a_layer_used_by_itself_and_inside_a_nested_model_is_refused_naming_it():
  """A layer called at the top and again inside a nested model holding it: Keras's own
  config cannot keep it one layer (from_config makes two: 290 parameters against 162),
  so neither can params.txt; refused in one line (it was two untied copies)."""
  shared = keras.layers.Dense(8, activation="tanh", name="shared")
  inner_input = keras.Input((8,))
  inner = keras.Model(inner_input, shared(inner_input), name="inner")
  inputs = keras.Input((8,))
  h = inner(keras.layers.Dense(8, name="mid")(shared(inputs)))
  model = keras.Model(inputs, keras.layers.Dense(2, name="out")(h))
  assert keras.Model.from_config(model.get_config()).count_params() > model.count_params()
  with pytest.raises(hyperparams.ParamsError, match=r"layer 'shared' is used inside "
                     r"'shared' and 'inner' at once; a Keras config records it in each"):
    g.from_keras(model)


def test_a_sequential_holding_a_layer_twice_ties_its_entries(cpu_devices):
  shared = keras.layers.Dense(6, activation="tanh", name="sh")
  model = keras.Sequential([keras.Input((6,)), shared, shared, keras.layers.Dense(2)])
  assert [p.name for p in g.from_keras(model).layers][:2] == ["sh", "sh_call1"]
  stack = pipelined(model, num_cells=2, num_micro_batches=2, devices=cpu_devices[:2])
  assert stack.num_params() == model.count_params()
  assert_keras_gradients(stack, model, batch(17))


def test_weights_load_only_from_a_model_holding_every_units_layer(cpu_devices):
  """load_keras_weights from a model without the batch norm's layer is refused naming
  it (a unit left at its initial values would train silently)."""
  model = conv_bn_model()
  stack = pipelined(model, num_cells=2, num_micro_batches=1, devices=cpu_devices[:2])
  without_bn = keras.Sequential([keras.Input((6, 6, 3)), *[
      layer for layer in model.layers if layer.name != "bn"]])
  with pytest.raises(hyperparams.ParamsError, match=r"the Keras model has no layer 'bn'"):
    g.load_keras_weights(stack, without_bn)


def test_a_weight_frozen_on_its_own_is_refused_naming_it():
  model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, name="a"),
                            keras.layers.Dense(2, name="out")])
  model.get_layer("a").kernel.trainable = False
  with pytest.raises(hyperparams.ParamsError, match=r"Keras weight '(.*/)?a/kernel' is frozen on "
                     r"its own .* while its layer 'a' trains"):
    g.from_keras(model)


@pytest.mark.parametrize("call, message", [
    (lambda h: PrefixMix(name="mix")(h, scale=np.full([8], 2.0, np.float32)),
     r"'mix' is called with call_kwargs\['scale'\] = .* is not a Python literal"),
])
def test_call_arguments_a_unit_cannot_keep_are_refused_naming_the_layer(call, message):
  inputs = keras.Input((4, 8))
  model = keras.Model(inputs, keras.layers.Dense(2, name="out")(call(
      keras.layers.Dense(8, name="embed")(inputs))))
  with pytest.raises(hyperparams.ParamsError, match=message):
    g.from_keras(model)


def recurrent_model() -> keras.Model:
  """x [B, 4, 8] → LSTM(8, sequences) → GRU(6) → Dense(2): Keras's recurrent layers,
  each a unit (their loops run inside the cells)."""
  return keras.Sequential([keras.Input((4, 8)),
                           keras.layers.LSTM(8, return_sequences=True, name="lstm"),
                           keras.layers.GRU(6, name="gru"), keras.layers.Dense(2, name="out")])


@EXHAUSTIVE
def test_recurrent_layers_have_keras_gradients(cpu_devices):
  """K=2, M=2, re-materialized: an LSTM and a GRU give Keras's loss and gradients."""
  keras.utils.set_random_seed(9)
  model = recurrent_model()
  stack = pipelined(model, num_cells=2, num_micro_batches=2, devices=cpu_devices[:2])
  assert_keras_gradients(stack, model, {
      "inputs": tf.random.stateless_normal([BATCH, 4, 8], [9, 1]),
      "target": tf.random.stateless_normal([BATCH, 2], [9, 2])})


RECURRENT_PARAM_FILE = """
import os

import keras
import lingvo_gpipe as g
from lingvo_gpipe_params import demo

SIZE = demo.TinyConvNet.IMAGE_SIZE
# Built at import: Keras's LSTM lists the GPUs, which starts TensorFlow's runtime.
BODY = keras.Sequential([keras.Input((SIZE, SIZE, 3)), keras.layers.Reshape((SIZE, SIZE * 3)),
                         keras.layers.LSTM(16), keras.layers.Dense(16)])


@g.register
class LstmNet(demo.TinyConvNet):
  def task(self):
    p = super().task().set(name="lstm_net")
    p.body = g.from_keras(BODY)
    p.softmax.input_dim = 16
    p.pipeline.set(num_cells=2, num_micro_batches=2)
    return p
"""


def test_a_param_file_that_builds_an_lstm_trains_on_the_devices_it_asks_for(tmp_path):
  from conftest import run_trainer

  (tmp_path / "recurrent.py").write_text(RECURRENT_PARAM_FILE)
  done = run_trainer(f"--params_path={tmp_path / 'recurrent.py'}", "--model=recurrent.LstmNet",
                     f"--logdir={tmp_path / 'run'}", "--devices=cpu:2", "--max_steps=2")
  assert done.returncode == 0, done.stderr[-2000:]
  assert "step 2/2" in done.stdout


# -- params, weights, statistics -------------------------------------------------------


def test_params_keep_the_config_and_read_it_back_from_text():
  """The layer is kept as its serialized config without its name; params.txt's line
  reads back to equal params, which build the same weights."""
  p = layers.Keras.Params().set(name="fc", layer=keras.layers.Dense(4, activation="gelu",
                                                                  name="my_dense"),
                                input_shape=[6])
  assert p.layer["class_name"] == "Dense" and "name" not in p.layer["config"]
  back = layers.Keras.Params().from_text(p.to_text())
  assert back == p
  a, b = p.instantiate(), back.instantiate()
  np.testing.assert_array_equal(a.kernel.numpy(), b.kernel.numpy())
  other = p.copy().set(name="fc2").instantiate()  # another path: other draws
  assert not np.array_equal(a.kernel.numpy(), other.kernel.numpy())
  x = tf.random.stateless_normal([3, 6], [1, 1])
  assert_close(a(x).numpy(), tf.nn.gelu(x @ a.kernel + a.bias, approximate=False).numpy())


@keras.saving.register_keras_serializable(package="lingvo_gpipe_tests")
class DrawsInBuild(keras.layers.Layer):
  """Makes its initializer in build(), without a seed (as params/keras_examples.py's
  PositionEmbedding does): no config shows it."""

  def build(self, input_shape):
    self.table = self.add_weight(shape=(input_shape[-1], 3), name="table",
                                 initializer=keras.initializers.RandomNormal(stddev=0.02))

  def call(self, x):
    return x @ self.table


def test_an_initializer_made_in_build_without_a_seed_draws_the_same_weights_each_build():
  import random

  p = layers.Keras.Params().set(name="drawn", layer=DrawsInBuild(), input_shape=[4])
  state = random.getstate()
  a, b = p.instantiate(), p.instantiate()
  assert random.getstate() == state  # (the caller's Python random is left as it was)
  np.testing.assert_array_equal(a.table.numpy(), b.table.numpy())
  other = p.copy().set(name="drawn2").instantiate()  # another path: other draws
  assert not np.array_equal(a.table.numpy(), other.table.numpy())


def test_each_keras_weight_is_one_library_variable_and_one_checkpoint_key(tmp_path):
  layer = layers.Keras.Params().set(
      name="attention", layer=keras.layers.MultiHeadAttention(2, 4),
      input_shape={"query_shape": [5, 8], "value_shape": [5, 8]}).instantiate()
  names = sorted(name for name in layer._var_names)
  assert names == sorted(f"{part}_{kind}" for part in ("query", "key", "value",
                                                       "attention_output")
                         for kind in ("kernel", "bias"))
  path = tf.train.Checkpoint(model=layer).write(str(tmp_path / "ckpt"))
  keys = [key for key, _ in tf.train.list_variables(path) if key.startswith("model/")]
  assert sorted(keys) == [f"model/{n}/.ATTRIBUTES/VARIABLE_VALUE" for n in names]
  assert layer.num_params() == layer.keras_layer.count_params()
  with base_layer.shapes_only():  # counted without allocating
    assert layer.params.instantiate().num_params() == layer.num_params()


def test_model_stats_count_a_keras_layer_like_the_native_one():
  from lingvo_gpipe.core import model_stats
  spec = tf.TensorSpec([4, 6], tf.float32)
  keras_stats = model_stats.analyze(layers.Keras.Params().set(
      name="fc", layer=keras.layers.Dense(8), input_shape=[6]), spec)[0]
  native = model_stats.analyze(layers.Linear.Params().set(name="fc", input_dim=6,
                                                          output_dim=8), spec)[0]
  assert (keras_stats.num_params, keras_stats.flops) == (native.num_params, native.flops)
  assert keras_stats.output_shapes == native.output_shapes


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_keras_layer_computes_in_fprop_dtype_through_its_policy(dtype):
  """fprop_dtype picks Keras's mixed policy: outputs in the half dtype, weights float32,
  values those of the float32 layer within the half dtype's rounding."""
  p = layers.Keras.Params().set(name="fc", layer=keras.layers.Dense(8, activation="relu"),
                                input_shape=[6])
  full, half = p.instantiate(), p.copy().set(fprop_dtype=dtype).instantiate()
  assert half.keras_layer.dtype_policy.name == f"mixed_{dtype}"
  assert {v.dtype for v in half.variables} == {tf.float32}
  x = tf.random.stateless_normal([4, 6], [2, 2])
  out = half(x)
  assert out.dtype == tf.as_dtype(dtype)
  assert_close(tf.cast(out, tf.float32).numpy(), full(x).numpy(), ulps=16, dtype=dtype)


# -- refusals ------------------------------------------------------------------------------


@keras.saving.register_keras_serializable(package="lingvo_gpipe_tests")
class _LossAdder(keras.layers.Layer):
  def call(self, x):
    self.add_loss(tf.reduce_sum(x))
    return x


@pytest.mark.parametrize("make,message", [
    (lambda: layers.Keras.Params().set(name="b", layer=keras.Sequential(
        [keras.Input((4,)), keras.layers.BatchNormalization()])),
     r"b: Keras layer 'batch_normalization.*' \(BatchNormalization\) assigns its moving "
     r"statistics in call.*g.from_keras makes it g.layers.BatchNorm"),
    (lambda: layers.Keras.Params().set(name="rnn", layer=keras.layers.SimpleRNN(
        4, stateful=True), input_shape=[3, 2]),
     r"rnn: Keras layer .*SimpleRNN\) is stateful"),
    (lambda: layers.Keras.Params().set(name="fc", layer=keras.layers.Dense(
        4, kernel_regularizer="l2"), input_shape=[3]),
     r"fc: Keras layer .*\(Dense\) has kernel_regularizer: Keras adds it to model.losses"),
    (lambda: layers.Keras.Params().set(name="fc", layer={"class_name": "NoSuchLayer",
                                                         "config": {}}),
     r"fc: Keras cannot build 'NoSuchLayer' from its config"),
    (lambda: layers.Keras.Params().set(name="fc", layer=keras.layers.Dense(4),
                                       input_shape=[2, "x"]),
     r"fc: Keras layer 'Dense' cannot be built for input_shape=\[2, 'x'\]"),
    (lambda: layers.Keras.Params().set(name="fc", layer=keras.layers.Dense(4),
                                       fprop_dtype="float64"),
     r"fc: a Keras layer takes dtype=float32 with fprop_dtype in"),
    (lambda: layers.Keras.Params().set(name="fc"), r"fc: layer is not set"),
])
def test_what_a_pipeline_cannot_run_faithfully_is_refused_at_build(make, message):
  with pytest.raises(hyperparams.ParamsError, match=message):
    make().instantiate()


def test_a_bad_layer_value_is_refused_when_set():
  with pytest.raises(hyperparams.ParamsError, match=r"layer must be a keras.layers.Layer or "
                     r"its keras.layers.serialize dict, got str"):
    layers.Keras.Params().set(layer="Dense")


@pytest.mark.parametrize("layer,message", [
    (keras.layers.Dense(4), r"fc: the Keras layer creates weight 'kernel' on its first "
     r"call; give input_shape"),
    (_LossAdder(), r"fc: the Keras layer adds a loss in call"),
])
def test_what_shows_only_when_called_is_refused_at_the_first_call(layer, message):
  fc = layers.Keras.Params().set(name="fc", layer=layer).instantiate()
  with pytest.raises(hyperparams.ParamsError, match=message):
    fc(tf.ones([2, 3]))


def test_from_keras_refuses_what_it_cannot_cut():
  class Subclassed(keras.Model):
    def call(self, x):
      return x

  with pytest.raises(hyperparams.ParamsError, match=r"Keras model .* \(Subclassed\) is "
                     r"subclassed: its call is Python that no config records"):
    g.from_keras(Subclassed())
  a, b = keras.Input((3,)), keras.Input((3,))
  two = keras.Model([a, b], keras.layers.Add()([a, b]))
  with pytest.raises(hyperparams.ParamsError, match=r"has 2 inputs and 1 outputs; "
                     r"from_keras takes one output and one input, or two: the ids and an "
                     r"input named 'padding_mask'"):
    g.from_keras(two)
  with pytest.raises(hyperparams.ParamsError, match=r"is not built: start it with "
                     r"keras.Input"):
    g.from_keras(keras.Sequential([keras.layers.Dense(2)]))
  scaled = keras.Sequential([keras.Input((6, 6, 3)), keras.layers.BatchNormalization(
      scale=False, name="bn")])
  with pytest.raises(hyperparams.ParamsError, match=r"'bn' \(BatchNormalization\) cannot "
                     r"become g.layers.BatchNorm: its scale=False"):
    g.from_keras(scaled)


# -- the trainer, export and the binary ----------------------------------------------


def example_params(key: str, **pipeline):
  """A Keras example's params for a test: batch 8, 16 eval examples, each step saved."""
  from lingvo_gpipe import model_registry
  model_registry.load_param_files([])
  p = model_registry.get_params(key)
  p.train_input.batch_size = 8
  p.eval_input.set(batch_size=8, num_examples=16)
  p.task.train.set(save_interval_steps=1, summary_interval_steps=1, log_interval_steps=1)
  p.task.pipeline.set(**pipeline)
  return p.freeze()


def checkpointed(logdir) -> dict:
  """{key: value} of the run's newest checkpoint (keys independent of K)."""
  reader = tf.train.load_checkpoint(str(logdir / "train"))
  return {key: reader.get_tensor(key)
          for key, dtype in reader.get_variable_to_dtype_map().items()
          if "/.ATTRIBUTES/" in key and dtype.is_floating}


@pytest.mark.parametrize("key, dtype", quick_sample(
    [("keras_examples.KerasConvNet", "bfloat16"), ("keras_examples.KerasConvNet", "float16"),
     ("keras_examples.KerasTransformerLm", "bfloat16"), ("keras_masks_test.Gpt2Lm", "bfloat16"),
     ("keras_masks_test.Gpt2Lm", "float16")],
    quick=[("keras_examples.KerasConvNet", "bfloat16"), ("keras_masks_test.Gpt2Lm", "float16")]))
def test_half_precision_exports_of_keras_models_agree_with_float32(tmp_path, key, dtype):
  """The Keras examples and a GPT-2-shaped model of KerasHub's layers (tied, with a
  padding mask) trained a step and served in a half dtype (weights stored so; Keras's
  policy casts them), against float32, to the half dtype's precision."""
  from lingvo_gpipe import exporter
  from lingvo_gpipe.tasks import serving
  from lingvo_gpipe.trainer import Trainer

  if key.startswith("keras_masks_test."):
    pytest.importorskip("keras_hub")
    import keras_masks_test  # noqa: F401 (registers the model)

  params = example_params(key, num_cells=2)
  Trainer(params, str(tmp_path), log=lambda _: None).train(1)
  eval_input = params.eval_input.instantiate()

  def model(dtype: str) -> serving.ServingModel:
    task, _, _ = exporter.restore_for_inference(params, str(tmp_path), None, None, dtype,
                                                log=lambda _: None)
    return serving.ServingModel(task, eval_input, serving.ServingOptions(dtype=dtype))

  half, full = model(dtype), model("float32")
  assert {v.dtype for v in half.weights.values() if v.dtype.is_floating} == {
      tf.as_dtype(dtype)}
  batch = {k: v.numpy() for k, v in next(iter(eval_input.dataset())).items()}
  tolerance = {"bfloat16": 0.1, "float16": 0.02}[dtype]  # (export_test's, the same nets)
  if "ConvNet" in key:
    got, want = (m("classify", images=batch["image"])["probabilities"] for m in (half, full))
    np.testing.assert_allclose(got.numpy(), want.numpy(), atol=tolerance)
    # Any B, 0 too (a convolution of an empty batch gave its input's shape back).
    empty = full("classify", images=batch["image"][:0])
    assert empty["probabilities"].shape == (0, want.shape[1])
    assert empty["top_k_classes"].shape[0] == 0
  else:
    got, want = (m("score", ids=batch["ids"], paddings=batch["paddings"])["token_log_probs"]
                 for m in (half, full))
    np.testing.assert_allclose(got.numpy(), want.numpy(), atol=tolerance * 5, rtol=tolerance)


def test_a_keras_language_models_ids_are_checked_by_its_embeddings_vocabulary(tmp_path):
  """KerasTransformerLm's ids are bounded by its Keras embedding's vocab_size (204, the
  corpus's) and its labels by the final Dense's units: pre-flight refuses a vocabulary
  smaller than the data's, and the served score and generate refuse an id past it
  (an XLA gather would clamp it)."""
  from lingvo_gpipe import exporter, preflight
  from lingvo_gpipe.tasks import serving
  from lingvo_gpipe.trainer import Trainer

  params = example_params("keras_examples.KerasTransformerLm", num_cells=2)
  embedding = params.task.stack.layers[0].layer["config"]
  vocab = embedding["vocab_size"]
  bounds = params.task.cls.id_bounds(params.task)
  assert (bounds["ids"].bound, bounds["labels"].bound) == (vocab, vocab) == (
      params.train_input.instantiate().id_space_size(), 204)
  small = params.copy()
  small.task.stack.layers[0].layer["config"]["vocab_size"] = 100
  with pytest.raises(hyperparams.ParamsError, match=r"task.stack.layers\[0\].layer's "
                     r"vocab_size=100 is smaller than train_input's 204 ids"):
    preflight.preflight(small, "train")

  Trainer(params, str(tmp_path), log=lambda _: None).train(1)
  task, _, _ = exporter.restore_for_inference(params, str(tmp_path), None, None, "float32",
                                              log=lambda _: None)
  served = serving.ServingModel(task, params.eval_input.instantiate(),
                                serving.ServingOptions(dtype="float32"))
  ids = np.array([[1, 5, vocab]], np.int32)
  with pytest.raises(tf.errors.InvalidArgumentError, match=rf"score: ids.*{vocab}"):
    served("score", ids=ids, paddings=np.zeros(ids.shape, np.float32))
  with pytest.raises(tf.errors.InvalidArgumentError, match=rf"generate: prefix_ids.*{vocab}"):
    served("generate", prefix_ids=ids, max_new_tokens=2, temperature=0.0, seed=1)
  # Paddings are 0 or 1 (7 scaled a score by -6, NaN made it NaN); T = 0 scores nothing.
  for bad in (7.0, 0.5, float("nan")):
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"score: paddings must be 0 "
                       r"\(a token\) or 1 \(padding\)"):
      served("score", ids=np.array([[1, 5]], np.int32), paddings=np.array([[0, bad]],
                                                                          np.float32))
  # At most max_decode_length positions (128 here, the position table's length).
  long = np.ones([1, 129], np.int32)
  with pytest.raises(tf.errors.InvalidArgumentError, match=r"score: ids has more positions "
                     r"than this export serves, 128 \(max_decode_length=128"):
    served("score", ids=long, paddings=np.zeros(long.shape, np.float32))
  empty = served("score", ids=np.zeros([2, 0], np.int32), paddings=np.zeros([2, 0], np.float32))
  assert empty["token_log_probs"].shape == (2, 0)
  assert empty["log_prob"].numpy().tolist() == [0.0, 0.0]


def weights_file_model(kind: str) -> keras.Model:
  """'conv_bn': a Sequential with batch norm (a library BatchNorm unit) and dropout;
  'nested': a frozen Sequential backbone inside a functional model; 'residual': blocks
  of several layers (each block one unit); 'gpt2': KerasHub decoders, a tied
  embedding."""
  if kind == "gpt2":
    pytest.importorskip("keras_hub")
    from keras_masks_test import gpt2_shaped  # noqa: PLC0415
    return gpt2_shaped()
  if kind == "ops_block":  # (a block of one Dense and Keras ops, not layers)
    inputs = keras.Input((6,))
    h = keras.layers.Dense(8, name="embed")(inputs)
    h = h + keras.ops.tanh(keras.layers.Dense(8, name="a")(h))
    return keras.Model(inputs, keras.layers.Dense(2, name="out")(h))
  if kind == "twice":  # (saved at its first place only)
    shared = keras.layers.Dense(6, activation="tanh", name="sh")
    return keras.Sequential([keras.Input((6,)), shared, shared, keras.layers.Dense(2)])
  return {"conv_bn": conv_bn_model, "nested": lambda: frozen_model("nested"),
          "residual": lambda: residual_model(blocks=2)}[kind]()


@pytest.mark.parametrize("kind", quick_sample(
    ["conv_bn", "nested", "residual", "gpt2", "ops_block", "twice"],
    quick=["conv_bn", "gpt2", "ops_block"]))
def test_a_stack_starts_from_a_keras_weights_file_as_from_the_model_itself(
    tmp_path, cpu_devices, kind):
  """A `.weights.h5` file (model.save_weights) sets each unit's weights, read at the
  place from_keras recorded, to exactly what load_keras_weights copies from the model
  object itself: Keras units, blocks, nested models, batch norms, tied units."""
  from lingvo_gpipe.core.from_keras import load_saved_keras_weights

  keras.utils.set_random_seed(31)
  model = weights_file_model(kind)
  path = str(tmp_path / "pretrained.weights.h5")
  model.save_weights(path)
  want = pipelined(model, num_cells=2, num_micro_batches=1, devices=cpu_devices[:2])
  got = PipeliningLayer.Params().set(name="body", layers=g.from_keras(model).layers,
                                     num_cells=2, num_micro_batches=1,
                                     devices=cpu_devices[:2]).instantiate()
  values = [(a.path if hasattr(a, "path") else a.name, a, b)
            for a, b in zip(got.variables, want.variables)]
  assert any(not np.array_equal(a.numpy(), b.numpy()) for _, a, b in values)
  load_saved_keras_weights(path, got)
  for name, a, b in values:
    np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=name)


def test_a_weights_file_that_does_not_fit_is_refused_naming_the_param(tmp_path, cpu_devices):
  from lingvo_gpipe.core.from_keras import load_saved_keras_weights

  stack = pipelined(conv_bn_model(), num_cells=2, num_micro_batches=1,
                    devices=cpu_devices[:2])
  wider = keras.Sequential([keras.Input((6, 6, 3)), keras.layers.Conv2D(
      8, 3, use_bias=False), keras.layers.BatchNormalization(),
      keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(2)])
  other = dense_chain()
  for model, name in ((wider, "wider"), (other, "other")):
    model.save_weights(tmp_path / f"{name}.weights.h5")
  (tmp_path / "text.weights.h5").write_text("not a weights file")
  for name, message in [
      ("wider", r"body/conv: the file.s weights do not fit"),
      ("other", r"body/conv: the file holds no weights at 'layers/conv2d'"),
      ("text", r"not a Keras weights file"),
      ("missing", r"no such file"),
  ]:
    path = str(tmp_path / f"{name}.weights.h5")
    with pytest.raises(hyperparams.ParamsError,
                       match=rf"task.train.init_from_keras='{path}'.*({message})"):
      load_saved_keras_weights(path, stack)
  with pytest.raises(hyperparams.ParamsError, match=r"neither a .keras file .* nor a "
                     r".weights.h5 file"):
    load_saved_keras_weights(str(tmp_path / "model.h5"), stack)


@EXHAUSTIVE
def test_a_fresh_run_starts_from_a_saved_keras_models_weights_and_a_resumed_one_ignores_it(
    tmp_path):
  """task.train.init_from_keras: KerasConvNet's units start from a saved conv_net()'s
  weights (every weight equal, moving statistics too); through the binary a fresh run
  says so and trains, a resumed one restores its checkpoint instead, and a model of
  other shapes is refused by pre-flight in one line, nothing written."""
  from conftest import run_trainer
  from lingvo_gpipe_params.keras_examples import conv_net

  from lingvo_gpipe.trainer import Trainer

  keras.utils.set_random_seed(12)
  pretrained = conv_net()
  path = str(tmp_path / "pretrained.keras")
  pretrained.save(path)
  params = example_params("keras_examples.KerasConvNet", num_cells=2).copy()
  params.task.train.init_from_keras = path
  trainer = Trainer(params.freeze(), str(tmp_path / "in_process"), log=lambda _: None)
  trainer.train(0)  # (nothing to train: the weights as the run starts)
  theirs = {v.path.split("/", 1)[-1]: v.numpy() for v in pretrained.weights}
  ours = {f"{unit.name}/{name}": tf.convert_to_tensor(getattr(unit, name)).numpy()
          for unit in trainer.task.main_stack.walk() if isinstance(unit, (Keras,
                                                                        layers.BatchNorm))
          for name in unit._var_names}  # noqa: SLF001
  assert sorted(ours) == sorted(theirs)
  for key, value in ours.items():
    np.testing.assert_array_equal(value, theirs[key], err_msg=key)

  logdir = tmp_path / "run"
  common = ("--model=keras_examples.KerasConvNet", f"--logdir={logdir}", "--devices=cpu:2",
            f"--params_override=task.train.init_from_keras='{path}'")
  first = run_trainer(*common, "--max_steps=1")
  assert first.returncode == 0, first.stderr[-2000:]
  assert f"Initialized from the Keras model {path}" in first.stdout
  resumed = run_trainer(*common, "--max_steps=2")
  assert resumed.returncode == 0, resumed.stderr[-2000:]
  assert "Resuming from checkpoint" in resumed.stdout and "Initialized" not in resumed.stdout
  os.remove(path)  # a resumed run does not read it, nor does its pre-flight
  again = run_trainer(*common, "--max_steps=3")
  assert again.returncode == 0, again.stderr[-2000:]
  conv_net(features=32).save(tmp_path / "narrow.keras")
  narrow = run_trainer("--model=keras_examples.KerasConvNet", f"--logdir={tmp_path / 'no'}",
                       "--devices=cpu:2", "--params_override=task.train.init_from_keras="
                       f"'{tmp_path / 'narrow.keras'}'")
  assert narrow.returncode == 2, narrow.stderr[-2000:]
  errors = [line for line in narrow.stderr.splitlines() if line.startswith("error:")]
  assert len(errors) == 1 and "task.train.init_from_keras=" in errors[0], errors
  assert not (tmp_path / "no").exists()


@EXHAUSTIVE
def test_a_run_resumed_with_a_layer_frozen_is_refused_in_one_line_writing_nothing(tmp_path):
  from conftest import run_trainer

  logdir = tmp_path / "run"
  common = ("--model=keras_examples.KerasConvNet", f"--logdir={logdir}", "--devices=cpu:2")
  assert run_trainer(*common, "--max_steps=1").returncode == 0
  before = sorted(str(p) for p in logdir.rglob("*"))
  done = run_trainer(*common, "--max_steps=2", "--params_override=task.body.layers[1].frozen=True")
  assert done.returncode == 2, done.stderr[-2000:]
  errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
  assert len(errors) == 1 and "task.body.layers[1].frozen: False -> True" in errors[0], errors
  assert "freezing or unfreezing a layer" in errors[0]
  assert sorted(str(p) for p in logdir.rglob("*")) == before


@EXHAUSTIVE
def test_a_keras_convnet_resumed_with_k_changed_equals_one_run_and_serves_it(tmp_path):
  """KerasConvNet (Sequential with batch norm and dropout): 2 steps at K=2 then 1 at
  K=1 give the weights of 3 steps at K=2 (masks and micro-batch statistics depend on
  neither K), and the exported classify equals the trainer's eval forward."""
  from lingvo_gpipe import exporter
  from lingvo_gpipe.trainer import Trainer

  Trainer(example_params("keras_examples.KerasConvNet", num_cells=2),
          str(tmp_path / "straight"), log=lambda _: None).train(3)
  logdir = str(tmp_path / "resumed")
  Trainer(example_params("keras_examples.KerasConvNet", num_cells=2), logdir,
          log=lambda _: None).train(2)
  params = example_params("keras_examples.KerasConvNet", num_cells=1)
  resumed = Trainer(params, logdir, log=lambda _: None)
  resumed.train(3)
  want, got = checkpointed(tmp_path / "straight"), checkpointed(tmp_path / "resumed")
  assert sorted(got) == sorted(want)
  assert "task/body/layers/4/kernel/.ATTRIBUTES/VARIABLE_VALUE" in got  # conv2: Keras's name
  for key, value in got.items():
    assert_close(value, want[key])

  path = exporter.export(params, logdir, model_name="keras_examples.KerasConvNet",
                         log=lambda _: None)
  images = next(iter(params.eval_input.instantiate().dataset()))["image"]
  served = tf.saved_model.load(path).signatures["classify"](images=images)
  task = resumed.task
  with base_layer.step_context(training=False, step=0):
    expected = tf.nn.softmax(task.softmax(base_layer.call_with(task.main_stack, images)))
  assert_close(served["probabilities"].numpy(), expected.numpy())


def test_a_keras_transformer_lm_trains_and_scores_as_its_forward(tmp_path):
  from lingvo_gpipe import exporter
  from lingvo_gpipe.tasks import serving
  from lingvo_gpipe.trainer import Trainer

  params = example_params("keras_examples.KerasTransformerLm")
  trainer = Trainer(params, str(tmp_path), log=lambda _: None)
  trainer.train(1)
  batch = next(iter(params.eval_input.instantiate().dataset()))
  path = exporter.export(params, str(tmp_path), model_name="keras_examples.KerasTransformerLm",
                         options=serving.ServingOptions(max_decode_length=16),
                         log=lambda _: None)
  served = tf.saved_model.load(path).signatures["score"](
      ids=batch["ids"], paddings=tf.cast(batch["paddings"], tf.float32))
  with base_layer.step_context(training=False, step=0):
    logits = base_layer.call_with(trainer.task.main_stack, (batch["ids"], batch["paddings"]))
  log_probs = tf.nn.log_softmax(tf.cast(logits, tf.float32))
  # token t's log p(ids[t] | ids[<t]) is read from position t - 1's logits.
  want = tf.gather(log_probs[:, :-1], batch["ids"][:, 1:], batch_dims=2)
  want *= 1.0 - tf.cast(batch["paddings"][:, 1:], tf.float32)
  assert_close(served["token_log_probs"].numpy()[:, 1:], want.numpy())


@pytest.mark.parametrize("override,message", [
    ("task.body.layers[4].layer={'module': 'keras.layers', 'class_name': "
     "'BatchNormalization', 'config': {}}", r"\(BatchNormalization\) assigns its moving "
     r"statistics in call"),
    ("task.body.layers[0].layer={'module': 'keras.layers', 'class_name': 'Dense', "
     "'config': {'units': 4, 'kernel_regularizer': 'l2'}}", r"has kernel_regularizer"),
    # (found by pre-flight's traced forward: the config has no build shape)
    ("task.body.layers[13].layer={'module': 'keras.layers', 'class_name': 'Dense', "
     "'config': {'units': 64}}", r"creates weight 'kernel' on its first call"),
    # (a Keras body's width is Keras's: pre-flight traces it into the head)
    ("task.softmax.input_dim=32", r"task.softmax.input_dim=32, but the main stack's output "
     r"\[\d+, 64\] is 64 wide; valid: task.softmax.input_dim=64"),
])
def test_the_binary_refuses_a_keras_layer_in_one_line_writing_nothing(tmp_path, override,
                                                                      message):
  import re

  from conftest import run_trainer
  logdir = tmp_path / "run"
  done = run_trainer("--model=keras_examples.KerasConvNet", f"--logdir={logdir}",
                     "--devices=cpu:2", f"--params_override={override}")
  assert done.returncode == 2, done.stderr[-2000:]
  errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
  assert len(errors) == 1 and re.search(message, errors[0]), done.stderr[-2000:]
  assert not logdir.exists()


@pytest.mark.parametrize("dtype", quick_sample(["bfloat16", "float16"], quick=["float16"]))
def test_a_pipelined_keras_model_in_a_half_dtype_equals_it_unpartitioned(cpu_devices, dtype):
  """fprop_dtype on the pipeline reaches the Keras units (their mixed policy): K=2, M=4
  against the same units as one Sequential in that dtype, same weights."""
  keras.utils.set_random_seed(6)
  model = residual_model()
  data = batch(2)
  results = []
  for pipeline in ({"num_cells": 2, "num_micro_batches": 4, "devices": cpu_devices[:2]}, {}):
    body = g.from_keras(model)
    cls = PipeliningLayer if pipeline else layers.Sequential
    stack = cls.Params().set(name="body", layers=body.layers, fprop_dtype=dtype,
                             **pipeline).instantiate()
    g.load_keras_weights(stack, model)
    assert {unit.keras_layer.dtype_policy.name for unit in stack.walk()
            if isinstance(unit, Keras)} == {f"mixed_{dtype}"}
    loss, grads = engine_loss_and_grads(stack, train_step.StackWithLoss(stack, mse), data,
                                        STEP)
    paths = keras_paths(stack, model)
    results.append((loss, {paths[v.ref()]: grad for v, grad in zip(
        stacked_variables.trainable_weights(stack), grads)}))
  (loss, grads), (want_loss, want) = results
  assert_close(loss, want_loss, ulps=HALF_REORDERED, dtype=dtype)
  assert sorted(grads) == sorted(want)
  for path, grad in grads.items():
    assert_close(grad, want[path], ulps=HALF_REORDERED, dtype=dtype)


@keras.saving.register_keras_serializable(package="lingvo_gpipe_tests")
class MaskedSelfAttention(keras.layers.Layer):
  """(x [B, T, D], mask [B, T] of 1 where a key may be attended) → x + attention(x)."""

  def __init__(self, heads: int, **kwargs):
    super().__init__(**kwargs)
    self.heads = heads
    # (No biases: the key bias's gradient is zero up to rounding, softmax being blind
    # to a shift shared by all keys; no scale of its own bounds that.)
    self.attention = keras.layers.MultiHeadAttention(heads, 4, use_bias=False,
                                                     name="attention")

  def build(self, x_shape, mask_shape=None):
    self.attention.build(x_shape, x_shape)

  def call(self, x, mask):
    return x + self.attention(x, x, attention_mask=mask[:, None, :] > 0.5)

  def get_config(self):
    return {**super().get_config(), "heads": self.heads}


def test_units_that_take_and_pass_on_a_mask_have_keras_gradients(cpu_devices):
  """(x, mask) stacks: a first unit takes x only and passes the mask on (num_inputs,
  pass_through), blocks read both and pass the mask on, the last takes x: pipelined at
  K=2 against the same Keras layers called directly under a tape."""
  keras.utils.set_random_seed(7)
  embed, out = keras.layers.Dense(8, name="embed"), keras.layers.Dense(2, name="out")
  blocks = [MaskedSelfAttention(2, name=f"block{i}") for i in range(2)]
  x = tf.random.stateless_normal([BATCH, 5, 3], [8, 1])
  mask = tf.cast(tf.random.stateless_uniform([BATCH, 5], [8, 2]) > 0.3, tf.float32)
  target = tf.random.stateless_normal([BATCH, 5, 2], [8, 3])
  with tf.GradientTape() as tape:
    h = embed(x)
    for block in blocks:
      h = block(h, mask)
    want_loss = tf.reduce_mean(tf.square(out(h) - target))
  keras_layers = [embed, *blocks, out]
  weights = [w for layer in keras_layers for w in layer.trainable_weights]
  want = dict(zip([w.path for w in weights], tape.gradient(want_loss, weights)))

  units = [Keras.Params().set(name="embed", layer=embed, input_shape=[5, 3], num_inputs=1,
                              pass_through=1),
           *[Keras.Params().set(name=f"block{i}", layer=block, pass_through=1,
                                input_shape={"x_shape": [5, 8], "mask_shape": [5]})
             for i, block in enumerate(blocks)],
           Keras.Params().set(name="out", layer=out, input_shape=[5, 8], num_inputs=1)]
  stack = PipeliningLayer.Params().set(name="body", layers=units, num_cells=2,
                                       num_micro_batches=2,
                                       devices=cpu_devices[:2]).instantiate()
  paths = {}
  for unit in stack.walk():
    if isinstance(unit, Keras):
      source = next(layer for layer in keras_layers if layer.name == unit.name)
      unit.assign_from(source)
      paths.update({getattr(unit, name).ref(): path
                    for name, path in unit.keras_weight_paths(source).items()})
  data = {"inputs": (x, mask), "target": target}
  loss, grads = engine_loss_and_grads(stack, train_step.StackWithLoss(stack, mse), data, STEP)
  assert_close(loss, want_loss.numpy())
  assert len(grads) == len(want)
  for variable, grad in zip(stacked_variables.trainable_weights(stack), grads):
    assert_close(grad, want[paths[variable.ref()]].numpy())


def test_identical_blocks_are_one_kind_and_a_model_gives_one_text():
  """A functional model's residual blocks are one kind of unit (their layers renamed
  by position and class), so they share traces and stacks; the same model built twice
  (Keras's name counters moved on) gives the same params text."""
  first, second = (g.from_keras(residual_model(blocks=3)) for _ in range(2))
  assert first.to_text() == second.to_text()
  blocks = first.layers[1:4]
  assert len({base_layer.params_kind(p) for p in blocks}) == 1
  names = [[layer["name"] for layer in p.layer["config"]["layers"]] for p in blocks]
  assert names[0] == ["input_layer_0", "layer_normalization_1", "dense_2", "add_3"]
  assert names[0] == names[1] == names[2]
