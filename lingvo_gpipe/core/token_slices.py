"""Token slices: a causal sequence model run on slices of its sequences (TeraPipe).

A pipeline with `num_token_slices` S > 1 cuts every micro-batch [b, T, ...] along the
sequence (axis 1) into S slices [b, n_j, ...] of consecutive tokens that flow through
the cells one after another (pipeline/schedule.py's units (m, j)). Token t of a causal
model depends on tokens ≤ t only, so slice j at a layer needs, besides its own
tokens, only what the layer kept of slices < j: the keys and values of its causal
self-attention. A forward of a slice runs with `StepContext.token_slice` set to a
`TokenSlice`: the slice's first position (`offset`), the sequence's length T, and the
`SliceCache` that carries those keys and values from slice to slice.

A layer's cache entry is full-length, [..., T, ...] along its sequence axis: slice j
reads it masked to the positions before its own (`TokenSlice.extend`: positions <
offset kept, the rest zero), places its own entries at offset..offset+n_j, and passes
the result on. Masking what it reads makes an entry's later values invisible, so the
backward of slice j may be handed the entry as the last slice left it (the cell's
cache slots hold one entry per micro-batch, not one per slice) and reads exactly what
the forward read. What a slice's forward keeps for its backward (a cell that is not
re-materialized, or a recompute) holds the prefix it read: up to the whole sequence's
keys and values, for the last slice (step_model.unit_kept_bytes counts that bound for
every slice).

Slice j's attention reads the entries' first offset_j + n_j positions only
(`TokenSlice.prefix`): [n_j, offset_j + n_j] logits under a causal mask, so the S
slices together compute (S + 1) / 2S of the unsliced layer's [T, T] products (5/8 at
S = 4), later slices more than earlier ones.

Gradients run the other way: the entry slice j passes on is an output of its cell
call, whose gradient (from slices > j) the backward of slice j takes as a seed, and
the gradient of the entry it read is handed to the backward of slice j − 1.

A layer's class says whether it may run on slices, in its attribute `token_slicing`:
"tokenwise" (each position on its own: embeddings, projections, norms), "causal"
(position t sees positions ≤ t through the cache: a causal Transformer LM layer), or
None (it mixes positions some other way, e.g. an encoder's self-attention, a
convolution, or pools them): `check_layers` refuses the last.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from lingvo_gpipe.core import near_equal

TOKENWISE, CAUSAL = "tokenwise", "causal"
SLICING = (TOKENWISE, CAUSAL)


class SliceCache:
  """The cache entries of one cell call, in the order its layers extend them.

  incoming: the entries the call was given (a flat list, one per `extend` of the
  call), or None while a trace only learns their specs (each then reads zeros).
  After the call, `outgoing` holds the entries to pass on.
  """

  def __init__(self, incoming: Sequence[tf.Tensor] | None = None):
    self.incoming = None if incoming is None else list(incoming)
    self.outgoing: list[tf.Tensor] = []

  def take(self, specs: Sequence[tf.TensorSpec]) -> list[tf.Tensor]:
    """The next len(specs) incoming entries, those after the ones extended so far
    (zeros of `specs` while specs are learnt)."""
    i = len(self.outgoing)
    if self.incoming is None:  # (an unknown batch dimension reads as 1: it broadcasts)
      return [tf.zeros([1 if d is None else d for d in spec.shape.as_list()], spec.dtype)
              for spec in specs]
    if i + len(specs) > len(self.incoming):
      raise RuntimeError(f"a cell call extends more cache entries than the {len(self.incoming)} "
                         "it was given")
    entries = self.incoming[i:i + len(specs)]
    for j, (entry, spec) in enumerate(zip(entries, specs)):
      if entry.dtype != spec.dtype or not spec.shape.is_compatible_with(entry.shape):
        raise RuntimeError(f"cache entry {i + j}: given {entry.dtype.name}{entry.shape}, the "
                           f"layer extends {spec.dtype.name}{spec.shape}")
    return entries

  def give(self, entries: Sequence[tf.Tensor]) -> None:
    """Records `entries` as the next outgoing ones."""
    self.outgoing.extend(entries)


@dataclasses.dataclass
class TokenSlice:
  """The slice a forward pass computes: tokens offset .. offset+n−1 of sequences of
  `full_length` tokens (n: the inputs' length along their sequence axis).

  offset: int64 scalar tensor; full_length: T, static; cache: the call's SliceCache;
  whole_reads: `prefix` returns the whole entry, T positions, instead of the first
  offset + n (the causal mask hides the later ones, which `extend` zeroes): every
  shape static, what an XLA-compiled generate loop needs (one token per slice, where
  reading T instead of offset + 1 positions costs little).
  """
  offset: tf.Tensor
  full_length: int
  cache: SliceCache
  whole_reads: bool = False

  def extend(self, new: tf.Tensor, axis: int) -> tf.Tensor:
    """new [..., n, ...] (n along `axis`: this slice's entries) → the full-length entry
    [..., T, ...]: the incoming one at positions < offset, `new` at offset..offset+n−1,
    zeros after. Recorded as an outgoing entry.

    n must be static; the batch dimension (axis 0) may be unknown (a serving function's
    generate step takes any batch), the others must be known."""
    shape = new.shape.as_list()
    axis = axis % len(shape)
    n = shape[axis]
    if n is None or any(d is None for d in shape[1:]) or axis == 0:
      raise ValueError(f"token slices need static shapes but the batch's; cache entry "
                       f"{new.shape} along axis {axis}")
    full_shape = shape[:axis] + [self.full_length] + shape[axis + 1:]
    spec = tf.TensorSpec(full_shape, new.dtype)
    [previous] = self.cache.take([spec])
    # Each position's place in the slice (negative before it, n or more after): every
    # shape below is static, so that XLA can compile a generate loop over them.
    place = tf.range(self.full_length, dtype=tf.int32) - tf.cast(self.offset, tf.int32)
    along_axis = [self.full_length] + [1] * (len(shape) - axis - 1)
    # `new` at its positions (position p reads row p − offset), zeros before and after
    placed = tf.where(tf.reshape((place >= 0) & (place < n), along_axis),
                      tf.gather(new, tf.clip_by_value(place, 0, n - 1), axis=axis),
                      tf.zeros([], new.dtype))
    # previous entries before the slice, then this slice's, then zeros
    entry = tf.where(tf.reshape(place < 0, along_axis), previous, placed)
    self.cache.give([entry])
    return entry

  @property
  def outgoing(self) -> list[tf.Tensor]:
    """The entries this slice's layers extended, to pass on to the next slice."""
    return self.cache.outgoing

  def prefix(self, full: tf.Tensor, axis: int, length: int) -> tf.Tensor:
    """full [..., T, ...] → its positions 0 .. offset+length−1 along `axis`: the
    sequence up to the end of this slice of `length` tokens (a dynamic length: what a
    causal query of the slice may attend to); with `whole_reads`, `full` itself."""
    if self.whole_reads:
      return full
    rank = full.shape.rank
    axis = axis % rank
    end = tf.cast(self.offset, tf.int32) + length
    size = tf.tensor_scatter_nd_update(tf.fill([rank], -1), [[axis]], tf.reshape(end, [1]))
    out = tf.slice(full, tf.zeros([rank], tf.int32), size)
    # (Slice's shape function cannot see through the size: without this, every
    # dimension is unknown, and a batch of 1 broadcast against it in a matmul too)
    out.set_shape(full.shape[:axis].concatenate([None]).concatenate(full.shape[axis + 1:]))
    return out

  def window(self, full: tf.Tensor, axis: int, length: int) -> tf.Tensor:
    """full [..., T, ...] → its positions offset .. offset+length−1 along `axis`."""
    rank = full.shape.rank
    axis = axis % rank
    begin = tf.tensor_scatter_nd_update(tf.zeros([rank], tf.int64), [[axis]],
                                        tf.reshape(tf.cast(self.offset, tf.int64), [1]))
    size = [-1] * rank
    size[axis] = length
    out = tf.slice(full, begin, tf.constant(size, tf.int64))
    out.set_shape(full.shape[:axis].concatenate([length]).concatenate(full.shape[axis + 1:]))
    return out


def slice_of(offset: Any, full_length: int, incoming: Sequence[tf.Tensor] | None = None,
             whole_reads: bool = False) -> TokenSlice | None:
  """The TokenSlice of a call on tokens offset.. of sequences of `full_length` T
  tokens, given the `incoming` cache entries (None: a trace that only learns their
  specs reads zeros); None where T is 0 (whole sequences, no slice)."""
  if not full_length:
    return None
  return TokenSlice(offset, full_length, SliceCache(incoming), whole_reads)


def outgoing(token_slice: TokenSlice | None) -> list[tf.Tensor]:
  """The entries a call on `token_slice` extended ([] without a slice)."""
  return token_slice.outgoing if token_slice is not None else []


def traced_cache_specs(call: Callable[..., Sequence[tf.Tensor]], *args: Any
                       ) -> list[tf.TensorSpec]:
  """The specs of the cache entries a call extends: `call` (→ the outgoing entries of
  a slice whose incoming ones read as zeros, `slice_of(..., None)`) traced on `args`
  (specs), never run."""
  traced = tf.function(call, autograph=False).get_concrete_function(*args)
  return [tf.TensorSpec(t.shape, t.dtype) for t in tf.nest.flatten(traced.structured_outputs)]


def slice_lengths(length: int, num_slices: int) -> list[int]:
  """Near-equal slice lengths summing to `length`; the first (length % S) one longer."""
  if num_slices < 1 or num_slices > length:
    raise ValueError(f"num_token_slices={num_slices} must be in 1..{length} (the sequence "
                     f"length)")
  return near_equal.sizes(length, num_slices)


def check_layers(layers: Sequence[Any], path: str) -> None:
  """Raises ValueError naming the first of `layers` whose class does not declare that
  it runs on token slices (its attribute `token_slicing` not one of `SLICING`)."""
  for layer in layers:
    kind = getattr(type(layer), "token_slicing", None)
    if kind not in SLICING:
      raise ValueError(
          f"{path}: num_token_slices > 1 needs layers that are causal in the sequence; "
          f"{layer.path} ({type(layer).__name__}) is not (token_slicing={kind!r}; "
          f"valid: {SLICING}). Encoders, convolutions and pooling mix all positions: "
          "use num_token_slices=1")
