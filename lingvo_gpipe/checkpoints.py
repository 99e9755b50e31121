"""Checkpoints found from the files on disk, restored newest-readable-first, never lost.

TensorFlow's `CheckpointManager` learns which checkpoints exist from one small text
file, `<dir>/checkpoint` (the index). If that file is missing or garbled it reports no
checkpoint at all, and a trainer trusting it would start from step 0 and overwrite
every `ckpt-N` on disk. Here the files themselves are the truth:

- `find(directory)` lists every `ckpt-N` whose `.index` file exists (TensorFlow writes
  a checkpoint's `.index` last, after its data), newest first;
- `CheckpointStore.restore_newest` tries them newest first; one that cannot be read
  (a truncated or corrupt data file, a damaged `.index`) is reported and the next older
  one is tried; a checkpoint of another model (`CheckpointMismatchError`, raised by the
  caller's restore function) stops the search: that is the user's mistake, not damage.
  Nothing on disk changes during the search;
- `orphaned_data(directory)` lists the `ckpt-N.data-*` files whose `.index` is gone
  (deleted, or never written): no restore can read them, and the next save of step N
  would write over them;
- `CheckpointStore.repair` then, once the caller has checked the whole run, moves the
  unreadable checkpoints and the orphaned data files into `<dir>/unreadable/` (kept,
  not deleted, and no longer in the way of a save at the same step), removes
  `ckpt-N_temp/` directories and `checkpoint.tmp<uuid>` files that an interrupted save
  left, and rewrites the index so that it lists the checkpoints that are on disk (so
  `max_to_keep` rotates them, oldest first, as before);
- `CheckpointStore.save` turns a failed save (a full disk, say) into one
  `CheckpointSaveError` line naming the error and the last good checkpoint, and removes
  the half-written files of that save.

Only `max_to_keep` rotation ever deletes a checkpoint, and only ones older than the
checkpoint that was restored (newer ones, readable or not, do not survive the search).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shutil
from collections.abc import Callable, Iterator
from typing import Any

import tensorflow as tf

from lingvo_gpipe.core import stacked_variables, tf_internals

CHECKPOINT_NAME = "ckpt"
UNREADABLE_DIR = "unreadable"
_CHECKPOINT_INDEX = re.compile(rf"^{CHECKPOINT_NAME}-(\d+)\.index$")
_INTERRUPTED_SAVE = re.compile(rf"^{CHECKPOINT_NAME}-\d+_temp$")
# A shard of a checkpoint's data, as TensorFlow names it: <prefix>.data-00000-of-00001.
_CHECKPOINT_DATA = re.compile(rf"^({CHECKPOINT_NAME}-\d+)\.data-\d+-of-\d+$")
# TensorFlow rewrites the index through checkpoint.tmp<uuid>; a kill can leave one.
_INTERRUPTED_INDEX_WRITE = re.compile(r"^checkpoint\.tmp[0-9a-f]+$")


def io_options() -> tf.train.CheckpointOptions:
  """Checkpoint options that read and write every file through this process's CPU.

  By default each variable's shard is written by the device that holds it: a worker on
  another host would write its cell's variables to its own disk (or fail to), while the
  checkpoints belong in --logdir on the trainer's host. One I/O device makes every
  save and restore go through the trainer's filesystem; the tensors cross the network
  once per save, as the step's hand-offs do."""
  return tf.train.CheckpointOptions(
      experimental_io_device=f"{tf_internals.host_address_space()}/device:CPU:0")


class CheckpointError(RuntimeError):
  """A checkpoint problem the run cannot go on with; the message says which and why."""


class CheckpointSaveError(CheckpointError):
  pass


class NoReadableCheckpointError(CheckpointError):
  pass


def _names(directory: str) -> list[str]:
  """The entries of `directory`; none if it does not exist (yet)."""
  try:
    return os.listdir(directory)
  except FileNotFoundError:
    return []


def find(directory: str) -> list[tuple[int, str]]:
  """(step, prefix) of every `ckpt-<step>` in `directory` with an `.index` file, newest
  first. The prefix is what `tf.train.Checkpoint.restore` takes."""
  found = [(int(m.group(1)), os.path.join(directory, f"{CHECKPOINT_NAME}-{m.group(1)}"))
           for m in map(_CHECKPOINT_INDEX.match, _names(directory)) if m]
  return sorted(found, reverse=True)


def latest(directory: str) -> str | None:
  """The prefix of the newest complete checkpoint in `directory`, or None."""
  on_disk = find(directory)
  return on_disk[0][1] if on_disk else None


def interrupted_saves(directory: str) -> list[str]:
  """The `ckpt-N_temp` directories of saves that never finished (a kill or a full disk
  while writing); TensorFlow writes a checkpoint there and moves it into place last."""
  return sorted(os.path.join(directory, n) for n in _names(directory)
                if _INTERRUPTED_SAVE.match(n))


def orphaned_data(directory: str) -> list[str]:
  """The prefixes (`<dir>/ckpt-N`) whose `.data-*` files are in `directory` without their
  `.index`, newest first. Not while `ckpt-N_temp/` exists: a save writes there, then
  moves its data files into place and writes the `.index` last, removing `_temp` after;
  until then the data files are a save in flight, not an orphan (`repair` removes an
  interrupted save's `_temp` first, so the data it had moved are then found)."""
  names = set(_names(directory))
  prefixes = {m.group(1) for m in map(_CHECKPOINT_DATA.match, names) if m}
  orphaned = [p for p in prefixes if f"{p}.index" not in names and f"{p}_temp" not in names]
  return [os.path.join(directory, p)
          for p in sorted(orphaned, key=lambda p: int(p.rsplit("-", 1)[1]), reverse=True)]


@contextlib.contextmanager
def _tensorflow_warnings_off():
  """TensorFlow's own logger at ERROR: `get_checkpoint_state` logs a ParseError for a
  damaged index and `update_checkpoint_state` a deprecation notice (it is the public
  way to write an index that CheckpointManager reads); the store says what happened
  in its own words instead."""
  logger = tf.get_logger()
  level = logger.level
  logger.setLevel("ERROR")
  try:
    yield
  finally:
    logger.setLevel(level)


# Lines of TensorFlow's error text that say nothing of the cause.
_NO_CAUSE = re.compile(r"^(Graph execution error:|Detected at node .*|\s*)$")


def first_line(error: BaseException) -> str:
  """The error's first line that names a cause, without TensorFlow's
  '{{function_node ...}}' and '[Op:SaveV2]' decorations ('Graph execution error:' and
  'Detected at node' lines are skipped)."""
  text = getattr(error, "message", None) or str(error) or type(error).__name__
  lines = [re.sub(r"\{\{[^}]*\}\}\s*", "", line) for line in text.strip().split("\n")]
  line = next((line for line in lines if not _NO_CAUSE.match(line)), lines[0])
  return re.sub(r"\s*\[Op:\w+\]( name: \S*)?$", "", line.strip())


_VALUE_KEY = "/.ATTRIBUTES/VARIABLE_VALUE"
# Optimizer slots (ours: optimizer/slots/<variable>/<slot>; Keras's: OPTIMIZER_SLOT).
_SLOT = re.compile(r"OPTIMIZER_SLOT|(^|/)slots/")


def _variables_by_path(obj: Any, prefix: str = "", seen: set[int] | None = None
                       ) -> Iterator[tuple[str, tf.Variable]]:
  """(object path as a checkpoint names it, variable) for every variable reachable
  from `obj` through tracked attributes ('task/body/layers/4/w', ...)."""
  seen = set() if seen is None else seen
  for name, child in tf.train.TrackableView(obj).children(obj).items():
    if id(child) in seen:
      continue
    seen.add(id(child))
    # As the checkpoint escapes a name ('.' → '..', '/' → '.S': a dict key 'a/b').
    path = prefix + name.replace(".", "..").replace("/", ".S")
    if isinstance(child, (tf.Variable, stacked_variables.RowVariable)):
      yield path, child
    else:
      yield from _variables_by_path(child, path + "/", seen)


def variable_mismatches(path: str, root: Any) -> list[str]:
  """How the variables saved at checkpoint `path` differ from those of `root` (e.g. a
  tf.train.Checkpoint): one line per variable whose shape differs, that the checkpoint
  lacks, or that only the checkpoint has (optimizer slots are left out: they follow
  their variables). Read from the checkpoint's variable list, not from error text."""
  stored = {key.removesuffix(_VALUE_KEY): shape for key, shape in tf.train.list_variables(path)
            if key.endswith(_VALUE_KEY) and not _SLOT.search(key)}
  model = {key: v for key, v in _variables_by_path(root) if not _SLOT.search(key)}
  lines = []
  for key, variable in sorted(model.items()):
    if key not in stored:
      lines.append(f"{key} ({variable.name}) is not in the checkpoint")
    elif variable.shape.as_list() != list(stored[key]):
      lines.append(f"{key} ({variable.name}): checkpoint shape {list(stored[key])}, model "
                   f"shape {variable.shape.as_list()}")
  lines += [f"{key} is only in the checkpoint" for key in sorted(stored)
            if key not in model and key != "save_counter"]
  return lines


@dataclasses.dataclass
class Restored:
  """What `restore_newest` restored (the checkpoint used) and the newer ones that failed."""
  step: int | None                    # None: no checkpoint on disk at all
  path: str | None
  unreadable: list[tuple[str, str]]   # (prefix, why), newest first
  index_names: str | None             # what the index calls newest (None: missing/damaged)
  # Prefixes of data files without their .index (orphaned_data), newest first.
  orphaned: list[str] = dataclasses.field(default_factory=list)


class CheckpointStore:
  """The checkpoints of one directory: restore the newest readable one, save, rotate.

  `restore_fn(prefix)` restores one checkpoint into the model; it raises
  `CheckpointMismatchError` (any exception type passed as `mismatch_error`) for a
  checkpoint of another model, and anything else counts as "cannot be read".
  `options` are passed to every save (`io_options`: all files written through one
  device, this process's, when variables live on other hosts).
  """

  def __init__(self, checkpoint: tf.train.Checkpoint, directory: str, max_to_keep: int,
               restore_fn: Callable[[str], None], mismatch_error: type[Exception],
               log: Callable[[str], None] = print,
               options: tf.train.CheckpointOptions | None = None):
    self.checkpoint = checkpoint
    self.options = options
    self.directory = directory
    self.max_to_keep = max_to_keep
    self.restore_fn = restore_fn
    self.mismatch_error = mismatch_error
    self.log = log
    self._manager: tf.train.CheckpointManager | None = None

  # -- restoring (reads only) --------------------------------------------------------

  def restore_newest(self, writer: str | None = None) -> Restored:
    """Restores the newest checkpoint that can be read; changes nothing on disk.

    `writer`: the trainer writing this directory now (a reader beside it: export,
    decode), if any; the newest checkpoint not yet readable is then the one it is
    writing, and is passed over with a note, not a warning that it is damaged.

    Raises `NoReadableCheckpointError` if checkpoints exist and none can be read (the
    run must not start from step 0 over them), and the caller's mismatch error for a
    checkpoint of another model.
    """
    with _tensorflow_warnings_off():
      state = tf.train.get_checkpoint_state(self.directory)
    index_names = state.model_checkpoint_path if state else None
    orphaned = orphaned_data(self.directory)
    for prefix in orphaned:
      self.log(f"warning: checkpoint {prefix} has data files but no .index, so it cannot "
               f"be read; training moves them to {UNREADABLE_DIR}/")
    unreadable: list[tuple[str, str]] = []
    for step, prefix in find(self.directory):
      try:
        self.restore_fn(prefix)
      except self.mismatch_error:
        raise
      except Exception as e:  # noqa: BLE001 - every other failure means "cannot be read"
        unreadable.append((prefix, first_line(e)))
        if writer is not None and len(unreadable) == 1:
          self.log(f"Checkpoint {prefix} is not readable yet: the trainer in this logdir "
                   f"({writer}) is writing it; using the next older one")
        else:
          self.log(f"warning: checkpoint {prefix} cannot be read ({first_line(e)}); "
                   "trying the next older one")
        continue
      return Restored(step, prefix, unreadable, index_names, orphaned)
    if unreadable:
      listed = "; ".join(f"{p}: {why}" for p, why in unreadable)
      raise NoReadableCheckpointError(
          f"none of the {len(unreadable)} checkpoints in {self.directory} can be read "
          f"({listed}); not starting from step 0 over them: move them elsewhere or use "
          "a new --logdir")
    return Restored(None, None, [], index_names, orphaned)

  # -- making the directory consistent (writes) ----------------------------------------

  def repair(self, found: Restored) -> None:
    """Sets aside what `restore_newest` could not read, removes interrupted saves, sets
    aside data files without their `.index` and makes the index list the checkpoints
    on disk; then saves may begin."""
    for prefix, _ in found.unreadable:
      aside = self._set_aside(os.path.basename(prefix) + ".")
      self.log(f"Moved the unreadable checkpoint {prefix} to {aside}/ (kept, not used)")
    for leftover in interrupted_saves(self.directory):
      shutil.rmtree(leftover, ignore_errors=True)
      self.log(f"Removed {leftover}, left by a save that did not finish")
    for name in _names(self.directory):
      if _INTERRUPTED_INDEX_WRITE.match(name):
        os.remove(os.path.join(self.directory, name))
        self.log(f"Removed {name}, left by an index write that did not finish")
    # Looked for again, after the interrupted saves are gone: a save killed between
    # moving its data into place and writing the .index leaves such files too.
    for prefix in orphaned_data(self.directory):
      aside = self._set_aside(os.path.basename(prefix) + ".data-")
      self.log(f"Moved the data files of checkpoint {prefix}, whose .index is missing, "
               f"to {aside}/ (kept, not used)")
    on_disk = sorted(find(self.directory))
    if on_disk and found.index_names != on_disk[-1][1]:
      index = os.path.join(self.directory, "checkpoint")
      was = ("damaged" if os.path.exists(index) and found.index_names is None
             else "missing" if found.index_names is None
             else f"naming {found.index_names}")
      prefixes = [prefix for _, prefix in on_disk]
      with _tensorflow_warnings_off():
        tf.compat.v1.train.update_checkpoint_state(
            self.directory, prefixes[-1], all_model_checkpoint_paths=prefixes,
            all_model_checkpoint_timestamps=[os.path.getmtime(p + ".index")
                                             for p in prefixes])
      self.log(f"Rewrote the checkpoint index {index} (it was {was}) from the files on "
               f"disk: {len(prefixes)} checkpoints, newest {prefixes[-1]}")
    self._manager = tf.train.CheckpointManager(
        self.checkpoint, self.directory, max_to_keep=self.max_to_keep,
        checkpoint_name=CHECKPOINT_NAME)

  def _set_aside(self, starting: str) -> str:
    """Moves the files of the directory whose names start with `starting` into
    `<dir>/unreadable/` (a name already there, set aside before at the same step, gets
    '.again' appended), and returns that folder."""
    aside = os.path.join(self.directory, UNREADABLE_DIR)
    os.makedirs(aside, exist_ok=True)
    for name in _names(self.directory):
      if name.startswith(starting):
        target = os.path.join(aside, name)
        while os.path.exists(target):
          target += ".again"
        os.replace(os.path.join(self.directory, name), target)
    return aside

  # -- saving ----------------------------------------------------------------------------

  @property
  def latest(self) -> str | None:
    """The newest complete checkpoint on disk."""
    return latest(self.directory)

  def save(self, step: int) -> str:
    """Writes `ckpt-<step>`; a failure removes its partial files and raises one line."""
    if self._manager is None:
      raise CheckpointError("save() before repair(): the directory was not checked")
    prefix = os.path.join(self.directory, f"{CHECKPOINT_NAME}-{step}")
    before = set(_names(self.directory))
    try:
      with stacked_variables.whole_stack_io():  # one read per stack, not per row
        return self._manager.save(checkpoint_number=step, options=self.options)
    except (tf.errors.OpError, OSError) as e:
      for name in set(_names(self.directory)) - before:
        if name.startswith(os.path.basename(prefix)):
          path = os.path.join(self.directory, name)
          shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
      raise CheckpointSaveError(
          f"could not write checkpoint {prefix}: {first_line(e)}; the last good "
          f"checkpoint is {self.latest or 'none (nothing was saved yet)'}; rerun the same "
          "command to resume from it once the cause is fixed") from None
