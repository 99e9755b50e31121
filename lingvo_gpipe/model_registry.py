"""Registry of model param classes, keyed `<file>.<ClassName>`.

A param file is a Python module whose classes are decorated with `@register`; the
key of `class TinyConvNet` in `params/demo.py` is `demo.TinyConvNet`.

The repository's `params/` directory (installed as the package `lingvo_gpipe_params`)
is always loaded. Param files elsewhere are loaded from the paths given to
`load_param_files` (the trainer's `--params_path`) and from the environment variable
`LINGVO_GPIPE_PARAMS_PATH`; each entry, separated by ':', is a .py file or a
directory whose .py files are all loaded.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import inspect
import os
import pkgutil
import sys
import traceback
import zlib
from collections.abc import Iterable
from pathlib import Path

import tensorflow as tf

from lingvo_gpipe.base_model_params import SingleTaskModelParams

BUILTIN_PACKAGE = "lingvo_gpipe_params"
USER_PACKAGE = "lingvo_gpipe_user_params"
PATH_ENV = "LINGVO_GPIPE_PARAMS_PATH"

_REGISTRY: dict[str, type] = {}


class ModelNotFoundError(KeyError):
  def __str__(self) -> str:
    return str(self.args[0])


class ParamFileError(ImportError):
  """A param file that cannot be loaded; the message names the file, line and error."""


def _defined_in(cls: type) -> str:
  module = sys.modules.get(cls.__module__)
  return getattr(module, "__file__", None) or cls.__module__


def register(cls: type) -> type:
  """Class decorator: registers `cls` as `<file>.<ClassName>`.

  Two files of the same name defining the same class name would claim one key; the
  second is refused rather than silently replacing the first (a user's `demo.py` must
  not shadow the built-in `demo.TinyConvNet`).
  """
  if not (isinstance(cls, type) and issubclass(cls, SingleTaskModelParams)):
    raise TypeError(f"{cls!r} must subclass SingleTaskModelParams to be registered")
  key = f"{cls.__module__.rsplit('.', 1)[-1]}.{cls.__name__}"
  existing = _REGISTRY.get(key)
  if existing is not None and (existing.__module__, existing.__qualname__) != (
      cls.__module__, cls.__qualname__):
    raise ValueError(f"model key {key!r} is already defined by {_defined_in(existing)}; "
                     "rename this file or this class")
  _REGISTRY[key] = cls
  return cls


def _where(error: BaseException, path: Path) -> str:
  """'line N' of `path` where `error` arose, or '' if not inside it."""
  if isinstance(error, SyntaxError) and error.lineno:
    return f"line {error.lineno}"
  frames = [f for f in traceback.extract_tb(error.__traceback__) if f.filename == str(path)]
  return f"line {frames[-1].lineno}" if frames else ""


def _load_file(path: Path) -> None:
  # One module per file path; its last name component is the file stem, so the keys
  # of its classes are `<stem>.<ClassName>` wherever the file lives.
  path = path.resolve()
  name = f"{USER_PACKAGE}.p{zlib.crc32(str(path).encode()):08x}.{path.stem}"
  if name in sys.modules:
    return
  spec = importlib.util.spec_from_file_location(name, path)
  if spec is None or spec.loader is None:
    raise ImportError(f"cannot load param file {path}")
  module = importlib.util.module_from_spec(spec)
  sys.modules[name] = module
  try:
    spec.loader.exec_module(module)
  except SystemExit as e:  # would end the trainer, with exit code 0 for sys.exit(0)
    del sys.modules[name]
    where = _where(e, path)
    raise ParamFileError(f"param file {path}{', ' + where if where else ''} does not "
                         f"load: it calls sys.exit({e.code!r})") from None
  except Exception as e:
    del sys.modules[name]
    where = _where(e, path)
    message = e.msg if isinstance(e, SyntaxError) else str(e)
    raise ParamFileError(f"param file {path}{', ' + where if where else ''} does not "
                         f"load: {type(e).__name__}: {message}") from e
  except BaseException:
    del sys.modules[name]
    raise


def load_param_files(paths: Iterable[str] = ()) -> None:
  """Imports the built-in param files, then `paths` and $LINGVO_GPIPE_PARAMS_PATH, in a
  scratch `tf.Graph` (as `get_params` runs them): a module-level Keras model is built
  there without running an op, so devices can still be set up after."""
  with tf.Graph().as_default():
    _load_param_files(paths)


def _load_param_files(paths: Iterable[str]) -> None:
  package = importlib.import_module(BUILTIN_PACKAGE)
  for info in pkgutil.iter_modules(package.__path__):
    importlib.import_module(f"{BUILTIN_PACKAGE}.{info.name}")
  extra = [p for p in os.environ.get(PATH_ENV, "").split(":") if p]
  for entry in [*paths, *extra]:
    path = Path(entry).expanduser()
    if path.is_dir():
      for file in sorted(path.glob("*.py")):
        if file.name != "__init__.py":
          _load_file(file)
    elif path.is_file() and path.suffix == ".py":
      _load_file(path)
    else:
      raise FileNotFoundError(f"param path {entry!r} is neither a .py file nor a directory")


def where_in_param_files(error: BaseException) -> str | None:
  """'<file>, line <n>' of the innermost frame of `error`'s traceback that lies in a
  loaded param file (a user's or a built-in one), or None: where in their own code a
  user should look."""
  files = {getattr(module, "__file__", None) for name, module in list(sys.modules.items())
           if name.startswith((f"{USER_PACKAGE}.", f"{BUILTIN_PACKAGE}."))}
  frames = [f for f in traceback.extract_tb(error.__traceback__) if f.filename in files]
  return f"{frames[-1].filename}, line {frames[-1].lineno}" if frames else None


def keys() -> list[str]:
  return sorted(_REGISTRY)


def describe(key: str) -> str:
  """One line for `key`: the first line of its class's docstring, and '(needs
  --data_dir)' when its training input reads prepared TFDS data."""
  model = get_class(key)
  doc = (inspect.getdoc(model) or "").split("\n")[0].strip() or "(no description)"
  try:
    train_input = get_params(key).train_input
  except Exception as e:  # noqa: BLE001 (a param file's own code: anything; the rest list)
    why = (str(e).strip().splitlines() or [""])[0][:120]
    return f"{doc} (its params fail to build: {type(e).__name__}: {why})"
  needs_data = train_input is not None and "data_dir" in train_input
  return f"{doc} (needs --data_dir)" if needs_data else doc


def get_class(key: str) -> type:
  """The registered class for `key`; an unknown key names the closest ones."""
  if key not in _REGISTRY:
    close = difflib.get_close_matches(key, list(_REGISTRY), n=3, cutoff=0.4)
    hint = f"; closest: {', '.join(close)}" if close else ""
    raise ModelNotFoundError(f"unknown model {key!r}{hint} (list them with --mode=list_models)")
  return _REGISTRY[key]


def get_params(key: str):
  """The full model Params tree (task, train_input, eval_input) for `key`. A model whose
  params call sys.exit raises ParamFileError (it would end the caller).

  The param file's code runs in a scratch `tf.Graph`: building params runs no
  TensorFlow op, so the caller can still set up devices after (a Keras model built for
  `from_keras` creates its weights there as graph nodes, allocating nothing)."""
  model = get_class(key)
  try:
    with tf.Graph().as_default():
      return model().model_params()
  except SystemExit as e:
    raise ParamFileError(f"model {key}: building its params calls sys.exit({e.code!r}) "
                         f"(in {inspect.getsourcefile(model)})") from None
