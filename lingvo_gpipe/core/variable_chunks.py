"""Per-variable work of a training step in traced chunks: one call per chunk, not ops
per variable.

A step touches every variable outside the layers too: the gradient's global norm,
the optimizer's update, the check that the updated weights and slots are finite.
Written op by op, that is a dozen graph ops per variable, and a deep model has
thousands of variables: for `lm.Transformer48`'s shape (773 variables) these ops were
about 7.5 of the 22 s spent tracing the step. Here the variables are cut into chunks
of one device, shape and dtype (at most `MAX_CHUNK`, in power-of-two sizes), and each
chunk is one call of a `tf.function` traced once per chunk size, shape and dtype:
tracing grows with the kinds of variable, the graph by one call per chunk.

  chunks(variables)                  → [[positions], ...]
  global_norm(tensors, variables)    → √(Σ ‖t‖²), each chunk summed on its device
  all_finite(variables)              → whether every floating variable is finite
  zeros_like(variables)              → a zero tensor per variable, on its device
  scaled(tensors, variables, scale)  → tensor · scale, each on its variable's device
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from lingvo_gpipe.pipeline.tf_internals import NOT_INLINED

MAX_CHUNK = 32

# The chunks' functions stay calls at run time (NOT_INLINED): inlined, their ops would
# be back in the step's graph, and Grappler's time on it grows with them.
chunk_function = functools.partial(tf.function, autograph=False,
                                    experimental_attributes=NOT_INLINED)


def chunks(variables: Sequence[Any]) -> list[list[int]]:
  """Positions of `variables` grouped by (device, shape, dtype) in first-seen order,
  each group cut into runs of at most MAX_CHUNK whose sizes are powers of two (so few
  distinct signatures get traced)."""
  groups: dict[tuple, list[int]] = {}
  for i, v in enumerate(variables):
    groups.setdefault((v.device, tuple(v.shape.as_list()), v.dtype), []).append(i)
  out = []
  for positions in groups.values():
    while positions:
      size = min(MAX_CHUNK, 1 << (len(positions).bit_length() - 1))
      out.append(positions[:size])
      positions = positions[size:]
  return out


@chunk_function
def _sum_of_squares(tensors: list[tf.Tensor]) -> tf.Tensor:
  return tf.add_n([tf.reduce_sum(tf.square(tf.cast(t, tf.float32))) for t in tensors])


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
def _all_finite(variables: list[tf.Variable]) -> tf.Tensor:
  return tf.reduce_all(tf.stack([tf.reduce_all(tf.math.is_finite(v.read_value()))
                                 for v in variables]))


def all_finite(variables: Sequence[tf.Variable]) -> tf.Tensor:
  """Whether every floating-point variable holds only finite values: a scalar bool,
  each chunk reduced on its own device so no weights move."""
  floating = [v for v in variables if v.dtype.is_floating]
  checks = []
  for chunk in chunks(floating):
    with tf.device(floating[chunk[0]].device):
      checks.append(_all_finite([floating[i] for i in chunk]))
  return tf.reduce_all(tf.stack(checks)) if checks else tf.constant(True)


@chunk_function
def _zeros(shape: tuple[int, ...], dtype: tf.DType, count: int) -> list[tf.Tensor]:
  return [tf.zeros(shape, dtype) for _ in range(count)]


def zeros_like(variables: Sequence[tf.Variable]) -> list[tf.Tensor]:
  """A zero tensor shaped like each variable, made on the variable's device."""
  out: list[Any] = [None] * len(variables)
  for chunk in chunks(variables):
    first = variables[chunk[0]]
    with tf.device(first.device):
      for i, zeros in zip(chunk, _zeros(tuple(first.shape.as_list()), first.dtype, len(chunk))):
        out[i] = zeros
  return out


@chunk_function
def _scaled(tensors: list[tf.Tensor], scale: tf.Tensor) -> list[tf.Tensor]:
  return [t * tf.cast(scale, t.dtype) for t in tensors]


def scaled(tensors: Sequence[tf.Tensor], variables: Sequence[tf.Variable],
           scale: tf.Tensor) -> list[tf.Tensor]:
  """Each tensor times the float scalar `scale`, on the device of its variable in
  `variables` (aligned with `tensors`)."""
  out: list[Any] = [None] * len(tensors)
  for chunk in chunks(variables):
    with tf.device(variables[chunk[0]].device):
      for i, t in zip(chunk, _scaled([tensors[i] for i in chunk], scale)):
        out[i] = t
  return out
