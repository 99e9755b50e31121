"""PipeliningLayer against the same layers run unpartitioned on the whole batch."""

import itertools
import re

import numpy as np
import pytest
import tensorflow as tf

from lingvo_gpipe.core import base_layer, gpipe, layers, optimizers, timeline
from lingvo_gpipe.core.base_layer import BaseLayer

DIM = 8
BATCH = 13  # no M > 1 of the grid divides it: every split is uneven
STEP = 3


class PairLayer(BaseLayer):
  """(x, skip) → (dropout(tanh(x·W + b)) + 0.5·skip, x): a two-tensor cell interface."""

  @classmethod
  def Params(cls):  # noqa: N802
    p = super().Params()
    p.define("dim", DIM, "")
    p.define("keep_prob", 0.8, "")
    return p

  def __init__(self, params):
    super().__init__(params)
    self.create_child("proj", layers.Linear.Params().set(
        input_dim=self.params.dim, output_dim=self.params.dim, activation="TANH"))
    self.create_child("drop", layers.Dropout.Params().set(keep_prob=self.params.keep_prob))

  def fprop(self, x, skip):
    return self.drop(self.proj(x)) + 0.5 * skip, x


def pair_layers(num_layers: int = 8) -> list:
  return [PairLayer.Params().set(name=f"pair{i}") for i in range(num_layers)]


def model_params(cls, **pipeline):
  return cls.Params().set(name="stack", layers=pair_layers(), random_seed=11, **pipeline)


def inputs():
  rng = np.random.RandomState(0)
  return (tf.constant(rng.randn(BATCH, DIM), tf.float32),
          tf.constant(rng.randn(BATCH, DIM), tf.float32),
          tf.constant(rng.randn(BATCH, DIM), tf.float32))


def loss_of(outputs, target):
  out, skip = outputs
  return tf.reduce_mean(tf.square(out - target)) + 0.1 * tf.reduce_mean(tf.square(skip))


def reference_loss_and_grads(model):
  """Unpartitioned, whole batch, GradientTape (a different gradient path)."""
  x, skip, target = inputs()
  with tf.GradientTape() as tape:
    with base_layer.step_context(training=True, step=tf.constant(STEP, tf.int64)):
      loss = loss_of(model(x, skip), target)
  return loss.numpy(), [g.numpy() for g in tape.gradient(loss, model.trainable_variables)]


def pipelined_loss_and_grads(model):
  x, skip, target = inputs()

  @tf.function
  def step():
    with base_layer.step_context(training=True, step=tf.constant(STEP, tf.int64)):
      loss = loss_of(model(x, skip), target)
    return loss, tf.gradients(loss, model.trainable_variables)

  loss, grads = step()
  return loss.numpy(), [g.numpy() for g in grads]


def max_relative_difference(got, want) -> float:
  return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-12))


@pytest.fixture(scope="module")
def reference():
  return reference_loss_and_grads(model_params(layers.Sequential).instantiate())


GRID = list(itertools.product([1, 2, 4], [1, 2, 3, 4, 8], ["always", "never"]))


@pytest.mark.parametrize("num_cells, num_micro_batches, recompute", GRID)
def test_loss_and_gradients_equal_unpartitioned(reference, cpu_devices, num_cells,
                                                num_micro_batches, recompute):
  model = model_params(gpipe.PipeliningLayer, num_cells=num_cells,
                       num_micro_batches=num_micro_batches, recompute=recompute,
                       devices=cpu_devices[:num_cells]).instantiate()
  assert len(model.cells) == num_cells
  loss, grads = pipelined_loss_and_grads(model)
  want_loss, want_grads = reference
  assert max_relative_difference(loss, want_loss) <= 1e-5
  assert len(grads) == len(want_grads)
  for got, want in zip(grads, want_grads):
    assert max_relative_difference(got, want) <= 1e-5


@pytest.mark.parametrize("num_cells, recompute", [(2, "always"), (4, "except_last")])
def test_two_training_steps_give_the_same_weights(cpu_devices, num_cells, recompute):
  def train(model, use_tf_function):
    opt = optimizers.Adam.Params().set(learning_rate=0.05).instantiate()
    variables = model.trainable_variables
    opt.create_slots(variables)
    x, skip, target = inputs()

    def step(i):
      with tf.GradientTape() as tape:
        with base_layer.step_context(training=True, step=i):
          loss = loss_of(model(x, skip), target)
      opt.apply_gradients(tape.gradient(loss, variables), variables, i)

    run = tf.function(step) if use_tf_function else step
    for i in range(2):
      run(tf.constant(i, tf.int64))
    return [v.numpy() for v in variables]

  want = train(model_params(layers.Sequential).instantiate(), use_tf_function=False)
  got = train(model_params(gpipe.PipeliningLayer, num_cells=num_cells, num_micro_batches=3,
                           recompute=recompute, devices=cpu_devices[:num_cells]).instantiate(),
              use_tf_function=True)
  for g, w in zip(got, want):
    assert max_relative_difference(g, w) <= 1e-5


def test_eval_runs_forward_only_and_matches(cpu_devices):
  ref = model_params(layers.Sequential).instantiate()
  pipe = model_params(gpipe.PipeliningLayer, num_cells=2, num_micro_batches=4,
                      devices=cpu_devices[:2]).instantiate()
  x, skip, _ = inputs()
  fn = tf.function(lambda a, b: pipe(a, b))
  graph = fn.get_concrete_function(x, skip).graph
  assert not [op for op in graph.get_operations() if op.type == "IdentityN"]
  for got, want in zip(fn(x, skip), ref(x, skip)):
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-6)


def test_checkpoints_move_between_sequential_and_pipeline(tmp_path, cpu_devices):
  ref = model_params(layers.Sequential).set(random_seed=5).instantiate()
  path = tf.train.Checkpoint(model=ref).save(str(tmp_path / "ckpt"))
  pipe = model_params(gpipe.PipeliningLayer, num_cells=2, devices=cpu_devices[:2]).instantiate()
  tf.train.Checkpoint(model=pipe).restore(path).assert_consumed()
  for a, b in zip(ref.trainable_variables, pipe.trainable_variables):
    np.testing.assert_array_equal(a.numpy(), b.numpy())


# -- placement ---------------------------------------------------------------------

COMPUTE_OPS = {"MatMul", "BatchMatMulV2", "Conv2D", "Conv2DBackpropInput",
               "Conv2DBackpropFilter", "Tanh", "TanhGrad", "Relu", "ReluGrad"}


def _device(name: str) -> tuple[str, int]:
  spec = tf.DeviceSpec.from_string(name)
  return spec.device_type, spec.device_index


def _layer_index(op_name: str, prefix: str) -> int | None:
  # Name scopes of repeated calls get a suffix: pair3, pair3_1, ...
  found = {int(m) for m in re.findall(rf"(?:^|/){prefix}(\d+)(?:_\d+)?(?:/|$)", op_name)}
  assert len(found) <= 1, op_name
  return found.pop() if found else None


def _conv_stack():
  return [layers.Conv2D.Params().set(name=f"conv{i}", filter_shape=(3, 3, 4, 4),
                                     activation="RELU") for i in range(4)]


@pytest.mark.parametrize("gradient_api", ["tf.gradients", "GradientTape"])
@pytest.mark.parametrize("recompute", ["always", "never"])
def test_every_compute_op_runs_on_its_cells_device(cpu_devices, gradient_api, recompute):
  num_cells, num_micro_batches = 2, 2
  devices = cpu_devices[1:1 + num_cells]  # not the default device, so defaults show up
  pair = model_params(gpipe.PipeliningLayer, num_cells=num_cells, devices=devices,
                      num_micro_batches=num_micro_batches, splits=[4, 8],
                      recompute=recompute).instantiate()
  conv = gpipe.PipeliningLayer.Params().set(
      name="convs", layers=_conv_stack(), splits=[2, 4], devices=devices, recompute=recompute,
      num_micro_batches=num_micro_batches).instantiate()
  opt = optimizers.Adam.Params().instantiate()
  variables = pair.trainable_variables + conv.trainable_variables
  opt.create_slots(variables)
  x, skip, target = inputs()
  images = tf.zeros([4, 6, 6, 4])

  def step():
    with base_layer.step_context(training=True, step=tf.constant(1, tf.int64), layer_stats=[]):
      with tf.GradientTape() as tape:
        loss = loss_of(pair(x, skip), target) + tf.reduce_sum(conv(images))
    if gradient_api == "tf.gradients":
      grads = tf.gradients(loss, variables)
    else:
      grads = tape.gradient(loss, variables)
    opt.apply_gradients(grads, variables, tf.constant(0, tf.int64))
    return loss

  graph = tf.function(step).get_concrete_function().graph
  per_layer = {}
  for op in graph.get_operations():
    if op.type not in COMPUTE_OPS:
      continue
    index = _layer_index(op.name, "pair")
    cell_of = lambda i: 0 if i < 4 else 1  # noqa: E731
    if index is None:
      index = _layer_index(op.name, "conv")
      cell_of = lambda i: 0 if i < 2 else 1  # noqa: E731
    assert index is not None, f"compute op {op.name} belongs to no layer"
    assert op.device, f"{op.name} ({op.type}) has no device"
    assert _device(op.device) == _device(devices[cell_of(index)]), (op.name, op.device)
    per_layer.setdefault((op.name.split("/")[0], index, op.type), []).append(op.name)
  # MatMuls of one layer per micro-batch: the forward, the recomputed forward (with
  # recompute) and the two of its gradient.
  matmuls = sum(1 for op in graph.get_operations()
                if op.type == "MatMul" and _layer_index(op.name, "pair") == 5)
  assert matmuls == num_micro_batches * (4 if recompute == "always" else 3)
  for i, layer in enumerate(pair.layers):
    for var in layer.trainable_variables:
      assert _device(var.device) == _device(devices[0 if i < 4 else 1])
      for slot in opt.slots_of(var).values():
        assert _device(slot.device) == _device(var.device)


def _ancestors(op: tf.Operation) -> set:
  """Every op that `op` waits for, through data and control edges."""
  seen, frontier = set(), [op]
  while frontier:
    current = frontier.pop()
    for parent in [t.op for t in current.inputs] + list(current.control_inputs):
      if parent not in seen:
        seen.add(parent)
        frontier.append(parent)
  return seen


@pytest.mark.parametrize("gradient_api", ["tf.gradients", "GradientTape"])
def test_each_hand_off_is_awaited_on_the_receiving_device(cpu_devices, gradient_api):
  """A cell's next micro-batch waits until its last results are on the next device.

  Forward: cell 0's call m+1 waits for an op on device 1 that comes after its call m.
  Backward: cell 1's call m+1 waits for an op on device 0 that comes after its call m
  (the input gradients arrived there), not only for ops on its own device.
  """
  num_micro = 3
  devices = cpu_devices[:2]
  model = gpipe.PipeliningLayer.Params().set(
      name="stack", num_cells=2, num_micro_batches=num_micro, devices=devices,
      layers=[layers.Linear.Params().set(name=f"fc{i}", input_dim=4, output_dim=4)
              for i in range(4)]).instantiate()
  spans = []

  def step():
    with base_layer.step_context(training=True, step=tf.constant(1, tf.int64),
                                 schedule=[]) as ctx:
      with tf.GradientTape() as tape:
        loss = tf.reduce_sum(model(tf.ones([6, 4])))
    variables = model.trainable_variables
    grads = (tf.gradients(loss, variables) if gradient_api == "tf.gradients"
             else tape.gradient(loss, variables))
    spans[:] = ctx.schedule
    return grads

  tf.function(step).get_concrete_function()
  span = {(s.cell, s.micro_batch, s.phase): s for s in spans}

  def awaited_on(device: str, cell: int, m: int, phase: str) -> bool:
    previous_end = span[cell, m, phase].end.op
    waited = _ancestors(span[cell, m + 1, phase].start.op)
    return any(_device(op.device) == _device(device) and previous_end in _ancestors(op)
               for op in waited)

  for m in range(num_micro - 1):
    assert awaited_on(devices[1], 0, m, timeline.FORWARD), m
    assert awaited_on(devices[0], 1, m, timeline.BACKWARD), m


# -- batch norm ----------------------------------------------------------------------


def test_batch_norm_moving_stats_come_from_the_whole_batch_once(cpu_devices):
  num_micro_batches = 4
  p = gpipe.PipeliningLayer.Params().set(name="bn_stack", num_cells=2,
                                         num_micro_batches=num_micro_batches,
                                         devices=cpu_devices[:2], splits=[2, 3], layers=[
      layers.Linear.Params().set(name="fc1", input_dim=5, output_dim=6),
      layers.BatchNorm.Params().set(name="bn", dim=6, decay=0.9),
      layers.Linear.Params().set(name="fc2", input_dim=6, output_dim=3)])
  model = p.instantiate()
  fc1, bn = model.layers[0], model.layers[1]
  x = np.random.RandomState(3).randn(14, 5).astype(np.float32)

  @tf.function
  def step():
    with base_layer.step_context(training=True, layer_stats=[]) as ctx:
      loss = tf.reduce_sum(tf.square(model(x)))
    grads = tf.gradients(loss, model.trainable_variables)  # runs the recompute
    num_reports = len(ctx.layer_stats)
    base_layer.apply_layer_stats(ctx.layer_stats)
    return num_reports, grads

  num_reports, _ = step()
  assert num_reports == num_micro_batches  # the recomputed forward reported nothing
  h = x @ fc1.w.numpy() + fc1.b.numpy()
  np.testing.assert_allclose(bn.moving_mean.numpy(), 0.1 * h.mean(0), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(bn.moving_variance.numpy(), 0.9 + 0.1 * h.var(0), rtol=1e-5)


# -- bad input -----------------------------------------------------------------------


@pytest.mark.parametrize("settings, message", [
    (dict(num_micro_batches=0), "num_micro_batches must be >= 1, got 0"),
    (dict(num_micro_batches=-2), "num_micro_batches must be >= 1, got -2"),
    (dict(num_cells=9), "num_cells=9 is more than the 8 layers"),
    (dict(splits=[4, 2, 8]), r"bad splits \[4, 2, 8\]"),
    (dict(splits=[0, 8]), r"bad splits \[0, 8\]"),
    (dict(splits=[4, 9]), r"bad splits \[4, 9\].*in 1..8"),
    (dict(splits=[3, 6]), r"bad splits \[3, 6\].*must end at .* 8"),
    (dict(num_cells=4, devices=["/device:CPU:0", "/device:CPU:1"]),
     r"4 cells but only 2 device\(s\)"),
    (dict(recompute="sometimes"), "recompute must be one of"),
])
def test_bad_pipeline_params_are_named(settings, message):
  with pytest.raises(ValueError, match=message):
    model_params(gpipe.PipeliningLayer, **settings).instantiate()


def test_more_micro_batches_than_examples_is_named(cpu_devices):
  model = model_params(gpipe.PipeliningLayer, num_cells=2, num_micro_batches=16,
                       devices=cpu_devices[:2]).instantiate()
  x, skip, _ = inputs()
  with pytest.raises(ValueError, match="num_micro_batches=16 is larger than the batch size 13"):
    with base_layer.step_context(training=True, layer_stats=[]):
      model(x, skip)


def test_round_robin_places_several_cells_per_device(cpu_devices):
  model = model_params(gpipe.PipeliningLayer, num_cells=4, devices=cpu_devices[:2],
                       round_robin_devices=True).instantiate()
  assert [_device(d) for d in model.cell_devices] == [("CPU", 0), ("CPU", 1)] * 2


def test_micro_batch_sizes_are_near_equal():
  assert gpipe.micro_batch_sizes(13, 4) == [4, 3, 3, 3]
  assert gpipe.micro_batch_sizes(8, 8) == [1] * 8


# -- nested inputs and partition costs ------------------------------------------------


class DecoderLikeLayer(BaseLayer):
  """{'h', 'memory'} → {'h': tanh(h·W) + memory, 'memory'}: carries an encoder output."""

  def __init__(self, params):
    super().__init__(params)
    self.create_child("proj", layers.Linear.Params().set(input_dim=DIM, output_dim=DIM,
                                                         activation="TANH"))

  def fprop(self, state):
    return {"h": self.proj(state["h"]) + state["memory"], "memory": state["memory"]}


def test_nested_map_between_cells_matches_unpartitioned(cpu_devices):
  stack = [DecoderLikeLayer.Params().set(name=f"dec{i}") for i in range(4)]
  ref = layers.Sequential.Params().set(name="s", layers=stack, random_seed=2).instantiate()
  pipe = gpipe.PipeliningLayer.Params().set(name="s", layers=stack, random_seed=2, num_cells=2,
                                            num_micro_batches=3,
                                            devices=cpu_devices[:2]).instantiate()
  x, memory, _ = inputs()

  def loss_and_grads(model):
    with tf.GradientTape() as tape:
      with base_layer.step_context(training=True):
        out = model({"h": x, "memory": memory})
      loss = tf.reduce_sum(tf.square(out["h"]))
    return loss, tape.gradient(loss, model.trainable_variables)

  want_loss, want_grads = loss_and_grads(ref)
  got_loss, got_grads = tf.function(lambda: loss_and_grads(pipe))()
  assert max_relative_difference(got_loss.numpy(), want_loss.numpy()) <= 1e-5
  for g, w in zip(got_grads, want_grads):
    assert max_relative_difference(g.numpy(), w.numpy()) <= 1e-5


def test_flops_and_given_costs_drive_the_partition(cpu_devices):
  widths = [4, 4, 4, 64, 4]  # fc3 (4→64) and fc4 (64→4) do most of the work
  stack = [layers.Linear.Params().set(name=f"fc{i}", input_dim=w_in, output_dim=w_out)
           for i, (w_in, w_out) in enumerate(zip([4] + widths[:-1], widths))]
  common = dict(name="s", layers=stack, num_cells=2, devices=cpu_devices[:2])
  by_flops = gpipe.PipeliningLayer.Params().set(
      partition_cost="flops", input_specs=tf.TensorSpec([16, 4]), **common).instantiate()
  # FLOPs at batch 16 (matmul + bias): fc0..fc2 576 each, fc3 9216, fc4 8256. Best
  # bottleneck: [fc0..fc3] 10944 | [fc4] 8256 (by parameter counts, fc3 and fc4 tie).
  assert [(c.start, c.end) for c in by_flops.cells] == [(0, 4), (4, 5)]
  assert by_flops.cells[0].cost == 3 * 576 + 9216
  given = gpipe.PipeliningLayer.Params().set(partition_cost="given",
                                             layer_costs=[5, 1, 1, 1, 1], **common).instantiate()
  assert [(c.start, c.end) for c in given.cells] == [(0, 1), (1, 5)]
  assert given.describe_cells()[0]["cost_share"] == pytest.approx(5 / 9, abs=1e-6)
  with pytest.raises(ValueError, match="needs input_specs"):
    gpipe.PipeliningLayer.Params().set(partition_cost="flops", **common).instantiate()
