"""A small composite layer for tests of how a pipeline runs its layers
(layer_function_test.py, scan_layers_test.py)."""

from lingvo_gpipe.core import layers

DIM = 8


def block(name: str, keep_prob: float = 0.8):
  """A layer with sublayers: Linear [.., DIM] → [.., DIM], batch norm (statistics) and
  dropout (seeds)."""
  return layers.Sequential.Params().set(name=name, layers=[
      layers.Linear.Params().set(name="fc", input_dim=DIM, output_dim=DIM, activation="TANH"),
      layers.BatchNorm.Params().set(name="bn", dim=DIM),
      layers.Dropout.Params().set(name="drop", keep_prob=keep_prob)])
