"""Hybrid data + pipeline parallelism equals one pipeline on the R-times larger batch."""

import numpy as np
import pytest
import tensorflow as tf
from conftest import TEST_DEVICE_NAMES
from numerics import assert_close
from tiers import EXHAUSTIVE

from lingvo_gpipe.core import base_layer, layers, optimizers
from lingvo_gpipe.pipeline import hybrid
from lingvo_gpipe.pipeline import layer as gpipe

BATCH, DIM = 16, 8  # the global batch: 2 replicas × 8 examples


def stack_params():
  """Linear, dropout, batch norm, linear: dropout and batch statistics make the
  equivalence depend on example numbering and on statistics being shared."""
  return [
      layers.Linear.Params().set(name="fc0", input_dim=DIM, output_dim=DIM, activation="TANH"),
      layers.Dropout.Params().set(name="drop", keep_prob=0.7),
      layers.BatchNorm.Params().set(name="bn", dim=DIM, decay=0.5),
      layers.Linear.Params().set(name="fc1", input_dim=DIM, output_dim=DIM, activation="TANH"),
      layers.Linear.Params().set(name="fc2", input_dim=DIM, output_dim=DIM),
  ]


def pipeline_params(num_micro_batches: int):
  return gpipe.PipeliningLayer.Params().set(
      name="stack", layers=stack_params(), num_cells=2, num_micro_batches=num_micro_batches,
      random_seed=5)


def adam():
  return optimizers.Adam.Params().set(learning_rate=0.05).instantiate()


def batches(steps: int):
  rng = np.random.RandomState(0)
  return [tf.constant(rng.randn(BATCH, DIM), tf.float32) for _ in range(steps)]


def mean_square(outputs: tf.Tensor) -> tf.Tensor:
  return tf.reduce_mean(tf.square(outputs - 0.5))


def train_single_pipeline(devices, steps: int) -> list[np.ndarray]:
  """Reference: one pipeline (2 cells, 4 micro-batches) on the whole batch."""
  model = pipeline_params(4).set(devices=devices[:2]).instantiate()
  variables = model.trainable_variables
  optimizer = adam()
  optimizer.create_slots(variables)

  @tf.function
  def step(x, s):
    with base_layer.step_context(training=True, step=s, layer_stats=[]) as ctx:
      outputs = model(x)
      with tf.device(model.output_device):
        loss = mean_square(outputs)
    optimizer.apply_gradients(tf.gradients(loss, variables), variables, s)
    base_layer.apply_layer_stats(ctx.layer_stats)

  for s, x in enumerate(batches(steps)):
    step(x, tf.constant(s, tf.int64))
  return [v.numpy() for v in model.variables]


def test_two_replicas_of_two_cells_train_like_one_pipeline_on_the_double_batch(cpu_devices):
  """R=2 × K=2 on four devices, M=2 each, Adam, 3 steps: every replica's weights and
  batch-norm statistics equal those of one 2-cell pipeline over 4 micro-batches."""
  steps = 3
  hybrid_model = hybrid.ReplicatedPipeline(pipeline_params(2), num_replicas=2,
                                           devices=cpu_devices)
  assert [rep.cell_devices for rep in hybrid_model.replicas] == [
      cpu_devices[:2], cpu_devices[2:]]
  per_replica_vars = hybrid_model.trainable_variables
  optimizers_ = [adam() for _ in hybrid_model.replicas]  # slots are keyed by variable name
  for optimizer, variables in zip(optimizers_, per_replica_vars):
    optimizer.create_slots(variables)

  @tf.function
  def step(x, s):
    with base_layer.step_context(training=True, step=s, layer_stats=[]) as ctx:
      grads = []
      for r, shard in enumerate(hybrid_model.shard(x)):
        outputs = hybrid_model.fprop(r, shard)
        with tf.device(hybrid_model.replicas[r].output_device):
          loss = mean_square(outputs)
        grads.append(tf.gradients(loss, per_replica_vars[r]))
    reduced = hybrid_model.all_reduce_gradients(grads)
    for optimizer, g, variables in zip(optimizers_, reduced, per_replica_vars):
      optimizer.apply_gradients(g, variables, s)
    hybrid_model.apply_layer_stats(ctx.layer_stats)

  for s, x in enumerate(batches(steps)):
    step(x, tf.constant(s, tf.int64))

  want = train_single_pipeline(cpu_devices, steps)
  for rep in hybrid_model.replicas:
    got = [v.numpy() for v in rep.variables]
    assert len(got) == len(want)
    for g, w in zip(got, want):
      assert_close(g, w)
  # The update did something: the weights moved away from their initial values.
  initial = pipeline_params(2).set(devices=cpu_devices[:2]).instantiate()
  assert not np.allclose(initial.variables[0].numpy(), want[0])


def test_the_all_reduce_averages_over_the_group_on_every_device(cpu_devices):
  mean = hybrid.CollectiveMean(cpu_devices[1:4], group_key=1000)

  @tf.function
  def run():
    tensors = []
    for i, device in enumerate(cpu_devices[1:4]):
      with tf.device(device):
        tensors.append(tf.fill([2, 3], float(i + 1)))
    return mean(tensors, instance_key=1)

  for _ in range(2):  # a second call reuses the group and the instance key
    for t in run():
      np.testing.assert_allclose(t.numpy(), np.full([2, 3], 2.0))
  graph = run.get_concrete_function().graph
  placed = [tf.DeviceSpec.from_string(op.device).device_index
            for op in graph.get_operations() if op.type == "CollectiveReduceV2"]
  assert placed == [1, 2, 3]


def test_bad_replica_counts_and_batches_are_named(cpu_devices):
  with pytest.raises(hybrid.HybridError, match="3 replicas × 2 cells need 6 devices; 4 given"):
    hybrid.ReplicatedPipeline(pipeline_params(2), num_replicas=3, devices=cpu_devices)
  with pytest.raises(hybrid.HybridError, match="num_replicas must be >= 1, got 0"):
    hybrid.ReplicatedPipeline(pipeline_params(2), num_replicas=0, devices=cpu_devices)
  model = hybrid.ReplicatedPipeline(pipeline_params(2), num_replicas=2, devices=cpu_devices)
  with pytest.raises(hybrid.HybridError, match=r"batch size \(15\) .* divisible by "
                     r"num_replicas \(2\)"):
    model.shard(tf.zeros([15, DIM]))


def demo_trainer(logdir, overrides: str):
  from lingvo_gpipe import model_registry, trainer
  from lingvo_gpipe.core import hyperparams

  model_registry.load_param_files()
  params = model_registry.get_params("demo.TinyConvNet")
  for name, value in hyperparams.parse_overrides(
      "task.train.save_interval_steps=3;task.pipeline.num_cells=2;" + overrides):
    params.set_from_text(name, value)
  return trainer.Trainer(params.freeze(), str(logdir), log=lambda _: None)


@EXHAUSTIVE
def test_the_trainer_with_two_replicas_equals_one_pipeline_and_resumes_them_equal(tmp_path):
  """TinyConvNet (batch norm, SGD with momentum): R=2 × (K=2, M=2) gives the losses and
  checkpoint of R=1 × (K=2, M=4) on the same 32-example batches; a restored R=2
  trainer copies replica 0's weights and slots into replica 1."""
  single = demo_trainer(tmp_path / "r1", "task.pipeline.num_micro_batches=4")
  losses_single = []
  single.train(3, on_step=lambda _, v: losses_single.append(float(v["loss"])))
  hybrid_run = demo_trainer(tmp_path / "r2", "task.pipeline.num_micro_batches=2;"
                            "task.pipeline.num_replicas=2")
  assert [t.input_device for t in hybrid_run.replicas.replicas] == [
      single.task.input_device, TEST_DEVICE_NAMES[2]]
  losses_hybrid = []
  hybrid_run.train(3, on_step=lambda _, v: losses_hybrid.append(float(v["loss"])))
  assert_close(losses_hybrid, losses_single, dtype=np.float32)

  got = tf.train.load_checkpoint(str(tmp_path / "r2" / "train" / "ckpt-3"))
  want = tf.train.load_checkpoint(str(tmp_path / "r1" / "train" / "ckpt-3"))
  names = sorted(want.get_variable_to_dtype_map())
  assert sorted(got.get_variable_to_dtype_map()) == names
  dtypes = want.get_variable_to_dtype_map()
  for name in names:  # every numeric tensor: weights, slots, batch-norm statistics, step
    if dtypes[name].is_floating or dtypes[name].is_integer:
      assert_close(got.get_tensor(name), want.get_tensor(name), err_msg=name)

  resumed = demo_trainer(tmp_path / "r2", "task.pipeline.num_micro_batches=2;"
                         "task.pipeline.num_replicas=2")
  assert resumed.restore_latest() == 3
  first, second = resumed.replicas.replicas
  # Replica 0 holds the trained weights (not the initial ones both replicas were built
  # with), and replica 1 now equals it, optimizer slots included.
  trained = hybrid_run.task.trainable_variables[0].numpy()
  assert not np.allclose(trained, demo_trainer(tmp_path / "fresh", "").task
                         .trainable_variables[0].numpy())
  np.testing.assert_array_equal(first.trainable_variables[0].numpy(), trained)
  for a, b in zip(first.variables, second.variables):
    np.testing.assert_array_equal(a.numpy(), b.numpy())
  for a, b in zip(first.trainable_variables, second.trainable_variables):
    for name, slot in resumed.optimizers[1].slots_of(b).items():
      want_slot = resumed.optimizers[0].slots_of(a)[name].numpy()
      assert np.any(want_slot != 0), name
      np.testing.assert_array_equal(slot.numpy(), want_slot)


def test_the_trainer_names_a_bad_replica_count(tmp_path):
  with pytest.raises(hybrid.HybridError, match="num_replicas must be >= 1, got 0"):
    demo_trainer(tmp_path, "task.pipeline.num_replicas=0")
  with pytest.raises(hybrid.HybridError, match="3 replicas × 2 cells need 6 devices; 4 given"):
    demo_trainer(tmp_path, "task.pipeline.num_replicas=3;train_input.batch_size=30")


@pytest.mark.parametrize("overrides, message", [
    ("task.pipeline.num_micro_batches=9;train_input.batch_size=8",
     r"task\.pipeline\.num_micro_batches=9 does not fit a batch of 8 "
     r"\(train_input\.batch_size=8\); valid: 1\.\.8"),
    ("task.pipeline.num_micro_batches=5;task.pipeline.num_replicas=2;train_input.batch_size=8",
     r"num_micro_batches=5 does not fit a batch of 4 \(train_input\.batch_size=8 / 2 "
     r"replicas\); valid: 1\.\.4"),
    ("task.pipeline.num_replicas=2;train_input.batch_size=9",
     r"train_input\.batch_size=9 is not divisible by task\.pipeline\.num_replicas=2"),
])
def test_a_batch_that_cannot_be_split_is_refused_before_anything_is_written(
    tmp_path, overrides, message):
  """A ValueError naming the keys (the trainer binary: exit 2), raised while the
  Trainer is built, before it traces a step or writes to the logdir."""
  with pytest.raises(ValueError, match=message):
    demo_trainer(tmp_path / "run", overrides)
  assert not (tmp_path / "run").exists()
