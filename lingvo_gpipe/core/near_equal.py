"""Near-equal sizes: a count cut into parts that differ by at most one.

The pipeline cuts a batch into micro-batches (`pipeline.layer.micro_batch_sizes`,
`PipeliningLayer.infer`) and a sequence into token slices (`token_slices.slice_lengths`)
the same way: the first total mod parts parts one larger, so any cut reads the same
examples in the same order as the uncut batch.
"""

from __future__ import annotations

import tensorflow as tf


def sizes(total: int, parts: int) -> list[int]:
  """`parts` ints (parts >= 1) summing to `total`, near-equal; the first total % parts
  one larger."""
  base, extra = divmod(total, parts)
  return [base + (1 if i < extra else 0) for i in range(parts)]


def tensor_sizes(total: tf.Tensor, parts: int) -> tf.Tensor:
  """`sizes` of a count known at run time (e.g. a batch of unknown size): int32
  [parts], the first total % parts one larger (0s where total < parts)."""
  total = tf.cast(total, tf.int32)
  return total // parts + tf.cast(tf.range(parts) < total % parts, tf.int32)
