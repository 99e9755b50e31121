"""What each layer of a stack costs, measured on this machine, and a cache of it.

One record per layer (`LayerCost`), measured by building and running the layer alone
at the training micro-batch (`measure_layer_costs`), feeds both the partitioner
(`partition_cost='measured'`: forward + backward seconds) and the planner (seconds
and bytes). The bytes TensorFlow keeps of a forward for its backward are counted
exactly, from the static shapes of the tensors TensorFlow's own forward/backward pair
passes between them (`tf_internals.forward_backward_pair`), not guessed.

`cached_layer_costs` keeps measured records in a JSON file keyed by what they depend
on (model, input specs, host, TensorFlow version), so a plan is redone quickly. A cache
is only ever a shortcut: a file that cannot be read as one is reported and measured
around (never overwritten, since it may be the user's file given by mistake); a
directory is refused, and so is a cache that would have to be written where it
cannot be (checked before measuring; a read-only cache that holds the costs is read).
It holds only finite numbers: JSON has no Infinity or NaN, and other readers refuse
them.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from lingvo_gpipe.core import base_layer, token_slices
from lingvo_gpipe.core.gc_pause import cyclic_gc_paused
from lingvo_gpipe.core.hyperparams import ParamsError
from lingvo_gpipe.pipeline import memory


class CostCacheError(ParamsError):
  """A cost cache path that can never hold a cache; the message names it."""


@dataclasses.dataclass(frozen=True)
class LayerCost:
  """One layer at a micro-batch of `batch` examples: seconds and bytes.

  Seconds at b examples are the line a + c·b through two measured sizes
  (`step_model.layer_times`): forward_s and backward_s at `batch`, and the intercepts
  forward_fixed_s and backward_fixed_s (0: proportional to b). weight_share is the
  part of the backward that computes weight gradients (what a W action runs).
  kept_bytes is what the backward keeps of the forward beyond the layer's inputs and
  its weights' reads (those alias buffers counted elsewhere: the previous layer's
  kept outputs, the variables); kept_input_bytes the inputs it keeps, and
  kept_output_bytes the outputs among kept_bytes: a tensor between two layers is
  held once if either keeps it (`step_model.cell_kept_bytes`). The working sets are
  lines too (`step_model.layer_work_bytes`): the weight gradients a backward returns
  do not shrink with the batch.
  """
  forward_s: float
  backward_s: float
  weight_bytes: int
  input_bytes: int
  kept_bytes: int
  batch: int
  forward_fixed_s: float = 0.0
  backward_fixed_s: float = 0.0
  weight_share: float = 0.5
  product_bytes: int = 0  # what a deferred backward keeps for its W (zb_h1)
  backward_split_s: float | None = None  # the backward as its own function (below)
  backward_split_fixed_s: float = 0.0
  # A causal layer on token slices: the cache entries it keeps per micro-batch of
  # `batch` whole sequences (keys, values, key paddings; core/token_slices.py).
  cache_bytes: int = 0
  # Read off the device's allocator (`measure_layer_memory`; 0 where it cannot be
  # read): the most bytes the forward allocates beyond what it leaves held (outputs
  # and kept tensors), and the most the backward allocates beyond what it was given
  # (kept tensors, output gradients): temporaries, concatenations, kernels' own
  # buffers, and the gradients it returns.
  forward_work_bytes: int = 0
  backward_work_bytes: int = 0
  forward_work_fixed_bytes: int = 0
  backward_work_fixed_bytes: int = 0
  kept_input_bytes: int = 0
  kept_output_bytes: int = 0  # the part of kept_bytes that is the layer's outputs
  # Of weight_bytes, those standing in for weights tied to another layer's (a cell
  # away from the owner reads a copy: no optimizer slots); and the variables not
  # trained (frozen weights, a batch norm's moving statistics: held, no slots, no
  # gradients), beside weight_bytes.
  tied_bytes: int = 0
  frozen_bytes: int = 0

  # The figures measured at two sizes: each, at `batch`, and its intercept a.
  LINES = {"forward_s": "forward_fixed_s", "backward_s": "backward_fixed_s",
           "backward_split_s": "backward_split_fixed_s",
           "forward_work_bytes": "forward_work_fixed_bytes",
           "backward_work_bytes": "backward_work_fixed_bytes"}

  @property
  def step_s(self) -> float:
    """Forward and backward seconds together (the partitioner's cost)."""
    return self.forward_s + self.backward_s

  def at(self, name: str, batch: Any) -> Any:
    """Figure `name` (one of LINES) at `batch` examples: the line a + c·b through its
    intercept a and its value at `self.batch` (a number, or an array of batches)."""
    value, fixed = getattr(self, name), getattr(self, self.LINES[name])
    return fixed + (value - fixed) * (batch / self.batch)


def built_alone(layer_params: Any) -> Any:
  """The layer of `layer_params`, built as the only layer of its build: a weight it
  ties to another layer's is a stand-in of its own (base_layer.stand_in_ties), which
  costs what the tied one costs where the layer runs."""
  with base_layer.stand_in_ties():
    return layer_params.copy().instantiate()


def random_like(spec: tf.TensorSpec) -> tf.Tensor:
  """A tensor of spec's shape and dtype: normal floats, zeros otherwise (ids, masks)."""
  if spec.dtype.is_floating:
    return tf.random.normal(spec.shape, dtype=spec.dtype)
  return tf.zeros(spec.shape, spec.dtype)


def measure_layer_costs(layer_params: Sequence[Any], input_specs: Any, steps: int = 5,
                        full: bool = True, device: str | None = None,
                        small_batch: int | None = None) -> list[LayerCost]:
  """Each layer built and run alone on `device` (default: the default device), in
  training.

  Args:
    layer_params: the stack's layers' params, in order.
    input_specs: nested tf.TensorSpec of the first layer's input, batch first; each
      later layer gets the previous one's real output.
    steps: timed runs per layer after one warm-up; the median is kept.
    full: also time the forward alone, the input gradients alone and the layer at
      `small_batch` examples, and count what TensorFlow keeps for the backward (the
      planner's needs). False (the partitioner's): only forward + backward at the
      batch is timed, call included (never 0), recorded as backward_s with forward_s
      0 and kept_bytes 0.
    device: where the layer's variables live and its calls run (the device a plan's
      cells run on: a worker's device measures that worker's speed).
    small_batch: the second size the times are fitted at (full only; default a
      quarter of the batch, at least 1; none when the batch is 1).

  Returns:
    One LayerCost per layer: median seconds (full: with the cost of calling an empty
    function on `device` taken off, as the engine's calls are inside its loop), the
    bytes of its trainable weights (float32 master weights whatever the compute
    dtype) and of its input, and the bytes TensorFlow keeps of its forward for the
    backward (both in the layer's compute dtype, `fprop_dtype`).
  """
  with tf.device(device):
    costs = _measure_layer_costs(layer_params, input_specs, steps, full, small_batch)
  if not full:
    return costs
  twin = local_twin(device)
  batch = tf.nest.flatten(input_specs)[0].shape[0]
  memory = (measure_layer_memory(layer_params, input_specs, twin) if twin is not None
            else None)
  small = max(1, batch // 4)
  at_small = (measure_layer_memory(layer_params, with_batch(input_specs, small), twin)
              if memory is not None and small < batch else None)
  if memory is None:
    return costs
  out = []
  for i, (c, m) in enumerate(zip(costs, memory)):
    fixed = (0, 0) if at_small is None else tuple(
        int(_intercept(small, getattr(at_small[i], name), batch, getattr(m, name)))
        for name in ("forward_work_bytes", "backward_work_bytes"))
    out.append(dataclasses.replace(
        c, kept_bytes=c.kept_bytes + m.kept_excess_bytes,
        forward_work_bytes=m.forward_work_bytes, backward_work_bytes=m.backward_work_bytes,
        forward_work_fixed_bytes=fixed[0], backward_work_fixed_bytes=fixed[1]))
  return out


def with_batch(specs: Any, batch: int) -> Any:
  """Nested tf.TensorSpecs `specs` with batch `batch` (axis 0)."""
  return tf.nest.map_structure(lambda s: tf.TensorSpec([batch, *s.shape[1:]], s.dtype), specs)


def _measure_layer_costs(layer_params, input_specs, steps, full, small_batch):
  inputs = tf.nest.map_structure(random_like, input_specs)
  batch = tf.nest.flatten(input_specs)[0].shape[0]
  small = (small_batch or max(1, batch // 4)) if full and batch > 1 else None
  empty, zero = tf.function(lambda x: [x + 1]), tf.zeros([])
  call_s = median_seconds(lambda: empty(zero), 2 * steps)
  costs = []
  for p in layer_params:
    layer = built_alone(p)
    structure: dict[str, Any] = {}
    call = _flat_call(layer, inputs, structure)
    # In the layer's compute dtype, as a pipeline hands them over and keeps them (a
    # first layer's float32 images are cast before the micro-batches are split).
    flat = [layer.to_fprop_dtype(t) for t in tf.nest.flatten(inputs)]
    forward = tf.function(lambda *flat, call=call: _done(call(*flat)), autograph=False)
    first = not costs  # its inputs are the data: no gradient is sent back for them
    forward_backward = _gradient_function(layer, call, weights=True, inputs=not first)
    outputs = call(*flat)
    # The partitioner's costs (not full) keep the call's own cost: a layer too small
    # to time would otherwise cost 0 and move between cells for free.
    timed = _Timer(steps, call_s) if full else _Timer(steps, 0.0, chain=1)
    both_s = timed(forward_backward, flat)
    if not full:
      costs.append(LayerCost(0.0, both_s, _nbytes(layer.trainable_variables),
                             _nbytes(flat), 0, batch, **_weight_kinds(layer)))
      inputs = tf.nest.pack_sequence_as(structure["out"], list(outputs))
      continue
    forward_s = timed(forward, flat)
    share = _weight_share(layer, call, flat, timed, forward_s, both_s) if not first else 1.0
    pair, kept = _forward_backward_pair(call, flat)
    split_s = _split_backward_s(pair, flat, timed)
    fixed = (0.0, 0.0, 0.0)
    if small is not None and small < batch:
      part = [t[:small] for t in flat]
      at_small = (timed(forward, part), timed(forward_backward, part))
      small_pair, _ = _forward_backward_pair(call, part)
      fixed = tuple(_intercept(small, s, batch, b) for s, b in zip(
          (at_small[0], at_small[1] - at_small[0],
           _split_backward_s(small_pair, part, timed)),
          (forward_s, both_s - forward_s, split_s)))
    costs.append(LayerCost(forward_s, max(both_s - forward_s, 0.0),
                           _nbytes(layer.trainable_variables), _nbytes(flat),
                           kept.intermediates, batch, kept_input_bytes=kept.inputs,
                           kept_output_bytes=kept.outputs,
                           forward_fixed_s=fixed[0],
                           backward_fixed_s=fixed[1], weight_share=share,
                           product_bytes=_product_bytes(layer, inputs),
                           backward_split_s=split_s, backward_split_fixed_s=fixed[2],
                           cache_bytes=_cache_bytes(layer, inputs), **_weight_kinds(layer)))
    inputs = tf.nest.pack_sequence_as(structure["out"], list(outputs))
  return costs


PARTITION_STEPS = 7  # timed runs per layer: 3 let a noisy machine pick another split


def partition_costs(layer_params: Sequence[Any], input_specs: Any) -> list[float]:
  """Each layer's forward + backward seconds at the batch of `input_specs`, the call
  included (never 0): what `partition_cost='measured'` balances, wherever the
  partitioner asks (the trainer before it builds, a pipeline built eagerly)."""
  return [c.step_s for c in measure_layer_costs(layer_params, input_specs,
                                                steps=PARTITION_STEPS, full=False)]


def layer_work(layer_params: Any, input_specs: Any) -> Callable[[str], Callable[[], Any]]:
  """For `calibration.concurrency`: device → a function running one forward and
  backward of the layer (built on that device, inputs of `input_specs`) inside a
  tf.function, returning a scalar."""
  def build(device: str) -> Callable[[], Any]:
    with tf.device(device):
      layer = built_alone(layer_params)
      inputs = tf.nest.map_structure(random_like, input_specs)
      flat = [tf.Variable(layer.to_fprop_dtype(t), trainable=False, name="calibration_input")
              for t in tf.nest.flatten(inputs)]
    call = _flat_call(layer, inputs, {})
    gradients = _gradient_function(layer, call, weights=True, inputs=True)
    return lambda: gradients(*[v.read_value() for v in flat])[0]

  return build


def layer_input_specs(layer_params: Sequence[Any], input_specs: Any) -> list[Any]:
  """Each layer's nested input tf.TensorSpec (the first's `input_specs`, each next the
  previous one's outputs), found by tracing the layers in a scratch graph (nothing
  is allocated or run)."""
  specs = [input_specs]
  with tf.Graph().as_default():
    current = tf.nest.map_structure(lambda s: tf.compat.v1.placeholder(s.dtype, s.shape),
                                    input_specs)
    for p in layer_params[:-1]:
      layer = built_alone(p)
      with base_layer.step_context(training=True, layer_stats=[]):
        current = base_layer.call_with(layer, current)
      specs.append(tf.nest.map_structure(lambda t: tf.TensorSpec(t.shape, t.dtype), current))
  return specs


def _intercept(small: int, at_small: float, batch: int, at_batch: float) -> float:
  """a of the line a + c·b through (small, at_small) and (batch, at_batch), within
  [0, at_batch]: a time does not fall as the batch grows, nor is it negative at 0."""
  slope = (at_batch - at_small) / (batch - small)
  return float(min(max(at_small - slope * small, 0.0), max(at_batch, 0.0)))


def _gradient_function(layer: Any, call: Callable, weights: bool, inputs: bool) -> Callable:
  """flat inputs → a token once the gradients of the outputs' sum with respect to the
  layer's weights and/or its floating inputs are computed (a pipeline's backward
  computes both, but none for the data the first layer reads)."""
  @tf.function(autograph=False)
  def gradients(*flat):
    with tf.GradientTape() as tape:
      floating = [t for t in flat if t.dtype.is_floating]
      tape.watch(floating)
      out = call(*flat)
      total = tf.add_n([tf.reduce_sum(tf.cast(t, tf.float32))
                        for t in out if t.dtype.is_floating])
    sources = (list(layer.trainable_variables) if weights else []) + (
        floating if inputs else [])
    grads = tape.gradient(total, sources)
    return _done([tf.convert_to_tensor(g) for g in grads if g is not None])

  return gradients


def _weight_share(layer: Any, call: Callable, flat: Sequence[tf.Tensor], timed: Callable,
                  forward_s: float, both_s: float) -> float:
  """The part of the layer's backward that computes weight gradients: 1 − (input
  gradients alone) / (all gradients), each less the forward; 1 for a layer without
  floating inputs (an embedding), 0 for one without weights."""
  if not layer.trainable_variables:
    return 0.0
  if not any(t.dtype.is_floating for t in flat):
    return 1.0
  backward_s = both_s - forward_s
  if backward_s <= 0:
    return 0.5
  input_s = timed(_gradient_function(layer, call, weights=False, inputs=True),
                  flat) - forward_s
  return float(min(max(1.0 - input_s / backward_s, 0.0), 1.0))


def _done(tensors: Sequence[tf.Tensor]) -> list[tf.Tensor]:
  """A scalar that exists once every tensor does: fetching it waits for them without
  copying them off a remote device."""
  firsts = [tf.cast(tf.reshape(t, [-1])[:1], tf.float32) for t in tensors
            if t.shape.num_elements() != 0]
  return [tf.add_n([tf.reduce_sum(f) for f in firsts]) if firsts else tf.zeros([])]


CHAINED_CALLS = 3


class _Timer:
  """Seconds of one call of a function as a cell's loop pays it: the median of
  `steps` runs of CHAINED_CALLS calls one after another in one tf.function, less
  the median of runs of one call, over the calls it adds (each call not inlined,
  as a cell calls its layers: tf_internals.NOT_INLINED; each on its own copy of the
  arguments), never below zero. A run from Python pays a fixed cost beyond an empty
  call's (`call_s`) that a step pays once, not per action (docs/benchmarks_history.md,
  "A memory bound by measurement, one path from plan to run (2026-11-26)"). `chain=1`:
  one call less `call_s` (the partitioner's relative costs)."""

  def __init__(self, steps: int, call_s: float, chain: int = CHAINED_CALLS):
    self.steps, self.call_s, self.chain = steps, call_s, chain

  def __call__(self, fn: Callable, args: Sequence[Any]) -> float:
    if self.chain == 1:
      fn(*args)  # trace, warm up
      return max(median_seconds(lambda: fn(*args), self.steps) - self.call_s, 0.0)
    one, more = _chained(fn, len(args), 1), _chained(fn, len(args), self.chain)
    copies = list(args) + [_copy(t) for _ in range(self.chain - 1) for t in args]
    one(*args)  # trace, warm up
    more(*copies)
    runs = [(median_seconds(lambda: more(*copies), 1) - median_seconds(lambda: one(*args), 1))
            for _ in range(self.steps)]
    return max(float(np.median(runs)) / (self.chain - 1), 0.0)


def _chained(fn: Callable, num_args: int, calls: int) -> Callable:
  """A tf.function making `calls` calls of `fn` (not inlined) one after another,
  call i on arguments [i·num_args, (i+1)·num_args)."""
  from lingvo_gpipe.core.tf_internals import NOT_INLINED

  inner = tf.function(lambda *a: fn(*a), autograph=False, experimental_attributes=NOT_INLINED)

  @tf.function(autograph=False)
  def chained(*a):
    # Every call's output is summed into the result: a call whose outputs only gate
    # the next one (a control dependency) is pruned from the graph TensorFlow runs.
    outs: list = []
    for i in range(calls):
      with tf.control_dependencies(outs[-1:]):
        outs.append(tf.add_n(inner(*a[i * num_args:(i + 1) * num_args])))
    return [tf.add_n(outs)]

  return chained


def _copy(t: Any) -> Any:
  """A tensor equal to `t` in another buffer (anything else: itself)."""
  if isinstance(t, tf.Tensor):
    return tf.identity(t) + tf.zeros([], t.dtype) if t.dtype != tf.bool else tf.identity(t)
  return t


@dataclasses.dataclass(frozen=True)
class KeptBytes:
  """What a layer's backward takes from its forward, each buffer once (a tensor and
  its identities share one): `intermediates`, what the forward allocates for it;
  `inputs`, the layer's inputs it keeps (allocated before: the previous layer's
  output); `held`, the intermediates and the outputs together (what the forward
  leaves allocated); `outputs`, the layer's outputs among the intermediates (the
  next layer's inputs: what it keeps of them is held once). Reads of variables alias
  their buffers: in none."""
  intermediates: int
  inputs: int
  held: int
  outputs: int = 0


def _forward_backward_pair(call: Callable, flat: Sequence[tf.Tensor]
                           ) -> tuple[Any, KeptBytes]:
  """(TensorFlow's forward/backward pair of `call`, the KeptBytes of what its backward
  takes from its forward)."""
  from lingvo_gpipe.core import tf_internals

  concrete = tf.function(call, autograph=False).get_concrete_function(
      *[tf.TensorSpec(t.shape, t.dtype) for t in flat])
  pair = tf_internals.forward_backward_pair(concrete)

  def buffers(positions: Sequence[int]) -> dict:
    found = {}  # each buffer once: a tensor and its identities share one
    for i in positions:
      source = _aliased_source(concrete.graph.outputs[i])
      if source.op.type != "ReadVariableOp":
        found[(source.op.name, source.value_index)] = source
    return found

  kept = buffers(pair.kept_positions)
  inputs = {key: t for key, t in kept.items() if t.op.type == "Placeholder"}
  intermediates = {key: t for key, t in kept.items() if key not in inputs}
  outputs = {key: t for key, t in buffers(range(pair.num_outputs)).items()
             if t.op.type != "Placeholder"}
  return pair, KeptBytes(_nbytes(list(intermediates.values())),
                         _nbytes(list(inputs.values())),
                         _nbytes(list({**intermediates, **outputs}.values())),
                         _nbytes([t for key, t in intermediates.items() if key in outputs]))


@dataclasses.dataclass(frozen=True)
class LayerMemory:
  """One layer's bytes at its profiled batch, read off the device's allocator
  (`measure_layer_memory`)."""
  kept_excess_bytes: int  # held after the forward beyond its tensors' own sizes
  forward_work_bytes: int  # LayerCost.forward_work_bytes
  backward_work_bytes: int  # LayerCost.backward_work_bytes


def local_twin(device: str | None) -> str | None:
  """The device of this process whose allocator stands in for `device`'s: itself when
  local ('' for the default device); this process's CPU for a remote CPU (a worker on
  the same kind of host); None for a remote accelerator (no local allocator behaves
  as its does)."""
  spec = tf.DeviceSpec.from_string(device or "")
  kind = (spec.device_type or "CPU").upper()
  if spec.job in (None, "localhost"):
    return device or ""
  if kind != "CPU":
    return None
  from lingvo_gpipe.core import tf_internals

  return f"{tf_internals.host_address_space()}/device:CPU:0"


def allocator_name(device: str | None) -> str:
  """The name `tf.config.experimental.get_memory_info` knows a local device's
  allocator by: logical CPU devices share CPU:0's; each GPU has its own."""
  spec = tf.DeviceSpec.from_string(device or "")
  kind = (spec.device_type or "CPU").upper()
  return "CPU:0" if kind == "CPU" else f"{kind}:{spec.device_index or 0}"


def measure_layer_memory(layer_params: Sequence[Any], input_specs: Any,
                         device: str | None = None, repeats: int = 3
                         ) -> list[LayerMemory] | None:
  """Each layer built on `device` (a local one) and its forward and backward run
  alone, as a cell runs it (TensorFlow's forward/backward pair: the forward keeps
  what the backward takes), the allocator's peak read around each: the most over
  `repeats` runs (a bound: the allocator rounds and splits its chunks by history).
  None where the allocator cannot be read (a remote accelerator; a CPU without
  TensorFlow's BFC allocator)."""
  if not device and tf.config.list_logical_devices("GPU"):
    return None  # (the default device is a GPU; the caller did not say which)
  name = allocator_name(device)
  try:
    tf.config.experimental.reset_memory_stats(name)
    tf.config.experimental.get_memory_info(name)
  except (ValueError, tf.errors.OpError):
    return None
  found = []
  with tf.device(device), cyclic_gc_paused(collect_first=True):
    inputs = tf.nest.map_structure(random_like, input_specs)
    for p in layer_params:
      layer = built_alone(p)
      structure: dict[str, Any] = {}
      flat = [layer.to_fprop_dtype(t) for t in tf.nest.flatten(inputs)]
      pair, kept = _forward_backward_pair(_flat_call(layer, inputs, structure), flat)
      runs = [_memory_of_one_run(pair, flat, name) for _ in range(repeats + 1)][1:]
      held, forward_work, backward_work = (max(r[i] for r in runs) for i in range(3))
      found.append(LayerMemory(max(held - kept.held, 0), forward_work, backward_work))
      outputs, _ = pair.forward(list(flat))
      inputs = tf.nest.pack_sequence_as(structure["out"], list(outputs))
  return found


def _memory_of_one_run(pair: Any, flat: Sequence[tf.Tensor], allocator: str
                       ) -> tuple[int, int, int]:
  """(bytes the forward leaves held, its peak beyond that, the backward's peak beyond
  what it starts from) of one run of the pair."""
  forward, (outputs, kept) = memory.usage_during(
      functools.partial(pair.forward, list(flat)), allocator)
  seeds = [tf.ones_like(outputs[i]) for i in pair.trainable_outputs]
  backward, grads = memory.usage_during(
      functools.partial(pair.backward, seeds, list(kept)), allocator)
  held, forward_work = forward.after - forward.before, forward.peak - forward.after
  backward_work = backward.peak - backward.before
  # The allocator's statistics leave out allocations under 256 KiB on CPU (seen on
  # TensorFlow 2.21); the gradients the backward returns are its floor.
  returned = _nbytes([tf.convert_to_tensor(g) for g in grads if g is not None])
  del grads, outputs, kept, seeds
  return held, forward_work, max(backward_work, returned)


def _split_backward_s(pair: Any, flat: Sequence[tf.Tensor], timed: Callable) -> float:
  """Seconds of the pair's backward alone, given its forward's kept tensors and ones
  as the outputs' gradients."""
  outputs, kept = pair.forward(list(flat))
  seeds = [tf.ones_like(outputs[i]) for i in pair.trainable_outputs]
  num_seeds = len(seeds)

  @tf.function(autograph=False)
  def backward(*args):
    grads = pair.backward(list(args[:num_seeds]), list(args[num_seeds:]))
    return _done([tf.convert_to_tensor(g) for g in grads if g is not None])

  return timed(backward, seeds + list(kept))


def _product_bytes(layer: Any, given: Any) -> int:
  """Bytes of the inputs and outputs of the weight products (`layers.project`) of one
  traced call of `layer` on inputs shaped as `given`: what a deferred backward keeps
  for its W (the outputs' gradients have the outputs' shapes)."""
  products = base_layer.WeightProducts()
  specs = [tf.TensorSpec(t.shape, layer.to_fprop_dtype(t).dtype) for t in tf.nest.flatten(given)]

  def call(*flat):
    with base_layer.step_context(training=True, layer_stats=[], weight_products=products):
      base_layer.call_with(layer, tf.nest.pack_sequence_as(given, list(flat)))
    return []

  tf.function(call, autograph=False).get_concrete_function(*specs)
  return _nbytes([t for p in products.products for t in (p.inputs, p.outputs)])


def _cache_bytes(layer: Any, given: Any) -> int:
  """Bytes of the cache entries a causal layer (`token_slicing` "causal") extends in
  one traced call on inputs shaped as `given` [B, T, ...], as the first of one token
  slice spanning all T tokens: what a cell keeps of it per micro-batch in flight on
  token slices. 0 for any other layer."""
  if getattr(type(layer), "token_slicing", None) != token_slices.CAUSAL:
    return 0
  specs = [tf.TensorSpec(t.shape, layer.to_fprop_dtype(t).dtype) for t in tf.nest.flatten(given)]

  def call(*flat):
    whole = token_slices.slice_of(tf.constant(0, tf.int64), specs[0].shape[1])
    with base_layer.step_context(training=True, layer_stats=[], token_slice=whole):
      base_layer.call_with(layer, tf.nest.pack_sequence_as(given, list(flat)))
    return whole.outgoing

  return _nbytes(token_slices.traced_cache_specs(call, *specs))


def _aliased_source(t: tf.Tensor) -> tf.Tensor:
  """The tensor whose buffer `t` is: through Identity and IdentityN (which forward
  their inputs' buffers; tf.custom_gradient wraps its inputs and outputs in one, so
  its kept inputs appear twice)."""
  while t.op.type in ("Identity", "IdentityN"):
    t = t.op.inputs[t.value_index]
  return t


def _weight_kinds(layer: Any) -> dict[str, int]:
  """LayerCost's tied_bytes and frozen_bytes of a layer built alone."""
  trained = {id(v) for v in layer.trainable_variables}
  return {"tied_bytes": _nbytes([v for v in layer.stand_in_variables() if id(v) in trained]),
          "frozen_bytes": _nbytes([v for v in layer.variables if id(v) not in trained])}


def _nbytes(tensors: Sequence[Any]) -> int:
  return int(sum(t.shape.num_elements() * t.dtype.size for t in tensors))


def _flat_call(layer: Any, given: Any, structure: dict) -> Callable:
  """flat inputs (shaped as `given`) → the layer's flat outputs in training; the
  outputs' nesting is left in structure["out"]."""
  def call(*flat):
    with base_layer.step_context(training=True, layer_stats=[]):
      out = base_layer.call_with(layer, tf.nest.pack_sequence_as(given, list(flat)))
    structure["out"] = out
    return tf.nest.flatten(out)

  return call


def call_seconds(fn: Callable[[], Any], runs: int, warm_up: bool = False) -> list[float]:
  """Wall seconds of each of `runs` calls of fn(), every tensor of its (nested) result
  fetched (after one call more, not timed, with `warm_up`). The one timing loop of
  the profiler and the machine's calibration."""
  def fetch(result: Any) -> None:
    for t in tf.nest.flatten(result, expand_composites=False):
      if t is not None:
        tf.convert_to_tensor(t).numpy()  # embeddings' gradients are IndexedSlices

  if warm_up:
    fetch(fn())
  times = []
  for _ in range(runs):
    start = time.perf_counter()
    fetch(fn())
    times.append(time.perf_counter() - start)
  return times


def median_seconds(fn: Callable[[], Any], runs: int, warm_up: bool = False) -> float:
  """The median of `call_seconds`."""
  return float(np.median(call_seconds(fn, runs, warm_up)))


# -- the cache -------------------------------------------------------------------------


def check_cache_path(path: str) -> None:
  """Raises CostCacheError when `path` can never hold a cache: a directory, or a path
  under something that is not a folder. Called before the model is even probed."""
  if os.path.isdir(path):
    raise CostCacheError(f"cost cache {path!r} is a directory; give a file path (e.g. "
                         f"{os.path.join(path, 'layer_costs.json')!r}) or '' for none")
  folder = _first_existing(os.path.dirname(os.path.abspath(path)))
  if not os.path.isdir(folder):
    raise CostCacheError(f"cost cache {path!r} cannot be created: {folder!r} is not a "
                         "folder; give another path or '' for none")


def _check_writable(path: str) -> None:
  """Raises CostCacheError when the cache file cannot be created or replaced."""
  folder = _first_existing(os.path.dirname(os.path.abspath(path)))
  if not os.access(folder, os.W_OK | os.X_OK):
    raise CostCacheError(f"cost cache {path!r} cannot be written ({folder!r} is not "
                         "writable); give another path or '' for none")


def _first_existing(folder: str) -> str:
  while not os.path.exists(folder):
    folder = os.path.dirname(folder)
  return folder


def cached_layer_costs(path: str, key_parts: Sequence[Any],
                       measure: Callable[[], list[LayerCost]],
                       warn: Callable[[str], None] = print,
                       num_layers: int | None = None) -> list[LayerCost]:
  """The costs stored in the JSON file `path` under the key of `key_parts`, or
  `measure()`'s, stored there (folders made as needed; written whole to a temporary
  file, then renamed).

  A file that is not a cache (not JSON, not an object) is left as it is: `warn` says
  so and the costs are measured without being stored. An entry that is not a list of
  `num_layers` LayerCost records (another version's, or edited) is measured again and
  replaced.

  Raises:
    CostCacheError: `path` can never hold a cache (check_cache_path), or the costs
      must be measured and stored where nothing can be written (before measuring).
  """
  return cached_record(
      path, key_parts, measure, warn,
      decode=lambda entry: [LayerCost(**e) for e in _checked_entries(entry, num_layers)],
      encode=lambda costs: [dataclasses.asdict(c) for c in costs])


def cached_record(path: str, key_parts: Sequence[Any], measure: Callable[[], Any],
                  warn: Callable[[str], None], decode: Callable[[Any], Any],
                  encode: Callable[[Any], Any]) -> Any:
  """`cached_layer_costs` for any record: `decode(entry)` raises TypeError or
  ValueError on an entry it cannot use; `encode(record)` gives its JSON value.

  Only finite numbers are written (strict JSON): other entries that hold Infinity or
  NaN (written before that was checked) are left out, with a warning, and measured
  again when asked for.

  Raises:
    ValueError: `encode(record)` holds a number that is not finite (the message names
      the key and where in the record); nothing is written.
  """
  check_cache_path(path)
  key = hashlib.sha256(json.dumps([str(k) for k in key_parts]).encode()).hexdigest()[:16]
  stored, why_not = _read_cache(path)
  if why_not is not None:
    warn(f"warning: cost cache {path} ignored ({why_not}); measuring, and not saving over "
         "it: remove it or give another --cost_cache")
    return measure()
  if key in stored:
    try:
      return decode(stored[key])
    except (TypeError, ValueError) as e:
      warn(f"warning: cost cache {path}: the entry for this model is not usable ({e}); "
           "measuring again")
  _check_writable(path)
  record = measure()
  encoded = encode(record)
  where = _not_finite_at(encoded)
  if where is not None:
    named = f" ({str(key_parts[0])[:60]})" if key_parts else ""
    raise ValueError(f"cost cache {path}: the record for key {key}{named} holds {where}, "
                     "not a finite number (JSON has none); the cache is not written")
  stale = sorted(k for k, entry in stored.items()
                 if k != key and _not_finite_at(entry) is not None)
  if stale:
    warn(f"warning: cost cache {path}: left out the entries {', '.join(stale)}, which hold "
         "Infinity or NaN (not JSON); they are measured again when needed")
  stored = {k: entry for k, entry in stored.items() if k not in stale}
  stored[key] = encoded
  try:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
      json.dump(stored, f, allow_nan=False)
    os.replace(path + ".tmp", path)
  except OSError as e:  # e.g. a full disk: the record is measured all the same
    warn(f"warning: cost cache {path} not saved ({e})")
  return record


def _not_finite_at(value: Any, where: str = "") -> str | None:
  """Where the first number in `value` (JSON-like: dicts, lists, numbers) that is not
  finite is, as "[0]['forward_s']=inf"; None if every number is finite."""
  if isinstance(value, (float, np.floating)) and not np.isfinite(value):
    return f"{where or 'the value'}={value!r}"
  items = (value.items() if isinstance(value, dict)
           else enumerate(value) if isinstance(value, (list, tuple)) else ())
  for name, item in items:
    found = _not_finite_at(item, f"{where}[{name!r}]")
    if found is not None:
      return found
  return None


def cache_problem(path: str) -> str | None:
  """Why the file at `path` is not a cost cache (damaged, not JSON, not an object), or
  None: it is one, or it does not exist yet."""
  return _read_cache(path)[1]


def _read_cache(path: str) -> tuple[dict, str | None]:
  """(the cache's entries, None), or ({}, why it is not a cache)."""
  if not os.path.exists(path):
    return {}, None
  try:
    with open(path) as f:
      stored = json.load(f)
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
    return {}, f"not readable as JSON: {e}"
  if not isinstance(stored, dict):
    return {}, f"holds a JSON {type(stored).__name__}, not an object of cost records"
  return stored, None


def _checked_entries(entries: Any, num_layers: int | None) -> list[dict]:
  """entries, if they are `num_layers` LayerCost records with numbers ≥ 0 of the
  right kinds (batch ≥ 1)."""
  if not isinstance(entries, list) or not entries:
    raise ValueError("not a non-empty list")
  if num_layers is not None and len(entries) != num_layers:
    raise ValueError(f"{len(entries)} records for {num_layers} layers")
  fields = {f.name: f.type for f in dataclasses.fields(LayerCost)}
  for entry in entries:
    if not isinstance(entry, dict) or set(entry) != set(fields):
      raise ValueError(f"a record has keys {sorted(entry) if isinstance(entry, dict) else entry}"
                       f", not {sorted(fields)}")
    for name, value in entry.items():
      if value is None and "None" in fields[name]:
        continue
      kind = (int,) if fields[name] == "int" else (int, float)
      if isinstance(value, bool) or not isinstance(value, kind) or not value >= 0 \
          or not np.isfinite(value):
        raise ValueError(f"{name}={value!r} is not a number >= 0 of type {fields[name]}")
    if entry["batch"] < 1:
      raise ValueError(f"batch={entry['batch']} is not >= 1")
  return entries
