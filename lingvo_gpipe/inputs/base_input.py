"""Base class of input generators: Params in, batched and prefetched tf.data out."""

from __future__ import annotations

import tensorflow as tf

from lingvo_gpipe.core.hyperparams import Instantiable, InstantiableParams, ParamsError
from lingvo_gpipe.inputs.buckets import Buckets, SequenceGroup


class BaseInputGenerator(Instantiable):
  """Produces a `tf.data.Dataset` of batches: dicts of tensors with leading dim B.

  Subclasses implement `examples()` (a dataset of single examples); batching,
  repetition, shuffling and prefetching are done here, the same way for every input.
  An input of padded sequences names them (`sequence_groups`) and can then batch by
  length buckets (buckets.py): each batch from one bucket, padded to its bound.
  """

  @classmethod
  def Params(cls) -> InstantiableParams:  # noqa: N802
    p = super().Params()
    p.define("name", cls.__name__.lower(), "Name of this input.")
    p.define("batch_size", 32, "Examples per batch B (the GPipe mini-batch).")
    p.define("seed", 1, "Seed of the data's randomness (order, augmentation, synthesis).")
    p.define("repeat", True, "Repeat forever (training) or go through once (eval).")
    p.define("shuffle_buffer", 0, "Shuffle buffer size; 0 disables shuffling.")
    p.define("prefetch", 2, "Batches to prefetch (tf.data.AUTOTUNE is -1).")
    p.define("autotune", False, "tf.data's autotuning (its model thread). Off by default: "
             "in TensorFlow 2.21 freeing an iterator can wait out the model thread's "
             "period, up to 60 s (docs/library.md, 'Testing'); a parallel map then runs at "
             "min(16, CPU cores), what autotuning starts from.")
    p.define("bucket_upper_bounds", None, "Length buckets (inputs of padded sequences): "
             "increasing token bounds u_j; an example goes to the first bucket whose bound "
             "its longest sequence fits, and its batch is padded to that bound only. The "
             "last bound must be at least the padded length. None: every batch padded to "
             "the full length, batch_size examples each.")
    p.define("bucket_batch_sizes", None, "With bucket_upper_bounds: examples per batch of "
             "each bucket (about tokens_per_batch / u_j keeps each step's work even). "
             "batch_size is then unused.")
    return p

  def __init__(self, params: InstantiableParams):
    super().__init__(params)
    if params.batch_size < 1:
      raise ParamsError(f"{params.name}: batch_size must be >= 1, got {params.batch_size}")
    self.params = params

  def sequence_groups(self) -> list[SequenceGroup]:
    """The padded sequences of an example, by their paddings key (none: this input
    cannot be bucketed by length)."""
    return []

  @property
  def buckets(self) -> Buckets | None:
    """The length buckets the params ask for (None: one full-length batch shape).

    Raises:
      ParamsError: the bucket params are malformed or do not fit this input.
    """
    p = self.params
    return Buckets.from_params(p.name, p.bucket_upper_bounds, p.bucket_batch_sizes,
                               self.sequence_groups())

  def examples(self) -> tf.data.Dataset:
    """A dataset of single examples (dicts of tensors)."""
    raise NotImplementedError

  def dataset(self) -> tf.data.Dataset:
    """Batches of `batch_size`, or with buckets of each bucket's batch size and bound
    (a last partial batch is dropped: each batch shape is static; with buckets and
    `repeat` False, each bucket's last partial batch is kept)."""
    p = self.params
    buckets = self.buckets
    ds = self.examples()
    if p.shuffle_buffer:
      ds = ds.shuffle(p.shuffle_buffer, seed=p.seed)
    if p.repeat:
      ds = ds.repeat()
    if buckets is not None:
      # A pass that does not repeat (eval, decode) keeps each bucket's last partial
      # batch: with n buckets, dropping them would leave out up to Σ (b_j − 1) examples.
      ds = buckets.batches(ds, self.sequence_groups(), keep_partial=not p.repeat)
    else:
      ds = ds.batch(p.batch_size, drop_remainder=True)
    options = tf.data.Options()
    options.autotune.enabled = p.autotune
    return ds.prefetch(p.prefetch).with_options(options)

  def id_space_size(self) -> int | None:
    """N where every id and label this input gives lies in [0, N) (a vocabulary's
    size, a class count), known without reading data; None where it is not (the
    trainer then checks each batch as it comes)."""
    return None

  def full_batch_spec(self) -> dict[str, tf.TensorSpec]:
    """The TensorSpec of a batch of `batch_size` padded to the full lengths, without
    reading any data."""
    return {k: tf.TensorSpec([self.params.batch_size, *s.shape], s.dtype)
            for k, s in self.examples().element_spec.items()}

  def batch_specs(self) -> list[dict[str, tf.TensorSpec]]:
    """The TensorSpec of each batch shape this input gives: one per length bucket, or
    the one full-length batch."""
    buckets = self.buckets
    if buckets is None:
      return [self.full_batch_spec()]
    return buckets.specs(self.full_batch_spec(), self.sequence_groups())

  def batch_spec(self) -> dict[str, tf.TensorSpec]:
    """The TensorSpec of one batch; with buckets, of the largest (most tokens): the
    shape a step's memory is sized for and the planner plans."""
    buckets = self.buckets
    return self.batch_specs()[buckets.largest if buckets is not None else 0]
