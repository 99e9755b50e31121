"""A cell's forward and backward as functions traced once and called in its loop.

`CellFunctions` wraps the layers of one cell (and, for the last cell, the task's loss
head) in `tf.function`s:

  forward(inputs, head_inputs, step, call_info, cache)
      → outputs (the head's metrics on the last cell), batch statistics, cache
  backward(inputs, head_inputs, output_grads, sums, step, call_info, cache, cache_grads)
      → input gradients, the cache's gradients, sums + variable gradients
        (re-materialized: recomputes the forward inside)
  weight_gradients(sums, inputs [n, I] and output gradients [n, O] of each projection)
      → sums + the projections' weight gradients, one product each (a cell that
        defers them: with weight_gradient_group G > 1 each re-materialized cell, under
        the split-backward schedules (zb_h1, zbv, interleaved_zb) every cell,
        re-materialized or not; the backward then
        leaves them out)

`sums` are the cell's running gradient sums as a few stacked tensors, one per shape
and dtype (`gradient_sums.StackedLayout` of the variables the cell reads), added to
in place: its device's loop carries them instead of one loop variable per variable.

Each is traced once per distinct micro-batch shape (an uneven split has two) by
`CellFunctions.signature`, which returns what tracing found as a frozen
`CallSignature` (flat specs in and out, the outputs' and statistics' structures, the
variables and their sums' layout), and called from its device's loop
(device_loop.py), whatever M is (`tests/pipeline_graph_test.py` pins it). What the
bodies share with their tracer per cell lives in `_Traced` (see why there).

What varies per call enters as tensors: the global step, and `call_info` = int64
[example offset, token offset]; the step and the offsets seed
dropout exactly as in the unpartitioned model, so the recompute inside `backward`
draws the forward's masks.

On token slices (a signature traced with `full_length` T: core/token_slices.py), a
call computes tokens [token offset, +n) of its micro-batch's sequences, and `cache`
is the flat list of the cell's causal layers' cache entries (full-length, as the
micro-batch's latest slice left them; empty lists otherwise). The forward returns the
entries extended by its slice; the backward takes the gradient of those (from later
slices: `cache_grads`) and returns the gradient of the entries it read.

A cell that is not re-materialized (`recompute=False`) is differentiated by
TensorFlow's own pair for its forward function (`tf_internals.forward_backward_pair`):
a forward that also returns the intermediates the gradient needs, which the loop
keeps per micro-batch in flight, and a backward that takes them. Such a cell defers
its weight gradients (schedule.SPLIT_BACKWARD) through probes: its forward is traced once more with
each product x·W made as x·stop_gradient(W) + probe (a zero input [n, O]) and x
returned (as bits, sharing its buffer), so TensorFlow's backward gives each
product's output gradient as the probe's gradient and W gets x.

TensorFlow behaviours that shape the engine (the ones beyond its documented API are
listed, with the tests that pin them, in `tf_internals.py`):

- The functions carry the attribute `_noinline` (`tf_internals.NOT_INLINED`), so
  Grappler neither inlines them nor merges the recomputed forward into the forward.
- A call made on device d runs every op of its body that names no device on d; the
  traced graph does not show that, so placement is proven from the ops that executed
  (`tests/pipeline_placement_test.py`, TensorFlow's debug dump).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Collection, Sequence
from typing import Any, NamedTuple

import tensorflow as tf

from lingvo_gpipe.core import (
  base_layer,
  stacked_variables,
  tf_internals,
  token_slices,
)
from lingvo_gpipe.core.base_layer import BaseLayer
from lingvo_gpipe.core.tf_internals import NOT_INLINED
from lingvo_gpipe.pipeline import gradient_sums, layer_function

# Head(outputs of the last cell, head inputs of the micro-batch) → metrics
# {name: (value, weight)}; metrics["loss"][0] is the mean loss over the weight.
Head = Callable[[Any, Any], dict]

# Name scopes of the ops in the traced bodies: profiles tell the phases apart by them
# (bench/micro_batch_profile.py). TensorFlow names the gradient ops of the recomputed
# forward "gradient_tape/recompute/...".
FORWARD_SCOPE, RECOMPUTE_SCOPE, ACCUMULATE_SCOPE = "forward", "recompute", "accumulate"
WEIGHT_SCOPE = "weight_gradient"  # deferred weight gradients (W actions)


def call_layers(layers: Sequence[BaseLayer], x: Any, input_gradients: bool = True) -> Any:
  """Runs `layers` in order; a tuple output is passed on as positional arguments.
  (input_gradients: whether anything differentiates `x`; plain ops need not know:
  a gradient computes only what reaches the sources asked for.)"""
  for layer in layers:
    x = base_layer.call_with(layer, x)
  return x


def _is_float(t: Any) -> bool:
  return t is not None and t.dtype.is_floating


def _dense(g: Any) -> Any:
  """Embedding gradients arrive as IndexedSlices; summed densely over micro-batches
  the running sum stays one table-sized buffer instead of growing by every
  micro-batch's rows."""
  return tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g


def _accumulate(layout: gradient_sums.StackedLayout, sums: Sequence[tf.Tensor],
                grads: Sequence[Any], stack_grads: dict[int, Any] | None = None,
                zeros: Collection[int] = ()) -> list[tf.Tensor]:
  """sums (the stacked tensors of `layout`; `zeros`: the positions of those known to
  be zeros) + grads (one per variable; None adds nothing) + stack_grads
  ({id(VariableStack): its whole gradient [n, *shape] or None})."""
  with tf.name_scope(ACCUMULATE_SCOPE):
    return layout.add(sums, [None if g is None else _dense(g) for g in grads],
                      {k: _dense(g) for k, g in (stack_grads or {}).items() if g is not None},
                      zeros=zeros)


def _zeros_where_none(grads: Sequence[Any], like: Sequence[Any]) -> list[Any]:
  """Each gradient, or zeros shaped as its tensor or TensorSpec in `like` where None."""
  return [g if g is not None else
          tf_internals.zeros(t.shape, t.dtype) if t.shape.is_fully_defined() else
          tf.zeros_like(t)
          for g, t in zip(grads, like)]


def _specs(tensors: Sequence[tf.Tensor]) -> list[tf.TensorSpec]:
  return [tf.TensorSpec(t.shape, t.dtype) for t in tensors]


_BITS = {2: tf.int16, 4: tf.int32, 8: tf.int64}

# int64 [example offset, token offset]: where the unit's examples and tokens start.
CALL_INFO = tf.TensorSpec([2], tf.int64)
STEP = tf.TensorSpec([], tf.int64)  # the global step


def _as_bits(t: tf.Tensor) -> tf.Tensor:
  """A float tensor's bits as integers of its width (no copy). A function output of
  an integer type takes no gradient, so TensorFlow's backward of the call needs no
  zero seed of its size."""
  return tf.bitcast(t, _BITS[t.dtype.size])


def _from_bits(t: tf.Tensor, dtype: tf.DType) -> tf.Tensor:
  return tf.bitcast(t, dtype)


def _consecutive(sizes: Sequence[int]) -> list[slice]:
  """The slices of consecutive parts of these sizes in one flat list."""
  starts = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
  return [slice(a, b) for a, b in zip(starts, starts[1:])]


def _parts(flat: Sequence[Any], sizes: Sequence[int], what: str) -> list[list[Any]]:
  """`flat` cut into consecutive parts of `sizes` (raises unless they cover it)."""
  if sum(sizes) != len(flat):
    raise ValueError(f"{len(flat)} {what} where the parts hold {sum(sizes)}")
  return [list(flat[s]) for s in _consecutive(sizes)]


class ProductSpecs(NamedTuple):
  """A cell's deferred weight products (cells with W actions): per product, its
  inputs [n, I] and output gradient [n, O]. probes: a cell not re-materialized that
  defers: its pair's function takes one probe per product (shaped as its output
  gradient) and returns the products' inputs after its outputs, statistics and cache
  entries; its `Saved.product_bits` keeps them (as bits)."""
  inputs: tuple[tf.TensorSpec, ...] = ()
  grads: tuple[tf.TensorSpec, ...] = ()
  probes: tuple[tf.TensorSpec, ...] = ()


class Saved(NamedTuple):
  """What a forward keeps for its micro-batch's backward: specs in a CallSignature,
  tensors in a call; the device's loop stashes them flat (`flat`, `like`).

  A re-materialized cell keeps its inputs and head_inputs and recomputes the rest. A
  cell that is not keeps what the backward of TensorFlow's forward/backward pair
  reads: product_bits, the inputs [n, I] of its deferred weight products as integers
  of their width (`_as_bits`: outputs that take no gradient), and `kept`, the
  intermediates the pair keeps."""
  inputs: tuple = ()
  head_inputs: tuple = ()
  product_bits: tuple = ()
  kept: tuple = ()

  def flat(self) -> list[Any]:
    return [t for part in self for t in part]

  def like(self, flat: Sequence[Any]) -> Saved:
    """`flat` (as `flat()` lists a record like this one) in this record's parts."""
    return Saved(*map(tuple, _parts(flat, [len(part) for part in self], "stashed tensors")))


class _ForwardResults(NamedTuple):
  """What a cell's forward function returns, flat lists each: its outputs, its
  statistics, the cache entries it extended (token slices), and its deferred products'
  inputs as bits (a probed forward, `CellFunctions._probed_forward_body`); TensorFlow's
  pair returns them concatenated (`split`)."""
  outputs: list
  stats: list
  cache: list
  product_bits: list

  @classmethod
  def split(cls, flat: Sequence[Any], sig: CallSignature) -> _ForwardResults:
    """The pair's concatenated results, in their parts as `sig` sizes them."""
    sizes = (len(sig.outputs), len(sig.stats), len(sig.cache), len(sig.products.probes))
    return cls(*_parts(flat, sizes, "forward results"))


class _Backward(NamedTuple):
  """How a cell's backward gets what it needs: `saved`, what the forward keeps (specs);
  the forward/backward pair (None: re-materialized); the deferred products; the
  positions of the sums it never adds to (`CallSignature.weight_only_sums`)."""
  saved: Saved
  pair: tf_internals.ForwardBackwardPair | None
  products: ProductSpecs
  weight_only_sums: frozenset[int] = frozenset()


class PairArguments(NamedTuple):
  """Where each group of a cell's forward-function arguments sits, as slices: the
  order `CellFunctions.forward` passes them in (inputs, head inputs, step,
  call_info, cache entries, probes), which is also the order of the gradients the
  pair's backward returns, followed by one per captured input (`captured`)."""
  inputs: slice
  head_inputs: slice
  step: slice
  call_info: slice
  cache: slice
  probes: slice
  captured: slice

  @classmethod
  def of(cls, sig: CallSignature) -> PairArguments:
    sizes = (len(sig.inputs), len(sig.head_inputs), 1, 1, len(sig.cache),
             len(sig.products.probes))
    return cls(*_consecutive(sizes), slice(sum(sizes), None))


@dataclasses.dataclass(frozen=True, eq=False)
class CallSignature:
  """What tracing a cell for one micro-batch shape found (`CellFunctions.signature`).

  inputs, head_inputs: the flat arguments; outputs, stats: the forward's flat results;
  saved: what a forward keeps for its backward (`Saved`); pair: the
  forward/backward pair of a cell that is not re-materialized; products: its
  deferred weight products (`ProductSpecs`); weight_only_sums: the positions of the
  sums (`layout`'s tensors) that a backward of this shape never adds to, so only the
  W actions do: a stack of projection weights whose gradients are all deferred (its
  backward, TensorFlow's pair, gives it none); stacks only. Empty for a
  re-materialized cell: its backward adds inside its one traced body, which is not
  looked into.

  output_structure: the nest the layers (and the head) return, `outputs` flattened
  from it; stats_structure: per layer that reported batch statistics, the layer and
  the nest of its statistics, `stats` flattened from them; variables: the variables
  the cell reads, in the order of its gradient sums; layout: those sums as stacked
  tensors, one per shape and dtype. These four are the same for every shape of one cell
  (traces that disagree raise).
  """
  inputs: tuple[tf.TensorSpec, ...]
  head_inputs: tuple[tf.TensorSpec, ...]
  outputs: tuple[tf.TensorSpec, ...]
  stats: tuple[tf.TensorSpec, ...]
  saved: Saved
  output_structure: Any
  stats_structure: tuple[tuple[BaseLayer, Any], ...]
  variables: tuple[tf.Variable, ...]
  layout: gradient_sums.StackedLayout
  pair: tf_internals.ForwardBackwardPair | None = None
  products: ProductSpecs = ProductSpecs()  # () each: no deferred weight products
  weight_only_sums: frozenset[int] = frozenset()
  # Token slices: the sequences' length T (0: whole sequences) and the cell's cache
  # entries (full-length, one per `TokenSlice.extend` of a call, in call order).
  full_length: int = 0
  cache: tuple[tf.TensorSpec, ...] = ()

  @property
  def float_inputs(self) -> list[tf.TensorSpec]:
    return [t for t in self.inputs if t.dtype.is_floating]

  def loss_positions(self) -> tuple[int, int]:
    """Positions of the loss value and its weight among the last cell's flat outputs."""
    return _loss_positions(self.output_structure)

  def unflatten_outputs(self, flat_outputs: Sequence[Any]) -> Any:
    """Flat outputs (or anything in their places, e.g. stacked [M, ...]) → the nest
    the layers return."""
    return tf.nest.pack_sequence_as(self.output_structure, list(flat_outputs))

  def unflatten_stats(self, flat_stats: Sequence[tf.Tensor]) -> list[tuple[BaseLayer, Any]]:
    """Flat statistics → (layer, its statistics) per reporting layer."""
    return _unflatten_stats(self.stats_structure, flat_stats)


class _RunResult(NamedTuple):
  """What the layers (and head) did on one call's inputs (`CellFunctions._run`).

  outputs: the nest they return; cache_out: the token-slice cache entries the call
  extended ([] unless the inputs are a slice of sequences of T tokens; with the cache
  given as None, specs only: the entries were read as zeros); rows: the slices of
  the cell's stacked variables the call read, by id(RowVariable), and each stack read
  whole (`stacked_variables.bound`): the backward differentiates against them."""
  outputs: Any
  cache_out: list[tf.Tensor]
  rows: dict[int, tf.Tensor]


@dataclasses.dataclass
class _Traced:
  """What a cell's traced bodies share with the code that traces them.

  A tf.function body takes and returns flat tensors only: the nests it packs its
  arguments into come in here (input_structure, head_structure, set before each
  trace), and what a trace learns comes out here (the outputs' nest, the reporting
  layers, the variables read, the weight products' variables). Kept per cell, not
  per trace, because bodies traced later read it: the backward lays its sums out as
  the forward's variables, and the weight-gradient function is traced by the loop's
  first W call of each group size and `zeros`. The variables and weight products are
  checked to agree between traces (`_record_variables`, `_record_products`).
  """
  input_structure: Any = None
  head_structure: Any = None
  output_structure: Any = None
  stats_structure: tuple[tuple[BaseLayer, Any], ...] = ()
  variables: list[Any] | None = None
  # The running gradient sums of `variables` as stacked tensors, one per shape and dtype.
  layout: gradient_sums.StackedLayout | None = None
  # Per deferred weight product (in the order the layers make them): the position of
  # its variable in `variables`.
  product_variables: list[int] | None = None
  # Per deferred weight product: the static leading shape of its layer's input (what
  # its rows [n] were flattened from, e.g. (None, 12) for [b, S, I]), or None where
  # more than the micro-batch dimension is unknown (its n cannot be compared).
  product_rows: list[tuple | None] | None = None


def _comparable_rows(shape: tf.TensorShape) -> tuple | None:
  """A weight product's leading input shape as a key that equal row counts share:
  the shape itself where at most its first dimension (the micro-batch's, one for the
  whole cell) is unknown, else None (two such products may differ at run time)."""
  dims = shape.as_list() if shape.rank is not None else None
  if dims is None or None in dims[1:]:
    return None
  return tuple(dims)


def _differentiable(outputs: Any, has_head: bool) -> list[Any]:
  """The outputs (a cell's nest) a backward pass gets gradients for: the loss with a
  head, every floating output without one."""
  if has_head:
    return [outputs["loss"][0]]
  return [t for t in tf.nest.flatten(outputs) if _is_float(t)]


def _loss_positions(output_structure: Any) -> tuple[int, int]:
  positions = tf.nest.pack_sequence_as(
      output_structure, list(range(len(tf.nest.flatten(output_structure)))))
  return positions["loss"]


def _unflatten_stats(structure: Sequence[tuple[BaseLayer, Any]],
                     flat_stats: Sequence[tf.Tensor]) -> list[tuple[BaseLayer, Any]]:
  packed = tf.nest.pack_sequence_as([s for _, s in structure], list(flat_stats))
  return [(layer, s) for (layer, _), s in zip(structure, packed)]


class CellFunctions:
  """The traced-once forward and backward of the layers of one cell on `device`.

  `head` (last cell only) turns the cell's outputs and the micro-batch's head inputs
  (e.g. labels) into metrics; its loss is what the backward differentiates, and the
  head's own variables get gradients with the cell's.
  """

  def __init__(self, layers: Sequence[BaseLayer], device: str | None, index: int,
               recompute: bool, head: Head | None = None, needs_input_grads: bool = True,
               defer_weight_gradients: bool = False,
               run_layers: Callable[..., Any] = call_layers,
               stacks: Sequence[stacked_variables.VariableStack] = ()):
    self.layers = list(layers)
    # The cell's stacked variables: each body reads each once and differentiates
    # against its rows (stacked_variables.bound).
    self.stacks = list(stacks)
    # How the layers run on the cell's inputs: `call_layers`, or through functions
    # that layers of one kind share (LayerFunctions.call_layers).
    self.run_layers = run_layers
    self.device = device
    self.index = index
    self.recompute = recompute
    self.head = head
    self.needs_input_grads = needs_input_grads
    # The projections' weight gradients are left out of the backward call and
    # computed by `weight_gradients` in the schedule's W actions (over G micro-batches
    # at once, or one at a time in the bubble: schedule.SPLIT_BACKWARD).
    self.defers_weight_gradients = defer_weight_gradients
    self._traced = _Traced()
    self._forward_fn = tf.function(self._forward_body, experimental_attributes=NOT_INLINED,
                                   autograph=False)
    self._backward_fn = tf.function(self._backward_body, experimental_attributes=NOT_INLINED,
                                    autograph=False)
    self._weight_fn = tf.function(self._weight_body, experimental_attributes=NOT_INLINED,
                                  autograph=False, reduce_retracing=True)
    self._probed_forward_fn = tf.function(self._probed_forward_body,
                                          experimental_attributes=NOT_INLINED, autograph=False)
    self._signatures: dict[Any, CallSignature] = {}

  @property
  def product_variables(self) -> list[int] | None:
    """Per deferred weight product, the position of its variable among the cell's
    variables (None until a body that makes them is traced)."""
    return self._traced.product_variables

  # -- traced bodies ------------------------------------------------------------------

  def _run(self, flat_inputs, flat_head_inputs, step, call_info, stats, products=None,
           cache=(), full_length=0) -> _RunResult:
    """The layers (and head) on one call's inputs (`_RunResult`)."""
    example_offset, token_offset = tf.unstack(call_info)
    token_slice = token_slices.slice_of(token_offset, full_length, cache)
    with base_layer.step_context(training=True, step=step, example_offset=example_offset,
                                 layer_stats=stats, spans=None, weight_products=products,
                                 token_slice=token_slice), \
        stacked_variables.bound(self.stacks) as rows:
      traced = self._traced
      outputs = self.run_layers(self.layers,
                                tf.nest.pack_sequence_as(traced.input_structure, flat_inputs),
                                input_gradients=self.needs_input_grads)
      if self.head is not None:
        outputs = self.head(outputs, tf.nest.pack_sequence_as(traced.head_structure,
                                                             flat_head_inputs))
    return _RunResult(outputs, token_slices.outgoing(token_slice), rows)

  def _forward_body(self, flat_inputs, flat_head_inputs, step, call_info, cache, full_length):
    stats: list = []
    # Re-materialized, nothing differentiates this forward; otherwise TensorFlow's pair
    # does (`_kept_backward`).
    with tf.GradientTape() as tape, tf.name_scope(FORWARD_SCOPE), \
        layer_function.forward_only() if self.recompute else contextlib.nullcontext():
      # (the tape only learns which variables the cell reads)
      outputs, cache_out, _ = self._run(flat_inputs, flat_head_inputs, step, call_info,
                                        stats, cache=cache, full_length=full_length)
    self._record_variables(tape.watched_variables())
    self._traced.output_structure = outputs
    self._traced.stats_structure = tuple((layer, s) for layer, s in stats)
    return _ForwardResults(tf.nest.flatten(outputs), tf.nest.flatten([s for _, s in stats]),
                           cache_out, [])

  def _cache_specs_body(self, flat_inputs, flat_head_inputs, step, call_info, full_length):
    """The forward of a token slice with the cache read as zeros, for the specs of the
    cache entries it extends (traced once per shape, never run)."""
    return self._run(flat_inputs, flat_head_inputs, step, call_info, stats=[], cache=None,
                     full_length=full_length).cache_out

  def _product_outputs_body(self, flat_inputs, flat_head_inputs, step, call_info):
    """The forward, for the specs of its weight products' outputs [n, O] (traced once
    per shape, to size the probes of `_probed_forward_body`)."""
    products = base_layer.WeightProducts()
    self._run(flat_inputs, flat_head_inputs, step, call_info, stats=[], products=products)
    return [p.outputs for p in products.products]

  def _probed_forward_body(self, flat_inputs, flat_head_inputs, step, call_info, probes):
    """The forward with each weight product made as x·stop_gradient(W) + probe
    (WeightProducts): → outputs, statistics, and the products' inputs [n, I] as bits
    (`_as_bits`: outputs that take no gradient, so the backward needs no zero seeds
    of their size). No cache: a layer with token slices defers no weight gradient
    (pipeline/layer.py refuses the two together)."""
    stats: list = []
    products = base_layer.WeightProducts(probes=probes)
    with tf.name_scope(FORWARD_SCOPE):
      outputs = self._run(flat_inputs, flat_head_inputs, step, call_info, stats,
                          products).outputs
    recorded = self._record_products(products.products)
    if len(recorded) != len(probes):
      raise RuntimeError(f"cell {self.index}: {len(probes)} probes for {len(recorded)} "
                         "trainable weight products")
    return _ForwardResults(tf.nest.flatten(outputs), tf.nest.flatten([s for _, s in stats]),
                           [], [_as_bits(p.inputs) for p in recorded])

  def _backward_body(self, flat_inputs, flat_head_inputs, output_grads, sums, step,
                     call_info, cache, cache_grads, full_length):
    """→ input gradients, the gradients of the cache entries read, sums + variable
    gradients, and for each deferred weight product its inputs [n, I] and the
    gradient of its outputs [n, O] (empty lists unless weight gradients are
    deferred). `cache_grads`: the gradients of the entries the forward extended."""
    float_inputs = [t for t in flat_inputs if _is_float(t)]
    cache = list(cache)
    with tf.GradientTape() as tape:
      products = (base_layer.WeightProducts(tape) if self.defers_weight_gradients
                  else None)
      if self.needs_input_grads:
        tape.watch(float_inputs)
      tape.watch(cache)
      with tf.name_scope(RECOMPUTE_SCOPE):
        outputs, cache_out, rows = self._run(
            flat_inputs, flat_head_inputs, step, call_info,
            stats=None,  # statistics are reported by the forward only
            products=products, cache=cache, full_length=full_length)
      differentiated = _differentiable(outputs, self.head is not None)
    variables = self._record_variables(tape.watched_variables())
    products = self._record_products(products.products if products else [])
    input_sources = (float_inputs if self.needs_input_grads else []) + cache
    product_outputs = [p.outputs for p in products]
    # A stacked variable's rows are differentiated as the slices this trace read, and
    # a stack that runs of layers read whole (a loop over them) as that read too.
    sources = [rows[id(v)] if isinstance(v, stacked_variables.RowVariable) else v
               for v in variables]
    wholes = stacked_variables.whole_reads(rows)
    whole_stacks = [s for s in self.stacks if id(s) in wholes]
    # NONE, not ZERO: a variable reached only through deferred products gets no
    # gradient here, and its sum is passed on without adding zeros.
    grads = tape.gradient(differentiated + list(cache_out),
                          input_sources + sources + product_outputs
                          + [wholes[id(s)] for s in whole_stacks],
                          output_gradients=list(output_grads) + list(cache_grads),
                          unconnected_gradients=tf.UnconnectedGradients.NONE)
    split = len(grads) - len(whole_stacks)
    grads, whole_grads = grads[:split], grads[split:]
    input_grads = _zeros_where_none(grads[:len(input_sources)], input_sources)
    variable_grads = grads[len(input_sources):len(input_sources) + len(variables)]
    product_grads = _zeros_where_none(grads[len(input_sources) + len(variables):],
                                    product_outputs)
    num_inputs = len(input_sources) - len(cache)
    return (input_grads[:num_inputs], input_grads[num_inputs:],
            _accumulate(self._traced.layout, sums, variable_grads,
                        {id(s): g for s, g in zip(whole_stacks, whole_grads)}),
            [p.inputs for p in products],
            product_grads)

  def _weight_body(self, sums, inputs, output_grads, zeros):
    """sums + the deferred weight products' gradients over a group of micro-batches:
    inputs[i]ᵀ · output_grads[i] ([n, I]ᵀ·[n, O] → [I, O]) for each product i, in
    their (compute) dtype, then added in the variable's (the sums' float32 under
    mixed precision); `zeros`, a tuple of the positions of the sums known to be zeros
    (traced once per value)."""
    traced = self._traced
    grads: dict[int, tf.Tensor] = {}
    with tf.name_scope(WEIGHT_SCOPE):
      batched = self._batched_stacks(inputs, output_grads)
      stack_grads = {id(stack): tf.cast(tf.stack([tf.matmul(inputs[i], output_grads[i],
                                                            transpose_a=True)
                                                  for i in products]), stack.variable.dtype)
                     for stack, products in batched}
      in_batch = {i for _, products in batched for i in products}
      for i, (x, dy) in enumerate(zip(inputs, output_grads)):
        if i in in_batch:
          continue
        v = traced.product_variables[i]
        grad = tf.cast(tf.matmul(x, dy, transpose_a=True), traced.variables[v].dtype)
        grads[v] = grad if v not in grads else grads[v] + grad
    return _accumulate(traced.layout, sums,
                       [grads.get(v) for v in range(len(traced.variables))], stack_grads, zeros)

  def _batched_stacks(self, inputs: Sequence[Any], output_grads: Sequence[Any]
                      ) -> list[tuple[stacked_variables.VariableStack, list[int]]]:
    """The cell's stacks whose every row is the weight of exactly one deferred product,
    all of one input and one output shape and of inputs flattened from one static
    leading shape (a decoder's self-attention [b, T, I] and cross-attention [b, S, I]
    projections both give [n, I], n = b·T or b·S; `_Traced.product_rows`): each with
    its products in row order. Their gradient is each row's product [G·b, I]ᵀ·[G·b, O]
    → [I, O], stacked [n, I, O] and added to the sums whole. The rows' gradients one by
    one into a copy of the sums (`gradient_sums`' in-place path, for gradients that a
    backward makes one at a time) cost 1.6× as much (copy, then per-row adds that run
    at half the bandwidth of one add: docs/benchmarks_history.md, "Split backward's
    cost", 2026-11-26); one batched product of the stacked inputs
    [n, G·b, I]ᵀ·[n, G·b, O] cost 4-7% more than the rows' products and the stack of
    their results (the inputs' Pack, and BatchMatMul's transposed operand: there, "The
    engine's own cost, change by change (2026-11-28)")."""
    traced = self._traced
    products_of: dict[int, list[int]] = {}
    for i, v in enumerate(traced.product_variables):
      products_of.setdefault(v, []).append(i)
    positions = {id(v): k for k, v in enumerate(traced.variables)}
    batched = []
    for stack in self.stacks:
      found = [products_of.get(positions.get(id(row)), []) for row in stack.rows]
      if not all(len(p) == 1 for p in found):
        continue
      products = [p[0] for p in found]
      rows = {traced.product_rows[i] for i in products}
      if (None not in rows and len(rows) == 1
          and len({tuple(inputs[i].shape) for i in products}) == 1
          and len({tuple(output_grads[i].shape) for i in products}) == 1):
        batched.append((stack, products))
    return batched

  def _record_products(self, products: list[base_layer.WeightProduct]
                       ) -> list[base_layer.WeightProduct]:
    traced = self._traced
    positions = {v.ref(): i for i, v in enumerate(traced.variables)}
    products = [p for p in products if p.variable.ref() in positions]  # trainable ones
    indices = [positions[p.variable.ref()] for p in products]
    if traced.product_variables is None:
      traced.product_variables = indices
      traced.product_rows = [_comparable_rows(p.rows) for p in products]
    elif indices != traced.product_variables:
      raise RuntimeError(f"cell {self.index}: a second trace made other weight products")
    return products

  def _record_variables(self, watched: Sequence[tf.Variable]) -> list[Any]:
    """The variables a trace read, as the cell's sums lay them out: the rows of its
    stacks (each stack's rows in order), then every other variable read (a tf.Variable;
    `watched` holds the stacks themselves, which are read whole)."""
    traced = self._traced
    own = {s.variable.ref() for s in self.stacks}
    variables = ([row for s in self.stacks for row in s.rows]
                 + [v for v in watched if v.ref() not in own])
    if traced.variables is None:
      traced.variables = variables
      traced.layout = gradient_sums.StackedLayout(variables)
    elif [v.ref() for v in variables] != [v.ref() for v in traced.variables]:
      raise RuntimeError(
          f"cell {self.index}: a second trace read other variables "
          f"({[v.name for v in variables]} vs {[v.name for v in traced.variables]})")
    return traced.variables

  # -- what the device's loop calls ----------------------------------------------------

  def signature(self, input_specs: Any, head_specs: Any, full_length: int = 0
                ) -> CallSignature:
    """Traces the forward for one unit shape (nested TensorSpecs; head_specs None on
    cells without a head), and the backward of a re-materialized cell, and returns
    what tracing found: what its calls take and give, and the structures the loop
    packs their results into. full_length: T, the inputs being token slices of
    sequences of T tokens (0: whole sequences). Traced once per shape (the record is
    cached). Its parts: the cache entries (`_cache_specs`), the forward, then how the
    backward gets what it needs (`_recomputed_backward` or `_kept_backward`)."""
    key = (tuple(tf.nest.flatten(input_specs)), tuple(tf.nest.flatten(head_specs or [])),
           full_length)
    if key in self._signatures:
      return self._signatures[key]
    traced = self._traced
    traced.input_structure = input_specs
    traced.head_structure = head_specs
    flat_inputs, flat_head = list(key[0]), list(key[1])
    cache = self._cache_specs(flat_inputs, flat_head, full_length)
    forward = self._forward_fn.get_concrete_function(flat_inputs, flat_head, STEP, CALL_INFO,
                                                     cache, full_length)
    flat_outputs, flat_stats, _, _ = forward.structured_outputs
    backward = (self._recomputed_backward(flat_inputs, flat_head, flat_outputs, cache,
                                          full_length)
                if self.recompute else self._kept_backward(forward, flat_inputs, flat_head))
    signature = CallSignature(
        inputs=tuple(flat_inputs), head_inputs=tuple(flat_head),
        outputs=tuple(_specs(flat_outputs)), stats=tuple(_specs(flat_stats)),
        saved=backward.saved, output_structure=traced.output_structure,
        stats_structure=traced.stats_structure, variables=tuple(traced.variables),
        layout=traced.layout, pair=backward.pair, products=backward.products,
        weight_only_sums=backward.weight_only_sums,
        full_length=full_length, cache=tuple(cache))
    self._signatures[key] = signature
    return signature

  def _cache_specs(self, flat_inputs: list[tf.TensorSpec], flat_head: list[tf.TensorSpec],
                   full_length: int) -> list[tf.TensorSpec]:
    """Token slices: the specs of the cache entries the cell's forward extends ([] on
    whole sequences)."""
    if not full_length:
      return []
    return token_slices.traced_cache_specs(self._cache_specs_body, flat_inputs, flat_head,
                                           STEP, CALL_INFO, full_length)

  def _recomputed_backward(self, flat_inputs: list[tf.TensorSpec],
                           flat_head: list[tf.TensorSpec], flat_outputs: Sequence[Any],
                           cache: list[tf.TensorSpec], full_length: int) -> _Backward:
    """A re-materialized cell keeps its inputs; its backward (traced here) recomputes
    the forward and returns the deferred products' inputs and output gradients."""
    output_grads = _specs(_differentiable(
        tf.nest.pack_sequence_as(self._traced.output_structure, list(flat_outputs)),
        self.head is not None))
    backward = self._backward_fn.get_concrete_function(
        flat_inputs, flat_head, output_grads, self._traced.layout.specs(), STEP, CALL_INFO,
        cache, cache, full_length)
    _, _, _, product_inputs, product_grads = backward.structured_outputs
    return _Backward(Saved(inputs=tuple(flat_inputs), head_inputs=tuple(flat_head)), None,
                     ProductSpecs(tuple(_specs(product_inputs)), tuple(_specs(product_grads))))

  def _kept_backward(self, forward: Any, flat_inputs: list[tf.TensorSpec],
                     flat_head: list[tf.TensorSpec]) -> _Backward:
    """A cell not re-materialized keeps TensorFlow's intermediates for the backward
    of its forward function's pair; one that defers its weight gradients runs the
    probed forward instead (`_probed_forward_body`) and keeps, first, its products'
    inputs as bits."""
    products = ProductSpecs()
    if self.defers_weight_gradients:
      probes = tuple(_specs(tf.function(self._product_outputs_body, autograph=False)
                            .get_concrete_function(flat_inputs, flat_head, STEP, CALL_INFO)
                            .structured_outputs))
      forward = self._probed_forward_fn.get_concrete_function(
          flat_inputs, flat_head, STEP, CALL_INFO, list(probes))
      bits = _ForwardResults(*forward.structured_outputs).product_bits
      products = ProductSpecs(tuple(tf.TensorSpec(b.shape, p.dtype)
                                    for b, p in zip(bits, probes)), probes, probes)
    pair = tf_internals.forward_backward_pair(forward)
    saved = Saved(product_bits=tuple(tf.TensorSpec(s.shape, _BITS[s.dtype.size])
                                     for s in products.inputs),
                  kept=tuple(_specs([forward.graph.outputs[i] for i in pair.kept_positions])))
    return _Backward(saved, pair, products, self._sums_the_pair_leaves(pair))

  def _sums_the_pair_leaves(self, pair: tf_internals.ForwardBackwardPair) -> frozenset[int]:
    """The positions of the stacks' sums the backward of `pair` never adds to: stacks
    (read whole) that get no gradient from it (None among its traced outputs, as in
    every call of it). Other sums are left out: a W adds to them row by row, zeros or
    not."""
    given = {id(c) for c, g in zip(pair.captured_inputs, pair.captured_gradients())
             if g is not None}
    return self._traced.layout.positions_of(
        [s for s in self.stacks if id(s.variable.handle) not in given])

  def forward(self, sig: CallSignature, flat_inputs: Sequence[tf.Tensor],
              flat_head: Sequence[tf.Tensor], step: tf.Tensor, call_info: tf.Tensor,
              cache: Sequence[tf.Tensor] = ()
              ) -> tuple[list[tf.Tensor], list[tf.Tensor], Saved, list[tf.Tensor]]:
    """One forward call (on the caller's device): flat outputs, flat statistics, what
    the backward of this micro-batch needs (`Saved`, shaped as sig.saved), and the
    cache entries extended by this token slice (shaped as sig.cache; `cache`: as the
    micro-batch's previous slice left them)."""
    if sig.pair is None:
      results = self._forward_fn(list(flat_inputs), list(flat_head), step, call_info,
                                 list(cache), sig.full_length)
      return (list(results.outputs), list(results.stats),
              Saved(inputs=tuple(flat_inputs), head_inputs=tuple(flat_head)),
              list(results.cache))
    # Zeros: one tensor per distinct shape, passed as every probe of that shape.
    zeros: dict[tuple, tf.Tensor] = {}
    probes = [zeros.setdefault((tuple(spec.shape), spec.dtype),
                               tf_internals.zeros(spec.shape, spec.dtype))
              for spec in sig.products.probes]
    # (in PairArguments' order)
    results, kept = sig.pair.forward(list(flat_inputs) + list(flat_head) + [step, call_info]
                                     + list(cache) + probes)
    results = _ForwardResults.split(results, sig)
    return (results.outputs, results.stats,
            Saved(product_bits=tuple(results.product_bits), kept=tuple(kept)), results.cache)

  def backward(self, sig: CallSignature, saved: Saved,
               output_grads: Sequence[tf.Tensor], sums: Sequence[tf.Tensor], step: tf.Tensor,
               call_info: tf.Tensor, cache: Sequence[tf.Tensor] = (),
               cache_grads: Sequence[tf.Tensor] = (), zeros: Collection[int] = ()
               ) -> tuple[list[tf.Tensor], list[tf.Tensor], list[tf.Tensor], list[tf.Tensor],
                          list[tf.Tensor]]:
    """One backward call (on the caller's device).

    saved: what this micro-batch's forward kept; output_grads: one per differentiable
    output (the loss weight on the last cell);
    token slices: `cache`, the cell's cache entries as the micro-batch's last slice
    left them (a re-materialized cell reads what its slice read of them), and
    `cache_grads`, the gradients of the entries its forward extended.
    Returns the gradients of the floating inputs (an empty list when the cell needs
    none), those of the cache entries its forward read, `sums` (sig.layout's stacked
    tensors) plus this call's variable gradients, and per deferred weight product its
    inputs [n, I] and output gradient [n, O] (empty lists unless weight gradients are
    deferred).
    `zeros`: the positions of the sums known to be zeros (all of them at the cell's
    first backward of the step), where a stack's gradient, made whole, becomes its sum
    without an add (where the sums are added to outside a traced body, sig.pair's; a
    re-materialized cell's backward adds inside its one traced body, to the zeros). At
    M=1 that add was 2-3% of an MLP's step.
    """
    if sig.pair is None:
      input_grads, cache_in_grads, new_sums, product_inputs, product_grads = self._backward_fn(
          list(saved.inputs), list(saved.head_inputs), list(output_grads), list(sums),
          step, call_info, list(cache), list(cache_grads), sig.full_length)
      return (list(input_grads), list(cache_in_grads), list(new_sums), list(product_inputs),
              list(product_grads))
    pair, arguments = sig.pair, PairArguments.of(sig)
    product_inputs = [_from_bits(t, spec.dtype)
                      for t, spec in zip(saved.product_bits, sig.products.inputs)]
    # Seeds for every floating output of the forward function (outputs, statistics,
    # then the cache it extended): the given gradients for the differentiable ones,
    # zeros elsewhere.
    seeds = [tf_internals.zeros(spec.shape, spec.dtype) for spec in sig.outputs + sig.stats]
    if self.head is not None:
      seeds[sig.loss_positions()[0]] = output_grads[0]
    else:
      differentiable = [i for i, spec in enumerate(sig.outputs) if spec.dtype.is_floating]
      for i, g in zip(differentiable, output_grads):
        seeds[i] = g
    seeds += list(cache_grads)
    grads = pair.backward([seeds[i] for i in pair.trainable_outputs], list(saved.kept))
    cache_in_grads = _zeros_where_none(grads[arguments.cache], sig.cache)
    product_grads = _zeros_where_none(grads[arguments.probes], sig.products.probes)
    input_grads = []
    if self.needs_input_grads:
      input_grads = [_dense(g) for g, spec in zip(
          _zeros_where_none(grads[arguments.inputs], sig.inputs), sig.inputs)
                     if spec.dtype.is_floating]
    by_handle = {id(c): g for c, g in zip(pair.captured_inputs, grads[arguments.captured])}
    # A stack's gradient comes whole ([n, *shape]: the forward read it whole).
    variable_grads = [None if isinstance(v, stacked_variables.RowVariable)
                      else by_handle.get(id(v.handle)) for v in sig.variables]
    stack_grads = {id(s): by_handle.get(id(s.variable.handle)) for s in self.stacks}
    return (input_grads, cache_in_grads,
            _accumulate(sig.layout, sums, variable_grads, stack_grads, zeros),
            product_inputs, product_grads)

  def weight_gradients(self, sums: Sequence[tf.Tensor], inputs: Sequence[tf.Tensor],
                       output_grads: Sequence[tf.Tensor], zeros: Collection[int] = ()
                       ) -> list[tf.Tensor]:
    """One call: `sums` plus the deferred weight gradients of a group of micro-batches,
    each one product: inputs[i] [n, I] and output_grads[i] [n, O] are projection i's,
    the group's micro-batches concatenated. `zeros`: the positions of the sums known to
    be zeros (the cell's first W of the step, at its `weight_only_sums`): a stack
    batched whole there becomes its sum without an add."""
    return list(self._weight_fn(list(sums), list(inputs), list(output_grads),
                                tuple(sorted(zeros))))

  def call_forward(self, inputs: Any, head_inputs: Any, step: tf.Tensor, call_info: tf.Tensor
                   ) -> tuple[Any, list]:
    """A plain forward call under tf.device(self.device), differentiable by TensorFlow
    (`PipeliningLayer.fprop`): nested outputs and the (layer, stats) pairs reported."""
    traced = self._traced
    traced.input_structure = inputs
    traced.head_structure = head_inputs
    flat_head = tf.nest.flatten(head_inputs) if head_inputs is not None else []
    with tf.device(self.device):
      flat_outputs, flat_stats, _, _ = self._forward_fn(tf.nest.flatten(inputs), flat_head,
                                                        step, call_info, [], 0)
    return (tf.nest.pack_sequence_as(traced.output_structure, list(flat_outputs)),
            _unflatten_stats(traced.stats_structure, list(flat_stats)))

  def tracing_count(self) -> int:
    """How many times the bodies were traced (forward, and the backward of a
    re-materialized cell, once per distinct micro-batch shape each; weight gradients
    once per group size and `zeros`; whatever M is)."""
    return (self._forward_fn.experimental_get_tracing_count()
            + self._backward_fn.experimental_get_tracing_count()
            + self._weight_fn.experimental_get_tracing_count()
            + self._probed_forward_fn.experimental_get_tracing_count())
