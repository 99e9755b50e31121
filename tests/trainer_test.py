"""The trainer binary end to end: checkpoints, resumption, summaries, inspection, bad input."""

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
from conftest import REPO, run_trainer, sigint_as_default
from numerics import assert_close
from tiers import EXHAUSTIVE

from lingvo_gpipe import model_registry

MODEL = "--model=demo.TinyConvNet"
FAST = ("train_input.batch_size=8;eval_input.batch_size=32;eval_input.num_examples=64;"
        "task.train.save_interval_steps=20;task.train.log_interval_steps=10")


def scalar_tags(event_dir: Path) -> dict[str, list[int]]:
  """{tag: [steps]} of the scalar and text summaries written under `event_dir`."""
  tags: dict[str, list[int]] = {}
  for path in event_dir.glob("events.out.tfevents.*"):
    for event in tf.compat.v1.train.summary_iterator(str(path)):
      for value in event.summary.value:
        tags.setdefault(value.tag, []).append(event.step)
  return tags


def digest(directory: Path) -> dict[str, str]:
  return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
          for p in sorted(directory.glob("ckpt-*"))}


def test_train_resume_eval_and_summaries(tmp_path):
  logdir = tmp_path / "run"
  first = run_trainer(MODEL, f"--logdir={logdir}", "--max_steps=40",
                      f"--params_override={FAST}")
  assert first.returncode == 0, first.stderr
  assert "step 40/40" in first.stdout and "examples/sec" in first.stdout
  assert "eta" in first.stdout
  train_dir = logdir / "train"
  assert tf.train.latest_checkpoint(str(train_dir)).endswith("ckpt-40")
  assert (train_dir / "ckpt-20.index").exists()
  assert "task.train.max_steps : 40" in (logdir / "params.txt").read_text()
  tags = scalar_tags(train_dir)
  for tag in ("loss", "accuracy", "top5_accuracy", "learning_rate", "grad_norm",
              "examples_per_sec", "params"):
    assert tag in tags, tag
  assert max(tags["loss"]) == 40

  second = run_trainer(MODEL, f"--logdir={logdir}", "--max_steps=60", "--mode=train_and_eval",
                       f"--params_override={FAST}")
  assert second.returncode == 0, second.stderr
  assert f"Resuming from checkpoint {train_dir / 'ckpt-40'} at step 40" in second.stdout
  assert "step 50/60" in second.stdout and "step 10/" not in second.stdout
  assert tf.train.latest_checkpoint(str(train_dir)).endswith("ckpt-60")
  eval_tags = scalar_tags(logdir / "eval")
  assert eval_tags["accuracy"] == [60]

  third = run_trainer(MODEL, f"--logdir={logdir}", "--mode=eval", f"--params_override={FAST}")
  assert third.returncode == 0, third.stderr
  assert "eval at step 60: accuracy" in third.stdout


def files(directory: Path) -> dict[str, str]:
  """{relative path: sha256} of every file under `directory` but the lock file (each
  trainer that takes the lock writes its pid there; it records nothing of the run)."""
  return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
          for p in sorted(directory.rglob("*")) if p.is_file() and p.name != "trainer.lock"}


EVERY_10 = FAST + ";task.train.save_interval_steps=10"


@EXHAUSTIVE
def test_a_damaged_logdir_resumes_from_the_newest_readable_checkpoint_losing_nothing(tmp_path):
  """Index file lost, newest checkpoint truncated, a save interrupted: the run resumes
  from the newest checkpoint that reads, keeps the unreadable one aside, and ends where
  an uninterrupted run ends."""
  straight, damaged = tmp_path / "straight", tmp_path / "damaged"
  assert run_trainer(MODEL, f"--logdir={straight}", "--max_steps=30",
                     f"--params_override={EVERY_10}").returncode == 0
  assert run_trainer(MODEL, f"--logdir={damaged}", "--max_steps=20",
                     f"--params_override={EVERY_10}").returncode == 0
  train_dir = damaged / "train"
  (train_dir / "checkpoint").unlink()
  os.truncate(train_dir / "ckpt-20.data-00000-of-00001", 1000)
  truncated = {name: digest for name, digest in files(train_dir).items()
               if name.startswith("ckpt-20.")}
  (train_dir / "ckpt-25_temp").mkdir()

  resumed = run_trainer(MODEL, f"--logdir={damaged}", "--max_steps=30",
                        f"--params_override={EVERY_10}")
  assert resumed.returncode == 0, resumed.stderr
  assert (f"warning: checkpoint {train_dir / 'ckpt-20'} cannot be read (Read less bytes than "
          "requested)") in resumed.stdout
  assert f"Resuming from checkpoint {train_dir / 'ckpt-10'} at step 10" in resumed.stdout
  assert "(it was missing)" in resumed.stdout
  assert files(train_dir / "unreadable") == truncated  # kept byte for byte
  assert not (train_dir / "ckpt-25_temp").exists()
  assert tf.train.latest_checkpoint(str(train_dir)) == str(train_dir / "ckpt-30")
  a = tf.train.load_checkpoint(str(straight / "train" / "ckpt-30"))
  b = tf.train.load_checkpoint(str(train_dir / "ckpt-30"))
  names = [n for n in a.get_variable_to_shape_map() if n.startswith(("task/", "optimizer/"))]
  assert len(names) == 20  # 12 task variables (batch-norm statistics too), 8 momentum slots
  for name in names:
    assert_close(a.get_tensor(name), b.get_tensor(name), err_msg=name)


def test_a_resumed_run_is_checked_before_it_writes_and_a_failed_save_loses_nothing(tmp_path):
  logdir = tmp_path / "run"
  assert run_trainer(MODEL, f"--logdir={logdir}", "--max_steps=10",
                     f"--params_override={EVERY_10}").returncode == 0
  before = files(logdir)

  other_input = run_trainer(MODEL, f"--logdir={logdir}", "--max_steps=20",
                            f"--params_override={EVERY_10};train_input.batch_size=16")
  assert other_input.returncode == 2
  assert "train_input.batch_size: 8 -> 16" in other_input.stderr, other_input.stderr
  assert other_input.stderr.count("\n") == 1 and "Resuming" not in other_input.stdout
  assert files(logdir) == before

  # A fine change goes on (noted); the save at step 20 fails: one line, exit 1.
  full = run_trainer(MODEL, f"--logdir={logdir}", "--max_steps=20",
                     f"--params_override={EVERY_10};task.train.log_interval_steps=5",
                     file_size_limit=64 * 1024)
  assert full.returncode == 1, full.stderr
  assert "Resuming with params that differ" in full.stdout
  assert "log_interval_steps: 10 -> 5 (allowed: " in full.stdout
  assert full.stderr.count("\n") == 1, full.stderr
  assert f"could not write checkpoint {logdir / 'train' / 'ckpt-20'}" in full.stderr
  assert "File too large" in full.stderr
  assert f"the last good checkpoint is {logdir / 'train' / 'ckpt-10'}" in full.stderr
  assert not list((logdir / "train").glob("ckpt-20*"))
  for name, digest in before.items():
    if name.startswith("train/ckpt-"):
      assert files(logdir)[name] == digest, name
  assert (logdir / "params.before_step_10.txt").exists()  # the params ckpt-10 was written with


def test_a_logdir_whose_records_are_not_files_is_refused_before_training(tmp_path):
  """A directory where params.txt belongs, or a file where <logdir>/eval belongs: exit 2
  with one line before any step (they used to fail after training, or with a traceback)."""
  logdir = tmp_path / "run"
  (logdir / "params.txt").mkdir(parents=True)
  result = run_trainer(MODEL, f"--logdir={logdir}", "--max_steps=5")
  assert result.returncode == 2, result.stderr
  assert result.stderr.count("\n") == 1 and "params.txt cannot be read as params text (Is a " \
      "directory)" in result.stderr, result.stderr
  other = tmp_path / "other"
  other.mkdir()
  (other / "eval").write_text("not a directory")
  result = run_trainer(MODEL, f"--logdir={other}", "--max_steps=5", "--mode=train_and_eval")
  assert result.returncode == 2, result.stderr
  assert "is not writable" in result.stderr and "step" not in result.stdout
  assert sorted(p.name for p in other.iterdir()) == ["eval"]


@EXHAUSTIVE
def test_a_full_disk_at_a_summary_write_is_one_line_naming_the_last_checkpoint(tmp_path):
  logdir = tmp_path / "run"
  assert run_trainer(MODEL, f"--logdir={logdir}", "--max_steps=5").returncode == 0
  # The resumed run's events file reaches the limit long before its next save.
  result = run_trainer(MODEL, f"--logdir={logdir}", "--max_steps=5000", "--params_override="
                       "task.train.save_interval_steps=100000;"
                       "task.train.summary_interval_steps=1", file_size_limit=48 * 1024)
  assert result.returncode == 1, result.stderr
  assert result.stderr.count("\n") == 1, result.stderr
  assert re.search(rf"could not write summaries to {logdir / 'train'}: .*File too large; the "
                   rf"last good checkpoint is {logdir / 'train' / 'ckpt-5'}", result.stderr)


def test_inspect_model_json_counts_the_real_variables():
  result = run_trainer(MODEL, "--mode=inspect_model")
  assert result.returncode == 0, result.stderr
  lines = result.stdout.strip().split("\n")
  summary = json.loads(lines[-1])
  model_registry.load_param_files()
  task = model_registry.get_params("demo.TinyConvNet").task.instantiate()
  real = sum(int(tf.size(v)) for v in task.trainable_variables)
  assert summary["model"] == "demo.TinyConvNet" and summary["total_params"] == real
  assert any("conv2" in line and "Conv2D" in line for line in lines)


@EXHAUSTIVE
def test_inspect_model_counts_a_pipelines_flops_as_the_unpipelined_model():
  """lm.TransformerTiny at K=2: every layer's FLOPs and the total equal those of the same
  model unpipelined (num_cells=0), and no layer with weights counts 0 (a pipeline's
  cells run inside its loops' functions, whose ops a graph's op list does not show)."""
  def inspected(*override: str) -> tuple[dict, dict]:
    result = run_trainer("--model=lm.TransformerTiny", "--mode=inspect_model", *override)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.strip().split("\n")
    rows = {}
    for line in lines[2:]:
      if not line.strip() or line.startswith("{"):
        break
      fields = line.split()
      rows[fields[0]] = (fields[-2], fields[-1])  # (params, FLOPs)
    return rows, json.loads(lines[-1])

  pipelined, summary = inspected()
  assert len(summary["cells"]) == 2
  plain, plain_summary = inspected("--params_override=task.pipeline.num_cells=0")
  assert summary["total_flops_per_batch"] == plain_summary["total_flops_per_batch"] > 8e7
  assert {name: row for name, row in pipelined.items() if name != "stack"} == {
      name: row for name, row in plain.items() if name != "stack"}
  assert all(flops != "0" for params, flops in pipelined.values() if params != "0")


@EXHAUSTIVE
def test_list_models_and_inspect_params():
  listed = run_trainer("--mode=list_models")
  assert listed.returncode == 0, listed.stderr
  lines = dict(line.split(maxsplit=1) for line in listed.stdout.strip().split("\n"))
  assert lines["demo.TinyConvNet"].startswith("Two conv-BN-ReLU blocks and a softmax")
  assert lines["image.AmoebaNetD_18_208"].endswith("(needs --data_dir)")
  assert not lines["image.AmoebaNetTiny"].endswith("(needs --data_dir)")
  # As a user runs it (no TF_CPP_MIN_LOG_LEVEL of the test's own): no TensorFlow start-up
  # lines on stderr unless --verbosity asks for them.
  shown = subprocess.run(
      [sys.executable, str(REPO / "tools" / "trainer.py"), MODEL, "--mode=inspect_params",
       "--params_override=task.train.max_steps=7"], capture_output=True, text=True,
      timeout=300, cwd=REPO,
      env={k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"})
  assert shown.returncode == 0 and "task.train.max_steps : 7" in shown.stdout
  assert shown.stderr == ""


@pytest.mark.parametrize("args, message", [
    (["--model=demo.TinyConvnet", "--mode=inspect_params"], "closest: demo.TinyConvNet"),
    ([MODEL, "--mode=inspect_params", "--params_override=task.trian.max_steps=3"],
     "'task.trian.max_steps' \\(no 'trian' at that level\\); did you mean 'train'"),
    ([MODEL, "--mode=inspect_params", "--params_override=task.train.max_steps=lots"],
     "'task.train.max_steps' \\(expected int\\)"),
    ([MODEL, "--mode=inspect_model", "--devices=tpu:3"], "bad device spec 'tpu:3'"),
])
def test_bad_input_exits_2_with_a_named_error(args, message):
  result = run_trainer(*args)
  assert result.returncode == 2, result.stderr
  assert re.search(message, result.stderr), result.stderr


@pytest.mark.parametrize("args, file_text, message", [
    # Every ParamFileError (an import error, a key a built-in file has:
    # model_registry_test) takes this path.
    ([], "def broken(:\n", r"param file .*broken\.py, line 1 does not load: SyntaxError"),
    (["--cluster_spec=worker=localhost:99999"], "",
     r"--cluster_spec: bad port 99999 .* valid ports: 1\.\.65535"),
    (["--model=image.AmoebaNetD_18_208", "--data_dir={tmp}/no_data"], "",
     r"TFDS dataset 'imagenet2012' is not prepared in .*/no_data; nothing is downloaded here"),
    # Values that once failed only after params.txt and events were written, or trained.
    (["--params_override=task.train.save_interval_steps=0"], "",
     r"task.train.save_interval_steps must be an int >= 1, got 0"),
    (["--params_override=task.pipeline.num_cells=-2"], "",
     r"task.pipeline: num_cells must be an int >= 0 .*, got -2"),
    (["--devices=cpu:2", "--params_override=task.pipeline.num_cells=2;"
      "task.pipeline.devices=['/cpu:0','/cpu:9']"], "",
     r"devices names '/cpu:9', which this process does not have; its devices: "
     r"\['/device:CPU:0', '/device:CPU:1'\]"),
    (["--devices=cpu:2", "--params_override=task.pipeline.num_cells=2;"
      "task.pipeline.num_micro_batches=1000000000"], "",  # before the model is built (a
     # schedule of 10^9 micro-batches once hung the trainer for hours)
     r"task.pipeline.num_micro_batches=1000000000 does not fit a batch of 32 .* valid: 1..32"),
    ([], "import sys\nsys.exit(0)\n",
     r"param file .*broken\.py, line 2 does not load: it calls sys.exit\(0\)"),
    # Pre-flight (lingvo_gpipe/preflight.py): refused before the logdir is made.
    (["--model=lm.TransformerTiny", "--devices=cpu:2",
      "--params_override=task.pipeline.num_token_slices=13"], "",
     r"task.pipeline: num_token_slices=13 must be in 1..12 \(the sequence length\)"),
    (["--model=lm.TransformerTiny", "--devices=cpu:2", "--params_override="
      "task.pipeline.num_token_slices=2;task.pipeline.token_slice_lengths=[5, 5]"], "",
     r"token_slice_lengths=\[5, 5\] must sum to the sequence length 12, not 10"),
    (["--model=lm.TransformerTiny", "--devices=cpu:2", "--mode=train_and_eval",
      "--params_override=eval_input.sequence_length=8"], "",
     r"eval_input: synthetic_lm_eval: need 1 <= min_length <= max_length <= "
     r"sequence_length - 2"),
    (["--model=lm.TransformerTiny", "--devices=cpu:2", "--params_override=task.fprop_dtype=14"],
     "", r"task: fprop_dtype 14 is not a compute dtype; valid: \['float32'"),
    (["--params_override=task.fprop_dtype=True"], "",
     r"task: fprop_dtype True is not a compute dtype"),
    (["--devices=cpu:2", "--params_override=task.pipeline.num_cells=3;"
      "task.pipeline.round_robin_devices=False"], "",
     r"task.pipeline: 3 cells but only 2 device\(s\) .* or set round_robin_devices=True"),
])
def test_bad_input_exits_2_with_one_line_and_writes_nothing(tmp_path, args, file_text, message):
  param_file = tmp_path / "broken.py"
  param_file.write_text(file_text)
  logdir = tmp_path / "run"
  model = [] if any(a.startswith("--model") for a in args) else [MODEL]
  result = run_trainer(*model, *[a.format(tmp=tmp_path) for a in args],
                       f"--params_path={param_file}", f"--logdir={logdir}", "--max_steps=5")
  assert result.returncode == 2, result.stderr
  assert result.stderr.count("\n") == 1 and re.search(message, result.stderr), result.stderr
  assert not logdir.exists() and not (tmp_path / "no_data").exists()


@EXHAUSTIVE
def test_a_fresh_trainer_process_holds_back_tensorflows_start_up_lines(tmp_path):
  """The other tests fork their trainers from a process that imported TensorFlow
  already (tests/trainer_forkserver.py); a new interpreter imports it in the trainer,
  which holds back TensorFlow's start-up lines (oneDNN, absl): bad input is still one
  line on stderr."""
  result = run_trainer(MODEL, "--params_override=task.train.save_interval_steps=0",
                       f"--logdir={tmp_path / 'run'}", fresh_process=True)
  assert result.returncode == 2, result.stderr
  assert result.stderr.count("\n") == 1, result.stderr
  assert not (tmp_path / "run").exists()


BUGGY_LAYER_PARAM_FILE = textwrap.dedent("""
    from lingvo_gpipe import model_registry
    from lingvo_gpipe.core import layers
    from lingvo_gpipe_params import demo

    class BuggyLayer(layers.Dropout):
      def __init__(self, params):
        super().__init__(params)
        int("not a number")  # a ValueError that is the layer's bug, not the user's

    @model_registry.register
    class WithBuggyLayer(demo.TinyConvNet):
      def task(self):
        p = super().task()
        p.body.layers.append(BuggyLayer.Params().set(name="buggy"))
        return p
    """)


def test_a_bug_in_a_layer_is_not_reported_as_bad_params(tmp_path):
  param_file = tmp_path / "buggy.py"
  param_file.write_text(BUGGY_LAYER_PARAM_FILE)
  args = ["--model=buggy.WithBuggyLayer", f"--params_path={param_file}", "--mode=inspect_model"]
  bug = run_trainer(*args)
  assert bug.returncode == 1, bug.stderr
  assert "Traceback" in bug.stderr and "invalid literal for int()" in bug.stderr
  assert "bad model params" not in bug.stderr
  # A bad value of the same model is the user's: one line, exit 2.
  bad_value = run_trainer(*args, "--params_override=task.body.layers[0].filter_shape=(3, 3, 0, 8)")
  assert bad_value.returncode == 2, bad_value.stderr
  assert bad_value.stderr.startswith("error: bad model params: ") and \
      bad_value.stderr.count("\n") == 1, bad_value.stderr


USER_MISTAKES_PARAM_FILE = textwrap.dedent("""
    import lingvo_gpipe as g
    from lingvo_gpipe_params import demo

    @g.register
    class TypoInTask(demo.TinyConvNet):
      def task(self):
        p = super().task()
        p.pipeline.set(num_cell=2)
        return p

    @g.register
    class TypoInInput(demo.TinyConvNet):
      def train_input(self):
        return super().train_input().set(batch_sise=8)

    class Picky(g.BaseLayer):
      def __init__(self, params):
        super().__init__(params)
        raise g.ParamsError(f"{self.path}: picky refuses")

    @g.register
    class PickyLayer(demo.TinyConvNet):
      def task(self):
        p = super().task()
        p.body.layers.append(Picky.Params())
        return p
    """)


@pytest.mark.parametrize("model, message, line", [
    ("TypoInTask", "unknown param 'num_cell'; did you mean 'num_cells'", 9),
    ("TypoInInput", "unknown param 'batch_sise'; did you mean 'batch_size'", 15),
    ("PickyLayer", "tiny_conv_net/body/picky: picky refuses", 20),
])
def test_a_bad_value_in_a_users_param_file_is_one_line_naming_its_line(tmp_path, model,
                                                                       message, line):
  param_file = tmp_path / "mistakes.py"
  param_file.write_text(USER_MISTAKES_PARAM_FILE)
  logdir = tmp_path / "run"
  result = run_trainer(f"--model=mistakes.{model}", f"--params_path={param_file}",
                       f"--logdir={logdir}", "--max_steps=1")
  assert result.returncode == 2, result.stderr
  assert result.stderr.count("\n") == 1, result.stderr
  assert result.stderr.startswith(f"error: bad model params: {message}"), result.stderr
  assert result.stderr.rstrip().endswith(f"(at {param_file}, line {line})"), result.stderr
  assert not logdir.exists()


def test_unwritable_logdir_exits_2_before_training(tmp_path):
  blocker = tmp_path / "a_file"
  blocker.write_text("not a directory")
  result = run_trainer(MODEL, f"--logdir={blocker / 'run'}", "--max_steps=5")
  assert result.returncode == 2
  assert "is not writable" in result.stderr and "step" not in result.stdout


NAN_PARAM_FILE = textwrap.dedent("""
    import tensorflow as tf
    from lingvo_gpipe import model_registry
    from lingvo_gpipe.inputs.synthetic_images import SyntheticImages
    from lingvo_gpipe_params import demo

    class PoisonedImages(SyntheticImages):
      '''Images turn to NaN from example 8 * 25 on: batch 26 (batch size 8) is poisoned.'''

      def _example(self, index):
        example = super()._example(index)
        poison = tf.where(index >= 8 * 25, float("nan"), 0.0)
        return dict(example, image=example["image"] + poison)

    @model_registry.register
    class Poisoned(demo.TinyConvNet):
      def train_input(self):
        p = super().train_input()
        p.cls = PoisonedImages
        return p
    """)


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path):
  param_file = tmp_path / "nan_models.py"
  param_file.write_text(NAN_PARAM_FILE)
  logdir = tmp_path / "run"
  args = ["--model=nan_models.Poisoned", f"--params_path={param_file}", f"--logdir={logdir}",
          f"--params_override={FAST}"]
  assert run_trainer(*args, "--max_steps=20").returncode == 0
  before = digest(logdir / "train")
  result = run_trainer(*args, "--max_steps=60")
  assert result.returncode == 1
  # Batch 26 (examples 200..207) is poisoned: the update that would make step 26.
  assert "non-finite loss" in result.stderr and "at step 26" in result.stderr
  assert f"Last good checkpoint: {logdir / 'train' / 'ckpt-20'}" in result.stderr
  assert digest(logdir / "train") == before
  assert tf.train.latest_checkpoint(str(logdir / "train")).endswith("ckpt-20")


@EXHAUSTIVE
def test_an_update_that_overflows_the_weights_is_not_saved(tmp_path):
  """A finite loss and gradient norm times a learning rate of 1e39 (inf in float32)
  give non-finite weights: the step is refused before its checkpoint is written."""
  logdir = tmp_path / "run"
  args = [MODEL, f"--logdir={logdir}"]
  assert run_trainer(*args, f"--params_override={FAST}", "--max_steps=20").returncode == 0
  before = digest(logdir / "train")
  result = run_trainer(*args, "--max_steps=40", "--params_override=" + FAST +
                       ";task.train.save_interval_steps=1;task.train.optimizer.learning_rate=1e39")
  assert result.returncode == 1, result.stderr
  assert re.search(r"the update of step 21 made \d+ variable\(s\) non-finite \(\S+", result.stderr)
  assert f"Last good checkpoint: {logdir / 'train' / 'ckpt-20'}" in result.stderr
  assert digest(logdir / "train") == before


@EXHAUSTIVE
def test_a_second_trainer_on_a_logdir_is_refused_naming_the_first(tmp_path):
  logdir = tmp_path / "run"
  first = subprocess.Popen(
      [sys.executable, str(REPO / "tools" / "trainer.py"), MODEL, f"--logdir={logdir}",
       "--max_steps=100000", f"--params_override={FAST}"], stdout=subprocess.PIPE,
      stderr=subprocess.PIPE, text=True, cwd=REPO, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
  try:
    for line in first.stdout:  # training: params.txt and a checkpoint exist
      if line.startswith("step 20/"):
        break
    params_before = (logdir / "params.txt").read_text()
    second = run_trainer(MODEL, f"--logdir={logdir}", "--max_steps=30",
                         "--params_override=train_input.batch_size=4")
    assert second.returncode == 2, second.stderr
    assert re.search(rf"logdir .* is in use by another trainer \(pid {first.pid} on \S+ since ",
                     second.stderr), second.stderr
    assert second.stderr.count("\n") == 1 and second.stdout == ""
    assert (logdir / "params.txt").read_text() == params_before
    assert first.poll() is None  # undisturbed
  finally:
    first.kill()
    first.wait()
  # Killed with -9, the first leaves the logdir free: a rerun resumes.
  resumed = run_trainer(MODEL, f"--logdir={logdir}", f"--params_override={FAST}",
                        "--max_steps=25")
  assert resumed.returncode == 0, resumed.stderr
  assert "Resuming from checkpoint" in resumed.stdout


def test_checkpoint_of_another_model_is_refused_and_kept(tmp_path):
  logdir = tmp_path / "run"
  assert run_trainer(MODEL, f"--logdir={logdir}", "--max_steps=20",
                     f"--params_override={FAST}").returncode == 0
  before = digest(logdir / "train")
  wider = (FAST + ";task.body.layers[4].filter_shape=(3, 3, 16, 48);task.body.layers[5].dim=48"
           ";task.softmax.input_dim=48")
  result = run_trainer(MODEL, f"--logdir={logdir}", "--max_steps=40", f"--params_override={wider}")
  assert result.returncode == 2
  assert "does not match model" in result.stderr and "conv2" in result.stderr, result.stderr
  assert digest(logdir / "train") == before


PIPELINE = "task.pipeline.num_cells=2;task.pipeline.num_micro_batches=4"


def test_pipelined_model_trains_and_inspects_as_two_cells(tmp_path):
  # partition_cost=flops from the command line: the trainer derives the input's specs.
  shown = run_trainer(MODEL, "--mode=inspect_model", "--devices=cpu:2",
                      f"--params_override={PIPELINE};task.pipeline.partition_cost=flops")
  assert shown.returncode == 0, shown.stderr
  assert "share of flops" in shown.stdout
  summary = json.loads(shown.stdout.strip().split("\n")[-1])
  cells = summary["cells"]
  assert [tf.DeviceSpec.from_string(c["device"]).device_index for c in cells] == [0, 1]
  assert sum(c["cost_share"] for c in cells) == pytest.approx(1.0, abs=1e-5)
  model_registry.load_param_files()
  body = model_registry.get_params("demo.TinyConvNet").task.body.instantiate()
  assert sum(c["params"] for c in cells) == body.num_params()
  assert "Pipeline tiny_conv_net/body: 2 cells, 4 micro-batches" in shown.stdout

  logdir = tmp_path / "run"
  trained = run_trainer(MODEL, "--devices=cpu:2", f"--logdir={logdir}", "--max_steps=10",
                        "--profile_steps=4,5", f"--params_override={FAST};{PIPELINE};"
                        "task.pipeline.partition_cost=measured")
  assert trained.returncode == 0, trained.stderr
  assert tf.train.latest_checkpoint(str(logdir / "train")).endswith("ckpt-10")
  # The measured schedule: per-cell busy fractions, bubbles, and its image.
  tags = scalar_tags(logdir / "train")
  for tag in ("pipeline/busy_fraction/cell_0", "pipeline/busy_fraction/cell_1",
              "pipeline/bubble_measured", "pipeline/bubble_theoretical",
              "pipeline/schedule_seconds", "pipeline/schedule"):
    assert tags.get(tag) == [10], tag
  assert "Profiled steps 4..5" in trained.stdout
  assert list((logdir / "train" / "plugins" / "profile").glob("*/*.xplane.pb"))


def test_bad_profile_steps_exit_2_and_write_nothing(tmp_path):
  logdir = tmp_path / "run"
  result = run_trainer(MODEL, f"--logdir={logdir}", "--profile_steps=5,2")
  assert result.returncode == 2
  assert "bad --profile_steps '5,2': need 1 <= A <= B" in result.stderr
  assert not logdir.exists()


def test_more_cells_than_devices_exits_2():
  result = run_trainer(MODEL, "--mode=inspect_model", "--devices=cpu:2",
                       "--params_override=task.pipeline.num_cells=3")
  assert result.returncode == 2
  assert "3 cells but only 2 device(s)" in result.stderr


def scalar_values(event_dir: Path, tag: str) -> dict[int, float]:
  """{step: value} of the scalar summary `tag` written under `event_dir`."""
  values = {}
  for path in event_dir.glob("events.out.tfevents.*"):
    for event in tf.compat.v1.train.summary_iterator(str(path)):
      for value in event.summary.value:
        if value.tag == tag:
          values[event.step] = float(tf.make_ndarray(value.tensor))
  return values


@EXHAUSTIVE
def test_zero_bubble_and_interleaved_train_a_real_model_as_gpipe_does(tmp_path):
  """lm.TransformerTiny (dropout on) through the trainer, 4 steps with Adam: the losses
  of zb_h1, of interleaved_1f1b and of zbv (4 cells on 2 devices each) are gpipe's."""
  every_step = ("task.train.log_interval_steps=1;task.train.summary_interval_steps=1;"
                "task.train.save_interval_steps=100")
  runs = {"gpipe": "task.pipeline.num_cells=2",
          "zb_h1": "task.pipeline.num_cells=2;task.pipeline.schedule=zb_h1",
          "interleaved_1f1b": "task.pipeline.num_cells=4;task.pipeline.virtual_stages=2;"
                              "task.pipeline.schedule=interleaved_1f1b",
          "zbv": "task.pipeline.num_cells=4;task.pipeline.virtual_stages=2;"
                 "task.pipeline.schedule=zbv"}
  losses = {}
  for name, override in runs.items():
    logdir = tmp_path / name
    result = run_trainer("--model=lm.TransformerTiny", "--devices=cpu:2", f"--logdir={logdir}",
                         "--max_steps=4", f"--params_override={every_step};{override}")
    assert result.returncode == 0, result.stderr
    assert f"schedule {name}" in result.stdout
    losses[name] = scalar_values(logdir / "train", "loss")
    assert sorted(losses[name]) == [1, 2, 3, 4]
  want = [losses["gpipe"][step] for step in sorted(losses["gpipe"])]
  for name in ("zb_h1", "interleaved_1f1b", "zbv"):
    assert_close([losses[name][step] for step in sorted(losses[name])], want,
                 dtype=np.float32, err_msg=name)


def test_ctrl_c_stops_after_the_step_in_flight_flushing_its_summaries(tmp_path):
  """SIGINT to a local run: exit 130 naming the last checkpoint, which is readable. The
  handler reaches the trainer (through tools/trainer.py's RunState) and its loop stops
  after the step in flight with its summaries flushed, rather than training on for the
  2 s the handler waits before it exits."""
  logdir = tmp_path / "run"
  override = (FAST + ";task.train.summary_interval_steps=20;task.train.log_interval_steps=20;"
              "task.train.save_interval_steps=10")
  # Step 20's line comes before its save: the signal goes once the save is done (the
  # checkpoint state names it), so what is asserted below never depends on whether a
  # save outlasts the handler's 2 s on a loaded machine.
  returncode, stderr = signal_after_checkpoint(logdir, override, signal.SIGINT, 20)
  assert returncode == 130, stderr
  latest = tf.train.latest_checkpoint(str(logdir / "train"))
  assert int(latest.rsplit("-", 1)[1]) >= 20, latest
  assert stderr.endswith(f"error: interrupted (Ctrl-C); the last checkpoint is {latest}: "
                         "rerun the same command to resume from it\n"), stderr
  tf.train.load_checkpoint(latest)  # intact
  summarized = scalar_tags(logdir / "train")["loss"]
  assert 20 in summarized and max(summarized) < 100, summarized  # (at 20, 40, ...)


@EXHAUSTIVE
def test_sigterm_stops_like_ctrl_c_with_exit_143_naming_the_checkpoint(tmp_path):
  """SIGTERM (a scheduler stopping the run) to a local run: exit 143 with one line
  naming the last checkpoint, which is readable."""
  logdir = tmp_path / "run"
  override = FAST + ";task.train.save_interval_steps=1;task.train.log_interval_steps=1"
  returncode, stderr = signal_after_checkpoint(logdir, override, signal.SIGTERM, 1)
  assert returncode == 143, stderr
  latest = tf.train.latest_checkpoint(str(logdir / "train"))
  assert stderr.endswith(f"error: interrupted (SIGTERM); the last checkpoint is {latest}: "
                         "rerun the same command to resume from it\n"), stderr
  tf.train.load_checkpoint(latest)


def signal_after_checkpoint(logdir: Path, override: str, signum: int,
                            step: int) -> tuple[int, str]:
  """Starts an endless training run of MODEL in `logdir`, sends it `signum` once its
  checkpoint state names a step >= `step` (polled, under a 60 s deadline), and returns
  its exit code and stderr."""
  trainer = subprocess.Popen(
      [sys.executable, str(REPO / "tools" / "trainer.py"), MODEL, f"--logdir={logdir}",
       "--max_steps=1000000", f"--params_override={override}"],
      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=REPO,
      env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1"),
      preexec_fn=sigint_as_default)
  try:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and trainer.poll() is None:
      latest = tf.train.latest_checkpoint(str(logdir / "train"))
      if latest and int(latest.rsplit("-", 1)[1]) >= step:
        break
      time.sleep(0.05)
    trainer.send_signal(signum)
    _, stderr = trainer.communicate(timeout=60)
  finally:
    trainer.kill()
  return trainer.returncode, stderr


@EXHAUSTIVE
def test_resume_rules_say_which_row_each_change_falls_in(tmp_path):
  """docs/trainer.md's resume table through the binary: float32 → float16 (and K 1 → 2)
  resumes with the loss scale at its start, and back; a changed shape is refused
  naming the variable, with the logdir unchanged."""
  logdir = tmp_path / "run"
  args = [MODEL, "--devices=cpu:2", f"--logdir={logdir}"]
  fast = FAST.replace("task.train.save_interval_steps=20", "task.train.save_interval_steps=1")
  assert run_trainer(*args, "--max_steps=1", f"--params_override={fast}").returncode == 0
  half = run_trainer(*args, "--max_steps=2", f"--params_override={fast};"
                     "task.fprop_dtype='float16';task.pipeline.num_cells=2")
  assert half.returncode == 0, half.stderr
  assert "task.fprop_dtype: None -> 'float16' (allowed with a consequence: " in half.stdout
  assert "task.pipeline.num_cells: 0 -> 2 (allowed: " in half.stdout
  assert "without its loss scale: the loss scale starts at its initial value" in half.stdout
  back = run_trainer(*args, "--max_steps=3", f"--params_override={fast}")
  assert back.returncode == 0 and "drops it" in back.stdout, back.stderr
  before = digest(logdir / "train")
  wider = (fast + ";task.body.layers[4].filter_shape=(3, 3, 16, 48);task.body.layers[5].dim=48"
           ";task.softmax.input_dim=48")
  narrower = run_trainer(*args, "--max_steps=4", f"--params_override={wider}")
  assert narrower.returncode == 2 and narrower.stderr.count("\n") == 1, narrower.stderr
  assert "task.softmax.input_dim: 32 -> 48 (checked by the restore: " in narrower.stdout
  assert "does not match model" in narrower.stderr and "shape" in narrower.stderr
  assert digest(logdir / "train") == before


@EXHAUSTIVE
def test_a_damaged_params_txt_is_refused_naming_its_line_and_can_be_set_aside(tmp_path):
  logdir = tmp_path / "run"
  args = [MODEL, f"--logdir={logdir}", f"--params_override={FAST}"]
  assert run_trainer(*args, "--max_steps=20").returncode == 0
  params_txt = logdir / "params.txt"
  damaged = params_txt.read_text().replace("task.train.max_steps : 20",
                                           "task.train.max_steps 20")
  params_txt.write_text(damaged)
  before = files(logdir)
  refused = run_trainer(*args, "--max_steps=21")
  assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
  assert re.search(r"params.txt line \d+ is not 'key : value': 'task.train.max_steps 20'",
                   refused.stderr) and "--reset_params" in refused.stderr
  assert files(logdir) == before
  reset = run_trainer(*args, "--max_steps=21", "--reset_params")
  assert reset.returncode == 0, reset.stderr
  aside = list(logdir.glob("params.txt.set_aside_*"))
  assert len(aside) == 1 and aside[0].read_text() == damaged
  assert "Resuming from checkpoint" in reset.stdout


def test_ctrl_c_while_tensorflow_imports_exits_130_in_one_line(tmp_path):
  """Ctrl-C half a second in (TensorFlow is still importing: it takes seconds) exits
  130 with one line, not a traceback of the import, and writes nothing."""
  done = subprocess.Popen(
      [sys.executable, str(REPO / "tools" / "trainer.py"), MODEL,
       f"--logdir={tmp_path / 'run'}", "--max_steps=1"], stdout=subprocess.PIPE,
      stderr=subprocess.PIPE, text=True, cwd=REPO, preexec_fn=sigint_as_default,
      env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
  time.sleep(0.5)
  done.send_signal(signal.SIGINT)
  _, stderr = done.communicate(timeout=120)
  assert done.returncode == 130, stderr
  assert "Traceback" not in stderr and stderr.strip().count("\n") == 0, stderr
  assert "interrupted (Ctrl-C)" in stderr and not (tmp_path / "run").exists()
