"""task.train.steps_per_call: several training steps traced into one call.

Oracle: the same run with one step per call, on the same batches in the same order:
the losses, the weights, the checkpoints, the step a non-finite batch stops at and the
state it leaves, the loss scale's skips.
"""

import re

import numpy as np
import pytest
import tensorflow as tf
from numerics import REORDERED, assert_close
from tiers import EXHAUSTIVE, quick_sample

from lingvo_gpipe import model_registry, trainer
from lingvo_gpipe.core import hyperparams
from lingvo_gpipe.inputs.synthetic_images import SyntheticImages
from lingvo_gpipe.preflight import preflight
from lingvo_gpipe.tasks.base_task import check_train_params


class PoisonedImages(SyntheticImages):
  """Examples 40 to 47 are NaN: batch 6 alone (batch size 8) is poisoned, so the
  batches after it would update if they were let."""

  def _example(self, index):
    example = super()._example(index)
    poisoned = tf.logical_and(index >= 8 * 5, index < 8 * 6)
    return dict(example, image=example["image"] + tf.where(poisoned, float("nan"), 0.0))


def make_params(model: str, overrides: str) -> hyperparams.Params:
  model_registry.load_param_files()
  params = model_registry.get_params(model)
  for key, value in hyperparams.parse_overrides(overrides):
    params.set_from_text(key, value)
  return params


def train(params, logdir, steps: int, logs: list | None = None):
  """(the trainer, each step's loss, the weights after the run)."""
  run = trainer.Trainer(params.freeze(), str(logdir),
                        log=logs.append if logs is not None else (lambda _: None))
  losses = []
  run.train(steps, on_step=lambda _, values: losses.append(float(values["loss"])))
  return run, np.array(losses), [v.numpy() for v in run.task.trainable_variables]


CONV = ("train_input.batch_size=8;task.pipeline.num_cells=2;task.pipeline.num_micro_batches=2;"
        "task.train.save_interval_steps=5;task.train.summary_interval_steps=1;"
        "task.train.log_interval_steps=1")


@pytest.mark.parametrize("replicas", quick_sample([1, 2], quick=[1]))
def test_several_steps_per_call_train_as_one_per_call(tmp_path, replicas):
  """TinyConvNet (batch norm, SGD with momentum), K=2, M=2 (R=2: two pipelines, their
  gradients all-reduced), 7 steps: 3 per call (calls of 3, 2 ending at the checkpoint
  of step 5, and 2) give one per call's losses, weights and checkpoints."""
  overrides = CONV + f";task.pipeline.num_replicas={replicas}"
  _, want, want_weights = train(make_params("demo.TinyConvNet", overrides), tmp_path / "one", 7)
  logs: list = []
  run, got, weights = train(make_params("demo.TinyConvNet",
                                        overrides + ";task.train.steps_per_call=3"),
                            tmp_path / "three", 7, logs)
  assert any("(3 steps per call)" in line for line in logs), logs
  # Progress lines (every step) inside a call: each step takes its share of the call's
  # time, so steps 2 and 3 of the first call show one rate (it read millions: the steps
  # after the first were counted when the call had already ended).
  rates = {int(m.group(1)): float(m.group(2)) for line in logs if (m := re.search(
      r"step (\d+)/7 .*examples/sec ([\d.]+)", line))}
  assert rates[2] == rates[3] < 1e5, rates
  assert len(got) == 7
  assert_close(got, want, REORDERED, dtype=np.float32)
  assert_close(np.concatenate([w.ravel() for w in weights]),
               np.concatenate([w.ravel() for w in want_weights]), REORDERED, dtype=np.float32)
  assert sorted(p.name for p in (tmp_path / "three" / "train").glob("ckpt-*.index")) == [
      "ckpt-5.index", "ckpt-7.index"]
  assert int(run.global_step.numpy()) == 7


def test_a_call_is_traced_no_longer_than_the_run_can_make_one(tmp_path):
  """steps_per_call = 10⁹ with max_steps 3 and checkpoints every 2: the run's calls
  take at most 2 steps, and that is what is traced (a billion unrolled steps never
  finished tracing), noted; the losses are one step per call's."""
  _, want, _ = train(make_params("demo.TinyConvNet", CONV), tmp_path / "one", 3)
  logs: list = []
  overrides = CONV + ";task.train.save_interval_steps=2;task.train.steps_per_call=1000000000"
  _, got, _ = train(make_params("demo.TinyConvNet", overrides), tmp_path / "many", 3, logs)
  assert any("steps_per_call=1000000000 is more than a call of this run takes: at most 2"
             in line for line in logs), logs
  assert any("(2 steps per call)" in line for line in logs), logs
  assert_close(got, want, REORDERED, dtype=np.float32)


@EXHAUSTIVE
def test_a_non_finite_step_inside_a_call_stops_there_leaving_the_state_before_it(tmp_path):
  """Batch 6 is NaN; 4 steps per call run steps 5 to 8 in the second call. The run
  stops at step 6 as one step per call does, and steps 7 and 8, run in the same call,
  changed nothing: the weights and the global step are step 5's."""
  states = {}
  for per_call in (1, 4):
    params = make_params("demo.TinyConvNet", CONV + ";task.train.save_interval_steps=100;"
                         f"task.train.steps_per_call={per_call}")
    params.train_input.cls = PoisonedImages
    run = trainer.Trainer(params.freeze(), str(tmp_path / str(per_call)), log=lambda _: None)
    with pytest.raises(trainer.NonFiniteLossError, match="at step 6"):
      run.train(12)
    states[per_call] = (int(run.global_step.numpy()),
                        np.concatenate([v.numpy().ravel() for v in run.task.variables]))
  assert states[4][0] == states[1][0] == 5
  assert np.all(np.isfinite(states[4][1]))
  assert_close(states[4][1], states[1][1], REORDERED, dtype=np.float32)


@EXHAUSTIVE
def test_loss_scale_overflows_inside_a_call_are_skipped_as_one_per_call(tmp_path):
  """TinyConvNet in float16 from a scale of 2^24 (8 overflows before the first update):
  the overflowing steps inside a call are skipped and the later ones go on at the
  halved scale, as one per call."""
  overrides = CONV + ";task.fprop_dtype='float16';task.train.loss_scale.initial_scale=16777216.0"
  results = {}
  for per_call in (1, 4):
    logs: list = []
    run, losses, _ = train(make_params("demo.TinyConvNet", overrides +
                                       f";task.train.steps_per_call={per_call}"),
                           tmp_path / str(per_call), 3, logs)
    skips = [line for line in logs if "gradient overflow" in line]
    results[per_call] = (skips, float(run.loss_scale.scale.numpy()), losses)
  assert results[1][0] and results[4][0] == results[1][0]
  assert results[4][1] == results[1][1]
  assert_close(results[4][2], results[1][2], REORDERED, dtype=np.float32)


def test_bad_steps_per_call_are_refused_by_name():
  params = make_params("lm.TransformerTiny", "task.train.steps_per_call=0")
  with pytest.raises(hyperparams.ParamsError, match="steps_per_call must be an int >= 1, got 0"):
    check_train_params(params.task.train)
  params = make_params("lm.TransformerTinyBuckets", "task.train.steps_per_call=2")
  with pytest.raises(hyperparams.ParamsError,
                     match=r"steps_per_call=2 needs batches of one shape.*length buckets"):
    preflight(params, "train")
