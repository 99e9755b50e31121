"""Length buckets: each batch holds sequences of similar length, padded only to its
bucket's bound (Lingvo's bucket_upper_bound and bucket_batch_limit).

Text inputs pad every example to one full length T (sequence_length). With buckets
(u_0 < u_1 < ... < u_{n-1}, batch sizes b_0 ... b_{n-1}) an example whose longest
sequence has n tokens (its non-padding positions) goes to the first bucket j with
n <= u_j; bucket j's batches hold b_j examples, each sequence cut to min(u_j, its full
length). Choosing b_j ∝ 1 / u_j keeps the tokens per batch about constant, so a step
of short sentences costs about what a step of long ones does, and padding is bounded
by the gap between neighbouring bounds instead of by T.

Each bucket is one batch shape, so a training step is traced once per bucket
(trainer.py). tf.data's `bucket_by_sequence_length` does the grouping; its iterator
is checkpointable, so a resumed run sees the batches the uninterrupted run would.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import tensorflow as tf

from lingvo_gpipe.core.hyperparams import ParamsError


@dataclasses.dataclass(frozen=True)
class SequenceGroup:
  """Keys of an example padded together: `paddings` [T] (1.0 at a pad, pads at the
  end) and every key in `keys` ([T, ...], `paddings` among them), T = `length`."""
  paddings: str
  keys: tuple[str, ...]
  length: int


@dataclasses.dataclass(frozen=True)
class Buckets:
  """upper_bounds: increasing token bounds u_j; batch_sizes: examples per batch b_j."""
  upper_bounds: tuple[int, ...]
  batch_sizes: tuple[int, ...]

  @classmethod
  def from_params(cls, name: str, upper_bounds: Sequence[int] | None,
                  batch_sizes: Sequence[int] | None, groups: Sequence[SequenceGroup]
                  ) -> Buckets | None:
    """The buckets an input's params ask for (None: none), checked against its
    sequence groups (each example must fit the last bucket).

    Raises:
      ParamsError: naming the bad value and what would be valid.
    """
    if upper_bounds is None and batch_sizes is None:
      return None
    if upper_bounds is None or batch_sizes is None:
      raise ParamsError(f"{name}: bucket_upper_bounds and bucket_batch_sizes go together; "
                        f"got {upper_bounds!r} and {batch_sizes!r}")
    if not groups:
      raise ParamsError(f"{name}: this input has no sequences to bucket by length; leave "
                        "bucket_upper_bounds and bucket_batch_sizes None")
    bounds, sizes = list(upper_bounds), list(batch_sizes)
    for key, values in (("bucket_upper_bounds", bounds), ("bucket_batch_sizes", sizes)):
      if not values or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1
                               for v in values):
        raise ParamsError(f"{name}: {key} must be a non-empty list of ints >= 1, got "
                          f"{values!r}")
    if len(bounds) != len(sizes):
      raise ParamsError(f"{name}: bucket_upper_bounds has {len(bounds)} entries and "
                        f"bucket_batch_sizes {len(sizes)}; give one batch size per bucket")
    if any(a >= b for a, b in zip(bounds, bounds[1:])):
      raise ParamsError(f"{name}: bucket_upper_bounds must increase, got {bounds}")
    longest = max(g.length for g in groups)
    if bounds[-1] < longest:
      raise ParamsError(f"{name}: the last of bucket_upper_bounds, {bounds[-1]}, is below "
                        f"the padded length {longest} (sequence_length); make it at least "
                        f"{longest} so that every example fits a bucket")
    return cls(tuple(bounds), tuple(sizes))

  @property
  def largest(self) -> int:
    """The bucket whose batch holds the most tokens (b_j · u_j; the longer on a tie):
    the one a step's memory and the planner's plan are sized for."""
    return max(range(len(self.upper_bounds)),
               key=lambda j: (self.batch_sizes[j] * self.upper_bounds[j], self.upper_bounds[j]))

  def specs(self, full_spec: Mapping[str, tf.TensorSpec], groups: Sequence[SequenceGroup]
            ) -> list[dict[str, tf.TensorSpec]]:
    """Per bucket, the TensorSpec of its batches: `full_spec` (a batch padded to the
    full lengths, [B, T, ...] or [B, ...]) with b_j rows and each group's sequences
    cut to min(u_j, T)."""
    length_of = {key: g.length for g in groups for key in g.keys}
    out = []
    for bound, size in zip(self.upper_bounds, self.batch_sizes):
      spec = {}
      for key, s in full_spec.items():
        shape = [size, *s.shape[1:]]
        if key in length_of:
          shape[1] = min(bound, length_of[key])
        spec[key] = tf.TensorSpec(shape, s.dtype)
      out.append(spec)
    return out

  def batches(self, examples: tf.data.Dataset, groups: Sequence[SequenceGroup],
              keep_partial: bool = False) -> tf.data.Dataset:
    """`examples` (dicts padded to the full lengths) → batches of one bucket each,
    cut to its bound. Each bucket's last partial batch is dropped (a training step's
    shapes are static per bucket), or kept with `keep_partial` (a pass over an eval
    set: every example counts; its partial batches are shapes of their own)."""
    bounds = tf.constant(self.upper_bounds, tf.int32)

    def length(example: dict[str, tf.Tensor]) -> tf.Tensor:
      return tf.reduce_max(tf.stack([_tokens(example[g.paddings]) for g in groups]))

    def cut(batch: dict[str, tf.Tensor]) -> dict[str, tf.Tensor]:
      longest = tf.reduce_max(tf.stack([tf.reduce_max(_tokens(batch[g.paddings]))
                                        for g in groups]))
      bound = bounds[tf.searchsorted(bounds, longest[None], side="left")[0]]
      out = dict(batch)
      for g in groups:
        for key in g.keys:
          out[key] = batch[key][:, :tf.minimum(bound, g.length)]
      return out

    # tf.data's buckets are [0, c_0), [c_0, c_1), ..., [c_{n-2}, ∞): c_j = u_j + 1.
    grouped = examples.bucket_by_sequence_length(
        length, [u + 1 for u in self.upper_bounds[:-1]], list(self.batch_sizes),
        no_padding=True, drop_remainder=not keep_partial)
    return grouped.map(cut)


def _tokens(paddings: tf.Tensor) -> tf.Tensor:
  """paddings [..., T] (1.0 at a pad) → the non-padding positions per sequence [...]."""
  return tf.reduce_sum(tf.cast(paddings < 0.5, tf.int32), axis=-1)


def padding_fraction(batch: Mapping[str, tf.Tensor], groups: Sequence[SequenceGroup]) -> float:
  """The fraction of a batch's sequence positions that are padding."""
  total = padded = 0
  for g in groups:
    paddings = batch[g.paddings]
    total += int(tf.size(paddings))
    padded += int(tf.reduce_sum(tf.cast(paddings >= 0.5, tf.int32)))
  return padded / max(total, 1)
