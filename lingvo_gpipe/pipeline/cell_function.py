"""A cell's forward and backward as functions traced once and called per micro-batch.

`CellFunctions` wraps the layers of one cell (and, for the last cell, the task's loss
head) in `tf.function`s:

  forward(inputs, head_inputs, step, call_info)
      → outputs (the head's metrics on the last cell), batch statistics
  backward(inputs, head_inputs, output_grads, sums, step, call_info)
      → input gradients, sums + variable gradients (recomputes the forward inside)
  weight_gradients(sums, deferred inputs and output gradients of G micro-batches)
      → sums + the projections' weight gradients over the G micro-batches, one product
        each (only with weight_gradient_group G > 1: the backward then leaves them out)

Each is traced once per distinct micro-batch shape (an uneven split has two) and then
*called*: the step graph holds one call op per (cell, micro-batch, phase), so its
size grows with K·M call ops while the traced bodies do not grow with M
(`tests/pipeline_graph_test.py` pins both). What varies per call enters as tensors:
the global step, and `call_info` = int64 [micro-batch index, example offset] (see
`executor.call_infos`); the step and the offset seed dropout exactly as in the
unpartitioned model, so the recompute inside `backward` draws the forward's masks.

TensorFlow behaviours that shape the engine (the ones beyond its documented API are
listed, with the tests that pin them, in `tf_internals.py`):

- The calls carry the function attribute `_noinline` (`tf_internals.NOT_INLINED`), so
  Grappler neither inlines them into the step nor merges the recomputed forward into
  the forward.
- Grappler's function optimizer is off for the process
  (`tf_internals.disable_function_specialization`): it would specialize a body copy
  per call. The per-call scalars also come from a PlaceholderWithDefault, which it
  never sees as constant (`executor.call_infos`).
- A call op placed with `tf.device(d)` runs every op of its body that names no device
  on d; the traced outer graph does not show that, so placement is proven from the
  ops that executed (`tests/pipeline_placement_test.py`, TensorFlow's debug dump).

Without re-materialization (`recompute=False`) the backward is TensorFlow's own
gradient of the forward call, taken from a GradientTape held across the call: TF
rewrites the forward function once to also return the intermediates the gradient
needs, and differentiates it once; both are again called per micro-batch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from lingvo_gpipe.core import base_layer
from lingvo_gpipe.core.base_layer import BaseLayer
from lingvo_gpipe.pipeline.tf_internals import NOT_INLINED

# Head(outputs of the last cell, head inputs of the micro-batch) → metrics
# {name: (value, weight)}; metrics["loss"][0] is the mean loss over the weight.
Head = Callable[[Any, Any], dict]

# Name scopes of the ops in the traced bodies: profiles tell the phases apart by them
# (bench/micro_batch_profile.py). TensorFlow names the gradient ops of the recomputed
# forward "gradient_tape/recompute/...".
FORWARD_SCOPE, RECOMPUTE_SCOPE, ACCUMULATE_SCOPE = "forward", "recompute", "accumulate"
WEIGHT_SCOPE = "weight_gradient"  # deferred weight gradients (weight_gradient_group > 1)


def call_layers(layers: Sequence[BaseLayer], x: Any) -> Any:
  """Runs `layers` in order; a tuple output is passed on as positional arguments."""
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


def _accumulate(sums: Sequence[tf.Tensor], grads: Sequence[Any]) -> list[tf.Tensor]:
  """sums + grads; a None gradient leaves its sum as it is."""
  with tf.name_scope(ACCUMULATE_SCOPE):
    return [s if g is None else s + _dense(g) for s, g in zip(sums, grads)]


def _zeros_for_none(grads: Sequence[Any], like: Sequence[tf.Tensor]) -> list[tf.Tensor]:
  return [tf.zeros_like(t) if g is None else g for g, t in zip(grads, like)]


def _concat(tensors: Sequence[tf.Tensor]) -> tf.Tensor:
  return tensors[0] if len(tensors) == 1 else tf.concat(list(tensors), axis=0)


@dataclasses.dataclass
class DeferredWeightGradient:
  """What one backward call leaves for `CellFunctions.weight_gradients`: per deferred
  weight product, its inputs [n, I] and the gradient of its outputs [n, O]."""
  inputs: list[tf.Tensor]
  output_grads: list[tf.Tensor]


@dataclasses.dataclass
class Saved:
  """What a forward call keeps for its backward: the inputs (re-materialized
  cells), or the tape and outputs of the forward (the others)."""
  inputs: list[tf.Tensor]
  head_inputs: list[tf.Tensor]
  outputs: list[tf.Tensor]
  tape: tf.GradientTape | None = None


class CellFunctions:
  """The traced-once forward and backward of the layers of one cell on `device`.

  `head` (last cell only) turns the cell's outputs and the micro-batch's head inputs
  (e.g. labels) into metrics; its loss is what the backward differentiates, and the
  head's own variables get gradients with the cell's.
  """

  def __init__(self, layers: Sequence[BaseLayer], device: str | None, index: int,
               recompute: bool, head: Head | None = None, needs_input_grads: bool = True,
               weight_gradient_group: int = 1):
    self.layers = list(layers)
    self.device = device
    self.index = index
    self.recompute = recompute
    self.head = head
    self.needs_input_grads = needs_input_grads
    # G > 1 (re-materialized cells only): the projections' weight gradients are left
    # out of the backward call and computed by `weight_gradients` over G micro-batches.
    self.weight_gradient_group = weight_gradient_group if recompute else 1
    # Python structure of a call, fixed by the layers (the same for every shape);
    # recorded when a body is traced.
    self.input_structure: Any = None
    self.head_structure: Any = None
    self.output_structure: Any = None
    self.stats_structure: list[tuple[BaseLayer, Any]] | None = None
    self.variables: list[tf.Variable] | None = None
    # Per deferred weight product (in the order the layers make them): the position of
    # its variable in self.variables.
    self.product_variables: list[int] | None = None
    self._forward_fn = tf.function(self._forward_body, experimental_attributes=NOT_INLINED,
                                   autograph=False)
    self._backward_fn = tf.function(self._backward_body, experimental_attributes=NOT_INLINED,
                                    autograph=False)
    self._weight_fn = tf.function(self._weight_body, experimental_attributes=NOT_INLINED,
                                  autograph=False)

  @property
  def defers_weight_gradients(self) -> bool:
    return self.weight_gradient_group > 1

  # -- traced bodies ------------------------------------------------------------------

  def _run(self, flat_inputs, flat_head_inputs, step, call_info, stats, products=None):
    micro_batch, example_offset = tf.unstack(call_info)
    with base_layer.step_context(training=True, step=step, micro_batch=micro_batch,
                                 example_offset=example_offset, layer_stats=stats,
                                 spans=None, weight_products=products):
      outputs = call_layers(self.layers,
                            tf.nest.pack_sequence_as(self.input_structure, flat_inputs))
      if self.head is not None:
        outputs = self.head(outputs, tf.nest.pack_sequence_as(self.head_structure,
                                                             flat_head_inputs))
    return outputs

  def _forward_body(self, flat_inputs, flat_head_inputs, step, call_info):
    stats: list = []
    with tf.GradientTape() as tape, tf.name_scope(FORWARD_SCOPE):
      # (the tape only learns which variables the cell reads)
      outputs = self._run(flat_inputs, flat_head_inputs, step, call_info, stats)
    self._record_variables(tape.watched_variables())
    self.output_structure = outputs
    self.stats_structure = [(layer, s) for layer, s in stats]
    return tf.nest.flatten(outputs), tf.nest.flatten([s for _, s in stats])

  def _backward_body(self, flat_inputs, flat_head_inputs, output_grads, sums, step,
                     call_info):
    """→ input gradients, sums + variable gradients, and for each deferred weight
    product its inputs [n, I] and the gradient of its outputs [n, O] (empty lists
    unless weight gradients are deferred)."""
    float_inputs = [t for t in flat_inputs if _is_float(t)]
    with tf.GradientTape() as tape:
      products = (base_layer.WeightProducts(tape) if self.defers_weight_gradients
                  else None)
      if self.needs_input_grads:
        tape.watch(float_inputs)
      with tf.name_scope(RECOMPUTE_SCOPE):
        outputs = self._run(flat_inputs, flat_head_inputs, step, call_info,
                            stats=None,  # statistics are reported by the forward only
                            products=products)
      differentiated = self.differentiable_outputs(tf.nest.flatten(outputs))
    variables = self._record_variables(tape.watched_variables())
    products = self._record_products(products.products if products else [])
    input_sources = float_inputs if self.needs_input_grads else []
    product_outputs = [p.outputs for p in products]
    # NONE, not ZERO: a variable reached only through deferred products gets no
    # gradient here, and its sum is passed on without adding zeros.
    grads = tape.gradient(differentiated, input_sources + variables + product_outputs,
                          output_gradients=list(output_grads),
                          unconnected_gradients=tf.UnconnectedGradients.NONE)
    input_grads = _zeros_for_none(grads[:len(input_sources)], input_sources)
    variable_grads = grads[len(input_sources):len(input_sources) + len(variables)]
    product_grads = _zeros_for_none(grads[len(input_sources) + len(variables):],
                                    product_outputs)
    return (input_grads, _accumulate(sums, variable_grads), [p.inputs for p in products],
            product_grads)

  def _weight_body(self, sums, group_inputs, group_output_grads):
    """sums + the deferred weight products' gradients over a group of micro-batches.

    group_inputs[i][g]: product i's inputs [n_g, I] in the group's g-th micro-batch;
    group_output_grads[i][g]: the gradient of its outputs [n_g, O]. One product
    concat(inputs)ᵀ · concat(output gradients) per product: [I, O].
    """
    grads: dict[int, tf.Tensor] = {}
    with tf.name_scope(WEIGHT_SCOPE):
      for i, (inputs, output_grads) in enumerate(zip(group_inputs, group_output_grads)):
        grad = tf.matmul(_concat(inputs), _concat(output_grads), transpose_a=True)
        v = self.product_variables[i]
        grads[v] = grad if v not in grads else grads[v] + grad
    return _accumulate(sums, [grads.get(v) for v in range(len(sums))])

  def _record_products(self, products: list[base_layer.WeightProduct]
                       ) -> list[base_layer.WeightProduct]:
    positions = {v.ref(): i for i, v in enumerate(self.variables)}
    products = [p for p in products if p.variable.ref() in positions]  # trainable ones
    indices = [positions[p.variable.ref()] for p in products]
    if self.product_variables is None:
      self.product_variables = indices
    elif indices != self.product_variables:
      raise RuntimeError(f"cell {self.index}: a second trace made other weight products")
    return products

  def _record_variables(self, watched: Sequence[tf.Variable]) -> list[tf.Variable]:
    variables = list(watched)
    if self.variables is None:
      self.variables = variables
    elif [v.ref() for v in variables] != [v.ref() for v in self.variables]:
      raise RuntimeError(f"cell {self.index}: a second trace read other variables "
                         f"({[v.name for v in variables]} vs {[v.name for v in self.variables]})")
    return self.variables

  # -- what the executor calls --------------------------------------------------------

  def differentiable_outputs(self, flat_outputs: Sequence[tf.Tensor]) -> list[tf.Tensor]:
    """The outputs a backward pass gets gradients for: the loss on the last cell,
    every floating output on the others."""
    if self.head is not None:
      packed = tf.nest.pack_sequence_as(self.output_structure, list(flat_outputs))
      return [packed["loss"][0]]
    return [t for t in flat_outputs if _is_float(t)]

  def forward(self, inputs: Any, head_inputs: Any, step: tf.Tensor, call_info: tf.Tensor
              ) -> tuple[Any, list, Saved]:
    """One forward call under tf.device(self.device).

    inputs: nested tensors [b, ...] of one micro-batch; head_inputs: the head's nested
    tensors [b, ...] (None on cells without a head). Returns the outputs (nested),
    the (layer, stats) pairs layers reported, and what the backward needs.
    """
    self.input_structure = inputs
    self.head_structure = head_inputs
    flat_inputs = tf.nest.flatten(inputs)
    flat_head = tf.nest.flatten(head_inputs) if head_inputs is not None else []
    tape = None
    with tf.device(self.device):
      if self.recompute:
        flat_outputs, flat_stats = self._forward_fn(flat_inputs, flat_head, step, call_info)
      else:
        with tf.GradientTape(persistent=False) as tape:
          if self.needs_input_grads:
            tape.watch([t for t in flat_inputs if _is_float(t)])
          flat_outputs, flat_stats = self._forward_fn(flat_inputs, flat_head, step,
                                                      call_info)
    stats = self._unflatten_stats(list(flat_stats))
    outputs = tf.nest.pack_sequence_as(self.output_structure, list(flat_outputs))
    return outputs, stats, Saved(flat_inputs, flat_head, list(flat_outputs), tape)

  def zero_gradients(self) -> list[tf.Tensor]:
    """Zeros shaped like self.variables, on this cell's device: the running sums'
    start (the variables are known once the forward is traced)."""
    with tf.device(self.device):
      return [tf.zeros(v.shape, v.dtype) for v in self.variables]

  def backward(self, saved: Saved, output_grads: Sequence[tf.Tensor],
               sums: Sequence[tf.Tensor], step: tf.Tensor, call_info: tf.Tensor
               ) -> tuple[list[tf.Tensor | None], list[tf.Tensor], DeferredWeightGradient]:
    """One backward call: gradients of the differentiable outputs (seeded with
    output_grads) with respect to the floating inputs (None for the others, and for
    all when the cell needs no input gradients), `sums` (aligned with self.variables)
    plus this call's variable gradients, and what `weight_gradients` needs for the
    deferred weight products (empty unless defers_weight_gradients)."""
    deferred = DeferredWeightGradient([], [])
    with tf.device(self.device):
      if self.recompute:
        input_grads, new_sums, deferred.inputs, deferred.output_grads = self._backward_fn(
            saved.inputs, saved.head_inputs, list(output_grads), list(sums), step, call_info)
      else:
        float_inputs = [t for t in saved.inputs if _is_float(t)]
        sources = (float_inputs if self.needs_input_grads else []) + self.variables
        grads = saved.tape.gradient(self.differentiable_outputs(saved.outputs), sources,
                                    output_gradients=list(output_grads),
                                    unconnected_gradients=tf.UnconnectedGradients.ZERO)
        num = len(sources) - len(self.variables)
        input_grads = grads[:num]
        new_sums = _accumulate(sums, grads[num:])
    full_input_grads: list[tf.Tensor | None] = []
    remaining = list(input_grads)
    for t in saved.inputs:
      full_input_grads.append(remaining.pop(0) if _is_float(t) and self.needs_input_grads
                              else None)
    return full_input_grads, list(new_sums), deferred

  def weight_gradients(self, group: Sequence[DeferredWeightGradient],
                       sums: Sequence[tf.Tensor]) -> list[tf.Tensor]:
    """One call: `sums` plus the deferred weight gradients of a group of micro-batches
    (what their backward calls returned), each a single product over the group."""
    with tf.device(self.device):
      return list(self._weight_fn(
          list(sums), [[d.inputs[i] for d in group] for i in range(len(group[0].inputs))],
          [[d.output_grads[i] for d in group] for i in range(len(group[0].inputs))]))

  def _unflatten_stats(self, flat_stats: list[tf.Tensor]) -> list[tuple[BaseLayer, Any]]:
    structure = self.stats_structure or []
    packed = tf.nest.pack_sequence_as([s for _, s in structure], flat_stats)
    return [(layer, s) for (layer, _), s in zip(structure, packed)]

  def tracing_count(self) -> int:
    """How many times the bodies were traced (forward and backward once per distinct
    micro-batch shape each, weight gradients once per distinct group shape; whatever
    M is)."""
    return (self._forward_fn.experimental_get_tracing_count()
            + self._backward_fn.experimental_get_tracing_count()
            + self._weight_fn.experimental_get_tracing_count())
