"""A cell's run of layers of one kind as one loop over their stacked weights
(`scan_layers`, pipeline/layer_function.py `_KindFunction.scan`).

References: the same pipeline calling its layers one by one (scan_layers=False),
which the equivalence grid (gpipe_test.py) checks against the unpartitioned model;
and the traced step of the same cells at another depth.
"""

import collections

import numpy as np
import pytest
import tensorflow as tf
from layer_blocks import BATCH, DIM, block, step_function
from numerics import assert_close
from tiers import EXHAUSTIVE, quick_sample

from lingvo_gpipe import train_step
from lingvo_gpipe.core import layers, stacked_variables
from lingvo_gpipe.pipeline.layer import PipelineError, PipeliningLayer


def build(num_blocks: int, scan: bool, devices, recompute: str = "always",
          schedule: str = "gpipe", num_cells: int = 2, batch_norm: bool = True,
          dtype: str | None = None):
  """num_blocks blocks, then one Linear of another kind: each cell holds a run of
  blocks (the last cell's ends in a run of length 1)."""
  stack = [block(f"block{i}") for i in range(num_blocks)]
  if not batch_norm:  # (its moving statistics are read once per layer)
    for b in stack:
      b.layers = [p for p in b.layers if p.name != "bn"]
  stack.append(layers.Linear.Params().set(name="out", input_dim=DIM, output_dim=DIM))
  model = PipeliningLayer.Params().set(
      name="stack", layers=stack, num_cells=num_cells, num_micro_batches=3,
      devices=devices[:num_cells], recompute=recompute, schedule=schedule,
      scan_layers=scan, fprop_dtype=dtype, random_seed=5).instantiate()
  wrapped = train_step.StackWithLoss(model, lambda out, h: {
      "loss": (tf.reduce_mean(tf.square(tf.cast(out, tf.float32) - h["y"])),
               tf.cast(tf.shape(out)[0], tf.float32))})
  return model, wrapped


def per_weight(model, grads) -> dict[str, np.ndarray]:
  """Each weight's gradient by name (the stacks differ between the two settings)."""
  variables = model.trainable_variables
  weights = stacked_variables.weights_of(variables)
  return {w.name: np.asarray(g) for w, g in zip(
      weights, stacked_variables.per_weight(weights, variables,
                                            [tf.convert_to_tensor(g) for g in grads]))}


@pytest.mark.parametrize("schedule, recompute, dtype", quick_sample([
    ("gpipe", "always", None), ("1f1b", "never", None), ("1f1b", "except_last", None),
    ("zb_h1", "always", None), ("gpipe", "always", "bfloat16"), ("1f1b", "never", "bfloat16")],
    quick=[("gpipe", "always", "bfloat16")]))
def test_a_loop_over_a_run_gives_what_calls_one_by_one_give(cpu_devices, schedule, recompute,
                                                            dtype):
  """Bit for bit: the loop runs each layer through the same traced function (and its
  gradient through TensorFlow's same pair) on the same rows and seeds (zb_h1's weight
  gradients: to float32's rounding, see below)."""
  results = []
  for scan in (True, False):
    model, wrapped = build(7, scan, cpu_devices, recompute, schedule, dtype=dtype)
    loss, grads, stats = step_function(model, wrapped)()
    results.append((loss.numpy(), per_weight(model, grads),
                    [(path, {k: v.numpy() for k, v in s.items()}) for path, s in stats]))
  (loss, grads, stats), (want_loss, want_grads, want_stats) = results
  assert loss == want_loss
  assert grads.keys() == want_grads.keys()
  for name in want_grads:
    if schedule == "zb_h1":
      # Its W actions compute a stack's weight gradients as one batched product, and
      # the two settings stack the weights apart (a stack per weight of a kind, or
      # per shape): batches of other sizes, which Eigen (oneDNN off) may sum in
      # another order.
      assert_close(grads[name], want_grads[name], err_msg=name)
    else:
      np.testing.assert_array_equal(grads[name], want_grads[name], err_msg=name)
  # Each batch norm reports its own statistics, for its own path, once per micro-batch.
  assert [p for p, _ in stats] == [p for p, _ in want_stats]
  for (path, s), (_, want) in zip(stats, want_stats):
    for key in want:
      np.testing.assert_array_equal(s[key], want[key], err_msg=f"{path} {key}")


@EXHAUSTIVE
def test_runs_become_loops_and_calls_that_defer_weight_products_stay_calls(cpu_devices):
  """Per cell body (2 cells × 2 micro-batch shapes: 8 examples in 3), its loops: a
  forward runs its run of blocks as one loop, a re-materialized backward as two (the
  recomputed forward and its gradient); under zb_h1 the backward records each weight
  product for its W, so it calls its layers one by one (its forward still loops)."""
  def loops(schedule: str) -> dict[str, list[int]]:
    model, wrapped = build(7, True, cpu_devices, schedule=schedule)
    graph = step_function(model, wrapped).get_concrete_function().graph.as_graph_def()
    out = collections.defaultdict(list)
    for f in graph.library.function:
      for body in ("_forward_body", "_backward_body"):
        if body in f.signature.name:
          out[body].append(sum(n.op in ("While", "StatelessWhile") for n in f.node_def))
    return dict(out)
  assert loops("gpipe") == {"_forward_body": [1] * 4, "_backward_body": [2] * 4}
  assert loops("zb_h1") == {"_forward_body": [1] * 4, "_backward_body": [0] * 4}


def op_counts(num_blocks: int, devices) -> collections.Counter:
  """The traced step's ops by type. A zero that tf.zeros makes (TensorFlow's gradient
  code makes them too) is one Const below 1000 elements and a Fill of a Const shape
  above, so a zero [n, ...] changes form with n: each Fill and its shape count as the
  one Const."""
  model, wrapped = build(num_blocks, True, devices, recompute="always", batch_norm=False)
  graph = step_function(model, wrapped).get_concrete_function().graph.as_graph_def()
  counts = collections.Counter(n.op for n in graph.node)
  for f in graph.library.function:
    counts.update(n.op for n in f.node_def)
  counts["Const"] -= counts.pop("Fill", 0)
  return counts


@EXHAUSTIVE
def test_the_traced_step_does_not_grow_with_depth(cpu_devices):
  """The same cells (a run of blocks, then a Linear) at L = 8 and L = 512 blocks: the
  same ops, one by one (tracing, the function library, Grappler and the first call's
  instantiation are then constant in depth). Without batch norm: its moving
  statistics, variables of their own, are read once per layer."""
  assert op_counts(512, cpu_devices) == op_counts(8, cpu_devices)


def test_scan_needs_shared_functions_and_stacks(cpu_devices):
  params = PipeliningLayer.Params().set(
      name="stack", layers=[block("b0"), block("b1")], num_cells=1, devices=cpu_devices[:1],
      scan_layers=True, share_layer_functions=False)
  with pytest.raises(PipelineError, match="scan_layers must be False unless"):
    params.instantiate()


def test_eval_loops_over_runs_too(cpu_devices):
  """Eval (batch norm's moving averages, no dropout) through the loop, which keeps
  nothing for a backward there: the outputs of the calls one by one, bit for bit."""
  data = tf.constant(np.random.RandomState(2).randn(BATCH, DIM), tf.float32)
  outputs = []
  for scan in (True, False):
    model, _ = build(7, scan, cpu_devices)
    outputs.append(tf.function(model)(data).numpy())
  np.testing.assert_array_equal(outputs[0], outputs[1])
