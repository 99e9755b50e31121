"""What is served is what was trained, and data the model cannot take is refused.

Oracles: the trainer's own forward of the params the run trained with (a Trainer built
from them and restored), against which a served score is compared, and the same
forward of the registered params (which the served one must not equal); numpy
bounds over the inputs' own arrays; gpipe's losses for the split-backward schedules.
"""

import json
import os
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
from conftest import REPO, run_trainer, sigint_as_default
from export_test import reference_token_log_probs
from numerics import assert_close
from tiers import EXHAUSTIVE

from lingvo_gpipe import exporter, logdirs, model_registry, run_params
from lingvo_gpipe import trainer as trainer_lib
from lingvo_gpipe.core.hyperparams import ParamsError
from lingvo_gpipe.preflight import preflight
from lingvo_gpipe.tasks import base_task

SMALL = ("train_input.batch_size=8;eval_input.batch_size=8;eval_input.num_examples=16;"
         "task.train.save_interval_steps=1")
EIGHT_HEADS = "task.stack.layers[1].num_heads=8"


def registered(key: str, overrides: str = ""):
  model_registry.load_param_files([])
  params = model_registry.get_params(key)
  for item in filter(None, overrides.split(";")):
    params.set_from_text(*item.split("=", 1))
  return params


def files_of(folder) -> dict:
  return {str(f.relative_to(folder)): f.read_bytes() for f in folder.rglob("*") if f.is_file()}


@pytest.fixture(scope="module")
def eight_heads_run(tmp_path_factory):
  """lm.TransformerTiny trained 1 step through the binary with 8 heads in layer 1 (the
  registered model has 4), then exported through the binary without the override."""
  logdir = tmp_path_factory.mktemp("eight_heads")
  trained = run_trainer("--model=lm.TransformerTiny", f"--logdir={logdir}", "--max_steps=1",
                        f"--params_override={SMALL};{EIGHT_HEADS}")
  assert trained.returncode == 0, trained.stderr
  exported = run_trainer("--model=lm.TransformerTiny", f"--logdir={logdir}", "--mode=export")
  assert exported.returncode == 0, exported.stderr
  return logdir


def test_an_export_serves_the_params_the_run_trained_with(eight_heads_run):
  logdir = eight_heads_run
  export = logdir / "export" / "1"
  assert "task.stack.layers[1].num_heads : 8" in (export / "assets" / "params.txt").read_text()
  facts = json.loads((export / "assets" / "version.json").read_text())
  assert facts["params_changed_from_training"] == []
  batch = next(iter(registered("lm.TransformerTiny", SMALL).eval_input.instantiate().dataset()))
  ids, paddings = batch["ids"].numpy(), batch["paddings"].numpy()
  served = tf.saved_model.load(str(export)).signatures["score"](
      ids=tf.constant(ids), paddings=tf.constant(paddings))["token_log_probs"].numpy()

  def reference(overrides: str) -> np.ndarray:
    run = trainer_lib.Trainer(registered("lm.TransformerTiny", overrides).freeze(),
                              str(logdir), log=lambda _: None)
    assert run.restore_latest() == 1
    return reference_token_log_probs(run.task, ids, paddings)

  trained = reference(f"{SMALL};{EIGHT_HEADS}")
  np.testing.assert_allclose(served, trained, atol=1e-4)
  # The binary's decode of the same logdir: the trained params too, records and metric.
  decoded = run_trainer("--model=lm.TransformerTiny", f"--logdir={logdir}", "--mode=decode")
  assert decoded.returncode == 0, decoded.stderr[-2000:]
  records = (logdir / "decode_1.jsonl").read_text().splitlines()
  assert len(records) == 16 and "log_pplx" in decoded.stdout, decoded.stdout[-2000:]
  # The registered model (4 heads) restores from the same checkpoint and scores
  # otherwise: the check above tells them apart.
  assert np.abs(reference(SMALL) - trained).max() > 1e-3


def test_an_override_of_a_trained_param_at_export_is_refused(eight_heads_run):
  logdir = eight_heads_run
  before = files_of(logdir)
  done = run_trainer("--model=lm.TransformerTiny", f"--logdir={logdir}", "--mode=export",
                     "--overwrite", "--params_override=task.stack.layers[1].num_heads=4")
  assert done.returncode == 2, done.stderr
  assert done.stderr.strip().count("\n") == 0
  assert "an export serves the params the run trained with" in done.stderr
  assert "task.stack.layers[1].num_heads" in done.stderr
  assert files_of(logdir) == before
  # Without its params text the logdir is refused, unless a checkpoint is named.
  os.rename(logdir / "params.txt", logdir / "params.txt.aside")
  try:
    missing = run_trainer("--model=lm.TransformerTiny", f"--logdir={logdir}",
                          "--mode=decode")
  finally:
    os.rename(logdir / "params.txt.aside", logdir / "params.txt")
  assert missing.returncode == 2 and "params.txt is missing" in missing.stderr
  assert "--checkpoint" in missing.stderr and missing.stderr.strip().count("\n") == 0


def test_the_params_text_of_a_checkpoint_is_the_one_its_run_wrote(tmp_path):
  for name in ("params.txt", "params.before_step_100.txt", "params.before_step_300.txt"):
    (tmp_path / name).write_text("")
  chosen = {step: os.path.basename(run_params.params_file_for_step(str(tmp_path), step))
            for step in (None, 50, 100, 101, 300, 400)}
  assert chosen == {None: "params.txt", 50: "params.before_step_100.txt",
                    100: "params.before_step_100.txt", 101: "params.before_step_300.txt",
                    300: "params.before_step_300.txt", 400: "params.txt"}
  assert run_params.checkpoint_step("/x/train/ckpt-300") == 300
  # A checkpoint renamed by hand: its global step, read from it.
  step = tf.Variable(250, dtype=tf.int64)
  renamed = tf.train.Checkpoint(global_step=step).write(str(tmp_path / "renamed" / "best"))
  assert run_params.checkpoint_step(renamed) == 250
  assert run_params.checkpoint_step(str(tmp_path / "no_such_checkpoint")) is None


def test_trained_params_override_the_registered_model_and_refuse_another_models(tmp_path):
  text = registered("lm.TransformerTiny", EIGHT_HEADS).to_text()
  path = tmp_path / "params.txt"
  path.write_text(text)
  served = run_params.trained_params(registered("lm.TransformerTiny"), str(path))
  assert served.to_text() == text
  with pytest.raises(run_params.RunParamsError, match="which this model lacks"):
    run_params.trained_params(registered("mt.MultilingualTiny"), str(path))
  changed = run_params.apply_serving_overrides(served, [("task.pipeline.num_cells", "1"),
                                                        ("eval_input.batch_size", "4")])
  assert changed == [{"key": "task.pipeline.num_cells", "trained": "2", "served": "1"},
                     {"key": "eval_input.batch_size", "trained": "32", "served": "4"}]
  with pytest.raises(run_params.RunParamsError, match="task.label_smoothing"):
    run_params.apply_serving_overrides(served, [("task.label_smoothing", "0.2")])
  # The trained value given again (a training command reused) changes nothing.
  assert run_params.apply_serving_overrides(served, [(EIGHT_HEADS.split("=")[0], "8")]) == []
  # The eval input's vocabulary is the trained one's: its keys are refused.
  with pytest.raises(run_params.RunParamsError, match="eval_input.num_words"):
    run_params.apply_serving_overrides(served, [("eval_input.num_words", "30")])
  # Without a params text, an explicit checkpoint serves the registered model as given.
  given, changes = run_params.served_params(
      registered("lm.TransformerTiny"), str(tmp_path / "empty"), "/x/ckpt-3",
      [("task.stack.layers[1].num_heads", "2")], "lm.TransformerTiny", log=lambda _: None)
  assert given.task.stack.layers[1].num_heads == 2 and changes[0]["served"] == "2"


def test_an_unpipelined_export_drops_the_training_devices_and_serves_one_replica(cpu_devices):
  params = registered("lm.TransformerTiny")
  params.task.pipeline.set(devices=["/device:GPU:0", "/device:GPU:1"], num_replicas=2)
  served = exporter.inference_params(params.task, None, "float32")
  assert served.pipeline.devices == [] and served.pipeline.num_cells == 0
  assert served.pipeline.num_replicas == 1
  # Pre-flight of an export on two devices of a run trained on 2 replicas × 2 cells.
  params.task.pipeline.devices = []
  preflight(params.freeze(), "export", cpu_devices[:2])
  with pytest.raises(ParamsError):
    preflight(params, "train", cpu_devices[:2])  # training needs the four


def test_a_softmax_smaller_than_the_data_is_refused_before_anything_is_written(tmp_path):
  logdir = tmp_path / "run"
  done = run_trainer("--model=lm.TransformerTiny", f"--logdir={logdir}", "--max_steps=1",
                     "--params_override=task.stack.layers[3].vocab_size=10")
  assert done.returncode == 2 and done.stderr.strip().count("\n") == 0, done.stderr
  size = registered("lm.TransformerTiny").train_input.instantiate().vocab.size
  assert (f"task.stack.layers[3].vocab_size=10 is smaller than train_input's {size}"
          in done.stderr)
  assert not logdir.exists()
  image = registered("image.AmoebaNetTiny", "task.softmax.num_classes=5")
  with pytest.raises(ParamsError, match="task.softmax.num_classes=5 is smaller than "
                                        "eval_input's 10"):
    preflight(image.freeze(), "eval")


def test_an_id_past_the_embedding_stops_training_naming_it(tmp_path):
  """Pre-flight is skipped (the library's Trainer): the per-batch check names the id.
  (The softmax untied: tied to a 10-row table it would be refused when built.)"""
  params = registered("lm.TransformerTiny", f"{SMALL};task.stack.layers[0].vocab_size=10;"
                      "task.stack.layers[3].tie_to=None")
  run = trainer_lib.Trainer(params.freeze(), str(tmp_path), log=lambda _: None)
  batch = next(iter(params.train_input.instantiate().dataset()))
  worst = int(batch["ids"].numpy().max())  # the first batch's, numpy's own maximum
  with pytest.raises(trainer_lib.BadDataError) as raised:
    run.train(1)
  assert f"train_input gave ids {worst} at step 1, outside [0, 10)" in str(raised.value)
  assert "task.stack.layers[0].vocab_size=10 (the embedding's rows)" in str(raised.value)
  assert not list((tmp_path / "train").glob("ckpt-*"))


def test_a_batch_check_names_the_first_bad_key_and_value():
  bounds = {"ids": base_task.IdBound(5, "task.e", "rows"),
            "labels": base_task.IdBound(4, "task.s", "classes")}
  base_task.check_batch_ids({"ids": np.array([[0, 4]]), "labels": np.array([[3, 0]])},
                            bounds, "x")
  with pytest.raises(base_task.BadBatchError, match="x gave labels -1, outside"):
    base_task.check_batch_ids({"ids": np.array([[0, 4]]), "labels": np.array([[3, -1]])},
                              bounds, "x")


def test_a_failed_step_reports_its_cause_in_one_line():
  @tf.function
  def gather(ids):
    return tf.gather(tf.zeros([10, 2]), ids)

  with pytest.raises(tf.errors.InvalidArgumentError) as raised:
    gather(tf.constant([3, 13]))
  cause = trainer_lib.step_error_cause(raised.value)
  assert "13 is not in [0, 10)" in cause and "(at node" in cause and "\n" not in cause
  cancelled = tf.errors.CancelledError(None, None, "[_Derived_]RecvAsync is cancelled.")
  assert "a cancelled hand-off" in trainer_lib.step_error_cause(cancelled)


MT_LENGTHS = ("train_input.target_sequence_length=6;train_input.max_length=5;"
              "train_input.min_length=2;train_input.batch_size=8;"
              "task.pipeline.num_micro_batches=4")
SPLIT_BACKWARD = {
    "zb_h1": "task.pipeline.schedule=zb_h1",
    "1f1b G=2": "task.pipeline.schedule=1f1b;task.pipeline.weight_gradient_group=2",
    "zbv": "task.pipeline.schedule=zbv;task.pipeline.num_cells=4;"
           "task.pipeline.virtual_stages=2",
    "interleaved_zb": "task.pipeline.schedule=interleaved_zb;task.pipeline.num_cells=4;"
                      "task.pipeline.virtual_stages=2",
}


@EXHAUSTIVE
def test_split_backward_schedules_train_sources_and_targets_of_two_lengths_as_gpipe(
    tmp_path, cpu_devices):
  """mt.MultilingualTiny, sources 12 and targets 6 tokens: a decoder's self- and
  cross-attention projections share weight shapes but not row counts, and their
  deferred weight gradients must not be stacked into one product."""

  def losses(name: str, overrides: str) -> list[float]:
    params = registered("mt.MultilingualTiny", f"{MT_LENGTHS};{overrides}")
    params.task.pipeline.devices = cpu_devices[:2]
    got = []
    run = trainer_lib.Trainer(params.freeze(), str(tmp_path / name), log=lambda _: None)
    run.train(2, on_step=lambda step, values: got.append(float(values["loss"])))
    return got

  want = losses("gpipe", "task.pipeline.schedule=gpipe")
  assert len(want) == 2
  for name, overrides in SPLIT_BACKWARD.items():
    assert_close(losses(name.replace(" ", "_"), overrides), want, dtype=np.float32,
                 err_msg=name)


def test_an_export_leaves_no_partial_folder_and_never_sets_the_umask(tmp_path, monkeypatch):
  parent = tmp_path / "export"
  parent.mkdir()
  host = exporter._host()  # noqa: SLF001
  dead = parent / ".3.partial-999999999-abcd"  # a pid no process has (an older name)
  dead.mkdir()
  mine = parent / f".3.partial-{os.getpid()}-abcd@{host}"  # a live process's: kept
  mine.mkdir()
  elsewhere = parent / ".3.partial-999999999-abcd@another-host"  # not judged here: kept
  elsewhere.mkdir()
  # Killed between moving export 2 aside and moving its new one in: 2 comes back.
  moved_aside = parent / f".2.old-999999999-abcd@{host}"
  moved_aside.mkdir()
  (moved_aside / "saved_model.pb").write_text("the previous export")
  # Killed after the new export 4 took its place: the old one goes.
  (parent / "4").mkdir()
  (parent / f".4.old-999999999-abcd@{host}").mkdir()
  exporter.clean_up_killed_exports(str(parent), log=lambda _: None)
  assert sorted(p.name for p in parent.iterdir()) == sorted(
      ["2", "4", mine.name, elsewhere.name])
  assert (parent / "2" / "saved_model.pb").read_text() == "the previous export"

  def no_umask(*_):
    raise AssertionError("os.umask changes the whole process's mask")

  monkeypatch.setattr(os, "umask", no_umask)
  staging = exporter._staging_dir(str(parent), 3)  # noqa: SLF001 - the folder's mode
  shutil.rmtree(staging)


def test_bad_flags_and_params_exit_2_with_one_line(eight_heads_run, tmp_path):
  logdir = tmp_path / "run"
  for override in ("task.stack.layers[0].embedding_dim=0", "train_input.name=7",
                   "task.pipeline.stack_variables=1"):
    done = run_trainer("--model=lm.TransformerTiny", f"--logdir={logdir}", "--max_steps=1",
                       f"--params_override={override}")
    assert done.returncode == 2 and done.stderr.strip().count("\n") == 0, (override,
                                                                          done.stderr)
    assert override.split("=")[0].rsplit(".", 1)[-1] in done.stderr
    assert not logdir.exists()
  before = files_of(eight_heads_run)
  for flag, says in (("--export_dtype=", "--export_dtype"),
                     ("--max_decode_length=3e9", "--max_decode_length"),
                     (f"--max_decode_length={2**31 - 1}", "--max_decode_length")):
    done = run_trainer("--model=lm.TransformerTiny", f"--logdir={eight_heads_run}",
                       "--mode=export", "--overwrite", flag)
    assert done.returncode == 2 and done.stderr.strip().count("\n") == 0, (flag, done.stderr)
    assert says in done.stderr
  assert files_of(eight_heads_run) == before


@EXHAUSTIVE
def test_an_interrupted_export_says_what_it_left_and_the_next_cleans_up(eight_heads_run):
  """SIGINT while the export traces: exit 130 with nothing written (its hidden folder,
  if any, removed by the next export), or exit 0 if it had finished; never a message
  that disagrees with the disk."""
  logdir = eight_heads_run
  export = subprocess.Popen(
      [sys.executable, str(REPO / "tools" / "trainer.py"), "--model=lm.TransformerTiny",
       f"--logdir={logdir}", "--mode=export", "--overwrite"],
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
      env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1"),
      preexec_fn=sigint_as_default)
  try:
    for line in export.stdout:
      if "tracing the serving functions" in line:
        break
    export.send_signal(signal.SIGINT)
    out, err = export.communicate(timeout=120)
  finally:
    export.kill()
  if export.returncode == 130:
    assert "before the export was written: nothing of it was written" in err, err
  else:
    assert export.returncode == 0 and "Exported step 1" in out, err
  assert tf.saved_model.load(str(logdir / "export" / "1")).signatures["score"] is not None
  # The next export removes what an interrupted one left, and leaves no folder of its own.
  again = run_trainer("--model=lm.TransformerTiny", f"--logdir={logdir}", "--mode=export",
                      "--overwrite")
  assert again.returncode == 0, again.stderr
  assert sorted(p.name for p in (logdir / "export").iterdir()) == ["1"]


def test_a_checkpoint_being_written_by_the_trainer_is_noted_not_called_damaged(
    eight_heads_run, tmp_path):
  copy = tmp_path / "run"
  shutil.copytree(eight_heads_run / "train", copy / "train")
  shutil.copy(eight_heads_run / "params.txt", copy / "params.txt")
  for data in (copy / "train").glob("ckpt-1.data-*"):  # the newest, as if half-written
    data.write_bytes(b"")
  params = registered("lm.TransformerTiny", f"{SMALL};{EIGHT_HEADS}").freeze()
  lines = []
  lock = logdirs.LogdirLock(str(copy))
  lock.acquire()  # a trainer training in this logdir
  try:
    assert logdirs.lock_holder(str(copy)).startswith(f"pid {os.getpid()}")
    with pytest.raises(exporter.ExportError):  # ckpt-1 is its only one
      exporter.restore_for_inference(params, str(copy), None, None, "float32", lines.append)
  finally:
    lock.release()
  assert logdirs.lock_holder(str(copy)) is None
  assert any("is not readable yet: the trainer in this logdir" in line for line in lines)
  assert not any(line.startswith("warning") for line in lines), lines
