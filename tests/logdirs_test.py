"""A logdir's params.txt is compared before a resumed run writes anything; the
writability probe leaves nothing behind."""

import errno
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from lingvo_gpipe import logdirs, model_registry


def demo_params(**overrides):
  model_registry.load_param_files()
  params = model_registry.get_params("demo.TinyConvNet")
  return params.set(**overrides).freeze()


def make_logdir(tmp_path, with_checkpoint: bool = True):
  logdir = tmp_path / "run"
  (logdir / "train").mkdir(parents=True)
  logdirs.write_params(str(logdir), demo_params(), step=0)
  if with_checkpoint:
    (logdir / "train" / "ckpt-10.index").write_bytes(b"")  # what checkpoints.find looks for
  return logdir


def test_a_changed_training_input_is_refused_naming_the_keys(tmp_path):
  logdir = make_logdir(tmp_path)
  before = (logdir / "params.txt").read_text()
  changed = demo_params(**{"train_input.batch_size": 16, "train_input.seed": 7})
  with pytest.raises(logdirs.IncompatibleParamsError) as raised:
    logdirs.check_resumable(str(logdir), changed)
  message = str(raised.value)
  assert "train_input.batch_size: 32 -> 16 (refused:" in message
  assert "train_input.seed: 1 -> 7 (refused:" in message
  assert (logdir / "params.txt").read_text() == before


def test_each_change_falls_in_its_row_of_the_resume_rules(tmp_path):
  logdir = make_logdir(tmp_path)
  changed = demo_params(**{"task.train.max_steps": 99999, "task.train.log_interval_steps": 7,
                           "eval_input.batch_size": 8, "task.pipeline.num_cells": 2,
                           "task.fprop_dtype": "bfloat16",
                           "task.train.optimizer.learning_rate": 0.5,
                           "train_input.autotune": True,
                           "task.softmax.num_classes": 3})
  change = logdirs.check_resumable(str(logdir), changed)
  rows = {key: rule.verdict for key, _, _, rule in change.changes}
  assert rows == {  # max_steps differs on every resume: not a change
      "eval_input.batch_size": logdirs.ALLOWED,
      "task.fprop_dtype": logdirs.ALLOWED,
      "task.pipeline.num_cells": logdirs.ALLOWED,
      "task.softmax.num_classes": logdirs.CHECKED,
      "task.train.log_interval_steps": logdirs.ALLOWED,
      "task.train.optimizer.learning_rate": logdirs.ALLOWED,
      "train_input.autotune": logdirs.ALLOWED}
  # A param None in params.txt, set now (it was refused: "None is not a value of it").
  capped = logdirs.check_resumable(str(logdir), demo_params(**{
      "task.pipeline.memory_cap_bytes": 10**9}))
  assert [(key, rule.verdict) for key, _, _, rule in capped.changes] == [
      ("task.pipeline.memory_cap_bytes", logdirs.ALLOWED)]
  float16 = logdirs.check_resumable(str(logdir), demo_params(**{"task.fprop_dtype": "float16"}))
  assert [rule.verdict for *_, rule in float16.changes] == [logdirs.CONSEQUENCE]
  assert "loss scale" in float16.describe()
  # A logdir written before the inputs had `autotune` resumes: at the value it had
  # then (its default), that param is no change; set otherwise, a change of its row.
  params_txt = logdir / "params.txt"
  params_txt.write_text("".join(line for line in params_txt.read_text().splitlines(True)
                                if "_input.autotune" not in line and not line.startswith("#")))
  assert not logdirs.check_resumable(str(logdir), demo_params()).changes
  older = logdirs.check_resumable(str(logdir), demo_params(**{"train_input.autotune": True}))
  assert {key: rule.verdict for key, _, _, rule in older.changes} == {
      "train_input.autotune": logdirs.ALLOWED}


def test_freezing_or_unfreezing_a_layer_is_refused_on_resume():
  """A frozen weight has no optimizer slots: a Keras unit's trainable, or a BatchNorm's
  frozen, changed on resume would not restore; it is refused, before anything is
  written, naming the layer."""
  old = "{'class_name': 'Dense', 'config': {'units': 4, 'trainable': True}}"
  new = old.replace("'trainable': True", "'trainable': False")
  assert logdirs.resume_rule("task.body.layers[0].layer", old, new).verdict == logdirs.REFUSED
  assert logdirs.resume_rule("task.body.layers[1].frozen", "False", "True").verdict == \
      logdirs.REFUSED
  wider = old.replace("'units': 4", "'units': 8")  # (another shape: the restore names it)
  assert logdirs.resume_rule("task.body.layers[0].layer", old, wider).verdict == \
      logdirs.CHECKED


def test_without_a_checkpoint_any_change_is_only_a_note(tmp_path):
  logdir = make_logdir(tmp_path, with_checkpoint=False)
  change = logdirs.check_resumable(str(logdir), demo_params(**{"train_input.batch_size": 16}))
  assert not change.has_checkpoints
  assert [key for key, *_ in change.changes] == ["train_input.batch_size"]


@pytest.mark.parametrize("line, damage, named", [
    ("task.train.max_steps : 200", "task.train.max_steps 200", "is not 'key : value'"),
    ("task.softmax.num_classes : 10", "task.softmax.num_classes : banana",
     "'task.softmax.num_classes : banana' is not a value of that key")])
def test_a_damaged_params_txt_is_refused_naming_the_line(tmp_path, line, damage, named):
  logdir = make_logdir(tmp_path)
  text = (logdir / "params.txt").read_text()
  assert line in text
  damaged = text.replace(line, damage)
  (logdir / "params.txt").write_text(damaged)
  with pytest.raises(logdirs.LogdirError) as raised:
    logdirs.check_resumable(str(logdir), demo_params())
  assert named in str(raised.value) and "--reset_params" in str(raised.value)
  assert (logdir / "params.txt").read_text() == damaged
  aside = logdirs.set_params_aside(str(logdir))
  assert open(aside).read() == damaged and not (logdir / "params.txt").exists()
  assert logdirs.check_resumable(str(logdir), demo_params()) is None


def test_params_txt_keeps_the_params_it_replaces(tmp_path):
  logdir = make_logdir(tmp_path)
  original = (logdir / "params.txt").read_text()
  logdirs.write_params(str(logdir), demo_params(**{"task.train.max_steps": 5}), step=10)
  assert sorted(os.listdir(logdir)) == ["params.txt", "train"]  # max_steps alone: no copy
  changed = demo_params(**{"task.train.log_interval_steps": 7})
  logdirs.write_params(str(logdir), changed, step=20)
  assert (logdir / "params.before_step_20.txt").read_text() != original  # the max_steps=5 one
  assert (logdir / "params.txt").read_text() == logdirs.stamped(changed.to_text())


def test_a_params_txt_changed_since_it_was_written_is_refused_not_read_as_older(tmp_path):
  """A line deleted from a params.txt the trainer wrote (its stamp then no longer
  matches) is refused by resume and export: read as a param added since, it took its
  default (learning_rate 0.1 where the run trained at 0.003, said to be "as it
  trained"). One without a stamp (an older version's) is read as one."""
  from lingvo_gpipe import run_params

  logdir = make_logdir(tmp_path)
  text = (logdir / "params.txt").read_text()
  assert text.splitlines()[-1].startswith("# sha256 of the lines above: ")
  edited = "".join(line for line in text.splitlines(True)
                   if not line.startswith("task.train.optimizer.learning_rate"))
  (logdir / "params.txt").write_text(edited)
  with pytest.raises(logdirs.LogdirError, match="was changed since the trainer wrote it"):
    logdirs.check_resumable(str(logdir), demo_params())
  with pytest.raises(run_params.RunParamsError, match="was changed since the trainer wrote"):
    run_params.trained_params(demo_params().copy(), str(logdir / "params.txt"))
  (logdir / "params.txt").write_text(logdirs.unstamped(edited))  # (as an older version's)
  older = logdirs.check_resumable(str(logdir), demo_params())
  assert [(key, rule.verdict) for key, _, _, rule in older.changes] == [
      ("task.train.optimizer.learning_rate", logdirs.ALLOWED)]


def test_a_second_resume_at_one_step_keeps_the_params_its_checkpoints_had(tmp_path):
  """Resumed at step 20 with one change, stopped before a checkpoint, resumed at 20 with
  another: params.before_step_20.txt still holds the params of the checkpoints up to 20."""
  logdir = make_logdir(tmp_path)
  original = (logdir / "params.txt").read_text()
  for interval in (7, 9):
    logdirs.write_params(str(logdir),
                         demo_params(**{"task.train.log_interval_steps": interval}), step=20)
  assert (logdir / "params.before_step_20.txt").read_text() == original


def test_the_writability_probe_leaves_nothing_behind(tmp_path):
  logdirs.check_writable(str(tmp_path / "a" / "b"))
  assert list(tmp_path.iterdir()) == []
  blocker = tmp_path / "file"
  blocker.write_text("x")
  with pytest.raises(logdirs.LogdirError, match="is not writable"):
    logdirs.check_writable(str(blocker / "run"))
  assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_a_logdir_has_one_trainer_and_a_dead_holder_leaves_it_free(tmp_path):
  logdir = str(tmp_path / "new" / "run")
  first = logdirs.LogdirLock(logdir)
  first.acquire()
  with pytest.raises(logdirs.LogdirInUseError,
                     match=rf"in use by another trainer \(pid {os.getpid()} on "):
    logdirs.LogdirLock(logdir).acquire()
  first.release()
  # A holder killed with -9 (its open file closed by the kernel) leaves the lock free.
  holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
      import sys, time
      from lingvo_gpipe import logdirs
      logdirs.LogdirLock({logdir!r}).acquire()
      print("held", flush=True)
      time.sleep(600)""")], stdout=subprocess.PIPE, text=True)
  try:
    assert holder.stdout.readline() == "held\n"
    with pytest.raises(logdirs.LogdirInUseError, match=f"pid {holder.pid} "):
      logdirs.LogdirLock(logdir).acquire()
  finally:
    holder.kill()
    holder.wait()
  again = logdirs.LogdirLock(logdir)
  again.acquire()
  again.release(remove_if_unused=False)


def test_a_probe_of_the_lock_is_not_taken_for_a_trainer(tmp_path):
  """lock_holder's shared probe (export, decode) holds the flock for a moment: a trainer
  starting then waits it out instead of being refused; a held lock still refuses."""
  import fcntl
  import threading

  logdir = str(tmp_path / "run")
  lock = logdirs.LogdirLock(logdir)
  lock.acquire()
  lock.release()
  probe = os.open(os.path.join(logdir, logdirs.LOCK_FILE), os.O_RDONLY)
  fcntl.flock(probe, fcntl.LOCK_SH | fcntl.LOCK_NB)  # a probe caught mid-way
  threading.Timer(0.2, lambda: os.close(probe)).start()
  trainer = logdirs.LogdirLock(logdir)
  trainer.acquire()  # (waits for the probe to let go)
  assert logdirs.lock_holder(logdir).startswith(f"pid {os.getpid()} ")
  trainer.release()
  assert logdirs.lock_holder(logdir) is None


def test_a_refused_run_leaves_no_logdir_behind(tmp_path):
  logdir = tmp_path / "new" / "run"
  lock = logdirs.LogdirLock(str(logdir))
  lock.acquire()
  lock.release(remove_if_unused=True)
  assert not (tmp_path / "new").exists()
  existing = make_logdir(tmp_path)
  lock = logdirs.LogdirLock(str(existing))
  lock.acquire()
  lock.release(remove_if_unused=True)  # not created by it: left as it was
  assert sorted(os.listdir(existing)) == ["params.txt", "train", "trainer.lock"]


def test_a_failed_params_write_keeps_the_old_params_txt(tmp_path, monkeypatch):
  logdir = make_logdir(tmp_path)
  before = (logdir / "params.txt").read_text()

  def disk_full(path, mode="r", *args, **kwargs):
    if "w" in mode:
      raise OSError(errno.ENOSPC, "No space left on device", path)
    return open(path, mode, *args, **kwargs)

  monkeypatch.setattr(logdirs, "open", disk_full, raising=False)
  with pytest.raises(OSError, match="No space left"):
    logdirs.write_params(str(logdir), demo_params(train_input=demo_params().train_input.copy()
                                                  .set(batch_size=3)), step=10)
  monkeypatch.undo()
  assert (logdir / "params.txt").read_text() == before
  assert sorted(os.listdir(logdir)) == ["params.txt", "train"]


@pytest.mark.parametrize("content, why", [(bytes(range(256)), "not UTF-8 text"),
                                          (b"just words\n", "line 1 is not 'key : value'"),
                                          (b"\n \n", "holds no 'key : value' lines")])
def test_a_params_txt_that_is_not_params_text_is_refused_naming_it(tmp_path, content, why):
  logdir = make_logdir(tmp_path)
  (logdir / "params.txt").write_bytes(content)
  with pytest.raises(logdirs.LogdirError, match=f"params.txt.*{why}"):
    logdirs.check_resumable(str(logdir), demo_params())
  assert (logdir / "params.txt").read_bytes() == content


# -- logdirs an earlier version wrote ---------------------------------------------------

EARLIER = Path(__file__).resolve().parent / "data" / "logdir_of_fb46c18"
EARLIER_MODEL = ("--model=earlier_version_lm.SmallLm",
                 f"--params_path={EARLIER.parent / 'earlier_version_lm.py'}")


def test_a_param_added_since_a_params_text_means_what_the_code_did_before_it():
  """A leaf the text lacks while holding the params around it is a param added since:
  it takes its `before` (its default unless its define says otherwise). A leaf under
  params the text lacks too (a layer more) is a change of structure, not one."""
  from lingvo_gpipe.core.hyperparams import Params

  def params(layers: int) -> Params:
    p = Params()
    p.define("width", 8, "")
    p.define("tied", True, "", before=False)  # added later, with another default
    p.define("scale", 2.0, "")  # added later, its default what the code did
    p.define("layers", [Params() for _ in range(layers)], "")
    for layer in p.layers:
      layer.define("dim", 4, "")
      layer.define("bias", True, "")
    return p.set(width=16, scale=3.0)

  text = "width : 16\nlayers[0].dim : 4\n"
  added = dict(logdirs.params_added_since(params(2), logdirs.params_leaves(text)))
  assert added == {"tied": False, "scale": 2.0, "layers[0].bias": True}
  p = params(1)
  changed = logdirs.take_params_added_since(p, text, "params.txt", keep=frozenset({"scale"}))
  assert changed == ["tied = False"] and (p.tied, p.scale) == (False, 3.0)


def test_a_logdir_of_an_earlier_version_serves_what_it_trained(tmp_path):
  """tests/data/logdir_of_fb46c18, trained by the library before tied weights and
  length buckets (its params.txt has neither), with a param file that ties its
  softmax since: today's export serves it untied, as it trained, and its `score` is
  the one that version served."""
  from numerics import assert_close

  from lingvo_gpipe import exporter, run_params
  from lingvo_gpipe.tasks import serving

  logdir = tmp_path / "run"
  shutil.copytree(EARLIER, logdir)
  model_registry.load_param_files([str(EARLIER.parent / "earlier_version_lm.py")])
  registered = model_registry.get_params("earlier_version_lm.SmallLm")
  assert registered.task.stack.layers[2].tie_to  # (tied today)
  lines = []
  params, _ = run_params.served_params(registered, str(logdir), None, [],
                                       "earlier_version_lm.SmallLm", log=lines.append)
  assert any("was written before these params existed" in line
             and "task.stack.layers[2].tie_to = None" in line for line in lines), lines
  path = exporter.export(params.freeze(), str(logdir), model_name="earlier_version_lm.SmallLm",
                         options=serving.ServingOptions(max_decode_length=16),
                         log=lambda _: None)
  expected = json.loads((EARLIER / "expected_scores.json").read_text())
  served = tf.saved_model.load(path).signatures["score"](
      ids=tf.constant(expected["ids"], tf.int32), paddings=tf.constant(expected["paddings"]))
  assert_close(served["token_log_probs"].numpy(), np.array(expected["token_log_probs"]))


def test_a_logdir_of_an_earlier_version_resumes_and_decodes_through_the_binary(tmp_path):
  """The same logdir resumed for a step (the params added since as they were then,
  noted; before: refused for bucket keys it never had), then decoded."""
  from conftest import run_trainer

  logdir = tmp_path / "run"
  shutil.copytree(EARLIER, logdir)
  resumed = run_trainer(*EARLIER_MODEL, f"--logdir={logdir}", "--devices=cpu:1",
                        "--max_steps=3")
  assert resumed.returncode == 0, resumed.stderr[-2000:]
  assert ("was written before these params existed; the run goes on as it trained, with "
          "each as it was then: task.stack.layers[2].tie_to = None") in resumed.stdout
  assert "Resuming from checkpoint" in resumed.stdout and "step 3/3" in resumed.stdout
  assert (logdir / "params.before_step_2.txt").read_text() == (
      EARLIER / "params.txt").read_text()
  decoded = run_trainer(*EARLIER_MODEL, f"--logdir={logdir}", "--mode=decode")
  assert decoded.returncode == 0, decoded.stderr[-2000:]
  assert "decode at step 3" in decoded.stdout


def test_an_export_takes_the_params_of_the_checkpoint_it_can_read(tmp_path):
  """The newest checkpoint cannot be read (ckpt-5: its data cut in half, its global step
  still readable), so the export restores ckpt-2, and serves the params ckpt-2 was
  written with (the text a resume at step 3 set aside), not those of params.txt (the
  newest checkpoint's). A copy renamed by hand ('best-7') is the step it holds."""
  from lingvo_gpipe import run_params

  logdir = tmp_path / "run"
  shutil.copytree(EARLIER, logdir)
  train = logdir / "train"
  (train / "ckpt-5.index").write_bytes((train / "ckpt-2.index").read_bytes())
  data = (train / "ckpt-2.data-00000-of-00001").read_bytes()
  (train / "ckpt-5.data-00000-of-00001").write_bytes(data[:len(data) // 2])
  assert tf.train.load_checkpoint(str(train / "ckpt-5")).get_tensor(
      "global_step/.ATTRIBUTES/VARIABLE_VALUE") == 2  # (what a cheaper look would see)
  shutil.copy(logdir / "params.txt", logdir / "params.before_step_3.txt")
  (logdir / "params.txt").write_text((logdir / "params.txt").read_text().replace(
      "eval_input.batch_size : 8", "eval_input.batch_size : 4"))
  model_registry.load_param_files([str(EARLIER.parent / "earlier_version_lm.py")])
  lines = []
  params, _ = run_params.served_params(
      model_registry.get_params("earlier_version_lm.SmallLm"), str(logdir), None, [],
      "earlier_version_lm.SmallLm", log=lines.append)
  assert f"Serving the params the checkpoint was trained with: {logdir}/params.before_step_3.txt" \
      in lines, lines
  assert params.eval_input.batch_size == 8
  for suffix in (".index", ".data-00000-of-00001"):
    shutil.copy(train / f"ckpt-2{suffix}", tmp_path / f"best-7{suffix}")
  assert run_params.checkpoint_step(str(tmp_path / "best-7")) == 2


def test_a_refused_run_puts_back_the_params_txt_reset_params_set_aside(tmp_path):
  """--reset_params on the earlier version's logdir: the registered model (tied) does
  not restore its checkpoint, so the run is refused, and params.txt, set aside first,
  is put back (the logdir was left without one: neither resume nor export then ran)."""
  from conftest import run_trainer

  logdir = tmp_path / "run"
  shutil.copytree(EARLIER, logdir)
  refused = run_trainer(*EARLIER_MODEL, f"--logdir={logdir}", "--devices=cpu:1",
                        "--max_steps=3", "--reset_params")
  assert refused.returncode == 2, refused.stderr[-2000:]
  assert "Put " in refused.stdout and "the run was refused" in refused.stdout
  assert (logdir / "params.txt").read_text() == (EARLIER / "params.txt").read_text()
  assert not list(logdir.glob("params.txt.set_aside_*"))
