"""PipeliningLayer against the same layers run unpartitioned on the whole batch."""

import itertools

import numpy as np
import pytest
import tensorflow as tf
from conftest import TEST_DEVICE_NAMES, engine_loss_and_grads
from numerics import assert_all_close, assert_close
from tiers import EXHAUSTIVE, quick_sample

from lingvo_gpipe import train_step
from lingvo_gpipe.core import base_layer, layers, optimizers, stacked_variables
from lingvo_gpipe.core.base_layer import BaseLayer
from lingvo_gpipe.core.tf_internals import step_function
from lingvo_gpipe.pipeline import layer as gpipe

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


def loss_head(outputs, head_inputs):
  """loss_of per micro-batch, weighted by its examples."""
  target = head_inputs["target"]
  return {"loss": (loss_of(outputs, target), tf.cast(tf.shape(target)[0], tf.float32))}


def with_loss(model):
  """The pipeline with loss_head as its head."""
  return train_step.StackWithLoss(model, loss_head)


def pipelined_loss_and_grads(model, wrapped=None):
  """The engine: scheduled cell calls, the loss per micro-batch, summed gradients."""
  x, skip, target = inputs()
  return engine_loss_and_grads(model, wrapped or with_loss(model),
                               {"inputs": (x, skip), "target": target}, STEP)


def fprop_loss_and_grads(model):
  """The pipeline's fprop differentiated by tf.gradients (no schedule, no recompute)."""
  x, skip, target = inputs()

  @tf.function
  def step():
    with base_layer.step_context(training=True, step=tf.constant(STEP, tf.int64)):
      loss = loss_of(model(x, skip), target)
    return loss, tf.gradients(loss, model.trainable_variables)

  loss, grads = step()
  return loss.numpy(), stacked_variables.per_weight(
      stacked_variables.trainable_weights(model), model.trainable_variables,
      [g.numpy() for g in grads])


@pytest.fixture(scope="module")
def reference():
  return reference_loss_and_grads(model_params(layers.Sequential).instantiate())


# A covering set of schedule × K ∈ {1, 2, 4} × M ∈ {1, 2, 3, 4, 8} × recompute (60
# cases): every K·M, and every pair of values of any two of the four, once at least
# (`test_the_grid_covers_every_pair` checks it); K=4·M=8 with both schedules and both
# policies. BATCH=13 makes every M > 1 an uneven split.
GRID = [
    ("1f1b", 1, 1, "always"), ("gpipe", 1, 2, "never"), ("1f1b", 1, 3, "never"),
    ("1f1b", 1, 4, "never"), ("gpipe", 1, 8, "always"), ("gpipe", 2, 1, "never"),
    ("gpipe", 2, 2, "always"), ("1f1b", 2, 3, "always"), ("gpipe", 2, 4, "never"),
    ("1f1b", 2, 8, "never"), ("1f1b", 4, 1, "never"), ("1f1b", 4, 2, "never"),
    ("gpipe", 4, 3, "always"), ("1f1b", 4, 4, "always"), ("gpipe", 4, 8, "never"),
    ("1f1b", 4, 8, "always"),
]
# The quick tier's sample: both schedules, every K, both policies, uneven M of 3, 4 and 8.
QUICK_GRID = [("1f1b", 2, 3, "always"), ("gpipe", 4, 8, "never"), ("1f1b", 1, 4, "never")]
FULL_GRID = list(itertools.product(["gpipe", "1f1b"], [1, 2, 4], [1, 2, 3, 4, 8],
                                   ["always", "never"]))


def test_the_grid_covers_every_pair():
  def pairs(rows):
    return {(i, j, row[i], row[j]) for row in rows for i, j in itertools.combinations(range(4), 2)}
  assert pairs(GRID) == pairs(FULL_GRID)
  assert {("gpipe", 4, 8), ("1f1b", 4, 8)} <= {row[:3] for row in GRID}


def assert_matches_reference(got, reference):
  loss, grads = got
  want_loss, want_grads = reference
  assert_close(loss, want_loss)
  assert_all_close(grads, want_grads)


@pytest.mark.parametrize("schedule, num_cells, num_micro_batches, recompute",
                         quick_sample(GRID, quick=QUICK_GRID))
def test_loss_and_gradients_equal_unpartitioned(reference, cpu_devices, schedule, num_cells,
                                                num_micro_batches, recompute):
  model = model_params(gpipe.PipeliningLayer, num_cells=num_cells, schedule=schedule,
                       num_micro_batches=num_micro_batches, recompute=recompute,
                       devices=cpu_devices[:num_cells]).instantiate()
  assert len(model.cells) == num_cells
  assert_matches_reference(pipelined_loss_and_grads(model), reference)


@pytest.mark.parametrize("num_cells, num_micro_batches, recompute", quick_sample(
    [(1, 1, "always"), (2, 3, "always"), (4, 4, "never")], quick=[(2, 3, "always")]))
def test_fprop_differentiated_by_tensorflow_equals_unpartitioned(reference, cpu_devices,
                                                                 num_cells, num_micro_batches,
                                                                 recompute):
  model = model_params(gpipe.PipeliningLayer, num_cells=num_cells,
                       num_micro_batches=num_micro_batches, recompute=recompute,
                       devices=cpu_devices[:num_cells]).instantiate()
  assert_matches_reference(fprop_loss_and_grads(model), reference)


@pytest.mark.parametrize("num_cells, recompute, schedule", quick_sample([
    (2, "always", "gpipe"), (4, "except_last", "gpipe"), (4, "always", "1f1b"),
    (2, "never", "1f1b"), (4, "except_last", "zb_h1"), (4, "always", "interleaved_1f1b")],
    quick=[(4, "except_last", "zb_h1")]))
def test_two_training_steps_give_the_same_weights(cpu_devices, num_cells, recompute, schedule):
  """TrainStep (the trainer's step) against Adam on the unpartitioned model by hand."""
  x, skip, target = inputs()
  want_model = model_params(layers.Sequential).instantiate()
  opt = optimizers.Adam.Params().set(learning_rate=0.05).instantiate()
  variables = want_model.trainable_variables
  opt.create_slots(variables)
  for i in range(2):
    with tf.GradientTape() as tape:
      with base_layer.step_context(training=True, step=tf.constant(i, tf.int64)):
        loss = loss_of(want_model(x, skip), target)
    opt.apply_gradients(tape.gradient(loss, variables), variables, tf.constant(i, tf.int64))

  virtual_stages = 2 if schedule == "interleaved_1f1b" else 1
  model = model_params(gpipe.PipeliningLayer, num_cells=num_cells,
                       num_micro_batches=4 if virtual_stages > 1 else 3,
                       recompute=recompute, schedule=schedule, virtual_stages=virtual_stages,
                       devices=cpu_devices[:num_cells // virtual_stages]).instantiate()
  pipeline_opt = optimizers.Adam.Params().set(learning_rate=0.05).instantiate()
  pipeline_opt.create_slots(model.trainable_variables)
  global_step = tf.Variable(0, dtype=tf.int64)
  step = train_step.TrainStep(with_loss(model), pipeline_opt, global_step)
  run = step_function(step)
  for _ in range(2):
    run({"inputs": (x, skip), "target": target})
  assert int(global_step.numpy()) == 2
  assert_all_close([v.numpy() for v in stacked_variables.trainable_weights(model)],
                   [v.numpy() for v in variables])


def test_eval_runs_forward_only_and_matches(cpu_devices):
  ref = model_params(layers.Sequential).instantiate()
  pipe = model_params(gpipe.PipeliningLayer, num_cells=2, num_micro_batches=4,
                      devices=cpu_devices[:2]).instantiate()
  x, skip, _ = inputs()
  fn = tf.function(lambda a, b: pipe(a, b))
  graph = fn.get_concrete_function(x, skip).graph
  assert not [op for op in graph.get_operations() if op.type == "IdentityN"]
  assert_all_close([t.numpy() for t in fn(x, skip)], [t.numpy() for t in ref(x, skip)])


def test_checkpoints_move_between_sequential_and_pipeline(tmp_path, cpu_devices):
  ref = model_params(layers.Sequential).set(random_seed=5).instantiate()
  path = tf.train.Checkpoint(model=ref).save(str(tmp_path / "ckpt"))
  pipe = model_params(gpipe.PipeliningLayer, num_cells=2, devices=cpu_devices[:2]).instantiate()
  tf.train.Checkpoint(model=pipe).restore(path).assert_consumed()
  pipe_weights = stacked_variables.trainable_weights(pipe)
  assert len(pipe_weights) == len(ref.trainable_variables)
  for a, b in zip(ref.trainable_variables, pipe_weights, strict=True):
    np.testing.assert_array_equal(a.numpy(), b.numpy())


def _device(name: str) -> tuple[str, int]:
  spec = tf.DeviceSpec.from_string(name)
  return spec.device_type, spec.device_index


# -- batch norm ----------------------------------------------------------------------


@pytest.mark.parametrize("schedule", quick_sample(["gpipe", "1f1b", "zb_h1", "interleaved_1f1b"],
                                                quick=["zb_h1"]))
def test_batch_norm_moving_stats_come_from_the_whole_batch_once(cpu_devices, schedule):
  num_micro_batches = 4
  interleaved = schedule == "interleaved_1f1b"
  p = gpipe.PipeliningLayer.Params().set(name="bn_stack", num_cells=2, schedule=schedule,
                                         num_micro_batches=num_micro_batches,
                                         virtual_stages=2 if interleaved else 1,
                                         devices=cpu_devices[:1 if interleaved else 2],
                                         splits=[2, 3], layers=[
      layers.Linear.Params().set(name="fc1", input_dim=5, output_dim=6),
      layers.BatchNorm.Params().set(name="bn", dim=6, decay=0.9),
      layers.Linear.Params().set(name="fc2", input_dim=6, output_dim=3)])
  model = p.instantiate()
  fc1, bn = model.layers[0], model.layers[1]
  x = np.random.RandomState(3).randn(14, 5).astype(np.float32)
  wrapped = train_step.StackWithLoss(
      model, lambda out, _: {"loss": (tf.reduce_sum(tf.square(out)), tf.constant(1.0))})

  @tf.function
  def step():
    with base_layer.step_context(training=True, layer_stats=[]) as ctx:
      _, grads = train_step.loss_and_gradients(wrapped, {"inputs": x},
                                               model.trainable_variables)
    num_reports = len(ctx.layer_stats)
    base_layer.apply_layer_stats(ctx.layer_stats)
    return num_reports, grads

  num_reports, _ = step()
  assert num_reports == num_micro_batches  # the recomputed forward reported nothing
  h = x @ fc1.w.numpy() + fc1.b.numpy()
  assert_close(bn.moving_mean.numpy(), 0.1 * h.mean(0), dtype=np.float32)
  assert_close(bn.moving_variance.numpy(), 0.9 + 0.1 * h.var(0), dtype=np.float32)


@pytest.mark.parametrize("schedule, num_cells, num_micro_batches, group, recompute",
                         quick_sample([
    ("gpipe", 1, 4, 4, "always"),     # one group: every weight gradient in one product
    ("gpipe", 2, 8, 3, "always"),     # groups of 3, 3, 2 (uneven micro-batches, too)
    ("1f1b", 4, 8, 2, "always"),
    ("gpipe", 2, 3, 8, "except_last"),  # G > M; the last cell computes them per call
    ("1f1b", 2, 4, 2, "never"),       # no recompute: nothing is deferred
], quick=[("gpipe", 2, 8, 3, "always")]))
def test_weight_gradients_over_groups_of_micro_batches_equal_unpartitioned(
    reference, cpu_devices, schedule, num_cells, num_micro_batches, group, recompute):
  model = model_params(gpipe.PipeliningLayer, num_cells=num_cells, schedule=schedule,
                       num_micro_batches=num_micro_batches, recompute=recompute,
                       weight_gradient_group=group,
                       devices=cpu_devices[:num_cells]).instantiate()
  wrapped = with_loss(model)
  assert_matches_reference(pipelined_loss_and_grads(model, wrapped), reference)
  cells = model.cell_functions(wrapped.head)
  deferring = [c.defers_weight_gradients for c in cells]
  assert deferring == [model._recompute_cell(k) for k in range(num_cells)]
  for cell in cells:
    if cell.defers_weight_gradients:  # one deferred product per PairLayer's Linear
      assert len(cell.product_variables) == len(cell.layers)


# -- schedules past fill-drain: zero bubble (ZB-H1) and interleaved virtual stages -------


@pytest.mark.parametrize("num_cells, num_micro_batches, recompute", quick_sample([
    (2, 4, "always"), (4, 8, "always"), (2, 3, "except_last"), (4, 2, "always"),
    (2, 8, "never"), (4, 4, "never"),  # deferred through probes (no recompute)
    (1, 4, "always"),
], quick=[(2, 3, "except_last")]))
def test_zero_bubble_equals_unpartitioned(reference, cpu_devices, num_cells, num_micro_batches,
                                          recompute):
  model = model_params(gpipe.PipeliningLayer, num_cells=num_cells, schedule="zb_h1",
                       num_micro_batches=num_micro_batches, recompute=recompute,
                       devices=cpu_devices[:num_cells]).instantiate()
  wrapped = with_loss(model)
  assert_matches_reference(pipelined_loss_and_grads(model, wrapped), reference)
  plan = model.plan()
  for k, cell in enumerate(model.cell_functions(wrapped.head)):
    assert cell.defers_weight_gradients and plan.defers(k)
    assert len(cell.product_variables) == len(cell.layers)  # one per PairLayer's Linear
    # one W per backward: each computes one micro-batch's weight gradients
    assert all(len(g) == 1 for g in plan.weight_groups(k).values())


@pytest.mark.parametrize("num_cells, virtual_stages, num_micro_batches, recompute",
                         quick_sample([
    (4, 2, 2, "always"), (4, 2, 4, "never"), (4, 2, 8, "except_last"), (6, 3, 4, "always"),
    (2, 2, 3, "always"),  # one device holding both cells
    (4, 2, 3, "never"), (4, 2, 5, "always"),  # M the devices do not divide
], quick=[(4, 2, 3, "never")]))
def test_interleaved_virtual_stages_equal_unpartitioned(reference, cpu_devices, num_cells,
                                                        virtual_stages, num_micro_batches,
                                                        recompute):
  num_devices = num_cells // virtual_stages
  model = model_params(gpipe.PipeliningLayer, num_cells=num_cells,
                       schedule="interleaved_1f1b", virtual_stages=virtual_stages,
                       num_micro_batches=num_micro_batches, recompute=recompute,
                       devices=cpu_devices[:num_devices]).instantiate()
  assert [model.cell_devices.index(d) for d in model.cell_devices] == [
      k % num_devices for k in range(num_cells)]
  assert_matches_reference(pipelined_loss_and_grads(model), reference)


@pytest.mark.parametrize("num_cells, num_micro_batches, recompute", quick_sample([
    (4, 1, "always"), (4, 3, "never"), (4, 5, "except_last"), (8, 4, "always"),
    (2, 2, "never"),  # one device holding both cells
], quick=[(4, 5, "except_last")]))
def test_zbv_equals_unpartitioned(reference, cpu_devices, num_cells, num_micro_batches,
                                  recompute):
  """ZB-V: cells k and K−1−k on device k (a V), every backward split into B and W, at
  any M (uneven micro-batches at BATCH=13)."""
  model = model_params(gpipe.PipeliningLayer, num_cells=num_cells, schedule="zbv",
                       virtual_stages=2, num_micro_batches=num_micro_batches,
                       recompute=recompute, devices=cpu_devices[:num_cells // 2]).instantiate()
  assert [model.cell_devices.index(d) for d in model.cell_devices] == [
      min(k, num_cells - 1 - k) for k in range(num_cells)]
  plan = model.plan()
  assert plan.name == "zbv" and all(plan.defers(k) for k in range(num_cells))
  assert_matches_reference(pipelined_loss_and_grads(model), reference)


@pytest.mark.parametrize("num_cells, virtual_stages, num_micro_batches, recompute",
                         quick_sample([
    (4, 2, 2, "always"), (4, 2, 3, "never"), (6, 3, 4, "except_last"),
], quick=[(4, 2, 2, "always")]))
def test_interleaved_zero_bubble_equals_unpartitioned(reference, cpu_devices, num_cells,
                                                      virtual_stages, num_micro_batches,
                                                      recompute):
  model = model_params(gpipe.PipeliningLayer, num_cells=num_cells, schedule="interleaved_zb",
                       virtual_stages=virtual_stages, num_micro_batches=num_micro_batches,
                       recompute=recompute,
                       devices=cpu_devices[:num_cells // virtual_stages]).instantiate()
  assert all(model.plan().defers(k) for k in range(num_cells))
  assert_matches_reference(pipelined_loss_and_grads(model), reference)


@EXHAUSTIVE
def test_interleaved_with_weight_gradient_groups_equals_unpartitioned(reference, cpu_devices):
  model = model_params(gpipe.PipeliningLayer, num_cells=4, schedule="interleaved_1f1b",
                       virtual_stages=2, num_micro_batches=4, weight_gradient_group=2,
                       devices=cpu_devices[:2]).instantiate()
  assert_matches_reference(pipelined_loss_and_grads(model), reference)


@EXHAUSTIVE
def test_round_robin_cells_share_one_loop_per_device(reference, cpu_devices):
  """Four 1F1B cells on two devices: each device runs its two cells in one loop, in
  the order their actions start in the simulated schedule."""
  model = model_params(gpipe.PipeliningLayer, num_cells=4, schedule="1f1b",
                       num_micro_batches=4, devices=cpu_devices[:2],
                       round_robin_devices=True).instantiate()
  plan = model.plan()
  assert plan.num_devices == 2 and plan.device_of == (0, 1, 0, 1)
  assert_matches_reference(pipelined_loss_and_grads(model), reference)


# -- bad input -----------------------------------------------------------------------


@pytest.mark.parametrize("settings, message", [
    (dict(num_micro_batches=0), "num_micro_batches must be an int >= 1, got 0"),
    (dict(num_micro_batches=-2), "num_micro_batches must be an int >= 1, got -2"),
    (dict(num_cells=9), "num_cells=9 is more than the 8 layers"),
    (dict(splits=[4, 2, 8]), r"bad splits \[4, 2, 8\]"),
    (dict(splits=[0, 8]), r"bad splits \[0, 8\]"),
    (dict(splits=[4, 9]), r"bad splits \[4, 9\].*in 1..8"),
    (dict(splits=[3, 6]), r"bad splits \[3, 6\].*must end at .* 8"),
    (dict(num_cells=4, devices=TEST_DEVICE_NAMES[:2]),
     r"4 cells but only 2 device\(s\)"),
    (dict(recompute="sometimes"), "recompute must be one of"),
    (dict(schedule="zigzag"),
     r"schedule must be one of \['1f1b', 'gpipe', 'interleaved_1f1b', 'interleaved_zb', "
     r"'zb_h1', 'zbv'\], got 'zigzag'"),
    (dict(schedule="zb_h1", weight_gradient_group=2),
     "weight_gradient_group must be 1 with schedule='zb_h1'"),
    (dict(schedule="interleaved_1f1b"), "virtual_stages must be >= 2 with "
                                        "schedule='interleaved_1f1b'"),
    (dict(virtual_stages=2), r"virtual_stages must be 1 with schedule='gpipe' \(cells per "
                             r"device: interleaved_1f1b >= 2, zbv 2, interleaved_zb >= 2, "
                             r"any other 1\), got 2"),
    (dict(schedule="zbv", virtual_stages=3, num_cells=6),
     "virtual_stages must be 2 with schedule='zbv'"),
    (dict(schedule="zbv", weight_gradient_group=2, virtual_stages=2),
     "weight_gradient_group must be 1 with schedule='zbv'"),
    (dict(schedule="interleaved_1f1b", virtual_stages=3, num_cells=4),
     "virtual_stages=3 must divide the 4 cells"),
    (dict(weight_gradient_group=0), "weight_gradient_group must be an int >= 1, got 0"),
])
def test_bad_pipeline_params_are_named(settings, message):
  with pytest.raises(ValueError, match=message):
    model_params(gpipe.PipeliningLayer, **settings).instantiate()


def test_more_micro_batches_than_examples_is_named(cpu_devices):
  model = model_params(gpipe.PipeliningLayer, num_cells=2, num_micro_batches=16,
                       devices=cpu_devices[:2]).instantiate()
  x, skip, target = inputs()
  with pytest.raises(ValueError, match="num_micro_batches=16 is larger than the batch size 13"):
    with base_layer.step_context(training=True, layer_stats=[]):
      train_step.loss_and_gradients(with_loss(model), {"inputs": (x, skip), "target": target},
                                    model.trainable_variables)


def test_round_robin_places_several_cells_per_device(cpu_devices):
  model = model_params(gpipe.PipeliningLayer, num_cells=4, devices=cpu_devices[:2],
                       round_robin_devices=True).instantiate()
  assert [_device(d) for d in model.cell_devices] == [_device(d) for d in cpu_devices[:2]] * 2


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
  batch = {"inputs": {"h": x, "memory": memory}}

  def loss_of_state(out, _):
    per_example = tf.reduce_sum(tf.square(out["h"]), axis=-1)
    return {"loss": (tf.reduce_mean(per_example), tf.cast(tf.size(per_example), tf.float32))}

  with tf.GradientTape() as tape:
    with base_layer.step_context(training=True):
      want_loss = loss_of_state(ref(batch["inputs"]), None)["loss"][0]
  want_grads = tape.gradient(want_loss, ref.trainable_variables)

  @tf.function
  def step():
    with base_layer.step_context(training=True):
      metrics, grads = train_step.loss_and_gradients(
          train_step.StackWithLoss(pipe, loss_of_state), batch,
          stacked_variables.trainable_weights(pipe))
    return metrics["loss"][0], grads

  got_loss, got_grads = step()
  assert_close(got_loss.numpy(), want_loss.numpy())
  assert_all_close([g.numpy() for g in got_grads], [w.numpy() for w in want_grads])


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


def test_variables_before_the_pipeline_are_refused(cpu_devices):
  """They would get no gradient: the pipeline trains its cells and the head after it."""
  model = model_params(gpipe.PipeliningLayer, num_cells=2,
                       devices=cpu_devices[:2]).instantiate()
  scale = tf.Variable(2.0, name="input_scale")

  class ScaledInputs(train_step.StackWithLoss):
    def stack_inputs(self, batch):
      x, skip = batch["inputs"]
      return x * scale, skip

  x, skip, target = inputs()
  wrapped = ScaledInputs(model, loss_head)
  with pytest.raises(ValueError, match=r"pipeline's inputs are computed with variables "
                                       r"\['input_scale:0'\]"):
    with base_layer.step_context(training=True):
      train_step.loss_and_gradients(wrapped, {"inputs": (x, skip), "target": target},
                                    model.trainable_variables)
