"""The traced training step's size: cells are traced once and called per micro-batch."""

import pytest
import tensorflow as tf

from lingvo_gpipe import train_step
from lingvo_gpipe.core import base_layer, layers
from lingvo_gpipe.pipeline.layer import PipeliningLayer

DIM = 8


def build(num_cells: int, num_micro_batches: int, devices, schedule: str = "gpipe",
          recompute: str = "always"):
  stack = []
  for i in range(8):
    stack += [layers.Linear.Params().set(name=f"fc{i}", input_dim=DIM, output_dim=DIM,
                                         activation="TANH"),
              layers.Dropout.Params().set(name=f"drop{i}", keep_prob=0.9)]
  model = PipeliningLayer.Params().set(
      name="stack", layers=stack, num_cells=num_cells, num_micro_batches=num_micro_batches,
      devices=devices[:num_cells], schedule=schedule, recompute=recompute,
      random_seed=3).instantiate()
  wrapped = train_step.StackWithLoss(model, lambda out, h: {
      "loss": (tf.reduce_mean(tf.square(out - h["y"])),
               tf.cast(tf.shape(out)[0], tf.float32))})
  return model, wrapped


def traced_step(model, wrapped, batch_size: int):
  """The concrete training-step function of `model` at `batch_size`."""
  batch = {"inputs": tf.ones([batch_size, DIM]), "y": tf.zeros([batch_size, DIM])}

  @tf.function
  def step():
    with base_layer.step_context(training=True, step=tf.constant(1, tf.int64),
                                 layer_stats=[], spans=[]):
      return train_step.loss_and_gradients(wrapped, batch, model.trainable_variables)

  return step.get_concrete_function()


def sizes(concrete) -> tuple[int, dict[str, int]]:
  """(ops in the outer graph, {function name: ops in its body})."""
  graph_def = concrete.graph.as_graph_def()
  return len(graph_def.node), {f.signature.name: len(f.node_def)
                               for f in graph_def.library.function}


@pytest.mark.parametrize("num_cells", [2, 4])
@pytest.mark.parametrize("schedule, recompute", [("gpipe", "always"), ("1f1b", "never")])
def test_graph_grows_by_a_constant_per_cell_call_and_bodies_do_not_grow(
    cpu_devices, num_cells, schedule, recompute):
  outer, bodies = {}, {}
  for m in (4, 8):
    model, wrapped = build(num_cells, m, cpu_devices, schedule, recompute)
    outer[m], functions = sizes(traced_step(model, wrapped, batch_size=16))
    bodies[m] = sorted(functions.values())
    # One forward and one backward body per cell (even split: one shape); without
    # recompute, TensorFlow adds a rewrite of the forward that also returns the
    # intermediates, and the backward is that rewrite's gradient.
    assert len(functions) == (3 if recompute == "never" else 2) * num_cells
  assert bodies[4] == bodies[8]
  per_extra_micro_batch = (outer[8] - outer[4]) / 4
  # Per extra micro-batch, each cell adds two calls and their gates, hand-offs and
  # timestamps (measured: 23 ops), whatever the cell's depth (16 layers here). Without
  # recompute the gradients are TensorFlow's own, summed outside the call: one add per
  # variable more.
  bound = 25 * num_cells + (len(model.trainable_variables) if recompute == "never" else 0)
  assert per_extra_micro_batch <= bound, (outer, per_extra_micro_batch)


def test_each_cell_is_traced_once_per_micro_batch_shape(cpu_devices):
  model, wrapped = build(2, 3, cpu_devices)
  traced_step(model, wrapped, batch_size=13)  # micro-batches of 5, 4, 4: two shapes
  for cell in model.cell_functions(wrapped.head):
    assert cell.tracing_count() == 2 * 2  # forward and backward, per shape
  model, wrapped = build(2, 8, cpu_devices)
  traced_step(model, wrapped, batch_size=16)  # eight micro-batches of 2: one shape
  for cell in model.cell_functions(wrapped.head):
    assert cell.tracing_count() == 2


def test_calls_are_not_inlined(cpu_devices):
  """Grappler would inline them and re-optimize the flat graph (slow; and CSE could
  merge a recompute into its forward)."""
  model, wrapped = build(2, 2, cpu_devices)
  graph_def = traced_step(model, wrapped, batch_size=4).graph.as_graph_def()
  names = {f.signature.name: f for f in graph_def.library.function}
  calls = [n for n in graph_def.node if n.op in ("PartitionedCall", "StatefulPartitionedCall")]
  assert len(calls) == 2 * 2 * 2  # K cells × M micro-batches × (forward, backward)
  for call in calls:
    body = names[call.attr["f"].func.name]
    assert body.attr["_noinline"].b, call.name
