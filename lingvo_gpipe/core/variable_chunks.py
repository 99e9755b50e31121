"""Per-variable work of a training step in traced chunks: one call per chunk, not ops
per variable.

A step touches every variable outside the layers too: the gradient's global norm,
the optimizer's update, the check that the updated weights and slots are finite.
Written op by op, that is a dozen graph ops per variable, and a deep model has
thousands of variables (what that cost in tracing: docs/benchmarks_history.md, "Layers
of one kind traced once (2026-11-23)"). Here the variables are cut into chunks
of one device, shape and dtype (at most `MAX_CHUNK`, in power-of-two sizes), and each
chunk is one call of a `tf.function` traced once per chunk size, shape and dtype:
tracing grows with the kinds of variable, the graph by one call per chunk.

  chunks(variables)                  → [[positions], ...]
  global_norm(tensors, variables)    → √(Σ ‖t‖²), each chunk summed on its device
  all_finite(variables)              → whether every floating variable is finite

(A pipeline cell's running gradient sums, one stacked tensor per shape and dtype, are
pipeline/gradient_sums.py's.)
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from lingvo_gpipe.core import stacked_variables
from lingvo_gpipe.core.tf_internals import NOT_INLINED

MAX_CHUNK = 32

# The chunks' functions stay calls at run time (NOT_INLINED): inlined, their ops would
# be back in the step's graph, and Grappler's time on it grows with them.
chunk_function = functools.partial(tf.function, autograph=False,
                                    experimental_attributes=NOT_INLINED)


def chunks(variables: Sequence[Any], by_device: bool = True) -> list[list[int]]:
  """Positions of `variables` grouped by (device, shape, dtype, whether stacked)
  (by_device=False: without the device) in first-seen order, each group cut into runs
  of at most MAX_CHUNK whose sizes are powers of two (so few distinct signatures get traced)."""
  groups: dict[tuple, list[int]] = {}
  for i, v in enumerate(variables):
    key = (v.device if by_device else None, tuple(v.shape.as_list()), v.dtype,
           stacked_variables.stack_of(v) is not None)
    groups.setdefault(key, []).append(i)
  out = []
  for positions in groups.values():
    while positions:
      size = min(MAX_CHUNK, 1 << (len(positions).bit_length() - 1))
      out.append(positions[:size])
      positions = positions[size:]
  return out


@chunk_function
def _sum_of_squares(tensors: list[tf.Tensor]) -> tf.Tensor:
  """float32 Σ‖t‖² of `tensors` (one dtype): 2·L2Loss, one pass over each tensor
  without the squared copy that Square + Sum writes (1.5 against 2.5 ms for 8M
  floats on one thread: docs/benchmarks_history.md, "The engine's own cost, change by
  change (2026-11-28)")."""
  return 2.0 * tf.add_n([tf.nn.l2_loss(tf.cast(t, tf.float32)) for t in tensors])


def global_norm(tensors: Sequence[Any], variables: Sequence[tf.Variable]) -> tf.Tensor:
  """float32 √(Σ ‖t‖²) of `tensors` (e.g. gradients; dense or IndexedSlices), each
  summed on the device of its variable in `variables` (aligned with `tensors`)."""
  tensors = [tf.convert_to_tensor(t) for t in tensors]
  if not tensors:
    return tf.constant(0.0)
  sums = []
  for chunk in chunks(variables):
    with tf.device(variables[chunk[0]].device):
      sums.append(_sum_of_squares([tensors[i] for i in chunk]))
  return tf.sqrt(tf.add_n(sums))


@chunk_function
def _all_finite(handles: list[tf.Tensor], dtype: tf.DType, shape: tuple[int, ...]
                ) -> tf.Tensor:
  """Whether the variables of `handles` (resource tensors of one dtype and shape) are
  finite: whether their sum is (a NaN or an infinity in a tensor makes its sum NaN or
  infinite), one reading pass without the boolean copy of IsFinite + All (half the
  time). A float32 sum overflows only past 3.4e38 (a million weights of order 1e32),
  and such weights count as broken too (the trainer's error says so). float16, whose
  sums overflow at 65504, is checked element by element.

  Handles, not the variables: a module-level tf.function keeps the variables
  it is first traced with, and so their buffers, alive for the process (a
  calibration's variables would stay in the trainer's memory); resource handles are
  traced by their spec, which does not hold the variable's shape: `shape` keys the
  trace (tests/variable_chunks_test.py pins both)."""
  values = [tf.raw_ops.ReadVariableOp(resource=h, dtype=dtype) for h in handles]
  if dtype == tf.float16:
    return tf.reduce_all(tf.stack([tf.reduce_all(tf.math.is_finite(v)) for v in values]))
  return tf.reduce_all(tf.math.is_finite(tf.stack([tf.reduce_sum(v) for v in values])))


def all_finite(variables: Sequence[tf.Variable]) -> tf.Tensor:
  """Whether every floating-point variable holds only finite values: a scalar bool,
  each chunk reduced on its own device so no weights move."""
  floating = [v for v in variables if v.dtype.is_floating]
  checks = []
  for chunk in chunks(floating):
    with tf.device(floating[chunk[0]].device):
      first = floating[chunk[0]]
      checks.append(_all_finite([floating[i].handle for i in chunk], first.dtype,
                                tuple(first.shape.as_list())))
  return tf.reduce_all(tf.stack(checks)) if checks else tf.constant(True)
