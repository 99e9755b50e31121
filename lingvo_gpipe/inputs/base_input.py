"""Base class of input generators: Params in, batched and prefetched tf.data out."""

from __future__ import annotations

import tensorflow as tf

from lingvo_gpipe.core.hyperparams import Instantiable, InstantiableParams, ParamsError


class BaseInputGenerator(Instantiable):
  """Produces a `tf.data.Dataset` of batches: dicts of tensors with leading dim B.

  Subclasses implement `examples()` (a dataset of single examples); batching,
  repetition, shuffling and prefetching are done here, the same way for every input.
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
    return p

  def __init__(self, params: InstantiableParams):
    super().__init__(params)
    if params.batch_size < 1:
      raise ParamsError(f"{params.name}: batch_size must be >= 1, got {params.batch_size}")
    self.params = params

  def examples(self) -> tf.data.Dataset:
    """A dataset of single examples (dicts of tensors)."""
    raise NotImplementedError

  def dataset(self) -> tf.data.Dataset:
    """Batches of `batch_size` (the last partial batch is dropped: shapes are static)."""
    p = self.params
    ds = self.examples()
    if p.shuffle_buffer:
      ds = ds.shuffle(p.shuffle_buffer, seed=p.seed)
    if p.repeat:
      ds = ds.repeat()
    ds = ds.batch(p.batch_size, drop_remainder=True)
    return ds.prefetch(p.prefetch)

  def id_space_size(self) -> int | None:
    """N where every id and label this input gives lies in [0, N) (a vocabulary's
    size, a class count), known without reading data; None where it is not (the
    trainer then checks each batch as it comes)."""
    return None

  def batch_spec(self) -> dict[str, tf.TensorSpec]:
    """The TensorSpec of one batch, without reading any data."""
    return {k: tf.TensorSpec([self.params.batch_size, *s.shape], s.dtype)
            for k, s in self.examples().element_spec.items()}
