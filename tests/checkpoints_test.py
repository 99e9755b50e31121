"""CheckpointStore: checkpoints found from the files; nothing lost to a damaged index,
an unreadable checkpoint, an interrupted save or a failed one."""

import hashlib
import os
import resource
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from lingvo_gpipe import checkpoints


class Mismatch(Exception):
  pass


class Model:
  """One variable ([64, 64] unless said); checkpoint k holds the value k everywhere."""

  def __init__(self, directory: Path, shape=(64, 64), max_to_keep: int = 3):
    self.value = tf.Variable(tf.zeros(shape))
    self.checkpoint = tf.train.Checkpoint(value=self.value)
    self.log: list[str] = []
    self.store = checkpoints.CheckpointStore(self.checkpoint, str(directory), max_to_keep,
                                             self.restore, Mismatch, self.log.append)

  def restore(self, prefix: str) -> None:
    """As the trainer's: a checkpoint that does not fit the model is a Mismatch."""
    try:
      self.checkpoint.restore(prefix).assert_consumed()
    except (ValueError, AssertionError) as e:
      raise Mismatch(str(e)) from None

  def save(self, step: int) -> str:
    self.value.assign(tf.fill([64, 64], float(step)))
    return self.store.save(step)


def files(directory: Path) -> dict[str, str]:
  """{relative path: sha256} of every file under `directory`."""
  return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
          for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture
def saved(tmp_path) -> Path:
  """A directory with ckpt-10, ckpt-20, ckpt-30 (values 10, 20, 30) and their index."""
  model = Model(tmp_path)
  model.store.repair(model.store.restore_newest())
  for step in (10, 20, 30):
    model.save(step)
  return tmp_path


@pytest.mark.parametrize("damage", ["missing", "garbled"])
def test_a_lost_index_still_finds_the_newest_checkpoint_and_is_rewritten(saved, damage):
  index = saved / "checkpoint"
  if damage == "missing":
    index.unlink()
  else:
    index.write_text("model_checkpoint_path: {{{ not a checkpoint state")
  model = Model(saved)
  found = model.store.restore_newest()
  assert found.step == 30 and found.path == str(saved / "ckpt-30")
  np.testing.assert_array_equal(model.value.numpy(), np.full([64, 64], 30.0))
  model.store.repair(found)
  assert tf.train.latest_checkpoint(str(saved)) == str(saved / "ckpt-30")
  assert any(f"it was {damage if damage == 'missing' else 'damaged'}" in line
             for line in model.log), model.log
  # Rotation (max_to_keep=3) knows the checkpoints again: ckpt-10 goes first.
  model.save(40)
  assert [step for step, _ in checkpoints.find(str(saved))] == [40, 30, 20]


def test_an_unreadable_newest_checkpoint_is_named_set_aside_and_the_older_one_used(saved):
  data = saved / "ckpt-30.data-00000-of-00001"
  os.truncate(data, 1000)
  before = files(saved)
  model = Model(saved)
  found = model.store.restore_newest()
  assert found.step == 20
  np.testing.assert_array_equal(model.value.numpy(), np.full([64, 64], 20.0))
  assert [prefix for prefix, _ in found.unreadable] == [str(saved / "ckpt-30")]
  assert any(str(saved / "ckpt-30") in line and "cannot be read" in line for line in model.log)
  assert files(saved) == before  # the search changes nothing

  model.store.repair(found)
  moved = files(saved / checkpoints.UNREADABLE_DIR)
  assert moved == {name: digest for name, digest in before.items()
                   if name.startswith("ckpt-30.")}  # kept byte for byte
  assert tf.train.latest_checkpoint(str(saved)) == str(saved / "ckpt-20")
  model.save(30)  # the same step again: a new checkpoint, the old bytes untouched
  assert files(saved / checkpoints.UNREADABLE_DIR) == moved
  assert Model(saved).store.restore_newest().step == 30


def test_data_whose_index_is_gone_is_set_aside_not_overwritten_by_the_next_save(saved):
  (saved / "ckpt-30.index").unlink()
  data = "ckpt-30.data-00000-of-00001"
  before = files(saved)
  model = Model(saved)
  found = model.store.restore_newest()
  assert found.step == 20 and found.orphaned == [str(saved / "ckpt-30")]
  np.testing.assert_array_equal(model.value.numpy(), np.full([64, 64], 20.0))
  assert any(str(saved / "ckpt-30") in line and "no .index" in line for line in model.log)
  assert files(saved) == before  # the search changes nothing

  model.store.repair(found)
  assert not (saved / data).exists()
  assert files(saved / checkpoints.UNREADABLE_DIR) == {data: before[data]}  # byte for byte
  assert any(line.startswith(f"Moved the data files of checkpoint {saved / 'ckpt-30'}")
             for line in model.log), model.log
  # The same step again, other values: a new checkpoint, the moved bytes untouched.
  model.value.assign(tf.fill([64, 64], 99.0))
  model.store.save(30)
  assert files(saved / checkpoints.UNREADABLE_DIR) == {data: before[data]}
  assert files(saved)[data] != before[data]
  restored = Model(saved)
  assert restored.store.restore_newest().step == 30
  np.testing.assert_array_equal(restored.value.numpy(), np.full([64, 64], 99.0))


def test_data_of_a_save_in_flight_is_not_taken_for_an_orphan(saved):
  """A save moves its data files out of ckpt-N_temp/ and writes the .index after; an
  interrupted one is removed at start, and then its data files are set aside."""
  (saved / "ckpt-40_temp").mkdir()
  (saved / "ckpt-40.data-00000-of-00001").write_bytes(b"moved into place, no index yet")
  assert checkpoints.orphaned_data(str(saved)) == []
  model = Model(saved)
  found = model.store.restore_newest()
  assert found.step == 30 and found.orphaned == []
  model.store.repair(found)
  assert not (saved / "ckpt-40_temp").exists()
  assert files(saved / checkpoints.UNREADABLE_DIR) == {
      "ckpt-40.data-00000-of-00001": hashlib.sha256(b"moved into place, no index yet")
      .hexdigest()}


def test_when_no_checkpoint_can_be_read_the_run_refuses_and_changes_nothing(saved):
  for step in (10, 20, 30):
    os.truncate(saved / f"ckpt-{step}.data-00000-of-00001", 100)
  (saved / "checkpoint").unlink()
  before = files(saved)
  with pytest.raises(checkpoints.NoReadableCheckpointError,
                     match="none of the 3 checkpoints .* can be read"):
    Model(saved).store.restore_newest()
  assert files(saved) == before


def test_a_checkpoint_of_another_model_is_not_mistaken_for_damage(saved):
  before = files(saved)
  with pytest.raises(Mismatch):
    Model(saved, shape=(3,)).store.restore_newest()
  assert files(saved) == before


def test_interrupted_saves_are_removed_at_start(saved):
  leftover = saved / "ckpt-40_temp"
  leftover.mkdir()
  (leftover / "part-00000-of-00001.data-00000-of-00001").write_bytes(b"half")
  index_write = saved / "checkpoint.tmp4f1c0e9a2b7d4c3e8f6a5b4c3d2e1f00"
  index_write.write_text("model_checkpoint_path")
  model = Model(saved)
  found = model.store.restore_newest()
  assert found.step == 30 and leftover.exists()
  model.store.repair(found)
  assert not leftover.exists() and not index_write.exists()


def test_a_failed_save_names_the_last_good_checkpoint_and_leaves_no_partial_files(saved):
  """A file-size limit (RLIMIT_FSIZE: writes past it fail with EFBIG, as a full disk
  fails them with ENOSPC) stands in for a full disk."""
  model = Model(saved)
  model.store.repair(model.store.restore_newest())
  before = files(saved)
  soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
  resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))  # the data file is 16 KB
  try:
    with pytest.raises(checkpoints.CheckpointSaveError) as raised:
      model.save(40)
  finally:
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
  message = str(raised.value)
  assert "\n" not in message and "File too large" in message
  assert f"could not write checkpoint {saved / 'ckpt-40'}" in message
  assert f"the last good checkpoint is {saved / 'ckpt-30'}" in message
  assert files(saved) == before
  assert not list(saved.glob("ckpt-40*"))


def test_variable_mismatches_are_read_from_the_checkpoint_not_from_error_text(tmp_path):
  class Layer(tf.Module):
    def __init__(self, width, extra=False):
      super().__init__()
      self.w = tf.Variable(tf.zeros([2, width]), name="dense/w")
      self.b = tf.Variable(tf.zeros([width]), name="dense/b")
      if extra:
        self.scale = tf.Variable(1.0, name="dense/scale")

  saved_path = tf.train.Checkpoint(task=Layer(3), step=tf.Variable(1)).save(
      str(tmp_path / "ckpt"))
  assert checkpoints.variable_mismatches(
      saved_path, tf.train.Checkpoint(task=Layer(3), step=tf.Variable(1))) == []
  assert checkpoints.variable_mismatches(
      saved_path, tf.train.Checkpoint(task=Layer(4, extra=True))) == [
          "task/b (dense/b:0): checkpoint shape [3], model shape [4]",
          "task/scale (dense/scale:0) is not in the checkpoint",
          "task/w (dense/w:0): checkpoint shape [2, 3], model shape [2, 4]",
          "step is only in the checkpoint"]


def test_optimizer_slots_are_not_reported_as_missing_after_a_width_change(tmp_path):
  """Slots are kept in a dict keyed by variable name ('task/body/w', escaped in the
  checkpoint as 'task.Sbody.Sw'); they follow their variables and are left out."""
  from lingvo_gpipe.core import optimizers

  def model(width):
    w = tf.Variable(tf.zeros([2, width]), name="task/body/w")
    optimizer = optimizers.SGD.Params().set(momentum=0.9).instantiate()
    optimizer.create_slots([w])
    return tf.train.Checkpoint(task=tf.Module(), w=w, optimizer=optimizer)

  saved_path = model(3).save(str(tmp_path / "ckpt"))
  assert checkpoints.variable_mismatches(saved_path, model(3)) == []
  assert checkpoints.variable_mismatches(saved_path, model(4)) == [
      "w (task/body/w:0): checkpoint shape [2, 3], model shape [2, 4]"]
