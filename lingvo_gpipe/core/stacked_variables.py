"""A pipeline cell's weights stored as a few stacked variables, checkpointed per layer.

A deep pipeline made one `tf.Variable` per weight and optimizer slot (with Adam, three
per weight). Each cost eager creation, a captured handle in the training step, an
argument Grappler and the executor set up, and host memory (what that came to:
docs/benchmarks_history.md, "A cell's weights stacked per shape (2026-11-25)"). Here the
trainable weights of one cell that share a shape and dtype are rows of one variable
[n, *shape] (`VariableStack`), and each optimizer slot kind is one variable of the
same shape: the step's variables grow with the cells and the kinds of weight, not
with the layers.

What the layers and the user see is unchanged:

- each layer attribute is a `RowVariable`, a view of its row: readable as a tensor
  (`tf.convert_to_tensor`, arithmetic, `numpy()`), assignable, named as the variable
  it stands for;
- a checkpoint saves each row under the layer's own key (`.../w/.ATTRIBUTES/
  VARIABLE_VALUE`) and restores it into its row (Trackable's `_serialize_to_tensors`
  / `_restore_from_tensors`), so checkpoints of unstacked models restore into stacked
  ones and back; the stacks themselves are not checkpointed;
- `tf.Module.variables` lists the stacks (they are held in a plain list the module
  walks but does not track).

Inside a cell's traced bodies, `bound(stacks)` reads each stack once and splits it
into its rows (dim-0 slices share the stack's buffer where rows keep the
allocator's alignment: tf_internals item 11); each RowVariable
then reads as its row's tensor, which is what a cell differentiates against, so
each row's gradient is added into its row of the cell's running sums
(`gradient_sums.StackedLayout`), and the sums of a stack are the stack's gradient.

  with deferred(): build layers       → trainable floating variables as unbound rows
  stack(rows, name)                   → [VariableStack], one per (shape, dtype)
  with bound(stacks): trace a cell    → rows read as slices of one read per stack
  stack_of(variable)                  → the VariableStack a tf.Variable holds, or None
  with whole_stack_io(): save/restore → one read / one write per stack, not per row
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import tensorflow as tf
from tensorflow.python.trackable import base as trackable

_STATE = threading.local()


class RowVariable(trackable.Trackable):
  """Row `row` of a VariableStack, standing in for one variable of a layer.

  Made unbound by `BaseLayer.create_variable` under `deferred()` (holding its initial
  value's recipe), bound to its stack by `stack`.
  """

  def __init__(self, name: str, shape: Sequence[int], dtype: tf.DType, trainable: bool,
               initial_value: Callable[[], tf.Tensor] | None = None):
    self._name = name
    self._shape = tf.TensorShape(shape)
    self._dtype = tf.as_dtype(dtype)
    self._trainable = trainable
    self._initial_value = initial_value
    self._stack: VariableStack | None = None
    self._row = -1

  # -- what a variable tells about itself -------------------------------------------

  @property
  def name(self) -> str:
    return f"{self._name}:0"

  @property
  def shape(self) -> tf.TensorShape:
    return self._shape

  @property
  def dtype(self) -> tf.DType:
    return self._dtype

  @property
  def trainable(self) -> bool:
    return self._trainable

  @property
  def stack(self) -> VariableStack:
    if self._stack is None:
      raise RuntimeError(f"{self._name}: a deferred variable read before its stack was made")
    return self._stack

  @property
  def row(self) -> int:
    return self._row

  @property
  def device(self) -> str:
    return self.stack.variable.device

  def ref(self) -> RowVariable:
    """Hashable identity, as tf.Variable.ref() (a row is its own key)."""
    return self

  def __repr__(self) -> str:
    where = f"row {self._row} of {self._stack.variable.name}" if self._stack else "unbound"
    return f"<RowVariable {self._name!r} shape={self._shape} dtype={self._dtype.name} ({where})>"

  # -- reading and writing -----------------------------------------------------------

  def value(self) -> tf.Tensor:
    """The row as a tensor: the slice `bound` made in the graph being traced (or in a
    graph enclosing it: a cond or loop body inside a cell captures it), else one
    read of the row."""
    bindings = getattr(_STATE, "bindings", None)
    if bindings:
      graph = tf.compat.v1.get_default_graph()
      while graph is not None:
        for frame_graph, frame in reversed(bindings):
          if frame_graph is graph and id(self) in frame:
            return frame[id(self)]
        graph = getattr(graph, "outer_graph", None)
    return tf.gather(self.stack.variable, self._row)

  read_value = value

  def numpy(self) -> Any:
    return self.value().numpy()

  def _update(self, method: str, value: Any, read_value: bool) -> Any:
    """stack.<method>(value as this row) (scatter_update / _add / _sub); then the row
    as it is after, or the update op."""
    io = _whole_stack_io()
    if io is not None:
      # A restore of this stack still pending would be written after this update,
      # over it: it is written first.
      io.apply_restores(self.stack)
      io.forget(self.stack)
    value = tf.convert_to_tensor(value, self._dtype)
    if not value.shape.is_compatible_with(self._shape):
      raise ValueError(f"{self._name}: cannot assign a value of shape {value.shape} to a "
                       f"variable of shape {self._shape}")
    op = getattr(self.stack.variable, method)(
        tf.IndexedSlices(tf.reshape(value, [1, *self._shape.as_list()]), [self._row]))
    if not read_value:
      return op
    with tf.control_dependencies([op]):
      return tf.gather(self.stack.variable, self._row)

  def assign(self, value: Any, use_locking: bool = False, name: str | None = None,
             read_value: bool = True) -> Any:
    """As tf.Variable.assign: writes `value` (this row's shape) into the row; returns
    the row's new value (read_value) or the update."""
    del use_locking, name
    return self._update("scatter_update", value, read_value)

  def assign_add(self, delta: Any, use_locking: bool = False, name: str | None = None,
                 read_value: bool = True) -> Any:
    del use_locking, name
    return self._update("scatter_add", delta, read_value)

  def assign_sub(self, delta: Any, use_locking: bool = False, name: str | None = None,
                 read_value: bool = True) -> Any:
    del use_locking, name
    return self._update("scatter_sub", delta, read_value)

  # -- checkpoints: saved and restored under the layer's own key ----------------------

  def _serialize_to_tensors(self) -> dict[str, tf.Tensor]:
    io = _whole_stack_io()
    if io is not None:
      return {trackable.VARIABLE_VALUE_KEY: io.row_value(self)}
    return {trackable.VARIABLE_VALUE_KEY: self.value()}

  def _restore_from_tensors(self, restored_tensors: dict[str, tf.Tensor]) -> Any:
    value = restored_tensors[trackable.VARIABLE_VALUE_KEY]
    io = _whole_stack_io()
    if io is not None:
      return io.defer_restore(self, value)
    return self.assign(value, read_value=False)

  # -- used as a tensor: every operator a tf.Tensor overloads, on the row's value
  # (as tf.Variable; == and != stay identity, so a row is its own hashable key) -------

  __iter__ = None  # not iterable (without it, __getitem__ would make it so)


def _overload(operator: str) -> None:
  tensor_operator = getattr(tf.Tensor, operator)

  def run_on_value(row, *args, **kwargs):
    return tensor_operator(row.value(), *args, **kwargs)

  functools.update_wrapper(run_on_value, tensor_operator)
  setattr(RowVariable, operator, run_on_value)


for _operator in tf.Tensor.OVERLOADABLE_OPERATORS - {"__eq__", "__ne__"}:
  _overload(_operator)


def _row_to_tensor(row: RowVariable, dtype: tf.DType | None = None, name: str | None = None,
                   as_ref: bool = False) -> tf.Tensor:
  """As a tf.Variable converts: to its own dtype only (a half-precision layer casts
  its weights itself, `BaseLayer.to_fprop_dtype`)."""
  del name
  if as_ref:
    raise ValueError(f"{row.name}: a row of a stacked variable has no reference to take")
  if dtype is not None and not row.dtype.is_compatible_with(dtype):
    raise ValueError(f"Incompatible type conversion requested to type {dtype.name!r} for "
                     f"variable {row.name!r} of type {row.dtype.name!r}")
  return row.value()


tf.register_tensor_conversion_function(RowVariable, _row_to_tensor)


class VariableStack:
  """One tf.Variable [n, *shape] holding rows `rows` (RowVariables of one shape and
  dtype), row i of the variable being rows[i]."""

  def __init__(self, variable: tf.Variable, rows: Sequence[RowVariable]):
    self.variable = variable
    self.rows = list(rows)
    for i, row in enumerate(self.rows):
      row._stack, row._row = self, i
    variable._variable_stack = self  # noqa: SLF001 (read back by stack_of)

  def rows_like(self, variable: tf.Variable, suffix: str) -> VariableStack:
    """A stack of `variable` (e.g. an optimizer slot [n, *shape'] of this stack) whose
    rows are named after this one's: row i '<row i's name>/<suffix>'."""
    rows = [RowVariable(f"{row.name.removesuffix(':0')}/{suffix}", variable.shape[1:],
                        variable.dtype, trainable=False) for row in self.rows]
    return VariableStack(variable, rows)


def stack_of(variable: Any) -> VariableStack | None:
  """The VariableStack `variable` (a tf.Variable) holds, or None."""
  return getattr(variable, "_variable_stack", None)


def stack_of_row(variable: Any) -> VariableStack | None:
  """The VariableStack whose row `variable` is (a bound RowVariable), or None."""
  return variable._stack if isinstance(variable, RowVariable) else None


def trainable_weights(module: tf.Module) -> list[Any]:
  """`module.trainable_variables` with each stacked variable replaced by its rows:
  one entry per weight, in the order tf.Module lists an unstacked model's variables
  (so the lists of a stacked and an unstacked build of one model align)."""
  return list(module._flatten(predicate=lambda x: (  # noqa: SLF001 (tf.Module's walk)
      (isinstance(x, RowVariable) and x.trainable)
      or (isinstance(x, tf.Variable) and x.trainable and stack_of(x) is None))))


def weights_of(variables: Sequence[tf.Variable]) -> list[Any]:
  """Each variable's weights, in order: a stack's rows, any other variable itself."""
  return [w for v in variables
          for w in (stack_of(v).rows if stack_of(v) is not None else [v])]


def per_weight(weights: Sequence[Any], variables: Sequence[Any], values: Sequence[Any]
               ) -> list[Any]:
  """`values` aligned with `variables` (tf.Variables, stacks among them: e.g. their
  gradients, or numpy arrays) → aligned with `weights` (RowVariables and tf.Variables):
  a row's value is row i of its stack's, taken on the row's device; None for a
  weight none of `variables` holds. The one place a stack's value is split by row."""
  by_ref = {v.ref(): x for v, x in zip(variables, values, strict=True)}
  out = []
  for w in weights:
    stack = stack_of_row(w)
    value = by_ref.get((stack.variable if stack is not None else w).ref())
    if value is not None and stack is not None:
      with tf.device(w.device):
        value = value[w.row]
    out.append(value)
  return out


@contextlib.contextmanager
def deferred(enabled: bool = True, kept_whole: Sequence[str] = ()) -> Iterator[None]:
  """Within (this thread), `BaseLayer.create_variable` makes unbound RowVariables for
  trainable floating-point variables, to be stacked by `stack`; except those whose
  path ends in '/' + one of `kept_whole`, or lies below it (a Keras unit's `tie_to`
  names the unit): variables other layers tie to (BaseLayer.tie_variable), which cells
  on other devices read, stay variables of their own."""
  previous = getattr(_STATE, "deferred", False), getattr(_STATE, "kept_whole", ())
  _STATE.deferred, _STATE.kept_whole = enabled, tuple(kept_whole)
  try:
    yield
  finally:
    _STATE.deferred, _STATE.kept_whole = previous


def deferring(path: str | None = None) -> bool:
  """Whether a variable (at `path`, if given) is made a row to stack now."""
  if not getattr(_STATE, "deferred", False):
    return False
  return path is None or not any(path.endswith("/" + k) or f"/{k}/" in path
                                 for k in getattr(_STATE, "kept_whole", ()))


def stack(rows: Sequence[RowVariable], name: str, keys: Sequence[Any] | None = None
          ) -> list[VariableStack]:
  """One VariableStack per (shape, dtype) of `rows` (in first-seen order, rows in
  their order), created on the current device with each row's own initial value;
  with `keys` (one hashable per row), one per (shape, dtype, key): e.g. the weight's
  place in its kind of layer, so that a run of layers of one kind finds each weight's
  rows side by side in a stack of their own (pipeline/layer_function.py)."""
  groups: dict[tuple, list[RowVariable]] = {}
  for i, row in enumerate(rows):
    groups.setdefault((tuple(row.shape.as_list()), row.dtype,
                       keys[i] if keys is not None else None), []).append(row)
  stacks = []
  for i, group in enumerate(groups.values()):
    variable = tf.Variable(lambda g=group: tf.stack([r._initial_value() for r in g]),
                           trainable=True, name=f"{name}/stack_{i}", dtype=group[0].dtype)
    stacks.append(VariableStack(variable, group))
    for row in group:
      row._initial_value = None
  return stacks


class _WholeStackIO:
  """Checkpoint reads and writes of rows, one op per stack (`whole_stack_io`)."""

  def __init__(self):
    self._rows: dict[int, list[tf.Tensor]] = {}  # id(stack) → its rows, read once
    self._restores: dict[int, tuple[VariableStack, dict[int, tf.Tensor]]] = {}

  def row_value(self, row: RowVariable) -> tf.Tensor:
    stack = row.stack
    if id(stack) not in self._rows:
      self._rows[id(stack)] = tf.unstack(stack.variable.read_value())
    return self._rows[id(stack)][row.row]

  def forget(self, stack: VariableStack) -> None:
    """`stack` was written: its rows are read again when next asked."""
    self._rows.pop(id(stack), None)

  def defer_restore(self, row: RowVariable, value: Any) -> None:
    _, values = self._restores.setdefault(id(row.stack), (row.stack, {}))
    values[row.row] = tf.convert_to_tensor(value, row.dtype)
    self.forget(row.stack)

  def apply_restores(self, only: VariableStack | None = None) -> None:
    """Each stack with pending restores (or only `only`) written once: whole if every
    row was restored, else its restored rows by one scatter."""
    keys = list(self._restores) if only is None else [id(only)]
    for key in keys:
      if key not in self._restores:
        continue
      stack, values = self._restores.pop(key)
      rows = sorted(values)
      update = tf.stack([values[i] for i in rows])
      if len(rows) == len(stack.rows):
        stack.variable.assign(update)
      else:
        stack.variable.scatter_update(tf.IndexedSlices(update, tf.constant(rows)))


def _whole_stack_io() -> _WholeStackIO | None:
  """The active `whole_stack_io`, when executing eagerly (a traced save or restore
  makes graph ops per row, which cost nothing per call)."""
  io = getattr(_STATE, "whole_stack_io", None)
  return io if io is not None and tf.executing_eagerly() else None


@contextlib.contextmanager
def whole_stack_io() -> Iterator[None]:
  """Within, an eager checkpoint save reads each stack once (one unstack, each row's
  key given its slice) and a restore writes each stack once, when the block ends.

  Outside, a row is read (saved) by a gather of its own and written (restored) by a
  scatter of its own: one eager op per row, which at 24,576 rows (512 layers of 16
  weights, with Adam's two slots) costs seconds per save and restore (docs/
  benchmarks.md). Each row keeps its own checkpoint key either way. Within the block a
  row reads as before its restore until the block ends.
  """
  outer = getattr(_STATE, "whole_stack_io", None)
  if outer is not None:
    yield
    return
  io = _WholeStackIO()
  _STATE.whole_stack_io = io
  try:
    yield
  finally:
    _STATE.whole_stack_io = None
    io.apply_restores()


def _frame() -> dict | None:
  """The binding frame of the graph being traced (or of a graph enclosing it)."""
  bindings = getattr(_STATE, "bindings", None)
  graph = tf.compat.v1.get_default_graph()
  while bindings and graph is not None:
    for frame_graph, frame in reversed(bindings):
      if frame_graph is graph:
        return frame
    graph = getattr(graph, "outer_graph", None)
  return None


def whole_read(stack: VariableStack) -> tf.Tensor:
  """Within `bound`, a read of `stack` [n, *shape] of its own, made once per binding:
  for layers that take their rows as slices of it (a loop over a run of layers,
  pipeline/layer_function.py). Not the read `bound` splits into rows, so a cell that
  differentiates against both gets each use's gradient once (`whole_reads`)."""
  frame = _frame()
  if frame is None:
    return stack.variable.read_value()
  key = ("whole", id(stack))
  if key not in frame:
    with tf.name_scope("stack_whole"):
      frame[key] = stack.variable.read_value()
  return frame[key]


def whole_reads(frame: dict) -> dict[int, tf.Tensor]:
  """{id(VariableStack): its `whole_read`} of the binding `frame` (what `bound`
  yielded)."""
  return {key[1]: t for key, t in frame.items() if isinstance(key, tuple)}


@contextlib.contextmanager
def bound(stacks: Sequence[VariableStack]) -> Iterator[dict[int, tf.Tensor]]:
  """Within, the rows of `stacks` read (in the current graph) as slices of one read
  of each stack. Yields {id(row): tensor}: what a cell differentiates against."""
  frame: dict[int, tf.Tensor] = {}
  for s in stacks:
    with tf.name_scope("stack_rows"):
      for row, tensor in zip(s.rows, tf.unstack(s.variable.read_value())):
        frame[id(row)] = tensor
  bindings = _STATE.__dict__.setdefault("bindings", [])
  bindings.append((tf.compat.v1.get_default_graph(), frame))
  try:
    yield frame
  finally:
    bindings.pop()
