"""Hyperparameter containers: `Params` and `InstantiableParams`.

Every layer, input generator, optimizer and task in lingvo_gpipe is described by a
`Params` tree before anything is built. A tree can be printed as text (one sorted
`a.b.c : value` line per leaf), overridden from text (`from_text`, or the trainer's
`--params_override`), copied, and frozen so that a built object cannot be changed
behind its back.

Keys are Python identifiers. Nested keys are addressed with dots (`task.train.lr`);
a list of nested `Params` (e.g. the layers of a sequential container) is addressed
with an index (`body.layers[2].output_dim`).
"""

from __future__ import annotations

import ast
import copy as copy_lib
import difflib
import importlib
import numbers
import re
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import tensorflow as tf

_INDEXED_KEY = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)\[(\d+)\]$")
_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class ParamsError(ValueError):
  """Raised for an unknown key, a bad value or a change to frozen params."""


# `define`'s marker for "no `before` given: the default".
_DEFAULT = object()


class _Param:
  """One named value with its description, and the kind of value its default declares
  (bool, int, float or str; None for anything else, which any value may replace).
  `convert`, if given, maps every value assigned (the default too) to the form kept,
  e.g. an object to the config that its text dump can write and read back."""

  def __init__(self, name: str, default: Any, description: str, kind: type | None = None,
               convert: Callable[[Any], Any] | None = None, before: Any = None):
    self.name = name
    self.convert = convert
    self.value = default if convert is None or default is None else convert(default)
    self.description = description
    self.kind = kind if kind is not None else _declared_kind(default)
    # The value a run had before this param existed: what a params text written then,
    # which lacks it, means (`Params.value_before`).
    self.before = before
    # Whether its default is None ("not set"): then a text "None" sets None whatever it
    # holds now (a float set by an override, read back from a params.txt of None).
    self.may_be_none = default is None

  def __deepcopy__(self, memo):
    # Classes, dtypes and functions are shared; everything else is copied.
    copied = _Param(self.name, copy_lib.deepcopy(self.value, memo), self.description,
                    self.kind, self.convert, copy_lib.deepcopy(self.before, memo))
    copied.may_be_none = self.may_be_none
    return copied

  def admits(self, value: Any) -> bool:
    """Whether `value` is of the declared kind (None always is: "not set")."""
    if self.kind is None or value is None:
      return True
    if self.kind is bool:
      return isinstance(value, (bool, np.bool_))
    if isinstance(value, (bool, np.bool_)):
      return False
    if self.kind is int:
      return isinstance(value, numbers.Integral)
    if self.kind is float:
      return isinstance(value, numbers.Real)
    return isinstance(value, self.kind)


def _a(noun: str) -> str:
  return f"an {noun}" if noun[0] in "aeiou" else f"a {noun}"


def _declared_kind(default: Any) -> type | None:
  for kind in (bool, int, float, str):  # bool first: it is an int too
    if type(default) is kind:
      return kind
  return None


def _is_class(value: Any) -> bool:
  return isinstance(value, type)


def _class_to_text(cls: type) -> str:
  return f"{cls.__module__}.{cls.__qualname__}"


# Where the classes of older params texts live now: old module (or class) path prefix →
# new one. A params.txt records each class by its module path, so a move would
# otherwise orphan the logdirs written before it (tests/pipeline_compat_test.py).
MOVED_CLASSES = {
    "lingvo_gpipe.core.gpipe.": "lingvo_gpipe.pipeline.layer.",
    "lingvo_gpipe.core.schedules.": "lingvo_gpipe.core.lr_schedules.",
    # (after the line above: the base class was the constant schedule)
    "lingvo_gpipe.core.lr_schedules.Schedule": "lingvo_gpipe.core.lr_schedules.Constant",
}


def _class_from_text(text: str) -> type:
  """Imports `package.module.ClassName` (a nested qualname is allowed); a path of an
  older version (MOVED_CLASSES) is read as where the class lives now."""
  for old, new in MOVED_CLASSES.items():
    if text.startswith(old):
      text = new + text[len(old):]
  parts = text.split(".")
  for split in range(len(parts) - 1, 0, -1):
    module_name = ".".join(parts[:split])
    try:
      obj: Any = importlib.import_module(module_name)
    except ImportError:
      continue
    try:
      for attr in parts[split:]:
        obj = getattr(obj, attr)
    except AttributeError:
      break
    if isinstance(obj, type):
      return obj
  raise ValueError(f"{text!r} does not name an importable class")


def _value_to_text(value: Any) -> str:
  """Renders a leaf value so that `_value_from_text` can read it back."""
  if isinstance(value, tf.dtypes.DType):
    return value.name
  if _is_class(value):
    return _class_to_text(value)
  if callable(value) and hasattr(value, "__qualname__"):
    return f"{value.__module__}.{value.__qualname__}"
  return repr(value)


def _literal(text: str) -> Any:
  try:
    return ast.literal_eval(text)
  except (ValueError, SyntaxError) as e:
    raise ValueError(f"{text!r} is not a Python literal") from e


def _value_from_text(text: str, existing: Any) -> Any:
  """Parses `text` as a value of the same type as `existing`."""
  text = text.strip()
  if existing is None:
    # No type to go by: a literal if it is one, otherwise the string itself.
    try:
      return ast.literal_eval(text)
    except (ValueError, SyntaxError):
      return text
  if isinstance(existing, bool):
    lowered = text.lower()
    if lowered == "true":
      return True
    if lowered == "false":
      return False
    raise ValueError(f"{text!r} is not a bool (use true or false)")
  if isinstance(existing, int):
    value = _literal(text)
    if isinstance(value, bool) or not isinstance(value, int):
      raise ValueError(f"{text!r} is not an int")
    return value
  if isinstance(existing, float):
    value = _literal(text)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
      raise ValueError(f"{text!r} is not a float")
    return float(value)
  if isinstance(existing, str):
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
      return _literal(text)
    try:
      literal = ast.literal_eval(text)
    except (ValueError, SyntaxError):
      return text  # a bare word: the string itself
    if literal is None or isinstance(literal, str):
      return literal  # (None: "not set", as check_types takes it)
    raise ValueError(f"{text!r} is a {type(literal).__name__}, not a str (quote it, "
                     f"'{text}', if you mean the text)")
  if isinstance(existing, tf.dtypes.DType):
    name = text[3:] if text.startswith("tf.") else text
    try:
      return tf.dtypes.as_dtype(name)
    except TypeError as e:
      raise ValueError(f"{text!r} is not a TensorFlow dtype") from e
  if _is_class(existing):
    return _class_from_text(text)
  for container in (list, tuple, dict):
    if isinstance(existing, container):
      value = _literal(text)
      if container is tuple and isinstance(value, list):
        value = tuple(value)
      if container is list and isinstance(value, tuple):
        value = list(value)
      if not isinstance(value, container):
        raise ValueError(f"{text!r} is not a {container.__name__}")
      return value
  raise ValueError(f"cannot parse a value of type {type(existing).__name__} from text")


def _type_name(value: Any) -> str:
  if isinstance(value, tf.dtypes.DType):
    return "dtype"
  if _is_class(value):
    return "class"
  return type(value).__name__


class Params:
  """A tree of named hyperparameters.

  Example:
    p = Params()
    p.define('dim', 8, 'Width of the layer.')
    p.set(dim=16).set(**{'init.scale': 0.1})
  """

  def __init__(self):
    object.__setattr__(self, "_params", {})
    object.__setattr__(self, "_frozen", False)

  # -- definition and access -------------------------------------------------

  def define(self, name: str, default: Any, description: str,
             convert: Callable[[Any], Any] | None = None, before: Any = _DEFAULT) -> None:
    """Adds a new hyperparameter `name` with a default value and a description.
    `convert`: applied to every value set other than None (it raises ParamsError for
    a value it cannot take), e.g. to keep a Keras layer as its config.
    `before`: what the library did before this param existed, which a params text
    written then (an older run's params.txt, lacking the key) means
    (`value_before`). By default the default: a param is added with the default that
    keeps what the code did; a param whose default does not must say so here."""
    self._check_not_frozen(name)
    if not _IDENTIFIER.match(name):
      raise ParamsError(f"param name {name!r} is not a valid identifier")
    if name in self._params:
      raise ParamsError(f"param {name!r} is already defined")
    param = _Param(name, default, description, convert=convert)
    param.before = copy_lib.deepcopy(param.value if before is _DEFAULT else before)
    self._params[name] = param

  def value_before(self, key: str) -> Any:
    """The value of (dotted) `key` in a run made before its param existed: the
    `before` its define gave, or else its default (`define`)."""
    node, leaf = self._resolve(key)
    return copy_lib.deepcopy(node._params[leaf].before)

  def __getattr__(self, name: str) -> Any:
    params = object.__getattribute__(self, "_params")
    if name.startswith("__") or name == "_params":
      raise AttributeError(name)
    if name not in params:
      raise AttributeError(self._unknown_key_message(name))
    return params[name].value

  def __setattr__(self, name: str, value: Any) -> None:
    self._check_not_frozen(name)
    if name not in self._params:
      raise AttributeError(self._unknown_key_message(name))
    param = self._params[name]
    param.value = value if param.convert is None or value is None else param.convert(value)

  def __contains__(self, name: str) -> bool:
    return name in self._params

  def __len__(self) -> int:
    return len(self._params)

  def __eq__(self, other: object) -> bool:
    if not isinstance(other, Params):
      return False
    return type(self) is type(other) and self._as_comparable() == other._as_comparable()

  def _as_comparable(self) -> dict:
    return {k: v.value for k, v in self._params.items()}

  def __repr__(self) -> str:
    return self.to_text()

  def _closest_hint(self, name: str) -> str:
    close = difflib.get_close_matches(name, list(self._params), n=3, cutoff=0.5)
    return f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""

  def _unknown_key_message(self, name: str) -> str:
    return f"unknown param {name!r}{self._closest_hint(name)}"

  def _check_not_frozen(self, name: str) -> None:
    if self._frozen:
      raise ParamsError(f"cannot set {name!r}: these params are frozen; use copy()")

  def _resolve(self, dotted: str) -> tuple[Params, str]:
    """Returns (the Params that holds the leaf, the leaf name) for `a.b[1].c`."""
    parts = dotted.split(".")
    node: Params = self
    for depth, part in enumerate(parts):
      match = _INDEXED_KEY.match(part) if depth < len(parts) - 1 else None
      key, index = (match.group(1), int(match.group(2))) if match else (part, None)
      if key not in node._params:
        where = f" (no {key!r} at that level)" if key != dotted else ""
        raise ParamsError(f"unknown param {dotted!r}{where}{node._closest_hint(key)}")
      if depth == len(parts) - 1:
        return node, key
      child = node._params[key].value
      if index is not None:
        if not isinstance(child, (list, tuple)) or index >= len(child):
          raise ParamsError(f"{dotted!r}: {key!r} has no element {index}")
        child = child[index]
      if not isinstance(child, Params):
        raise ParamsError(f"{dotted!r}: {part!r} is not nested Params")
      node = child
    raise AssertionError("unreachable")

  def get(self, name: str) -> Any:
    """Returns the value of `name`, which may be dotted (`a.b.c`) or indexed."""
    node, leaf = self._resolve(name)
    return node._params[leaf].value

  def set(self, **kwargs: Any) -> Params:
    """Sets values by name (dotted names through `**{'a.b': v}`); returns self."""
    for name, value in kwargs.items():
      node, leaf = self._resolve(name)
      setattr(node, leaf, value)
    return self

  def check_types(self, prefix: str = "") -> None:
    """Raises ParamsError naming the first leaf whose value is not of the kind its
    default declares (a number where a str is taken, a str or a bool where a number
    is, a number where a bool is); None is taken everywhere."""
    for name, param in self._params.items():
      key = f"{prefix}{name}"
      values = param.value if isinstance(param.value, (list, tuple)) else [param.value]
      if all(isinstance(v, Params) for v in values) and values:
        for i, child in enumerate(values):
          child.check_types(f"{key}[{i}]." if param.value is not child else f"{key}.")
      elif not param.admits(param.value):
        raise ParamsError(f"{key}={param.value!r} is {_a(type(param.value).__name__)}; "
                          f"this key takes {_a(param.kind.__name__)}")

  def description(self, name: str) -> str:
    node, leaf = self._resolve(name)
    return node._params[leaf].description

  # -- copy and freeze --------------------------------------------------------

  def copy(self) -> Params:
    """Returns a deep, unfrozen copy."""
    clone = copy_lib.deepcopy(self)
    clone._unfreeze_tree()
    return clone

  def __deepcopy__(self, memo):
    clone = self.__class__.__new__(self.__class__)
    object.__setattr__(clone, "_params", copy_lib.deepcopy(self._params, memo))
    object.__setattr__(clone, "_frozen", self._frozen)
    for name, value in self.__dict__.items():
      if name not in ("_params", "_frozen"):
        object.__setattr__(clone, name, copy_lib.deepcopy(value, memo))
    return clone

  def _walk_nested(self) -> Iterator[Params]:
    yield self
    for param in self._params.values():
      values = param.value if isinstance(param.value, (list, tuple)) else [param.value]
      for value in values:
        if isinstance(value, Params):
          yield from value._walk_nested()

  def _unfreeze_tree(self) -> None:
    for node in self._walk_nested():
      object.__setattr__(node, "_frozen", False)

  def freeze(self) -> Params:
    """Makes this tree read-only (nested Params included); returns self."""
    for node in self._walk_nested():
      object.__setattr__(node, "_frozen", True)
    return self

  @property
  def is_frozen(self) -> bool:
    return self._frozen

  # -- iteration and text -----------------------------------------------------

  def iter_params(self) -> Iterator[tuple[str, Any]]:
    """Yields (name, value) for the top-level params, in definition order."""
    for name, param in self._params.items():
      yield name, param.value

  def __iter__(self) -> Iterator[tuple[str, Any]]:
    return self.iter_params()

  def flatten(self, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Yields (dotted key, leaf value) for every leaf of the tree."""
    for name, value in self._params.items():
      value = value.value
      key = f"{prefix}{name}"
      if isinstance(value, Params):
        yield from value.flatten(key + ".")
      elif isinstance(value, (list, tuple)) and value and all(
          isinstance(v, Params) for v in value):
        for i, item in enumerate(value):
          yield from item.flatten(f"{key}[{i}].")
      else:
        yield key, value

  def to_text(self) -> str:
    """One `a.b.c : value` line per leaf, sorted by key."""
    lines = [f"{key} : {_value_to_text(value)}" for key, value in self.flatten()]
    return "\n".join(sorted(lines)) + "\n"

  def from_text(self, text: str) -> Params:
    """Sets leaves from `key : value` lines (or `key=value`); returns self.

    Each value is parsed by the type of the value it replaces. Blank lines and
    lines starting with '#' are ignored.
    """
    for line in text.splitlines():
      line = line.strip()
      if not line or line.startswith("#"):
        continue
      self.set_from_text(*_split_assignment(line))
    return self

  def set_from_text(self, key: str, value_text: str) -> None:
    """Sets one (possibly dotted) key from its text form."""
    node, leaf = self._resolve(key)
    existing = node._params[leaf].value
    if isinstance(existing, Params):
      raise ParamsError(f"{key!r} is nested Params; set its fields ({key}.FIELD) instead")
    if value_text.strip() == "None" and node._params[leaf].may_be_none:
      setattr(node, leaf, None)
      return
    try:
      value = _value_from_text(value_text, existing)
    except ValueError as e:
      raise ParamsError(
          f"bad value for {key!r} (expected {_type_name(existing)}): {e}") from None
    setattr(node, leaf, value)


def _split_assignment(line: str) -> tuple[str, str]:
  """Splits `key : value` or `key = value` at the first separator."""
  match = re.match(r"^\s*([A-Za-z0-9_.\[\]]+)\s*[:=]\s?(.*)$", line)
  if not match:
    raise ParamsError(f"cannot parse {line!r}; expected 'key : value' or 'key=value'")
  return match.group(1), match.group(2)


def parse_overrides(text: str) -> list[tuple[str, str]]:
  """Splits `a.b=1;c.d="x;y"` into [(key, value_text), ...].

  Semicolons inside quotes or brackets do not split.
  """
  pieces, current, quote, depth = [], [], None, 0
  for char in text:
    if quote:
      current.append(char)
      if char == quote:
        quote = None
      continue
    if char in "'\"":
      quote = char
    elif char in "([{":
      depth += 1
    elif char in ")]}":
      depth -= 1
    if char == ";" and depth == 0:
      pieces.append("".join(current))
      current = []
      continue
    current.append(char)
  pieces.append("".join(current))
  result = []
  for piece in pieces:
    if piece.strip():
      if "=" not in piece:
        raise ParamsError(f"override {piece.strip()!r} has no '='; use key=value")
      key, value = piece.split("=", 1)
      result.append((key.strip(), value.strip()))
  return result


class InstantiableParams(Params):
  """Params that know the class they build: `p.instantiate()` is `p.cls(p)`."""

  def __init__(self, cls: type | None = None):
    super().__init__()
    self.define("cls", cls, "The class this params builds.")

  def instantiate(self, **kwargs: Any) -> Any:
    """Builds `self.cls` from a frozen copy of these params."""
    if self.cls is None:
      raise ParamsError("cannot instantiate: 'cls' is not set")
    params_fn = getattr(self.cls, "Params", None)
    if callable(params_fn):
      own = {name for name, _ in self.iter_params()}
      missing = sorted(name for name, _ in params_fn().iter_params() if name not in own)
      if missing:  # e.g. an override that set `cls` alone: SGD's params given to Adam
        raise ParamsError(
            f"these params lack {missing}, which {self.cls.__name__}.Params() defines: "
            f"their cls was set to {self.cls.__name__} without its params; start from "
            f"{self.cls.__name__}.Params() instead")
    return self.cls(self.copy().freeze(), **kwargs)



class Instantiable:
  """Base of everything built from params: layers, optimizers, learning-rate schedules,
  inputs.

    p = SomeClass.Params()    # InstantiableParams with SomeClass's defaults
    p.some_key = ...
    obj = p.instantiate()     # SomeClass(frozen copy of p)

  The constructor refuses params that are not frozen: an object keeps its params, and
  a later edit of them would change what it reports without changing what it built.
  """

  @classmethod
  def Params(cls) -> InstantiableParams:  # noqa: N802 (Lingvo's spelling, reads as a constructor)
    return InstantiableParams(cls)

  def __init__(self, params: InstantiableParams, **kwargs: Any):
    if not isinstance(params, Params) or not params.is_frozen:
      raise ParamsError(f"{type(self).__name__} must be built from frozen params: use "
                        f"{type(self).__name__}.Params().instantiate() (or params.freeze())")
    super().__init__(**kwargs)
