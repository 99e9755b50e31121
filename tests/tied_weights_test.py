"""Tied weights: a softmax that projects with the embedding table (tie_to), one variable
read by the first cell and the last, its gradient the sum of both uses, equal to the
tied model unpartitioned; counted once, checkpointed under one key."""

import numpy as np
import pytest
import tensorflow as tf
from conftest import engine_loss_and_grads
from numerics import HALF_REORDERED, REORDERED, assert_close
from tiers import EXHAUSTIVE, quick_sample

from lingvo_gpipe import model_registry, train_step, trainer
from lingvo_gpipe.core import base_layer, hyperparams, layers, optimizers, stacked_variables
from lingvo_gpipe.core.base_layer import TieError
from lingvo_gpipe.models import transformer
from lingvo_gpipe.pipeline import layer as gpipe

VOCAB, DIM, BATCH, LENGTH, STEP = 16, 8, 8, 6, 3


def stack_params(cls, tied: bool = True, **pipeline):
  stack = transformer.lm_stack(VOCAB, model_dim=DIM, hidden_dim=16, num_heads=2,
                               num_layers=2, residual_keep_prob=0.9,
                               tie_embedding_softmax=tied)
  return cls.Params().set(name="stack", layers=stack.layers, random_seed=5, **pipeline)


def batch():
  rng = np.random.RandomState(0)
  return {"inputs": (tf.constant(rng.randint(VOCAB, size=[BATCH, LENGTH]), tf.int32),
                     tf.zeros([BATCH, LENGTH], tf.float32)),
          "labels": tf.constant(rng.randint(VOCAB, size=[BATCH, LENGTH]), tf.int32)}


def xent(logits, labels):
  return tf.reduce_mean(layers.softmax_cross_entropy(logits, labels))


def head(outputs, head_inputs):
  labels = head_inputs["labels"]
  return {"loss": (xent(outputs, labels), tf.cast(tf.shape(labels)[0], tf.float32))}


def reference_loss_and_grads(fprop_dtype: str):
  """The tied model unpartitioned, whole batch, GradientTape."""
  model = stack_params(layers.Sequential, fprop_dtype=fprop_dtype).instantiate()
  data = batch()
  with tf.GradientTape() as tape:
    with base_layer.step_context(training=True, step=tf.constant(STEP, tf.int64)):
      loss = xent(model(*data["inputs"]), data["labels"])
  variables = model.trainable_variables
  return loss.numpy(), [g.numpy() for g in tape.gradient(loss, variables)], variables


@pytest.fixture(scope="module")
def references():
  return {dtype: reference_loss_and_grads(dtype) for dtype in ("float32", "bfloat16")}


# Every schedule, K ∈ {1, 2, 4}, both recompute policies and both dtypes, each pair of
# values of two of them at least once; zbv's K cells in a V on K/2 devices.
GRID = [
    ("gpipe", 1, "always", "float32"), ("1f1b", 2, "never", "float32"),
    ("zb_h1", 2, "always", "bfloat16"), ("zbv", 2, "never", "bfloat16"),
    ("zbv", 4, "always", "float32"), ("1f1b", 4, "always", "bfloat16"),
    ("gpipe", 4, "never", "bfloat16"), ("zb_h1", 4, "never", "float32"),
    ("gpipe", 2, "always", "bfloat16"), ("1f1b", 1, "never", "bfloat16"),
]


@pytest.mark.parametrize("schedule, num_cells, recompute, dtype",
                         quick_sample(GRID, quick=[("zbv", 4, "always", "float32")]))
def test_tied_pipeline_equals_the_tied_model_unpartitioned(references, cpu_devices, schedule,
                                                           num_cells, recompute, dtype):
  want_loss, want_grads, want_vars = references[dtype]
  virtual = 2 if schedule == "zbv" else 1
  model = stack_params(gpipe.PipeliningLayer, num_cells=num_cells, num_micro_batches=4,
                       schedule=schedule, recompute=recompute, virtual_stages=virtual,
                       devices=cpu_devices[:num_cells // virtual], fprop_dtype=dtype
                       ).instantiate()
  names = [v.name for v in stacked_variables.trainable_weights(model)]
  assert names == [v.name for v in want_vars]  # the table once, no softmax weight
  loss, grads = engine_loss_and_grads(model, train_step.StackWithLoss(model, head),
                                      batch(), STEP)
  ulps = HALF_REORDERED if dtype != "float32" else REORDERED
  assert_close(loss, want_loss, ulps, dtype=dtype)
  # One scale for all gradients: some are zero but for rounding (attention's key bias:
  # the softmax over keys ignores a shift), carrying the error of the terms that
  # cancelled, i.e. of the largest gradients' scale.
  assert_close(np.concatenate([np.ravel(g) for g in grads]),
               np.concatenate([np.ravel(g) for g in want_grads]), ulps, dtype=dtype)
  tied = names.index(model.layers[0].emb.emb.name)
  assert np.abs(want_grads[tied]).max() > 1e-3  # the table's gradient is there


@pytest.mark.parametrize("settings", [
    pytest.param(dict(schedule="1f1b", num_token_slices=2, recompute="never"),
                 id="token_slices", marks=EXHAUSTIVE),
    pytest.param(dict(schedule="gpipe", stack_variables=False), id="unstacked",
                 marks=EXHAUSTIVE),
    pytest.param(dict(schedule="zb_h1", scan_layers=True), id="scan_layers"),
    pytest.param(dict(schedule="1f1b", share_layer_functions=False), id="unshared",
                 marks=EXHAUSTIVE),
])
def test_tied_pipeline_settings_equal_the_tied_model_unpartitioned(references, cpu_devices,
                                                                   settings):
  """K=2 across two devices with token slices, unstacked variables, layers run as a
  loop, and layers traced into their cells."""
  want_loss, want_grads, _ = references["float32"]
  model = stack_params(gpipe.PipeliningLayer, num_cells=2, num_micro_batches=2,
                       devices=cpu_devices[:2], **settings).instantiate()
  loss, grads = engine_loss_and_grads(model, train_step.StackWithLoss(model, head),
                                      batch(), STEP)
  assert_close(loss, want_loss)
  assert_close(np.concatenate([np.ravel(g) for g in grads]),
               np.concatenate([np.ravel(g) for g in want_grads]))


def test_the_table_is_one_variable_on_the_first_cell_and_not_stacked(cpu_devices):
  model = stack_params(gpipe.PipeliningLayer, num_cells=2, num_micro_batches=2,
                       devices=cpu_devices[:2]).instantiate()
  table = model.layers[0].emb.emb
  assert isinstance(table, tf.Variable)  # not a row of cell 0's stack
  assert model.layers[-1].softmax.emb is table
  assert table.device.endswith(cpu_devices[0].split("/")[-1])
  untied = stack_params(layers.Sequential, tied=False).instantiate()
  tied = stack_params(layers.Sequential).instantiate()
  assert untied.num_params() - tied.num_params() == VOCAB * DIM


def test_a_checkpoint_holds_the_table_once_and_restores_under_another_k(tmp_path,
                                                                        cpu_devices):
  two = stack_params(gpipe.PipeliningLayer, num_cells=2, num_micro_batches=2,
                     devices=cpu_devices[:2]).instantiate()
  path = tf.train.Checkpoint(model=two).save(str(tmp_path / "ckpt"))
  keys = [name for name, _ in tf.train.list_variables(path) if "emb/emb" in name
          or "softmax/emb" in name]
  assert len(keys) == 1, keys
  four = stack_params(gpipe.PipeliningLayer, num_cells=4, num_micro_batches=2,
                      devices=cpu_devices[:4]).set(random_seed=9).instantiate()
  tf.train.Checkpoint(model=four).restore(path).assert_existing_objects_matched()
  for a, b in zip(stacked_variables.trainable_weights(two),
                  stacked_variables.trainable_weights(four)):
    np.testing.assert_array_equal(np.asarray(a.numpy()), np.asarray(b.numpy()))


@pytest.mark.parametrize("tie_to, message", [
    ("embedding/emb/missing", "no variable built before it is at"),
    ("layer_000/self_atten/norm/scale", "its shape is"),
])
def test_a_bad_tie_is_named(tie_to, message):
  p = stack_params(layers.Sequential)
  p.layers[-1].tie_to = tie_to
  with pytest.raises(TieError, match=message):
    p.instantiate()


def tiny_lm_trainer(logdir, overrides: str):
  """lm.TransformerTiny at K=2 with plain SGD (Adam would move an element whose
  gradient is nearly zero by ±lr on its rounding alone: the comparisons below are of
  the tie, not of Adam)."""
  model_registry.load_param_files([])
  params = model_registry.get_params("lm.TransformerTiny")
  params.task.train.optimizer = optimizers.SGD.Params().set(learning_rate=0.05)
  for name, value in hyperparams.parse_overrides(
      "task.train.save_interval_steps=3;task.pipeline.num_cells=2;" + overrides):
    params.set_from_text(name, value)
  return trainer.Trainer(params.freeze(), str(logdir), log=lambda _: None)


@EXHAUSTIVE
def test_two_tied_replicas_train_like_one_pipeline_on_the_double_batch(tmp_path):
  """lm.TransformerTiny (tied, dropout on): R=2 × (K=2, M=2), each replica's softmax
  reading its own copy, gives the losses and the table of R=1 × (K=2, M=4). The two
  shards hold different numbers of tokens, so this also checks that the all-reduce
  weights each replica's gradient by its tokens (an unweighted mean was 2.6e-4 off in
  the second loss, tied or not)."""
  runs = {}
  for name, overrides in (("r1", "task.pipeline.num_micro_batches=4"),
                          ("r2", "task.pipeline.num_micro_batches=2;"
                                 "task.pipeline.num_replicas=2")):
    run = tiny_lm_trainer(tmp_path / name, overrides)
    losses = []
    run.train(3, on_step=lambda _, v, losses=losses: losses.append(float(v["loss"])))
    runs[name] = (losses, run.task.main_stack.layers[0].emb.emb.numpy())
  assert runs["r1"][0][-1] < runs["r1"][0][0]  # it learns
  assert_close(np.array(runs["r2"][0]), np.array(runs["r1"][0]), dtype=np.float32)
  assert_close(runs["r2"][1], runs["r1"][1])
