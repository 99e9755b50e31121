"""A small composite layer, a batch and a training step for tests of how a pipeline
runs its layers (layer_function_test.py, scan_layers_test.py)."""

import numpy as np
import tensorflow as tf
from conftest import engine_step

from lingvo_gpipe.core import layers

DIM = 8
BATCH = 8


def block(name: str, keep_prob: float = 0.8):
  """A layer with sublayers: Linear [.., DIM] → [.., DIM], batch norm (statistics) and
  dropout (seeds)."""
  return layers.Sequential.Params().set(name=name, layers=[
      layers.Linear.Params().set(name="fc", input_dim=DIM, output_dim=DIM, activation="TANH"),
      layers.BatchNorm.Params().set(name="bn", dim=DIM),
      layers.Dropout.Params().set(name="drop", keep_prob=keep_prob)])


def batch() -> dict[str, tf.Tensor]:
  """{"inputs": [BATCH, DIM], "y": [BATCH, DIM]}, the same each call."""
  rng = np.random.RandomState(1)
  return {"inputs": tf.constant(rng.randn(BATCH, DIM), tf.float32),
          "y": tf.constant(rng.randn(BATCH, DIM), tf.float32)}


def step_function(model, wrapped):
  """The traced training step of `model` (wrapped with its loss) on `batch()` at step 7
  (conftest.engine_step): → (loss, gradients of its trainable variables (a stack
  whole), each batch norm's reported statistics as (path, stats))."""
  return engine_step(model, wrapped, batch(), step=7, variables=model.trainable_variables)
