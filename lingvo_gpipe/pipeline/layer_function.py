"""Layers of one kind traced once: a pipeline calls one function per kind of layer.

Traced layer by layer, a pipeline of L identical layers (a Transformer's) put each
layer's ops into its cell's functions: tracing, the function library, Grappler and
the first call all grew with L (about 1.5 s per 64-wide Transformer layer;
docs/benchmarks.md). Here the layers of a pipeline that are of one *kind* share one
`tf.function`:

  kind = (the layer's class, its params but the name, training or not)
  layer_fn(variables, inputs, info, seeds, cache) → (outputs, flat batch statistics,
                                                     cache)

- variables: the layer's variables (its own, then its descendants', in `walk()`
  order; a stacked variable's row as the tensor its cell read) enter as arguments.
  tf.function traces once for variables of equal shapes and dtypes, and the
  gradient of a call reaches the variables passed to it.
- info: int64 [4], the StepContext's (global step, micro-batch, example offset,
  token offset).
- seeds: int64 [S], this layer's dropout seeds (`base_layer.seed_tensor`), in the
  order the trace asked for them; so layers sharing a trace still draw exactly the
  masks of unpartitioned training.
- batch statistics (`BaseLayer.report_stats`) come back as outputs and are reported
  for the calling layer's own sublayers.
- cache: on a token slice (`StepContext.token_slice`, core/token_slices.py), the
  layer's entries of its cell call's slice cache, taken from it and the extended ones
  given back (the specs learnt once per kind and input signature by a trace that
  reads zeros); an empty list otherwise.

A kind's function is traced (once per input signature) with the kind's first layer,
its representative, whose variable attributes stand for the arguments while it
traces (`base_layer.variables_read_as`); every layer of the kind calls that traced
function. TensorFlow differentiates each call with the forward/backward pair it
builds once per traced function, so a cell's forward, recomputed forward and
backward over any number of identical layers hold one call op per layer and share
three functions per kind (`tests/layer_function_test.py`).

Calls that record deferred weight products (`StepContext.weight_products`, with
`weight_gradient_group` > 1) are not shared: their products must reach the cell's
own tape. Nor are layers of a class with `shares_traces = False`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from lingvo_gpipe.core import base_layer, stacked_variables, token_slices
from lingvo_gpipe.core.base_layer import BaseLayer
from lingvo_gpipe.core.tf_internals import NOT_INLINED

_SEEDS = tf.TensorSpec([None], tf.int64)


def kind_of(layer: BaseLayer, training: bool) -> tuple:
  """What layers sharing a function have in common: their kind of params, the mode."""
  return (*base_layer.params_kind(layer.params), training)


@dataclasses.dataclass(frozen=True)
class _Layout:
  """What a trace asked of its representative, by sublayer position in `walk()` order:
  the seed of each (position, purpose), and the statistics each position reported
  (their structure, tensors as None)."""
  seeds: tuple[tuple[int, str], ...]
  stats: tuple[tuple[int, Any], ...]


def step_info() -> tf.Tensor:
  """int64 [3]: the current StepContext's (global step, example offset, token offset:
  0 unless on a token slice)."""
  ctx = base_layer.current_context()
  token_offset = ctx.token_slice.offset if ctx.token_slice is not None else 0
  return tf.stack([tf.cast(x, tf.int64) for x in (ctx.step, ctx.example_offset, token_offset)])


class _KindFunction:
  """The traced function of one kind of layer."""

  def __init__(self, representative: BaseLayer):
    self.representative = representative
    self.layout: _Layout | None = None
    # Not inlined: each kind's body is optimized once, not once per call site.
    self.function = tf.function(self._layer_body, autograph=False,
                                experimental_attributes=NOT_INLINED)
    # The specs of the cache entries of a call on a token slice, per input signature
    # (learnt by `_cache_specs`).
    self._cache_specs_of: dict[Any, list[tf.TensorSpec]] = {}

  def _layer_body(self, variables, inputs, info, seeds, cache, full_length):
    """cache: the layer's incoming cache entries (None: specs only, read as zeros);
    full_length: T of a token slice (0: whole sequences)."""
    sublayers = list(self.representative.walk())
    position = {id(layer): i for i, layer in enumerate(sublayers)}
    asked: list[tuple[int, str]] = []
    stats: list[tuple[BaseLayer, Any]] = []

    def seed(layer: BaseLayer, purpose: str) -> tf.Tensor:
      if id(layer) not in position:  # a layer outside this one: its own constant
        return tf.constant(layer.seed_for(purpose), tf.int64)
      asked.append((position[id(layer)], purpose))
      return seeds[len(asked) - 1]

    token_slice = token_slices.slice_of(info[2], full_length, cache)
    with base_layer.variables_read_as(sublayers, variables), base_layer.seed_source(seed), \
        base_layer.step_context(step=info[0], example_offset=info[1],
                                layer_stats=stats, spans=None, weight_products=None,
                                token_slice=token_slice):
      outputs = base_layer.call_with(self.representative, inputs)
    layout = _Layout(tuple(asked), tuple(
        (position[id(layer)], tf.nest.map_structure(lambda _: None, s)) for layer, s in stats))
    if self.layout is None:
      self.layout = layout
    elif layout != self.layout:
      raise RuntimeError(f"{self.representative.path}: a second trace of the layer asked "
                         "for other seeds or reported other statistics")
    return (outputs, tf.nest.flatten([s for _, s in stats]),
            token_slices.outgoing(token_slice))

  def _cache_specs(self, variables: list, inputs: Any, info: tf.Tensor,
                   full_length: int) -> list[tf.TensorSpec]:
    """The specs of the cache entries a call on a token slice extends (a trace that
    reads them as zeros, once per input signature; never run)."""
    key = (tuple(tf.nest.flatten(tf.nest.map_structure(
        lambda t: (tuple(t.shape), t.dtype), (variables, inputs)))), full_length)
    if key not in self._cache_specs_of:
      self._cache_specs_of[key] = token_slices.traced_cache_specs(
          lambda *args: self._layer_body(*args)[2],
          variables, inputs, info, _SEEDS, None, full_length)
    return self._cache_specs_of[key]

  def call(self, layer: BaseLayer, inputs: Any, info: tf.Tensor,
           ctx: base_layer.StepContext) -> Any:
    """`layer` (of this kind) on `inputs`, through the traced function. Its variables
    (its own, then its descendants', in `walk()` order) are the function's first
    argument; on a token slice its cache entries are taken from and given back to
    the StepContext's slice cache."""
    sublayers = list(layer.walk())
    # A stacked variable's row enters as the tensor its cell read (stacked_variables).
    variables = [v.value() if isinstance(v, stacked_variables.RowVariable) else v
                 for sublayer in sublayers for v in sublayer.own_variables()]
    token_slice = ctx.token_slice
    full_length = token_slice.full_length if token_slice is not None else 0
    specs = (self._cache_specs(variables, inputs, info, full_length) if token_slice is not None
             else [])
    cache = token_slice.cache.take(specs) if token_slice is not None else []
    concrete = self.function.get_concrete_function(variables, inputs, info, _SEEDS, specs,
                                                   full_length)
    seeds = tf.constant([sublayers[i].seed_for(purpose) for i, purpose in self.layout.seeds],
                        tf.int64, shape=[len(self.layout.seeds)])
    outputs, flat_stats, cache_out = concrete(variables, inputs, info, seeds, cache,
                                              full_length)
    if token_slice is not None:
      token_slice.cache.give(cache_out)
    if ctx.layer_stats is not None and self.layout.stats:
      packed = tf.nest.pack_sequence_as([s for _, s in self.layout.stats], list(flat_stats))
      for (i, _), stats in zip(self.layout.stats, packed):
        ctx.layer_stats.append((sublayers[i], stats))
    return outputs


class LayerFunctions:
  """The traced functions of the kinds of layer of one pipeline (all its cells, in
  training and eval)."""

  def __init__(self):
    self._functions: dict[tuple, _KindFunction] = {}
    self._kinds: dict[tuple[int, bool], tuple] = {}  # (id(layer), training) → kind

  def call_layers(self, layers: Sequence[BaseLayer], x: Any) -> Any:
    """Runs `layers` in order, each through its kind's function where it can share
    one; a tuple output is passed on as positional arguments."""
    ctx = base_layer.current_context()
    info = step_info()
    for layer in layers:
      if not type(layer).shares_traces or ctx.weight_products is not None:
        x = base_layer.call_with(layer, x)
        continue
      key = (id(layer), bool(ctx.training))
      if key not in self._kinds:
        self._kinds[key] = kind_of(layer, bool(ctx.training))
      kind = self._kinds[key]
      if kind not in self._functions:
        self._functions[kind] = _KindFunction(layer)
      x = self._functions[kind].call(layer, x, info, ctx)
    return x

  @property
  def num_kinds(self) -> int:
    return len(self._functions)

  def tracing_count(self) -> int:
    """How many times the kinds' functions were traced (once per kind and input
    signature, whatever the number of layers of each kind)."""
    return sum(f.function.experimental_get_tracing_count() for f in self._functions.values())
