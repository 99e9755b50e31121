"""Layers of one kind share one traced function (pipeline/layer_function.py).

References: the same pipeline with every layer traced on its own
(share_layer_functions=False), which the equivalence grid (gpipe_test.py) checks
against the unpartitioned model; and the tracing counts and library sizes of stacks
that differ only in their number of layers.
"""

import collections

import pytest
import tensorflow as tf
from layer_blocks import DIM, batch, block, step_function
from numerics import assert_close
from tiers import quick_sample

from lingvo_gpipe import train_step
from lingvo_gpipe.core import layers, stacked_variables
from lingvo_gpipe.pipeline import layer_function
from lingvo_gpipe.pipeline.layer import PipeliningLayer

BATCH_PER_MICRO_BATCH = 4  # layer_blocks.BATCH over build's 2 micro-batches


def build(keep_probs, share: bool = True, recompute: str = "always", num_micro_batches=2):
  model = PipeliningLayer.Params().set(
      name="stack", layers=[block(f"block{i}", p) for i, p in enumerate(keep_probs)],
      num_cells=2, num_micro_batches=num_micro_batches, recompute=recompute,
      share_layer_functions=share, random_seed=5).instantiate()
  wrapped = train_step.StackWithLoss(model, lambda out, h: {
      "loss": (tf.reduce_mean(tf.square(out - h["y"])), tf.cast(tf.shape(out)[0], tf.float32))})
  return model, wrapped


def shared(model):
  return model._function_cache.layers


@pytest.mark.parametrize("recompute", quick_sample(["always", "never"], quick=["never"]))
def test_shared_functions_give_what_layers_traced_apart_give(cpu_devices, recompute):
  """Dropout masks (seeds as arguments), batch statistics (reported for the calling
  layer's own batch norm) and gradients equal those of every layer traced alone."""
  keep_probs = [0.8] * 5
  results = []
  for share in (True, False):
    model, wrapped = build(keep_probs, share, recompute)
    loss, grads, stats = step_function(model, wrapped)()
    results.append((loss.numpy(), [g.numpy() for g in grads],
                    [(path, {k: v.numpy() for k, v in s.items()}) for path, s in stats]))
  (loss, grads, stats), (want_loss, want_grads, want_stats) = results
  assert_close(loss, want_loss)
  for got, want in zip(grads, want_grads):
    assert_close(got, want)
  assert [path for path, _ in stats] == [path for path, _ in want_stats]
  assert len(stats) == len(keep_probs) * 2  # each batch norm, each micro-batch
  for (_, got), (_, want) in zip(stats, want_stats):
    for key in want:
      assert_close(got[key], want[key])


def test_identical_layers_trace_their_function_once_whatever_their_number(cpu_devices):
  for num_layers in (3, 9):
    model, wrapped = build([0.8] * num_layers)
    step_function(model, wrapped).get_concrete_function()
    assert shared(model).num_kinds == 1
    # forward, recompute and backward of every layer, both cells: one trace, and one
    # more for the first cell's first layer, whose input gradient nothing needs
    assert shared(model).tracing_count() == 2, num_layers


def test_layers_that_differ_in_a_param_trace_apart(cpu_devices):
  model, wrapped = build([0.8, 0.9] * 3)
  step_function(model, wrapped).get_concrete_function()
  assert shared(model).num_kinds == 2
  assert shared(model).tracing_count() == 3  # (the first layer's own: the test above)


@pytest.mark.parametrize("recompute", quick_sample(["always", "never"], quick=["always"]))
def test_the_first_cells_first_layer_computes_no_input_gradient(cpu_devices, recompute):
  """A call's backward computes every gradient its function has. The first cell's
  first layer runs a trace of its own whose backward has no gradient for its inputs
  (tf.gradients through it gives None); the other layers' trace keeps it. The step's
  gradients equal those of every layer traced alone
  (test_shared_functions_give_what_layers_traced_apart_give)."""
  model, wrapped = build([0.8] * 3, recompute=recompute)
  step_function(model, wrapped).get_concrete_function()
  (kind,) = shared(model)._functions.values()
  first = model.cell_layers(0)[0]
  x = tf.TensorSpec([BATCH_PER_MICRO_BATCH, DIM], tf.float32)
  info = tf.TensorSpec([3], tf.int64)

  def input_gradient(skip: bool):
    @tf.function
    def gradient(x, info):
      with stacked_variables.bound(model._function_cache.stacks[0]):  # as the cell reads
        variables = [v.value() if isinstance(v, stacked_variables.RowVariable) else v
                     for sub in first.walk() for v in sub.own_variables()]
        concrete = kind.function.get_concrete_function(
            variables, x, info, layer_function._SEEDS, [], 0, not skip)
        outputs, _, _ = concrete(variables, x, info, tf.zeros([len(kind.layout.seeds)],
                                                              tf.int64), [], 0, not skip)
      return tf.gradients(outputs, x)[0]
    return gradient.get_concrete_function(x, info).structured_outputs

  traces = kind.function.experimental_get_tracing_count()
  assert input_gradient(skip=True) is None
  assert input_gradient(skip=False) is not None
  assert kind.function.experimental_get_tracing_count() == traces  # both traced by the step


# What a layer adds to a cell besides its calls: its batch statistics' per-micro-batch
# slots in the loop, its seeds, and the packing of its variables' gradients into the
# cell's flat running sums (a call per chunk of variables of one shape).
LOOP_STATE_OPS = {"Identity", "Const", "TensorListSetItem", "other call"}
CALL_OPS = {"PartitionedCall", "StatefulPartitionedCall"}
CHUNK_FUNCTIONS = ("_add_rows", "_unstack_rows")  # gradient_sums.StackedLayout


def library_ops(num_layers: int, share: bool = True) -> tuple[int, collections.Counter]:
  """(functions, op type → nodes) of the traced step's function library, but for the
  chunk functions of gradient_sums (their number is bounded by the chunk sizes, at most
  log2(MAX_CHUNK) + 1 per kind of variable)."""
  model, wrapped = build([0.8] * num_layers, share)
  graph_def = step_function(model, wrapped).get_concrete_function().graph.as_graph_def()
  functions = [f for f in graph_def.library.function
               if not any(f"_inference_{name}_" in f.signature.name for name in CHUNK_FUNCTIONS)]
  return len(functions), collections.Counter(_op_kind(n) for f in functions for n in f.node_def)


def _op_kind(node) -> str:
  """The op type; for a call, what it calls: a layer kind's function, or another."""
  if node.op not in CALL_OPS:
    return node.op
  return "layer call" if "_layer_body" in node.attr["f"].func.name else "other call"


def test_the_library_grows_by_calls_and_loop_state_only(cpu_devices):
  """Six more identical layers add no function and none of the layers' own ops: three
  calls each (forward; recompute and its gradient in the backward) and their
  statistics' places in the loop. Traced apart, each layer adds its
  ops (matmul, tanh, dropout's random draws, batch norm's moments, their gradients)."""
  num_small, small = library_ops(3)
  num_large, large = library_ops(9)
  grown = large - small
  assert num_small == num_large
  assert set(grown) <= LOOP_STATE_OPS | {"layer call"}, grown
  assert grown["layer call"] == 3 * 6
  _, apart = library_ops(3, share=False)
  assert {"MatMul", "Tanh", "StatelessRandomUniformV2"} <= set(apart - small)


def test_eval_calls_the_shared_functions(cpu_devices):
  outputs = []
  for share in (True, False):
    model, _ = build([0.8] * 4, share)
    outputs.append(tf.function(model)(batch()["inputs"]).numpy())
    if share:
      assert shared(model).num_kinds == 1  # the eval kind (batch norm's moving averages)
  assert_close(outputs[0], outputs[1])


class _Counter(layers.Linear):
  shares_traces = False


def test_a_class_can_opt_out(cpu_devices):
  model = PipeliningLayer.Params().set(
      name="stack", num_cells=1, layers=[
          _Counter.Params().set(name=f"fc{i}", input_dim=DIM, output_dim=DIM)
          for i in range(3)]).instantiate()
  tf.function(lambda: model(batch()["inputs"])).get_concrete_function()
  assert shared(model).num_kinds == 0
