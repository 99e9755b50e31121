"""A pipeline cell's running gradient sums: one stacked tensor per shape and dtype.

  StackedLayout(variables)   one tensor per variable ⇄ one stacked tensor per shape
                             and dtype (a stacked variable's rows: a tensor of their
                             own, the stack's gradient), added to in place

A cell's device loop carries its sums as these few tensors, not one loop variable per
variable (cell_function.py, device_loop.py).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import tensorflow as tf

from lingvo_gpipe.core import stacked_variables, tf_internals


@tf.function(autograph=False)  # inlined where called: a cell's backward runs it per action
def _add_rows(stacked: tf.Tensor, tensors: list[Any], shape: tuple[int, ...]) -> tf.Tensor:
  """stacked [n, *shape] + tensors (n of `shape`, None: nothing): one copy of
  `stacked`, then each tensor added into its row of the copy in place, the last row
  first (tf.raw_ops.InplaceAdd writes into its input's buffer whoever else holds it:
  tf_internals item 10; the copy is held by nothing else)."""
  if all(t is None for t in tensors):
    return stacked
  stacked = tf.raw_ops.DeepCopy(x=stacked)
  for row in reversed(range(len(tensors))):
    if tensors[row] is not None:
      stacked = tf.raw_ops.InplaceAdd(x=stacked, i=[row],
                                      v=tf.reshape(tensors[row], [1, *shape]))
  return stacked


@tf.function(autograph=False)
def _unstack_rows(stacked: tf.Tensor) -> list[tf.Tensor]:
  return tf.unstack(stacked)


class StackedLayout:
  """Where each of `variables`' tensors (a cell's running gradient sums) lives: one
  tensor [n, *shape] per shape and dtype, row i the i-th variable of that shape; the
  rows of a stacked variable (stacked_variables.RowVariable) in a tensor of their own,
  in their stack's order, so that tensor is the stack's gradient. A
  pipeline's device loop carries a cell's sums as these few tensors instead of one
  loop variable per variable (whose plumbing through the loop and its branches was
  most of the cost of tracing a deep cell).

  `add` copies a stacked tensor once, then adds each gradient into its row of the copy
  in place (tf.raw_ops.InplaceAdd), the variables' rows in reverse order, as a
  backward makes their gradients, so each gradient is freed once added. Packed into
  one flat vector per dtype (`s + concat(gradients)`), the end of every backward held
  all its gradients, their packed copy and the sums at once, about three
  weight-sized buffers, which set the peak of re-materialized steps
  (docs/benchmarks_history.md, "Mixed precision (2026-11-25)").
  """

  def __init__(self, variables: Sequence[Any]):
    self.shapes = [tuple(v.shape.as_list()) for v in variables]
    self._variables = list(variables)
    groups: dict[tuple, list[int]] = {}
    for i, v in enumerate(variables):
      stack = stacked_variables.stack_of_row(v)
      groups.setdefault((self.shapes[i], v.dtype, id(stack) if stack else None), []).append(i)
    # per group: (positions, shape, dtype, the VariableStack whose rows they are, or None)
    self._groups = []
    for (shape, dtype, _), positions in groups.items():
      stack = stacked_variables.stack_of_row(variables[positions[0]])
      if stack is not None and [variables[i] for i in positions] != stack.rows:
        raise ValueError(f"{stack.variable.name}: a layout needs all its rows in order")
      self._groups.append((positions, shape, dtype, stack))

  def specs(self) -> list[tf.TensorSpec]:
    return [tf.TensorSpec([len(positions), *shape], dtype)
            for positions, shape, dtype, _ in self._groups]

  def zeros(self, zero: tf.Tensor) -> list[tf.Tensor]:
    """The sums before a step's first gradient, filled with `zero`
    (tf_internals.runtime_zero: not a constant the step's function would hold)."""
    return [tf_internals.zeros(spec.shape, spec.dtype, zero) for spec in self.specs()]

  def add(self, stacked: Sequence[tf.Tensor], tensors: Sequence[Any],
          stack_tensors: dict[int, tf.Tensor] | None = None, zeros: Collection[int] = ()
          ) -> list[tf.Tensor]:
    """stacked + one tensor (or None: nothing) per variable, + stack_tensors[id(stack)]
    (a stack's whole [n, *shape], where given) (`stacked` unchanged). `zeros`: the
    positions in `stacked` of tensors known to be zeros; where a stack's whole gradient
    is the only one given for such a tensor, it is that tensor's sum as it is (no add:
    one weight-sized pass less)."""
    out = []
    for p, (s, (positions, shape, _, stack)) in enumerate(zip(stacked, self._groups)):
      whole = (stack_tensors or {}).get(id(stack)) if stack is not None else None
      rows = [tensors[i] for i in positions]
      if whole is not None and p in zeros and all(t is None for t in rows):
        whole.set_shape(s.shape)  # (a loop variable keeps its shape)
        out.append(whole)
        continue
      if whole is not None:
        s = s + whole
      out.append(_add_rows(s, rows, shape))
    return out

  def positions_of(self, stacks: Collection[Any]) -> frozenset[int]:
    """The positions of these stacked variables' tensors (VariableStacks; where a
    stack's whole gradient can become the sum: `add`'s `zeros`)."""
    ids = {id(s) for s in stacks}
    return frozenset(p for p, (_, _, _, stack) in enumerate(self._groups)
                     if stack is not None and id(stack) in ids)

  def by_variable(self, stacked: Sequence[tf.Tensor]) -> list[tuple[tf.Variable, tf.Tensor]]:
    """The stacked tensors → (tf.Variable, its tensor) pairs: a stacked variable's
    whole tensor [n, *shape] once, every other variable's row."""
    out = []
    for s, (positions, _, _, stack) in zip(stacked, self._groups):
      if stack is not None:
        out.append((stack.variable, s))
      else:
        out.extend(zip([self._variables[i] for i in positions], _unstack_rows(s)))
    return out
