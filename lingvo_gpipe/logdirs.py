"""What a logdir records about its run, checked before anything is written to it.

  <logdir>/params.txt                     the params of the newest run (`Params.to_text`)
  <logdir>/params.before_step_<N>.txt     the params a resumed run replaced at step N

A resumed run must be one its checkpoints can follow. Its model is checked by the
restore itself (a variable of another shape or name does not restore); its training
input is checked here: the checkpoints hold the input's position, which belongs to the
input the run started with (another batch size, seed, or example set has other
positions). Every other difference (max_steps, intervals, learning rate, eval input,
pipeline layout …) is fine and is reported as a note.
"""

from __future__ import annotations

import dataclasses
import os

from lingvo_gpipe import checkpoints
from lingvo_gpipe.core.hyperparams import Params

PARAMS_FILE = "params.txt"
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


def check_writable(logdir: str) -> None:
  """Proves that <logdir>/train can be created and written, leaving nothing behind:
  directories this check creates are removed again (the run creates them when it has
  been checked and writes its first file)."""
  train_dir = os.path.join(os.path.abspath(logdir), "train")
  missing = []
  path = train_dir
  while not os.path.lexists(path) and os.path.dirname(path) != path:
    missing.append(path)
    path = os.path.dirname(path)
  created: list[str] = []
  probe = os.path.join(train_dir, f".write_probe_{os.getpid()}")
  try:
    for directory in reversed(missing):
      os.mkdir(directory)
      created.append(directory)
    try:
      with open(probe, "w") as f:
        f.write("ok")
    finally:
      if os.path.exists(probe):
        os.remove(probe)
  except OSError as e:
    raise LogdirError(f"logdir {logdir!r} is not writable: {e.strerror or e}") from None
  finally:
    for directory in reversed(created):
      try:
        os.rmdir(directory)
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
  path = os.path.join(logdir, PARAMS_FILE)
  try:
    with open(path) as f:
      old = _leaves(f.read())
  except FileNotFoundError:
    return None
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


def write_params(logdir: str, params: Params, step: int) -> None:
  """Writes <logdir>/params.txt; a different one already there is kept beside it as
  params.before_step_<step>.txt, so the logdir records every params its checkpoints
  were written with."""
  path = os.path.join(logdir, PARAMS_FILE)
  text = params.to_text()
  try:
    with open(path) as f:
      previous = f.read()
  except FileNotFoundError:
    previous = None
  if previous == text:
    return
  if previous is not None and _comparable(previous) != _comparable(text):
    os.replace(path, os.path.join(logdir, f"params.before_step_{step}.txt"))
  temporary = path + ".tmp"
  with open(temporary, "w") as f:
    f.write(text)
  os.replace(temporary, path)
