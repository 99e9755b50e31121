"""A logdir's params.txt is compared before a resumed run writes anything; the
writability probe leaves nothing behind."""

import errno
import os
import subprocess
import sys
import textwrap

import pytest

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
  assert "train_input.batch_size: 32 -> 16" in message and "train_input.seed: 1 -> 7" in message
  assert (logdir / "params.txt").read_text() == before


def test_changes_its_checkpoints_can_follow_are_returned_as_notes(tmp_path):
  logdir = make_logdir(tmp_path)
  changed = demo_params(**{"task.train.max_steps": 99999, "task.train.log_interval_steps": 7,
                           "eval_input.batch_size": 8,
                           "task.train.optimizer.learning_rate": 0.5})
  notes = logdirs.check_resumable(str(logdir), changed)
  assert [key for key, _, _ in notes] == [
      "eval_input.batch_size", "task.train.log_interval_steps",
      "task.train.optimizer.learning_rate"]  # max_steps differs on every resume: no note


def test_without_a_checkpoint_any_change_is_only_a_note(tmp_path):
  logdir = make_logdir(tmp_path, with_checkpoint=False)
  notes = logdirs.check_resumable(str(logdir), demo_params(**{"train_input.batch_size": 16}))
  assert [key for key, _, _ in notes] == ["train_input.batch_size"]


def test_params_txt_keeps_the_params_it_replaces(tmp_path):
  logdir = make_logdir(tmp_path)
  original = (logdir / "params.txt").read_text()
  logdirs.write_params(str(logdir), demo_params(**{"task.train.max_steps": 5}), step=10)
  assert sorted(os.listdir(logdir)) == ["params.txt", "train"]  # max_steps alone: no copy
  changed = demo_params(**{"task.train.log_interval_steps": 7})
  logdirs.write_params(str(logdir), changed, step=20)
  assert (logdir / "params.before_step_20.txt").read_text() != original  # the max_steps=5 one
  assert (logdir / "params.txt").read_text() == changed.to_text()


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
                                          (b"just words\n", "holds no 'key : value' lines")])
def test_a_params_txt_that_is_not_params_text_is_refused_naming_it(tmp_path, content, why):
  logdir = make_logdir(tmp_path)
  (logdir / "params.txt").write_bytes(content)
  with pytest.raises(logdirs.LogdirError, match=f"params.txt.*{why}"):
    logdirs.check_resumable(str(logdir), demo_params())
  assert (logdir / "params.txt").read_bytes() == content
