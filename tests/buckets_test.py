"""Length buckets: each batch from one bucket, padded to its bound; long-tailed synthetic
lengths; bucketed training equal to unpartitioned training with the same buckets, and
resumable; pre-flight refusals that name the bucket."""

import numpy as np
import pytest
from numerics import TRAINED, assert_close
from tiers import EXHAUSTIVE

from lingvo_gpipe import model_registry, planning, preflight, trainer
from lingvo_gpipe.core.hyperparams import ParamsError
from lingvo_gpipe.inputs import buckets
from lingvo_gpipe.inputs.synthetic_text import SyntheticLm, SyntheticTranslation
from lingvo_gpipe.pipeline.layer import PipelineError

model_registry.load_param_files([])

BOUNDS, SIZES = [6, 9, 12], [8, 6, 4]


def lm_input(**overrides):
  p = SyntheticLm.Params().set(num_examples=400, repeat=False, bucket_upper_bounds=BOUNDS,
                               bucket_batch_sizes=SIZES)
  return p.set(**overrides).instantiate()


def test_each_batch_is_one_bucket_padded_to_its_bound_and_nothing_is_cut():
  gen = lm_input()
  paddings = np.stack([e["paddings"] for e in gen.examples().as_numpy_iterator()])
  lengths = (paddings < 0.5).sum(axis=1)  # numpy: each example's tokens
  per_bucket = np.bincount(np.searchsorted(BOUNDS, lengths, side="left"),
                           minlength=len(BOUNDS))
  seen = np.zeros(len(BOUNDS), np.int64)
  partial = np.zeros(len(BOUNDS), np.int64)
  for batch in gen.dataset():  # one pass (repeat=False): partial batches are kept
    ids, paddings = batch["ids"].numpy(), batch["paddings"].numpy()
    rows, bound = ids.shape
    j = BOUNDS.index(bound)
    assert rows <= SIZES[j]
    partial[j] += rows < SIZES[j]
    tokens = (paddings < 0.5).sum(axis=1)
    assert tokens.max() <= bound and tokens.min() > ([0] + BOUNDS)[j]  # its own bucket
    assert batch["labels"].shape == ids.shape == paddings.shape
    seen[j] += rows
  np.testing.assert_array_equal(seen, per_bucket)  # every example, in its bucket
  assert list(partial) == [int(n % b != 0) for n, b in zip(per_bucket, SIZES)]
  assert [tuple(s["ids"].shape) for s in gen.batch_specs()] == list(zip(SIZES, BOUNDS))
  assert tuple(gen.batch_spec()["ids"].shape) == (6, 9)  # the most tokens: 6 · 9 = 54
  repeated = lm_input(repeat=True)
  for batch, _ in zip(repeated.dataset(), range(40)):  # training: full batches only
    rows, bound = batch["ids"].shape
    assert rows == SIZES[BOUNDS.index(bound)]


def test_translation_buckets_cut_each_side_to_its_own_length():
  gen = SyntheticTranslation.Params().set(
      num_examples=200, target_sequence_length=11, bucket_upper_bounds=BOUNDS,
      bucket_batch_sizes=SIZES).instantiate()
  last = gen.batch_specs()[-1]
  assert last["src_ids"].shape == (4, 12) and last["tgt_ids"].shape == (4, 11)
  assert last["language"].shape == (4,)


@EXHAUSTIVE
def test_zipf_lengths_follow_one_over_rank():
  gen = SyntheticLm.Params().set(num_examples=20000, min_length=4, max_length=10,
                                 length_distribution="zipf").instantiate()
  paddings = np.stack([e["paddings"] for e in gen.examples().as_numpy_iterator()])
  tokens = (paddings < 0.5).sum(axis=1)  # the sentence and BOS
  counts = np.bincount(tokens - 5, minlength=7)[:7] / len(tokens)
  ranks = np.arange(1, 8)
  want = (1 / ranks) / np.sum(1 / ranks)
  sampling = 4 * np.sqrt(want * (1 - want) / len(tokens))  # 4 standard errors
  assert np.all(np.abs(counts - want) < sampling), (counts, want)


@pytest.mark.parametrize("overrides, message", [
    (dict(bucket_batch_sizes=None), "go together"),
    (dict(bucket_upper_bounds=[6, 12], bucket_batch_sizes=[8, 6, 4]), "one batch size"),
    (dict(bucket_upper_bounds=[9, 6, 12]), "must increase"),
    (dict(bucket_upper_bounds=[6, 9, 11]), "make it at least 12"),
    (dict(bucket_batch_sizes=[8, 0, 4]), "ints >= 1"),
    (dict(length_distribution="pareto"), "length_distribution"),
])
def test_bad_bucket_params_are_named(overrides, message):
  with pytest.raises(ParamsError, match=message):
    lm_input(**overrides).batch_specs()


def test_an_input_without_sequences_refuses_buckets():
  from lingvo_gpipe.inputs.synthetic_images import SyntheticImages
  images = SyntheticImages.Params().set(bucket_upper_bounds=[4], bucket_batch_sizes=[2])
  with pytest.raises(ParamsError, match="no sequences to bucket"):
    images.instantiate().batch_specs()


def bucketed_lm(overrides: dict):
  params = model_registry.get_params("lm.TransformerTiny")
  for name in ("train_input", "eval_input"):
    getattr(params, name).set(num_examples=300, bucket_upper_bounds=BOUNDS,
                              bucket_batch_sizes=SIZES)
  params.task.train.set(save_interval_steps=3, summary_interval_steps=3, log_interval_steps=3)
  for key, value in overrides.items():
    params.set_from_text(key, str(value))
  return params.freeze()


def train(params, logdir, steps):
  run = trainer.Trainer(params, str(logdir), log=lambda _: None)
  losses = []
  run.train(steps, on_step=lambda step, values: losses.append(float(values["loss"])))
  return run, np.array(losses)


@EXHAUSTIVE
def test_bucketed_training_equals_unpartitioned_training_and_resumes(tmp_path):
  """TransformerTiny (dropout on) on three buckets: unpartitioned, each bucket traced
  when first needed, against K=2, M=4 traced up front, stopped at step 3 and resumed
  (the input's position restored): the same 6 losses and the same eval."""
  reference, want = train(bucketed_lm({"task.pipeline.num_cells": 0,
                                       "task.train.trace_buckets": "when_needed"}),
                          tmp_path / "k0", 6)
  pipelined = bucketed_lm({"task.pipeline.num_cells": 2, "task.pipeline.num_micro_batches": 4})
  _, first = train(pipelined, tmp_path / "k2", 3)
  resumed, rest = train(pipelined, tmp_path / "k2", 6)
  assert_close(np.concatenate([first, rest]), want, TRAINED, dtype=np.float32)
  shapes = {tuple(spec["ids"].shape) for spec in resumed.train_input.batch_specs()}
  assert len(shapes) == 3
  got, expected = resumed.evaluate(), reference.evaluate()
  assert_close(np.array([got["loss"]]), np.array([expected["loss"]]), TRAINED, dtype=np.float32)


def test_preflight_names_the_bucket_a_split_does_not_fit():
  params = bucketed_lm({"task.pipeline.num_micro_batches": 6})
  with pytest.raises(PipelineError, match=r"bucket_batch_sizes\[2\]=4"):
    preflight.check_batch_splits(params)
  params = bucketed_lm({"task.pipeline.num_micro_batches": 2, "task.pipeline.num_replicas": 4})
  with pytest.raises(ValueError, match=r"bucket_batch_sizes\[1\]=6 is not divisible"):
    preflight.check_batch_splits(params)


def test_the_plan_is_for_the_largest_bucket():
  params = bucketed_lm({})
  assert planning.planned_batch(params) == (
      "the largest of 3 length buckets: batch 6 × 9 tokens")
  stack = planning.MainStack.of(params)
  assert stack.batch_size == 6


def test_padding_fraction_counts_pads():
  batch = {"paddings": np.array([[0, 0, 1, 1], [0, 0, 0, 1]], np.float32)}
  group = buckets.SequenceGroup("paddings", ("paddings",), 4)
  assert buckets.padding_fraction(batch, [group]) == 3 / 8
