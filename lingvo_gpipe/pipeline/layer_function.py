"""Layers of one kind traced once: a pipeline calls one function per kind of layer.

Traced layer by layer, a pipeline of L identical layers (a Transformer's) put each
layer's ops into its cell's functions: tracing, the function library, Grappler and
the first call all grew with L (about 1.5 s per 64-wide Transformer layer;
docs/benchmarks_history.md, the start-up entries "One loop per cell" and "Layers of one
kind traced once", 2026-11-23). Here the layers of a pipeline that are of one *kind*
share one `tf.function`:

  kind = (the layer's class, its params but the name, training or not)
  layer_fn(variables, inputs, info, seeds, cache) → (outputs, flat batch statistics,
                                                     cache)

- variables: the layer's variables (its own, then its descendants', in `walk()`
  order; a stacked variable's row as the tensor its cell read) enter as arguments.
  tf.function traces once for variables of equal shapes and dtypes, and the
  gradient of a call reaches the variables passed to it.
- info: int64 [3], the StepContext's (global step, example offset, token offset)
  (`step_info`).
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
`weight_gradient_group` > 1, or a schedule of schedule.SPLIT_BACKWARD) are not
shared: their products must reach the cell's own tape. Nor are layers of a class
with `shares_traces = False`.

With `scan_layers` (PipeliningLayer's param), a run of consecutive layers of one kind
in a cell is one loop over their stacked weights instead of one call per layer
(`_KindFunction.scan`, `_differentiable_loop`): the traced step is then the same ops
at any depth (`tests/scan_layers_test.py`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import tensorflow as tf

from lingvo_gpipe.core import base_layer, stacked_variables, tf_internals, token_slices
from lingvo_gpipe.core.base_layer import BaseLayer
from lingvo_gpipe.core.tf_internals import NOT_INLINED

_STATE = threading.local()


@contextlib.contextmanager
def forward_only() -> Iterator[None]:
  """Within (this thread), nothing differentiates the layers run: a loop over a run of
  layers keeps nothing for a backward (a re-materialized cell's forward action)."""
  previous = getattr(_STATE, "forward_only", False)
  _STATE.forward_only = True
  try:
    yield
  finally:
    _STATE.forward_only = previous


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

  def _layer_body(self, variables, inputs, info, seeds, cache, full_length,
                  input_gradient=True):
    """cache: the layer's incoming cache entries (None: specs only, read as zeros);
    full_length: T of a token slice (0: whole sequences); input_gradient False: the
    inputs are read through stop_gradient, so the backward TensorFlow builds for this
    trace computes no gradient for them (a call's backward computes every gradient
    its function has, whether the caller uses it or not)."""
    if not input_gradient:
      inputs = tf.nest.map_structure(
          lambda t: tf.stop_gradient(t) if isinstance(t, tf.Tensor) else t, inputs)
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

  def scan(self, layers: Sequence[BaseLayer], inputs: Any, info: tf.Tensor,
           ctx: base_layer.StepContext) -> Any:
    """`layers` (n ≥ 2 consecutive layers of this kind, each output the next one's
    input) as one tf.while_loop over their weights: iteration i calls the kind's
    traced function on layer i's weights and seeds, so the graph holds one call
    whatever n is. Layer i's weights are row i of [n, *shape] slices of their stacks'
    reads (`stacked_variables.whole_read`: a read of its own, so the cell's backward
    takes the slices' gradient whole, beside the rows the other layers read), entering
    the loop as TensorArrays. Where nothing differentiates the call (`forward_only`: a
    re-materialized cell's forward action; eval) the loop keeps nothing; otherwise it is
    `_differentiable_loop`, with a gradient of its own. None where the layers cannot
    run so (a weight not a stack's row, rows not evenly spaced in one stack, or outputs
    not shaped as the inputs): the caller calls them one by one."""
    sublayers = [list(layer.walk()) for layer in layers]
    weights = [[v for sub in subs for v in sub.read_variables()] for subs in sublayers]
    slices = _row_slices(weights)
    if slices is None:
      return None
    first = [v.value() for v in weights[0]]
    concrete = self.function.get_concrete_function(first, inputs, info, _SEEDS, [], 0, True)
    flat_inputs = tf.nest.flatten(inputs)
    if [(tuple(t.shape), t.dtype) for t in tf.nest.flatten(concrete.structured_outputs[0])] \
        != [(tuple(t.shape), t.dtype) for t in flat_inputs]:
      return None
    n = len(layers)
    seeds = tf.constant([[subs[i].seed_for(purpose) for i, purpose in self.layout.seeds]
                         for subs in sublayers], tf.int64, shape=[n, len(self.layout.seeds)])
    num_stats = len(concrete.structured_outputs[1])
    if getattr(_STATE, "forward_only", False) or not ctx.training:
      rows, seed_rows, stats = _iteration_arrays(slices, seeds, concrete.structured_outputs[1])

      def body(i, flat_x, stats):
        x = tf.nest.pack_sequence_as(inputs, flat_x)
        outputs, flat_stats, _ = concrete([ta.read(i) for ta in rows], x, info,
                                          seed_rows.read(i), [], 0, True)
        return (i + 1, tf.nest.flatten(outputs),
                [ta.write(i, t) for ta, t in zip(stats, flat_stats)])

      _, flat_out, stats = tf.while_loop(lambda i, *_: i < n, body, (0, flat_inputs, stats),
                                         maximum_iterations=n)
      stacked_stats = [ta.stack() for ta in stats]
    else:
      flat_out, stacked_stats = _differentiable_loop(concrete, slices, seeds, flat_inputs,
                                                     info, num_stats)
    if ctx.layer_stats is not None and self.layout.stats:
      per_layer = [tf.unstack(t, num=n) for t in stacked_stats]
      for k, subs in enumerate(sublayers):
        packed = tf.nest.pack_sequence_as([s for _, s in self.layout.stats],
                                          [values[k] for values in per_layer])
        for (i, _), layer_stats in zip(self.layout.stats, packed):
          ctx.layer_stats.append((subs[i], layer_stats))
    return tf.nest.pack_sequence_as(inputs, flat_out)

  def call(self, layer: BaseLayer, inputs: Any, info: tf.Tensor,
           ctx: base_layer.StepContext, input_gradient: bool = True) -> Any:
    """`layer` (of this kind) on `inputs`, through the traced function. Its variables
    (its own, then its descendants', in `walk()` order) are the function's first
    argument; on a token slice its cache entries are taken from and given back to
    the StepContext's slice cache. input_gradient False: nothing needs the gradient
    of `inputs` (a first cell's first layer), whose backward is then a trace of its
    own that skips it."""
    sublayers = list(layer.walk())
    # A stacked variable's row enters as the tensor its cell read (stacked_variables).
    variables = [v.value() if isinstance(v, stacked_variables.RowVariable) else v
                 for sublayer in sublayers for v in sublayer.read_variables()]
    token_slice = ctx.token_slice
    full_length = token_slice.full_length if token_slice is not None else 0
    specs = (self._cache_specs(variables, inputs, info, full_length) if token_slice is not None
             else [])
    cache = token_slice.cache.take(specs) if token_slice is not None else []
    concrete = self.function.get_concrete_function(variables, inputs, info, _SEEDS, specs,
                                                   full_length, input_gradient)
    seeds = tf.constant([sublayers[i].seed_for(purpose) for i, purpose in self.layout.seeds],
                        tf.int64, shape=[len(self.layout.seeds)])
    outputs, flat_stats, cache_out = concrete(variables, inputs, info, seeds, cache,
                                              full_length, input_gradient)
    if token_slice is not None:
      token_slice.cache.give(cache_out)
    if ctx.layer_stats is not None and self.layout.stats:
      packed = tf.nest.pack_sequence_as([s for _, s in self.layout.stats], list(flat_stats))
      for (i, _), stats in zip(self.layout.stats, packed):
        ctx.layer_stats.append((sublayers[i], stats))
    return outputs


def _differentiable_loop(concrete: Any, slices: list[tf.Tensor], seeds: tf.Tensor,
                         flat_x: list[tf.Tensor], info: tf.Tensor, num_stats: int
                         ) -> tuple[list[tf.Tensor], list[tf.Tensor]]:
  """The loop of `_KindFunction.scan` with a gradient of its own: → (flat outputs,
  statistics [n, ...] per flat statistic).

  Forward: iteration i runs TensorFlow's forward of `concrete` that also returns the
  intermediates its backward needs (`tf_internals.forward_backward_pair`) and pushes
  them onto one list per dtype (TensorFlow's own gradient of a loop keeps one list
  per intermediate, each a loop variable: 95 for a Transformer layer, and it was the
  loop's cost), each flat; after the loop each list is given as one dense tensor and its
  elements' lengths. Backward: the loop in reverse pops them, runs the pair's backward
  and writes row i of each weight's gradient in place (one list per weight, stacked
  once: TensorFlow's own adds an n-long list per row read, O(n) per iteration)."""
  pair = tf_internals.forward_backward_pair(concrete)
  kept_specs = [tf.TensorSpec(concrete.graph.outputs[i].shape, concrete.graph.outputs[i].dtype)
                for i in pair.kept_positions]
  dtypes = sorted({spec.dtype for spec in kept_specs}, key=lambda d: d.name)
  n = int(seeds.shape[0])
  num_rows, num_x = len(slices), len(flat_x)
  outputs_specs = [tf.TensorSpec(t.shape, t.dtype)
                   for t in concrete.graph.outputs[:pair.num_outputs]]
  # Kept tensors reshaped back from flat need at most one unknown dimension each (the
  # micro-batch's); otherwise the lists stay list handles.
  dense_kept = all(spec.shape.rank is not None and spec.shape.as_list().count(None) <= 1
                   for spec in kept_specs)

  @tf.custom_gradient
  def loop(*args):
    rows, seed_rows, stats = _iteration_arrays(args[:num_rows], seeds,
                                               outputs_specs[num_x:num_x + num_stats])
    kept_lists = [tf.raw_ops.EmptyTensorList(element_shape=tf.constant(-1, tf.int32),
                                             max_num_elements=-1, element_dtype=d)
                  for d in dtypes]

    def body(i, x, kept_lists, stats):
      results, kept = pair.forward([ta.read(i) for ta in rows] + list(x)
                                   + [info, seed_rows.read(i)])
      kept_lists = list(kept_lists)
      for t, spec in zip(kept, kept_specs):
        d = dtypes.index(spec.dtype)
        kept_lists[d] = tf.raw_ops.TensorListPushBack(
            input_handle=kept_lists[d], tensor=tf.reshape(t, [-1]) if dense_kept else t)
      return (i + 1, results[:num_x], kept_lists,
              [ta.write(i, t) for ta, t in zip(stats, results[num_x:num_x + num_stats])])

    _, out, kept_lists, stats = tf.while_loop(
        lambda i, *_: i < n, body, (0, list(args[num_rows:]), kept_lists, stats),
        maximum_iterations=n)
    # What the backward keeps, as dense tensors rather than list handles: a cell that
    # is not re-materialized stashes them in its device loop, and TensorArrays of
    # DT_VARIANT have no GPU kernels (tools/gpu_audit.py found it). The elements were
    # pushed flat; each list becomes one 1-D tensor and its elements' lengths (int64).
    if dense_kept:
      kept_lists = [tf.raw_ops.TensorListConcatV2(
          input_handle=handle, element_shape=tf.constant([-1], tf.int64),
          leading_dims=tf.constant([], tf.int64), element_dtype=d)
          for handle, d in zip(kept_lists, dtypes)]

    def gradient(*output_grads):
      dy = [g if g is not None else tf_internals.zeros(t.shape, t.dtype)
            for g, t in zip(output_grads[:num_x], out)]
      row_grads = [tf.TensorArray(t.dtype, size=n, element_shape=t.shape[1:])
                   for t in args[:num_rows]]
      lists = ([tf.raw_ops.TensorListSplit(
          tensor=flat, element_shape=tf.constant([-1], tf.int64), lengths=lengths)
          for flat, lengths in kept_lists] if dense_kept else kept_lists)

      def back(j, dy, kept_lists, row_grads):
        i = n - 1 - j
        kept_lists = list(kept_lists)
        kept: list[Any] = [None] * len(kept_specs)
        for k in reversed(range(len(kept_specs))):
          spec = kept_specs[k]
          d = dtypes.index(spec.dtype)
          kept_lists[d], t = tf.raw_ops.TensorListPopBack(
              input_handle=kept_lists[d], element_shape=tf.constant(-1, tf.int32),
              element_dtype=spec.dtype)
          if dense_kept:
            t = tf.reshape(t, [-1 if dim is None else dim for dim in spec.shape.as_list()])
          t.set_shape(spec.shape)
          kept[k] = t
        seeds_out = [tf_internals.zeros(spec.shape, spec.dtype) for spec in outputs_specs]
        seeds_out[:num_x] = dy
        grads = pair.backward([seeds_out[t] for t in pair.trainable_outputs], kept)
        dx = [g if g is not None else tf_internals.zeros(t.shape, t.dtype)
              for g, t in zip(grads[num_rows:num_rows + num_x], dy)]
        return (j + 1, dx, kept_lists,
                [ta.write(i, g if g is not None else tf_internals.zeros(ta.element_shape, ta.dtype))
                 for ta, g in zip(row_grads, grads[:num_rows])])

      _, dx, _, row_grads = tf.while_loop(lambda j, *_: j < n, back,
                                          (0, dy, lists, row_grads),
                                          maximum_iterations=n)
      return [ta.stack() for ta in row_grads] + [
          g if t.dtype.is_floating else None for g, t in zip(dx, args[num_rows:])]

    return list(out) + [ta.stack() for ta in stats], gradient

  results = loop(*slices, *flat_x)
  return list(results[:num_x]), list(results[num_x:])


def _iteration_arrays(slices: Sequence[tf.Tensor], seeds: tf.Tensor,
                      stat_specs: Sequence[Any]
                      ) -> tuple[list[tf.TensorArray], tf.TensorArray, list[tf.TensorArray]]:
  """A scan loop's TensorArrays, n = seeds' rows: each weight's [n, *shape] slice and
  the seeds [n, S] as arrays that iteration i reads row i of, and one empty array of n
  per statistic (each spec's shape) that iteration i writes."""
  n = int(seeds.shape[0])
  rows = [tf.TensorArray(t.dtype, size=n, element_shape=t.shape[1:]).unstack(t)
          for t in slices]
  seed_rows = tf.TensorArray(seeds.dtype, size=n, element_shape=seeds.shape[1:]).unstack(seeds)
  stats = [tf.TensorArray(spec.dtype, size=n, element_shape=spec.shape) for spec in stat_specs]
  return rows, seed_rows, stats


def _row_slices(weights: list[list[Any]]) -> list[tf.Tensor] | None:
  """weights[i][j]: layer i's j-th variable → per j, the [n, *shape] slice of its
  stack's whole read holding the n layers' rows (rows r, r + d, …, evenly spaced in
  one stack), or for variables that are not trained (batch norm's moving statistics:
  not stacked, not differentiated) their n reads stacked; None where a trained
  variable is not a stack's row or the rows are not so."""
  slices = []
  for j in range(len(weights[0])):
    column = [w[j] for w in weights]
    if not any(isinstance(v, stacked_variables.RowVariable) or v.trainable for v in column):
      slices.append(tf.stack([v.read_value() for v in column]))
      continue
    if not all(isinstance(v, stacked_variables.RowVariable) for v in column):
      return None
    stack = column[0].stack
    first = column[0].row
    step = column[1].row - first
    if step <= 0 or any(v.stack is not stack or v.row != first + i * step
                        for i, v in enumerate(column)):
      return None
    whole = stacked_variables.whole_read(stack)
    if first == 0 and step == 1 and len(column) == len(stack.rows):
      slices.append(whole)  # (scan_layers stacks each weight of a kind apart: the rule)
    else:
      slices.append(whole[first:first + (len(column) - 1) * step + 1:step])
  return slices


class LayerFunctions:
  """The traced functions of the kinds of layer of one pipeline (all its cells, in
  training and eval)."""

  def __init__(self, scan_layers: bool = False):
    self._functions: dict[tuple, _KindFunction] = {}
    self._kinds: dict[tuple[int, bool], tuple] = {}  # (id(layer), training) → kind
    # Consecutive layers of one kind run as one loop (`_KindFunction.scan`) where
    # they can: on whole sequences (not token slices), without deferred weight
    # products, their weights rows of stacks.
    self.scan_layers = scan_layers

  def _kind(self, layer: BaseLayer, training: bool) -> tuple | None:
    """The kind of `layer`, or None where it runs as itself (its class shares no
    traces, or the call records deferred weight products, which must reach the
    cell's own tape)."""
    if not type(layer).shares_traces or base_layer.current_context().weight_products is not None:
      return None
    key = (id(layer), training)
    if key not in self._kinds:
      self._kinds[key] = kind_of(layer, training)
    return self._kinds[key]

  def call_layers(self, layers: Sequence[BaseLayer], x: Any,
                  input_gradients: bool = True) -> Any:
    """Runs `layers` in order, each through its kind's function where it can share
    one, a run of consecutive layers of one kind as one loop where it can
    (`scan_layers`); a tuple output is passed on as positional arguments.
    input_gradients False: nothing differentiates `x` (the first cell's inputs), so a
    first layer called through its kind's function on a floating `x` skips its input
    gradient (a trace of its own: on the MLP of bench/pipeline_speedup.py that is one
    matmul of 16 in each backward, docs/benchmarks_history.md, "The engine's own cost,
    change by change (2026-11-28)")."""
    ctx = base_layer.current_context()
    info = step_info()
    training = bool(ctx.training)
    kinds = [self._kind(layer, training) for layer in layers]
    i = 0
    while i < len(layers):
      kind = kinds[i]
      if kind is None:
        x = base_layer.call_with(layers[i], x)
        i += 1
        continue
      if kind not in self._functions:
        self._functions[kind] = _KindFunction(layers[i])
      function = self._functions[kind]
      end = i + 1
      while end < len(kinds) and kinds[end] == kind:
        end += 1
      if self.scan_layers and end - i >= 2 and ctx.token_slice is None:
        scanned = function.scan(layers[i:end], x, info, ctx)
        if scanned is not None:
          x, i = scanned, end
          continue
      for layer in layers[i:end]:
        skip_input_gradient = (i == 0 and not input_gradients and any(
            isinstance(t, tf.Tensor) and t.dtype.is_floating for t in tf.nest.flatten(x)))
        x = function.call(layer, x, info, ctx, input_gradient=not skip_input_gradient)
        i += 1
    return x

  @property
  def num_kinds(self) -> int:
    return len(self._functions)

  def tracing_count(self) -> int:
    """How many times the kinds' functions were traced (once per kind and input
    signature, whatever the number of layers of each kind)."""
    return sum(f.function.experimental_get_tracing_count() for f in self._functions.values())
