"""Keras layers in Params stacks and `from_keras` models: each against Keras itself (the
same model, same weights, unpartitioned, differentiated by a GradientTape)."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import engine_loss_and_grads
from numerics import assert_close

import lingvo_gpipe as g
from lingvo_gpipe import train_step
from lingvo_gpipe.core import base_layer, hyperparams, layers, stacked_variables
from lingvo_gpipe.core.keras_layer import Keras
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


def keras_paths(stack: base_layer.BaseLayer, model: keras.Model) -> dict:
  """{library variable ref: the Keras weight path it was loaded from}."""
  sources = {layer.name: layer for layer in model.layers}
  from lingvo_gpipe.core.from_keras import _blocks
  sources.update({block.name: block for block in _blocks(model)})
  paths = {}
  for unit in stack.walk():
    if isinstance(unit, Keras):
      source = sources[unit.name]
      theirs = {v.path.split(f"{source.name}/", 1)[-1]: v.path for v in source.variables}
      for variable, name in unit._bound:
        paths[getattr(unit, name).ref()] = theirs[
            variable.path.split(f"{unit.keras_layer.name}/", 1)[-1]]
  return paths


def pipelined(model: keras.Model, **pipeline) -> PipeliningLayer:
  body = g.from_keras(model)
  stack = PipeliningLayer.Params().set(name="body", layers=body.layers,
                                       **pipeline).instantiate()
  g.load_keras_weights(stack, model)
  return stack


CASES = [("gpipe", 2, 1), ("1f1b", 2, 1), ("zb_h1", 2, 1), ("interleaved_1f1b", 4, 2),
         ("zbv", 4, 2), ("interleaved_zb", 4, 2)]


@pytest.mark.parametrize("recompute", ["always", "never"])
@pytest.mark.parametrize("schedule,num_cells,virtual_stages", CASES)
def test_a_pipelined_functional_model_has_keras_gradients(cpu_devices, schedule, num_cells,
                                                         virtual_stages, recompute):
  keras.utils.set_random_seed(1)
  model = residual_model(blocks=4)
  data = batch()
  want_loss, want = keras_loss_and_grads(model, data)
  stack = pipelined(model, num_cells=num_cells, num_micro_batches=4, schedule=schedule,
                    virtual_stages=virtual_stages, recompute=recompute,
                    devices=cpu_devices[:num_cells // virtual_stages])
  loss, grads = engine_loss_and_grads(stack, train_step.StackWithLoss(stack, mse), data, STEP)
  paths = keras_paths(stack, model)
  weights = stacked_variables.trainable_weights(stack)
  assert len(weights) == len(want)
  assert_close(loss, want_loss)
  for variable, grad in zip(weights, grads):
    assert_close(grad, want[paths[variable.ref()]])
