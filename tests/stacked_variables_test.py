"""Stacked variables (core/stacked_variables.py): a pipeline cell's weights of one shape
as one variable, checkpointed per weight, against the same model built with one
tf.Variable per weight."""

from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
from numerics import REORDERED, TRAINED, assert_all_close
from tiers import EXHAUSTIVE

from lingvo_gpipe import train_step
from lingvo_gpipe.core import layers, model_stats, optimizers, stacked_variables
from lingvo_gpipe.core.tf_internals import step_function
from lingvo_gpipe.pipeline.layer import PipeliningLayer

LEGACY = Path(__file__).resolve().parent / "data" / "legacy_unstacked_adam_k2" / "ckpt"


def model_params(num_blocks: int = 4, keep_prob: float = 1.0, **pipeline):
  """What tests/data/make_legacy_unstacked_checkpoint.py built: FeedForwardBlocks (a
  layer norm and two projections each, four weight shapes) in a pipeline; keep_prob < 1
  adds dropout on each block's hidden activations and output."""
  blocks = [layers.FeedForwardBlock.Params().set(name=f"ff{i}", input_dim=8, hidden_dim=16,
                                                 relu_keep_prob=keep_prob,
                                                 residual_keep_prob=keep_prob)
            for i in range(num_blocks)]
  settings = dict(num_cells=2, num_micro_batches=2)
  settings.update(pipeline)
  return PipeliningLayer.Params().set(name="stack", layers=blocks, random_seed=7, **settings)


def build(optimizer=None, keep_prob: float = 1.0, **pipeline):
  """(model, optimizer with slots, the training step, its batch)."""
  model = model_params(keep_prob=keep_prob, **pipeline).instantiate()
  opt = (optimizer or optimizers.Adam.Params().set(learning_rate=0.05)).instantiate()
  opt.create_slots(model.trainable_variables)
  wrapped = train_step.StackWithLoss(model, lambda out, _: {
      "loss": (tf.reduce_mean(tf.square(out)), tf.constant(6.0))})
  step = step_function(train_step.TrainStep(wrapped, opt, tf.Variable(0, dtype=tf.int64)))
  batch = {"inputs": tf.constant(np.random.RandomState(0).randn(6, 8), tf.float32)}
  return model, opt, step, batch


def checkpoint_tensors(path: str) -> dict[str, np.ndarray]:
  reader = tf.train.load_checkpoint(path)
  return {key: reader.get_tensor(key) for key, _ in tf.train.list_variables(path)
          if key != "_CHECKPOINTABLE_OBJECT_GRAPH"}


def test_a_cell_holds_one_variable_per_weight_shape(cpu_devices):
  model = model_params(devices=cpu_devices[:2]).instantiate()
  # Two blocks per cell, four shapes per block: [8] (norm scale, norm bias, outer
  # bias: one stack), [8, 16], [16], [16, 8].
  assert len(model.trainable_variables) == 2 * 4
  for variable in model.trainable_variables:
    stack = stacked_variables.stack_of(variable)
    assert stack is not None and variable.shape[0] == len(stack.rows)
    for i, row in enumerate(stack.rows):
      assert row.device == variable.device
      np.testing.assert_array_equal(row.numpy(), variable.numpy()[i])
  weights = stacked_variables.trainable_weights(model)
  assert len(weights) == 4 * 6
  assert {w.device for w in weights[:12]} == {model.trainable_variables[0].device}


def test_weights_are_those_of_one_variable_per_weight_in_the_same_order(cpu_devices):
  stacked = model_params(devices=cpu_devices[:2]).instantiate()
  plain = model_params(devices=cpu_devices[:2], stack_variables=False).instantiate()
  assert not any(stacked_variables.stack_of(v) for v in plain.trainable_variables)
  got, want = stacked_variables.trainable_weights(stacked), plain.trainable_variables
  assert [w.name for w in got] == [v.name for v in want]
  for w, v in zip(got, want, strict=True):
    np.testing.assert_array_equal(w.numpy(), v.numpy())


def test_a_row_assigns_into_its_stack_only(cpu_devices):
  model = model_params(devices=cpu_devices[:2]).instantiate()
  row = model.layers[1].inner.b
  before = row.stack.variable.numpy()
  np.testing.assert_array_equal(row.assign(np.arange(16, dtype=np.float32)), np.arange(16))
  np.testing.assert_array_equal(row.assign_add(np.ones(16, np.float32)), np.arange(1, 17))
  np.testing.assert_array_equal(row.assign_sub(np.full(16, 2, np.float32)),
                                np.arange(-1, 15))
  after = row.stack.variable.numpy()
  np.testing.assert_array_equal(after[row.row], np.arange(-1, 15))
  np.testing.assert_array_equal(np.delete(after, row.row, 0), np.delete(before, row.row, 0))


def test_a_row_read_in_a_nested_graph_is_its_cells_slice(cpu_devices):
  """Inside a cond branch (a graph within the traced cell), a row still reads as the
  slice its cell differentiates against, so its gradient is not lost."""
  model = model_params(devices=cpu_devices[:2]).instantiate()
  row = model.layers[0].inner.b  # [16]

  @tf.function
  def gradient():
    with stacked_variables.bound([row.stack]) as rows:
      with tf.GradientTape() as tape:
        tape.watch(rows[id(row)])
        y = tf.cond(tf.constant(True), lambda: tf.reduce_sum(row * 2.0),
                    lambda: tf.constant(0.0))
      return tape.gradient(y, rows[id(row)])

  np.testing.assert_array_equal(gradient(), np.full(16, 2.0, np.float32))


def test_a_row_refuses_what_a_variable_refuses(cpu_devices):
  """A value of another shape (even of the same size), a conversion to another dtype,
  and an optimizer given rows instead of their stacks raise, naming the weight."""
  model = model_params(devices=cpu_devices[:2]).instantiate()
  w = model.layers[0].inner.w  # [8, 16]
  with pytest.raises(ValueError, match=r"ff0/inner/w.*shape \(16, 8\)"):
    w.assign(np.zeros([16, 8], np.float32))
  with pytest.raises(ValueError, match="Incompatible type conversion.*bfloat16"):
    tf.convert_to_tensor(w, tf.bfloat16)
  opt = optimizers.Adam.Params().instantiate()
  with pytest.raises(ValueError, match="pass the model's trainable_variables"):
    opt.create_slots(stacked_variables.trainable_weights(model))
  np.testing.assert_array_equal((1.0 / w).numpy(), 1.0 / w.numpy())  # operators as a tensor
  with pytest.raises(TypeError):
    iter(w)


@pytest.mark.parametrize("num_cells, scan", [(1, False), (2, False), (4, False), (2, True)])
def test_a_checkpoint_of_unstacked_variables_restores_bit_for_bit(tmp_path, cpu_devices,
                                                                  num_cells, scan):
  """The checkpoint written by the engine before stacking (K=2, Adam after two steps)
  restores into K ∈ {1, 2, 4}, and with scan_layers (a stack per weight of a kind of
  layer), with every weight and slot equal to the bit, and the restored model saves
  under the same keys the same tensors."""
  model, opt, _, _ = build(num_cells=num_cells, devices=cpu_devices[:num_cells],
                           scan_layers=scan)
  tf.train.Checkpoint(model=model, optimizer=opt).read(str(LEGACY)).assert_consumed()
  saved = tf.train.Checkpoint(model=model, optimizer=opt).write(str(tmp_path / "again"))
  got, want = checkpoint_tensors(saved), checkpoint_tensors(str(LEGACY))
  assert sorted(got) == sorted(want)
  assert any("/m/.ATTRIBUTES" in key for key in want)  # the Adam slots are in it
  for key in want:
    np.testing.assert_array_equal(got[key], want[key], err_msg=key)


def test_whole_stack_io_saves_and_restores_what_rows_one_by_one_do(tmp_path, cpu_devices):
  """Saved within `whole_stack_io` (one read per stack), the legacy checkpoint's every
  key and tensor come out as saved row by row; restored within it (one write per
  stack, at the block's end), into a freshly built model, every weight and slot is the
  legacy checkpoint's to the bit; a restore that holds only some rows of a stack writes
  those rows and leaves the others."""
  model, opt, _, _ = build(num_cells=2, devices=cpu_devices[:2])
  with stacked_variables.whole_stack_io():
    status = tf.train.Checkpoint(model=model, optimizer=opt).read(str(LEGACY))
    untouched = [w.numpy() for w in stacked_variables.trainable_weights(model)]
  status.assert_consumed()
  fresh, _, _, _ = build(num_cells=2, devices=cpu_devices[:2])
  for a, b in zip(untouched, stacked_variables.trainable_weights(fresh)):
    np.testing.assert_array_equal(a, b.numpy())  # rows read as before until the end
  with stacked_variables.whole_stack_io():
    saved = tf.train.Checkpoint(model=model, optimizer=opt).write(str(tmp_path / "io"))
  got, want = checkpoint_tensors(saved), checkpoint_tensors(str(LEGACY))
  assert sorted(got) == sorted(want)
  for key in want:
    np.testing.assert_array_equal(got[key], want[key], err_msg=key)

  # One block's weights only: of a stack of four rows, one row restored.
  weights = stacked_variables.trainable_weights(model)
  row = next(w for w in weights if w.stack is not None and len(w.stack.rows) > 1)
  others = [r for r in row.stack.rows if r is not row]
  before = [r.numpy() for r in others]
  path = tf.train.Checkpoint(w=row).write(str(tmp_path / "one"))
  row.assign(tf.zeros_like(row))
  with stacked_variables.whole_stack_io():
    tf.train.Checkpoint(w=row).read(path).assert_consumed()
  np.testing.assert_array_equal(row.numpy(), checkpoint_tensors(path)["w/.ATTRIBUTES/"
                                                                     "VARIABLE_VALUE"])
  for r, value in zip(others, before):
    np.testing.assert_array_equal(r.numpy(), value)


def test_whole_stack_io_reads_a_row_written_within_it_afresh(tmp_path, cpu_devices):
  """A row assigned between two saves in one block is saved with its new value."""
  model, _, _, _ = build(num_cells=1, devices=cpu_devices[:1])
  row = stacked_variables.trainable_weights(model)[0]
  checkpoint = tf.train.Checkpoint(w=row)
  with stacked_variables.whole_stack_io():
    first = checkpoint.write(str(tmp_path / "first"))
    row.assign(row + 1.0)
    second = checkpoint.write(str(tmp_path / "second"))
  key = "w/.ATTRIBUTES/VARIABLE_VALUE"
  np.testing.assert_array_equal(checkpoint_tensors(second)[key],
                                checkpoint_tensors(first)[key] + 1.0)
  np.testing.assert_array_equal(checkpoint_tensors(second)[key], row.numpy())


def test_whole_stack_io_keeps_an_assign_made_after_a_restore_in_the_block(tmp_path,
                                                                          cpu_devices):
  """Restore a row, then assign it (and a sibling row) in the same block: the assigns
  stand after the block ends; the pending restore is written before them, not after."""
  model, _, _, _ = build(num_cells=1, devices=cpu_devices[:1])
  row = next(w for w in stacked_variables.trainable_weights(model)
             if w.stack is not None and len(w.stack.rows) > 1)
  sibling = next(r for r in row.stack.rows if r is not row)
  path = tf.train.Checkpoint(w=row).write(str(tmp_path / "row"))
  with stacked_variables.whole_stack_io():
    tf.train.Checkpoint(w=row).read(path).assert_consumed()
    row.assign(tf.fill(row.shape, 3.0))
    sibling.assign(tf.fill(sibling.shape, 5.0))
  np.testing.assert_array_equal(row.numpy(), np.full(row.shape, 3.0, np.float32))
  np.testing.assert_array_equal(sibling.numpy(), np.full(sibling.shape, 5.0, np.float32))


def assert_same_weights_and_slots(saved, restored) -> None:
  """(model, optimizer) pairs: every weight and its optimizer slots bit for bit equal."""
  (model, opt), (again, again_opt) = saved, restored
  for a, b in zip(stacked_variables.trainable_weights(model),
                  stacked_variables.trainable_weights(again), strict=True):
    np.testing.assert_array_equal(a.numpy(), b.numpy())
    for name, slot in opt.slots_of(a).items():
      np.testing.assert_array_equal(slot.numpy(), again_opt.slots_of(b)[name].numpy())


def test_checkpoints_move_between_stacked_and_unstacked_and_across_k(tmp_path, cpu_devices):
  """K=4 stacked → K=1 unstacked → K=2 stacked: each restores what the last saved."""
  model, opt, step, batch = build(num_cells=4, devices=cpu_devices)
  step(batch)
  path = tf.train.Checkpoint(model=model, optimizer=opt).write(str(tmp_path / "k4"))
  plain, plain_opt, _, _ = build(num_cells=1, stack_variables=False, devices=cpu_devices[:1])
  tf.train.Checkpoint(model=plain, optimizer=plain_opt).read(path).assert_consumed()
  path = tf.train.Checkpoint(model=plain, optimizer=plain_opt).write(str(tmp_path / "k1"))
  again, again_opt, _, _ = build(num_cells=2, devices=cpu_devices[:2])
  tf.train.Checkpoint(model=again, optimizer=again_opt).read(path).assert_consumed()
  assert_same_weights_and_slots((model, opt), (again, again_opt))


@EXHAUSTIVE
def test_checkpoints_move_between_zbv_and_gpipe_at_another_k(tmp_path, cpu_devices):
  """zbv (K=4, two cells per device in a V) → gpipe K=2 → zbv: the checkpoint holds each
  weight under its own name whatever the schedule, K and placement."""
  zbv = dict(num_cells=4, schedule="zbv", virtual_stages=2, devices=cpu_devices[:2])
  model, opt, step, batch = build(**zbv)
  step(batch)
  path = tf.train.Checkpoint(model=model, optimizer=opt).write(str(tmp_path / "zbv"))
  gpipe, gpipe_opt, gpipe_step, _ = build(num_cells=2, devices=cpu_devices[2:])
  tf.train.Checkpoint(model=gpipe, optimizer=gpipe_opt).read(path).assert_consumed()
  gpipe_step(batch)
  path = tf.train.Checkpoint(model=gpipe, optimizer=gpipe_opt).write(str(tmp_path / "gpipe"))
  again, again_opt, _, _ = build(**zbv)
  tf.train.Checkpoint(model=again, optimizer=again_opt).read(path).assert_consumed()
  assert_same_weights_and_slots((gpipe, gpipe_opt), (again, again_opt))


@pytest.mark.parametrize("optimizer", [
    pytest.param(optimizers.Adam.Params().set(learning_rate=0.05), id="adam",
                 marks=EXHAUSTIVE),
    pytest.param(optimizers.SGD.Params().set(learning_rate=0.1, momentum=0.9), id="sgd",
                 marks=EXHAUSTIVE),
    pytest.param(optimizers.RMSProp.Params().set(learning_rate=0.01), id="rmsprop",
                 marks=EXHAUSTIVE),
    # Per-weight statistics: factored second moments (both dims >= 8), update clipping
    # and the parameter scale, each per row of a stack.
    pytest.param(optimizers.Adafactor.Params().set(
        learning_rate=0.1, min_dim_size_to_factor=8, clipping_threshold=0.01, beta1=0.5),
        id="adafactor"),
])
def test_training_steps_equal_those_of_one_variable_per_weight(cpu_devices, optimizer):
  """Three steps (clipped by global norm) of the stacked pipeline against the same
  pipeline with one tf.Variable per weight: the same weights and slots."""
  optimizer = optimizer.copy().set(clip_gradient_norm=0.5)
  stacked, stacked_opt, stacked_step, batch = build(optimizer, devices=cpu_devices[:2])
  plain, plain_opt, plain_step, _ = build(optimizer, stack_variables=False,
                                          devices=cpu_devices[:2])
  for _ in range(3):
    stacked_step(batch)
    plain_step(batch)
  # Adafactor's per-weight means over a stack's rows sum in another order than over
  # one weight, and its first steps divide by them (u = g / sqrt(g²)): TRAINED's bound
  # (seen 65 ulps of the slots' scale); the element-wise optimizers stay within
  # REORDERED.
  ulps = TRAINED if optimizer.cls is optimizers.Adafactor else REORDERED
  got = stacked_variables.trainable_weights(stacked)
  assert_all_close([w.numpy() for w in got], [v.numpy() for v in plain.trainable_variables],
                   ulps=ulps)
  assert_all_close([s.numpy() for w in got for s in stacked_opt.slots_of(w).values()],
                   [s.numpy() for v in plain.trainable_variables
                    for s in plain_opt.slots_of(v).values()], ulps=ulps)


@pytest.mark.parametrize("pipeline", [
    pytest.param(dict(num_cells=2, num_micro_batches=3), id="gpipe", marks=EXHAUSTIVE),
    pytest.param(dict(num_cells=2, num_micro_batches=2, schedule="zb_h1"), id="zb_h1"),
    pytest.param(dict(num_cells=2, num_micro_batches=4, weight_gradient_group=2), id="group2",
                 marks=EXHAUSTIVE),
    pytest.param(dict(num_cells=2, num_micro_batches=2, recompute="never"), id="no_recompute",
                 marks=EXHAUSTIVE),
])
def test_dropout_and_deferred_weight_gradients_equal_one_variable_per_weight(
    cpu_devices, pipeline):
  """Two Adam steps with dropout on every block (each layer's seeds are its own) and
  with weight gradients deferred (rows read through weight products): the stacked
  pipeline's losses, weights and slots equal those of one tf.Variable per weight."""
  runs = []
  for stack in (True, False):
    model, opt, step, batch = build(keep_prob=0.7, stack_variables=stack,
                                    devices=cpu_devices[:2], **pipeline)
    losses = np.array([step(batch)[0]["loss"].numpy() for _ in range(2)])
    weights = (stacked_variables.trainable_weights(model) if stack
               else model.trainable_variables)
    runs.append((losses, [w.numpy() for w in weights],
                 [s.numpy() for w in weights for s in opt.slots_of(w).values()]))
  (losses, weights, slots), (want_losses, want_weights, want_slots) = runs
  assert_all_close(losses, want_losses)
  assert_all_close(weights, want_weights)
  assert_all_close(slots, want_slots)


def test_layer_statistics_do_not_depend_on_stacking(cpu_devices):
  """inspect_model's per-layer counts and the cells' descriptions: the same whether a
  cell's weights are stacked or not (and the parameter counts those of the weights)."""
  stacked = model_params(devices=cpu_devices[:2])
  plain = stacked.copy().set(stack_variables=False)
  spec = tf.TensorSpec([6, 8], tf.float32)
  got, want = model_stats.analyze(stacked, spec), model_stats.analyze(plain, spec)
  assert [(s.path, s.num_params, s.flops) for s in got] == [
      (s.path, s.num_params, s.flops) for s in want]
  model = stacked.instantiate()
  assert model.describe_cells() == plain.instantiate().describe_cells()
  assert sum(c["params"] for c in model.describe_cells()) == sum(
      int(np.prod(w.shape)) for w in stacked_variables.trainable_weights(model))


def test_a_non_finite_row_is_named_by_its_weight(cpu_devices):
  model = model_params(devices=cpu_devices[:2]).instantiate()
  model.layers[2].outer.w.assign(np.full([16, 8], np.nan, np.float32))
  assert train_step.non_finite_variables(model.trainable_variables) == [
      model.layers[2].outer.w.name]


def step_captures(num_blocks: int, stack: bool) -> int:
  """How many tensors (variable handles and slots) the traced training step of a
  2-cell pipeline of `num_blocks` identical blocks captures."""
  _, _, step, batch = build(num_blocks=num_blocks, stack_variables=stack)
  return len(step.get_concrete_function(batch).captured_inputs)


@EXHAUSTIVE
def test_the_steps_arguments_do_not_grow_with_identical_layers():
  """The step's captured variables and slots are per cell and weight shape: as many
  for 16 blocks as for 4 (one tf.Variable per weight: 6 more per block and slot)."""
  assert step_captures(4, stack=True) == step_captures(16, stack=True)
  assert step_captures(16, stack=False) - step_captures(4, stack=False) >= 12 * 6 * 3
