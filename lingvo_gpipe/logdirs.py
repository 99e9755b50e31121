"""What a logdir records about its run, checked before anything is written to it.

  <logdir>/params.txt                     the params of the newest run (`Params.to_text`)
  <logdir>/params.before_step_<N>.txt     the params a resumed run replaced at step N
  <logdir>/trainer.lock                   held (flock) by the one trainer writing here

Files are replaced atomically (`write_atomically`): a reader, or a run after a crash or
a full disk, sees the old text or the new one, never a mix or nothing.

A resumed run must be one its checkpoints can follow. Its model is checked by the
restore itself (a variable of another shape or name does not restore); its training
input is checked here: the checkpoints hold the input's position, which belongs to the
input the run started with (another batch size, seed, or example set has other
positions). Every other difference (max_steps, intervals, learning rate, eval input,
pipeline layout …) is fine and is reported as a note.
"""

from __future__ import annotations

import dataclasses
import datetime
import fcntl
import os
import re
import socket
import sys

from lingvo_gpipe import checkpoints
from lingvo_gpipe.core.hyperparams import Params

PARAMS_FILE = "params.txt"
LOCK_FILE = "trainer.lock"
# Keys of the training input that can change without invalidating its checkpointed
# position: where the prepared data lives.
_MOVABLE_INPUT_KEYS = frozenset({"train_input.data_dir"})
# Expected to differ on every resume (the trainer's --max_steps): neither noted nor
# a reason to keep the previous params.txt.
_EXPECTED_TO_CHANGE = frozenset({"task.train.max_steps"})
_ABSENT = "(absent)"


class LogdirError(ValueError):
  """A logdir that cannot be used; the message says which and why."""


class IncompatibleParamsError(LogdirError):
  pass


class LogdirInUseError(LogdirError):
  pass


class LogdirLock:
  """One trainer per logdir: an exclusive `flock` on <logdir>/trainer.lock.

  Two trainers writing one logdir would both save the same `ckpt-N` and overwrite each
  other's params.txt. The kernel releases the lock when its holder exits in any way
  (`kill -9` included), so a dead trainer never leaves the logdir stuck; the file stays,
  holding the last holder's description (pid, host, start time, command) for the error
  a second trainer gets.
  """

  def __init__(self, logdir: str):
    self.logdir = logdir
    self.path = os.path.join(logdir, LOCK_FILE)
    self._fd: int | None = None
    self._created: list[str] = []

  def acquire(self) -> None:
    """Takes the lock (creating the logdir if needed); raises LogdirInUseError naming
    the holder if another process has it."""
    _make_dirs(self.logdir, self._created)
    fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      holder = os.read(fd, 4096).decode(errors="replace").strip() or "a process starting up"
      os.close(fd)
      raise LogdirInUseError(
          f"logdir {self.logdir!r} is in use by another trainer ({holder}); two trainers "
          "in one logdir would overwrite each other's checkpoints: wait for it to end, "
          "stop it, or use another --logdir") from None
    started = datetime.datetime.now().isoformat(timespec="seconds")
    description = (f"pid {os.getpid()} on {socket.gethostname()} since {started}: "
                   f"{' '.join(sys.argv)}")
    os.ftruncate(fd, 0)
    os.pwrite(fd, description.encode() + b"\n", 0)
    self._fd = fd

  def release(self, remove_if_unused: bool = False) -> None:
    """Lets go of the lock. `remove_if_unused`: if `acquire` created the logdir and
    nothing but the lock file was written to it, both are removed (a run refused
    before it wrote leaves no trace)."""
    if self._fd is None:
      return
    if remove_if_unused and self._created and os.listdir(self.logdir) == [LOCK_FILE]:
      os.remove(self.path)
      for directory in reversed(self._created):
        os.rmdir(directory)
    os.close(self._fd)  # closing releases the flock
    self._fd = None


def write_atomically(path: str, text: str) -> None:
  """Replaces the file at `path` with `text` so that it is never missing nor partial:
  written to a temporary file beside it, flushed to disk, then renamed over it. A
  failure (a full disk) leaves the old file as it was and no temporary behind."""
  temporary = f"{path}.tmp{os.getpid()}"
  try:
    with open(temporary, "w") as f:
      f.write(text)
      f.flush()
      os.fsync(f.fileno())
    os.replace(temporary, path)
  except BaseException:
    if os.path.lexists(temporary):
      os.remove(temporary)
    raise


def check_writable(logdir: str, with_eval: bool = False) -> None:
  """Proves that <logdir>/train (and with `with_eval`, <logdir>/eval) can be created and
  written, leaving nothing behind: directories this check creates are removed again
  (the run creates them when it has been checked and writes its first file)."""
  for name in ("train", "eval") if with_eval else ("train",):
    _check_writable_dir(logdir, name)


def _make_dirs(path: str, created: list[str]) -> None:
  """Creates `path` and its missing parents, appending each directory it creates to
  `created` (outermost first) as it goes, so a caller can remove exactly those."""
  missing = []
  path = os.path.abspath(path)
  while not os.path.lexists(path) and os.path.dirname(path) != path:
    missing.append(path)
    path = os.path.dirname(path)
  for directory in reversed(missing):
    os.mkdir(directory)
    created.append(directory)


def _check_writable_dir(logdir: str, name: str) -> None:
  directory = os.path.join(os.path.abspath(logdir), name)
  created: list[str] = []
  probe = os.path.join(directory, f".write_probe_{os.getpid()}")
  try:
    _make_dirs(directory, created)
    try:
      with open(probe, "w") as f:
        f.write("ok")
    finally:
      if os.path.exists(probe):
        os.remove(probe)
  except OSError as e:
    raise LogdirError(f"logdir {logdir!r} is not writable: {e.strerror or e}") from None
  finally:
    for made in reversed(created):
      try:
        os.rmdir(made)
      except OSError:
        pass


def _leaves(text: str) -> dict[str, str]:
  """'a.b : value' lines → {'a.b': 'value'} (the value's text, compared as text)."""
  leaves = {}
  for line in text.splitlines():
    key, sep, value = line.partition(" : ")
    if sep:
      leaves[key.strip()] = value
  return leaves


@dataclasses.dataclass
class ParamsChange:
  """How a run's params differ from the logdir's params.txt: (key, old, new) triples."""
  fine: list[tuple[str, str, str]]
  incompatible: list[tuple[str, str, str]]

  @staticmethod
  def describe(changes: list[tuple[str, str, str]]) -> str:
    return "; ".join(f"{key}: {old} -> {new}" for key, old, new in changes)


def compare_params(logdir: str, params: Params) -> ParamsChange | None:
  """Compares `params` with <logdir>/params.txt; None if the logdir has none."""
  previous = read_params_text(logdir)
  if previous is None:
    return None
  old = _leaves(previous)
  new = _leaves(params.to_text())
  change = ParamsChange([], [])
  for key in sorted(old.keys() | new.keys()):
    before, after = old.get(key, _ABSENT), new.get(key, _ABSENT)
    if before == after or key in _EXPECTED_TO_CHANGE:
      continue
    follows = not key.startswith("train_input.") or key in _MOVABLE_INPUT_KEYS
    (change.fine if follows else change.incompatible).append((key, before, after))
  return change


def check_resumable(logdir: str, params: Params) -> list[tuple[str, str, str]]:
  """Raises IncompatibleParamsError if the checkpoints in `logdir` cannot follow
  `params`; returns the differences that are fine (for a note)."""
  change = compare_params(logdir, params)
  if change is None:
    return []
  if not checkpoints.find(os.path.join(logdir, "train")):
    return sorted(change.fine + change.incompatible)  # nothing to follow yet
  if change.incompatible:
    raise IncompatibleParamsError(
        f"these params differ from {os.path.join(logdir, PARAMS_FILE)}, which its "
        f"checkpoints were written with, and the checkpointed input position cannot "
        f"follow them: {ParamsChange.describe(change.incompatible)}. Use a new --logdir, "
        "or the params of params.txt")
  return change.fine


def _comparable(text: str) -> dict[str, str]:
  return {k: v for k, v in _leaves(text).items() if k not in _EXPECTED_TO_CHANGE}


def read_params_text(logdir: str) -> str | None:
  """The text of <logdir>/params.txt; None if there is none. Raises LogdirError if the
  path is there but holds no params text (a directory, binary data)."""
  path = os.path.join(logdir, PARAMS_FILE)
  try:
    with open(path, encoding="utf-8") as f:
      text = f.read()
  except FileNotFoundError:
    return None
  except (OSError, UnicodeDecodeError) as e:
    why = e.strerror if isinstance(e, OSError) else "not UTF-8 text"
    raise LogdirError(f"{path} cannot be read as params text ({why}); it records the "
                      "params of this logdir's checkpoints: restore it, or use a new "
                      "--logdir") from None
  if text and not _leaves(text):
    raise LogdirError(f"{path} holds no 'key : value' lines; it records the params of "
                      "this logdir's checkpoints: restore it, or use a new --logdir")
  return text


def write_params(logdir: str, params: Params, step: int) -> None:
  """Writes <logdir>/params.txt; a different one already there is kept beside it as
  params.before_step_<step>.txt, so the logdir records every params its checkpoints
  were written with."""
  path = os.path.join(logdir, PARAMS_FILE)
  for name in os.listdir(logdir):  # left by a trainer killed while writing one
    if re.fullmatch(r"params\S*\.txt\.tmp\d+", name):
      os.remove(os.path.join(logdir, name))
  text = params.to_text()
  previous = read_params_text(logdir)
  if previous == text:
    return
  if previous is not None and _comparable(previous) != _comparable(text):
    # Kept beside it first: if the new text then cannot be written, both are there.
    write_atomically(os.path.join(logdir, f"params.before_step_{step}.txt"), previous)
  write_atomically(path, text)
