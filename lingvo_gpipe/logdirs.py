"""What a logdir records about its run, checked before anything is written to it.

  <logdir>/params.txt                     the params of the newest run (`Params.to_text`)
  <logdir>/params.before_step_<N>.txt     the params a resumed run replaced at step N
  <logdir>/trainer.lock                   held (flock) by the one trainer writing here

Files are replaced atomically (`write_atomically`): a reader, or a run after a crash or
a full disk, sees the old text or the new one, never a mix or nothing.

A resumed run must be one its checkpoints can follow. Each param that differs from
params.txt falls in one row of RESUME_RULES (docs/trainer.md, "Resuming"):

  allowed                       how the step runs (task.pipeline.*: K, splits,
                                placement, schedule, micro-batches, recompute, token
                                slices, replicas), compute dtype float32 ↔ bfloat16,
                                the training loop's settings, the eval input,
                                the training input's data_dir and autotune
  allowed with a consequence    float16 ↔ another compute dtype: the dynamic loss
                                scale (float16's only) starts at its initial value,
                                or is dropped
  refused                       the training input (the checkpoints hold its
                                position, which belongs to the input they started
                                with), and freezing or unfreezing a layer (a Keras
                                unit's trainable, a BatchNorm's frozen: a frozen
                                weight has no optimizer slots): refused here,
                                before anything is written
  checked by the restore        everything else (the model's dimensions, layers,
                                vocabulary, optimizer): a variable of another shape
                                or name does not restore, and the restore names the
                                first; a change of no variable (a dropout rate)
                                trains on

params.txt is read strictly: a line that is not `key : value`, or a value that does
not parse as its key's type, is an error naming the line; `set_params_aside` (the
trainer's --reset_params) moves a damaged one out of the way. Its last line is the
SHA-256 of the lines above (`stamped`): one changed since it was written is refused
(`check_written_whole`). A param an older version's params.txt lacks takes what the
code did before it existed (`params_added_since`).
"""

from __future__ import annotations

import dataclasses
import datetime
import fcntl
import hashlib
import os
import re
import socket
import sys
import time

from lingvo_gpipe import checkpoints
from lingvo_gpipe.core.hyperparams import Params, ParamsError

PARAMS_FILE = "params.txt"
LOCK_FILE = "trainer.lock"
# Expected to differ on every resume (the trainer's --max_steps): neither noted nor
# a reason to keep the previous params.txt.
_EXPECTED_TO_CHANGE = frozenset({"task.train.max_steps"})
_ABSENT = "(absent)"
# The last line of a params.txt the trainer writes: the SHA-256 of the lines above it.
_STAMP = "# sha256 of the lines above: "

ALLOWED = "allowed"
CONSEQUENCE = "allowed with a consequence"
REFUSED = "refused"
CHECKED = "checked by the restore"


@dataclasses.dataclass(frozen=True)
class ResumeRule:
  """Changes of the keys `keys` (a regular expression matching the whole key) fall in
  row `verdict`, for the reason `why`."""
  keys: str
  verdict: str
  why: str


# The first rule whose keys match a changed key decides (the module docstring's table).
RESUME_RULES = (
    ResumeRule(r"train_input\.data_dir", ALLOWED, "where the prepared data lives"),
    ResumeRule(r"train_input\.autotune", ALLOWED, "how tf.data runs the input, not what "
               "it gives: the same batches in the same order"),
    ResumeRule(r"train_input\..*", REFUSED, "the checkpoints hold the training input's "
               "position, which belongs to the input they were written with"),
    ResumeRule(r"task\.pipeline\..*", ALLOWED, "how the step runs, not what it trains: a "
               "checkpoint keeps each weight under its own key, whatever the cells, "
               "placement, schedule, micro-batches or replicas"),
    ResumeRule(r"task(\..*)?\.fprop_dtype", ALLOWED, "the compute dtype: the weights and "
               "optimizer slots stay in their own dtype"),
    ResumeRule(r"task\.train\.optimizer\.cls", CHECKED, "another optimizer has other slots"),
    ResumeRule(r"task\.train\..*", ALLOWED, "the training loop's settings"),
    ResumeRule(r"eval_input\..*", ALLOWED, "evaluation only reads the checkpoints"),
    ResumeRule(r".*", CHECKED, "a variable of another shape or name does not restore; a "
               "change of no variable trains on"),
)
_FLOAT16_RULE = ResumeRule("", CONSEQUENCE, "float16 alone keeps a dynamic loss scale: "
                           "it starts at its initial value, or is dropped")
_FREEZING_RULE = ResumeRule("", REFUSED, "a frozen weight has no optimizer slots, so "
                            "freezing or unfreezing a layer changes the optimizer's "
                            "variables, which the checkpoints cannot restore into; train "
                            "the new phase in a new logdir")
_TRAINABLE = re.compile(r"'trainable': (True|False)")


def resume_rule(key: str, old: str, new: str) -> ResumeRule:
  """The row of RESUME_RULES a change of `key` from `old` to `new` (their text) falls in."""
  rule = next(r for r in RESUME_RULES if re.fullmatch(r.keys, key))
  if key.endswith(".frozen") or (key.endswith(".layer") and _TRAINABLE.findall(old)
                                 != _TRAINABLE.findall(new)):
    return _FREEZING_RULE  # (a Keras unit's config, or a BatchNorm's frozen)
  if rule.keys.endswith("fprop_dtype") and "float16" in (old + new).replace("bfloat16", ""):
    return _FLOAT16_RULE
  return rule


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
      _flock_exclusive(fd)
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


# How long `acquire` retries a lock held by someone: `lock_holder`'s shared probe (an
# export or decode asking whether a trainer runs) holds it for microseconds, a trainer
# for its whole run.
_PROBE_GRACE_S = 1.0


def _flock_exclusive(fd: int) -> None:
  """An exclusive flock on `fd`, retried for _PROBE_GRACE_S so that a probe's moment of
  holding it is not taken for a trainer; raises BlockingIOError if it stays held."""
  deadline = time.monotonic() + _PROBE_GRACE_S
  while True:
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      return
    except BlockingIOError:
      if time.monotonic() >= deadline:
        raise
      time.sleep(0.05)


def lock_holder(logdir: str) -> str | None:
  """The description of the trainer holding `logdir`'s lock now (pid, host, start,
  command), or None when no trainer holds it. Takes nothing: a shared probe of the
  flock, let go at once."""
  path = os.path.join(logdir, LOCK_FILE)
  try:
    fd = os.open(path, os.O_RDONLY)
  except OSError:
    return None
  try:
    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
  except BlockingIOError:
    return os.read(fd, 4096).decode(errors="replace").strip() or "a trainer starting up"
  else:
    fcntl.flock(fd, fcntl.LOCK_UN)
    return None
  finally:
    os.close(fd)


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


def params_leaves(text: str, path: str = PARAMS_FILE) -> dict[str, str]:
  """'a.b : value' lines → {'a.b': 'value'} (the value's text, compared as text).
  Raises LogdirError naming the first line that is not one (blank lines aside)."""
  leaves = {}
  for number, line in enumerate(text.splitlines(), 1):
    if not line.strip() or line.startswith(_STAMP):
      continue
    key, sep, value = line.partition(" : ")
    if not sep or not re.fullmatch(r"[A-Za-z0-9_.\[\]]+", key.strip()):
      raise LogdirError(f"{path} line {number} is not 'key : value': {line[:80]!r}; it "
                        "records the params of this logdir's checkpoints: restore it, or "
                        "set it aside with --reset_params (the restore still checks the "
                        "model against the checkpoint)")
    leaves[key.strip()] = value
  return leaves


@dataclasses.dataclass
class ParamsChange:
  """How a run's params differ from the logdir's params.txt: (key, old, new, rule) per
  differing key, in key order."""
  changes: list[tuple[str, str, str, ResumeRule]]
  has_checkpoints: bool = True

  def of(self, verdict: str) -> list[tuple[str, str, str, ResumeRule]]:
    return [c for c in self.changes if c[3].verdict == verdict]

  def describe(self, separator: str = "\n  ", first: str | None = None) -> str:
    """'key: old -> new (verdict: why)' per change, joined by `separator` (and led
    by it, unless `first` says otherwise)."""
    lead = separator if first is None else first
    return lead + separator.join(f"{key}: {old} -> {new} ({rule.verdict}: {rule.why})"
                                 for key, old, new, rule in self.changes)


def stamped(text: str) -> str:
  """`text` (Params.to_text) with its stamp: a last line holding the SHA-256 of the lines
  above, so that a reader can tell a params.txt the trainer wrote whole from one
  edited since (`check_written_whole`)."""
  return f"{text}{_STAMP}{hashlib.sha256(text.encode()).hexdigest()}\n"


def unstamped(text: str) -> str:
  """`text` without its stamp line (if it has one)."""
  return "".join(line for line in text.splitlines(True) if not line.startswith(_STAMP))


def check_written_whole(text: str, path: str) -> None:
  """Raises LogdirError if the params text `text` (read from `path`) has a stamp that
  its lines no longer match: edited since it was written (a line deleted would read as
  a param added since, taking what the code did before it existed). A text without a
  stamp was written before stamps (or by hand): taken as it is."""
  stamps = [line for line in text.splitlines() if line.startswith(_STAMP)]
  if stamps and stamps[-1][len(_STAMP):].strip() != hashlib.sha256(
      unstamped(text).encode()).hexdigest():
    raise LogdirError(f"{path} was changed since the trainer wrote it (its last line's "
                      "checksum no longer matches its lines); it records the params of this "
                      "logdir's checkpoints: restore it, or set it aside with --reset_params "
                      "(the restore still checks the model against the checkpoint)")


def params_added_since(params: Params, text_leaves: dict[str, str]
                       ) -> list[tuple[str, object]]:
  """[(key, the value it had before it existed)] for each leaf of `params` that an
  older version's params text (its leaves `text_leaves`) lacks while holding the
  params around it: a param added since, whose absence means what the code did then
  (`Params.value_before`: its default, unless its define says otherwise). A leaf whose
  enclosing params the text lacks as well (a layer more in a list) is not one: the
  model's structure changed, which the restore checks."""
  prefixes = set()
  for key in text_leaves:
    parts = key.split(".")
    prefixes.update(".".join(parts[:n]) for n in range(1, len(parts)))
  added = []
  for key, _ in params.flatten():
    parent = key.rpartition(".")[0]
    if key in text_leaves or (parent and parent not in prefixes):
      continue
    added.append((key, params.value_before(key)))
  return added


def take_params_added_since(params: Params, text: str, path: str,
                            keep: frozenset[str] = frozenset()) -> list[str]:
  """Sets on `params` (unfrozen) each param added since the params text `text` (read
  from `path`) was written to the value it had before it existed (params_added_since),
  but the keys in `keep` (set explicitly, e.g. by --params_override); returns
  'key = value' for each that changed a value of `params`, for the log."""
  check_written_whole(text, path)
  changed = []
  for key, before in params_added_since(params, params_leaves(text, path)):
    if key in keep or repr(params.get(key)) == repr(before):
      continue
    params.set(**{key: before})
    changed.append(f"{key} = {before!r}")
  return changed


def compare_params(logdir: str, params: Params) -> ParamsChange | None:
  """Compares `params` with <logdir>/params.txt; None if the logdir has none. Raises
  LogdirError if params.txt is damaged: a line that is not `key : value`, or a value
  of a key `params` has that does not parse as that key's type."""
  path = os.path.join(logdir, PARAMS_FILE)
  previous = read_params_text(logdir)
  if previous is None:
    return None
  old = params_leaves(previous, path)
  new = params_leaves(params.to_text())
  _check_values(old, new, params, path)
  check_written_whole(previous, path)  # (after what names a damaged line)
  has_checkpoints = bool(checkpoints.find(os.path.join(logdir, "train")))
  change = ParamsChange([], has_checkpoints)
  # (A param added since params.txt was written, at the value it had before it existed,
  # is no change: the run goes on as it trained.)
  as_before = {key for key, value in params_added_since(params, old)
               if repr(params.get(key)) == repr(value)}
  for key in sorted(old.keys() | new.keys()):
    before, after = old.get(key, _ABSENT), new.get(key, _ABSENT)
    if before == after or key in _EXPECTED_TO_CHANGE or key in as_before:
      continue
    change.changes.append((key, before, after, resume_rule(key, before, after)))
  return change


def _check_values(old: dict[str, str], new: dict[str, str], params: Params,
                  path: str) -> None:
  """Each changed value of params.txt parses as its key's type, where the key's value
  in `params` round-trips through text (numbers, bools, strings, lists, dtypes)."""
  probe = params.copy()
  for key, value in old.items():
    if key not in new or new[key] == value:
      continue
    try:
      probe.set_from_text(key, value)
    except (ParamsError, AttributeError, KeyError) as e:
      try:
        probe.set_from_text(key, new[key])
      except (ParamsError, AttributeError, KeyError):
        continue  # a value text cannot give back (an object): compared as text only
      raise LogdirError(f"{path}: '{key} : {value[:80]}' is not a value of that key: "
                        f"{str(e).splitlines()[0]}; restore params.txt, or set it aside "
                        "with --reset_params") from None


def check_resumable(logdir: str, params: Params) -> ParamsChange | None:
  """Raises IncompatibleParamsError if the checkpoints in `logdir` cannot follow
  `params` (a refused row of RESUME_RULES); returns how the params differ from
  params.txt (None without one), for the trainer's note."""
  change = compare_params(logdir, params)
  if change is None or not change.has_checkpoints:
    return change  # nothing to follow yet
  refused = change.of(REFUSED)
  if refused:
    raise IncompatibleParamsError(
        f"these params differ from {os.path.join(logdir, PARAMS_FILE)}, which its "
        "checkpoints were written with, and a resume cannot follow them: "
        + ParamsChange(refused).describe(separator="; ", first="") + ". Use a new --logdir, or the "
        "params of params.txt")
  return change


def _comparable(text: str) -> dict[str, str]:
  return {k: v for k, v in params_leaves(text).items() if k not in _EXPECTED_TO_CHANGE}


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
                      "params of this logdir's checkpoints: restore it, set it aside with "
                      "--reset_params, or use a new --logdir") from None
  if not text.strip():
    raise LogdirError(f"{path} holds no 'key : value' lines; it records the params of "
                      "this logdir's checkpoints: restore it, set it aside with "
                      "--reset_params, or use a new --logdir")
  return text


def set_params_aside(logdir: str) -> str | None:
  """Renames <logdir>/params.txt to params.txt.set_aside_<time> (kept, not deleted) so a
  run can go on without it; returns the new path (None if there was none)."""
  path = os.path.join(logdir, PARAMS_FILE)
  if not os.path.lexists(path):
    return None
  aside = f"{path}.set_aside_{datetime.datetime.now():%Y%m%d_%H%M%S}"
  os.rename(path, aside)
  return aside


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
  if previous is not None and unstamped(previous) == text and previous != text:
    return  # (the same params, stamped)
  before = os.path.join(logdir, f"params.before_step_{step}.txt")
  if (previous is not None and _comparable(previous) != _comparable(text)
      and not os.path.exists(before)):
    # Kept beside it first: if the new text then cannot be written, both are there. One
    # that exists (a second resume at this step, none of whose checkpoints came) holds
    # the params the checkpoints up to `step` were written with: it stays.
    write_atomically(before, previous)
  write_atomically(path, stamped(text))
