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
  FlatLayout(variables)              → one tensor per variable ⇄ one flat vector per
                                       dtype (a pipeline cell's running gradient sums)
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from lingvo_gpipe.pipeline.tf_internals import NOT_INLINED

MAX_CHUNK = 32

# The chunks' functions stay calls at run time (NOT_INLINED): inlined, their ops would
# be back in the step's graph, and Grappler's time on it grows with them.
chunk_function = functools.partial(tf.function, autograph=False,
                                    experimental_attributes=NOT_INLINED)


def chunks(variables: Sequence[Any], by_device: bool = True) -> list[list[int]]:
  """Positions of `variables` grouped by (device, shape, dtype) (by_device=False: by
  shape and dtype) in first-seen order, each group cut into runs of at most MAX_CHUNK
  whose sizes are powers of two (so few distinct signatures get traced)."""
  groups: dict[tuple, list[int]] = {}
  for i, v in enumerate(variables):
    key = (v.device if by_device else None, tuple(v.shape.as_list()), v.dtype)
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


@tf.function(autograph=False)  # inlined where called: a cell's backward runs it per action
def _flatten_chunk(tensors: list[Any], shape: tuple[int, ...], dtype: tf.DType) -> tf.Tensor:
  return tf.concat([tf.reshape(tf.zeros(shape, dtype) if t is None else t, [-1])
                    for t in tensors], axis=0)


@tf.function(autograph=False)
def _unflatten_chunk(flat: tf.Tensor, shape: tuple[int, ...], count: int) -> list[tf.Tensor]:
  return [tf.reshape(part, shape) for part in tf.split(flat, count)]


class FlatLayout:
  """Where each of `variables`' tensors (e.g. gradients) lives in flat vectors, one per
  dtype: a pipeline's device loop carries each cell's running gradient sums as these few
  vectors instead of one loop variable per variable (whose plumbing through the loop
  and its branches was most of the cost of tracing a deep cell). Packing and
  unpacking is one traced call per chunk of variables of one shape and dtype.

  dtypes: the vectors' dtypes, in first-seen order; specs(): their TensorSpecs.
  """

  def __init__(self, variables: Sequence[tf.Variable]):
    self.shapes = [tuple(v.shape.as_list()) for v in variables]
    self.dtypes: list[tf.DType] = []
    sizes: list[int] = []
    # per chunk: (positions, vector index, offset, elements per variable)
    self._chunks: list[tuple[list[int], int, int, int]] = []
    for positions in chunks(variables, by_device=False):
      dtype = variables[positions[0]].dtype
      if dtype not in self.dtypes:
        self.dtypes.append(dtype)
        sizes.append(0)
      vector = self.dtypes.index(dtype)
      elements = math.prod(self.shapes[positions[0]])
      self._chunks.append((positions, vector, sizes[vector], elements))
      sizes[vector] += elements * len(positions)
    self._sizes = sizes

  def specs(self) -> list[tf.TensorSpec]:
    return [tf.TensorSpec([n], d) for n, d in zip(self._sizes, self.dtypes)]

  def zeros(self) -> list[tf.Tensor]:
    return [tf.zeros([n], d) for n, d in zip(self._sizes, self.dtypes)]

  def flatten(self, tensors: Sequence[Any]) -> list[tf.Tensor]:
    """One tensor (or None: zeros) per variable → the flat vectors."""
    parts: list[list[tf.Tensor]] = [[] for _ in self.dtypes]
    for positions, vector, _, _ in self._chunks:  # (in offset order per vector)
      parts[vector].append(_flatten_chunk([tensors[i] for i in positions],
                                          self.shapes[positions[0]], self.dtypes[vector]))
    return [p[0] if len(p) == 1 else tf.concat(p, axis=0) for p in parts]

  def unflatten(self, vectors: Sequence[tf.Tensor]) -> list[tf.Tensor]:
    """The flat vectors → one tensor per variable."""
    out: list[Any] = [None] * len(self.shapes)
    for positions, vector, offset, elements in self._chunks:
      size = elements * len(positions)
      parts = _unflatten_chunk(vectors[vector][offset:offset + size],
                               self.shapes[positions[0]], len(positions))
      for i, part in zip(positions, parts):
        out[i] = part
    return out
