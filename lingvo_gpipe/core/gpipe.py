"""`PipeliningLayer`: GPipe's cells on devices, micro-batches and re-materialization.

The layers are cut into K cells (explicit `splits`, or `partition.balance` on their
costs); the variables of cell k are created on device k. A training forward pass
splits the mini-batch [B, ...] into M micro-batches of near-equal size along axis 0
and unrolls the loop: micro-batch m goes through cell 0 on device 0, then cell 1 on
device 1, and so on. Each cell takes its micro-batches in order, starting m+1 once the
results of m have arrived at the next cell; nothing orders cell k on micro-batch m+1
after cell k+1 on micro-batch m, so TensorFlow's dataflow executor runs them at the
same time: that is the pipeline. The outputs are concatenated back to [B, ...] on the
last device, so the loss and metrics are those of the whole mini-batch, and the
gradient of each variable is the sum over micro-batches (one synchronous update, as
unpartitioned).

Each cell call is a `tf.custom_gradient` entered under `tf.device(cell device)`:

  forward   runs the cell and keeps only its inputs (with recompute on);
  backward  re-enters tf.device(cell device) and the forward's StepContext (same
            step and example offset, so dropout draws the same masks; batch-norm
            statistics not reported again), recomputes the cell and differentiates it.

So the forward, the recomputed forward and the backward ops of cell k all carry
device k, whichever gradient API the caller uses (DESIGN.md: with
tf.recompute_grad + GradientTape they would all land on the default device). Cells
without recompute keep the tape of their forward pass and differentiate it in the
backward pass, on their device too.

The backward passes of one cell's M calls run one at a time and sum the variable
gradients as they go (`CellBackward`), so only one micro-batch is re-materialized
per cell at a time and only one gradient-sized buffer per cell is alive.

Peak activation memory with recompute: O(B + (L/K)·(B/M)) per device instead of O(B·L).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from lingvo_gpipe.core import base_layer, cluster, model_stats, partition, timeline
from lingvo_gpipe.core.base_layer import BaseLayer

RECOMPUTE_POLICIES = ("always", "except_last", "never")
PARTITION_COSTS = ("params", "flops", "given")


class PipelineError(ValueError):
  """Bad pipelining params or inputs; the message names the value."""


def micro_batch_sizes(batch_size: int, num_micro_batches: int) -> list[int]:
  """Near-equal sizes summing to batch_size; the first (batch_size % M) get one more."""
  if num_micro_batches < 1:
    raise PipelineError(f"num_micro_batches must be >= 1, got {num_micro_batches}")
  if num_micro_batches > batch_size:
    raise PipelineError(f"num_micro_batches={num_micro_batches} is larger than the batch "
                        f"size {batch_size}; use at most {batch_size} micro-batches")
  base, extra = divmod(batch_size, num_micro_batches)
  return [base + (1 if m < extra else 0) for m in range(num_micro_batches)]


def _call_layers(layers: Sequence[BaseLayer], x: Any) -> Any:
  for layer in layers:
    x = layer(*x) if isinstance(x, tuple) else layer(x)
  return x


def _zeros_if_none(grads: Sequence[Any], like: Sequence[tf.Tensor]) -> list[Any]:
  return [tf.zeros_like(t) if g is None else g for g, t in zip(grads, like)]


def _arrived(tensors: Any, device: str | None, destination: str | None) -> Any:
  """Markers, on `destination`, of `tensors` (made on `device`) having arrived there.

  A cell's next micro-batch waits for these markers rather than for its own results.
  A worker that runs one op at a time (one inter-op thread: a sequential accelerator)
  otherwise keeps running its own chain of ready compute and sends its results only
  when the chain breaks: at the end of the whole forward or backward pass (measured:
  the next cell got micro-batch 0 after all 8 were done). Waiting for the marker
  breaks the chain after each micro-batch, so the transfer goes out at once; the
  marker's own transfer is one control message. The tensors travel once: the next
  cell's Recv of them is shared with the marker's.

  In a backward pass, tf.gradients colocates every op a gradient function makes with
  the forward op (the cell's device), and colocation beats tf.device: the markers
  would sit on the sending device and mark nothing (measured: the previous cell got
  micro-batch 0's gradient one backward span late). They are made outside any
  colocation.
  """
  if destination is None or destination == device:
    return tensors
  with tf.compat.v1.colocate_with(None, ignore_existing=True), tf.device(destination):
    return tf.nest.map_structure(lambda t: None if t is None else tf.identity(t), tensors)


class CellBackward:
  """Orders and accumulates the backward passes of one cell over the micro-batches.

  The M calls of a cell in one step share this object. Their backward passes run
  one after the other, in the order their gradients are built: each waits for its
  output gradient *and* for the previous one's results. Without that order the
  executor may start every micro-batch's recompute at once (their inputs are all
  ready), even during the forward pass, and the activations of the whole
  mini-batch would be live again.

  The variable gradients are summed as they come, on the cell's device, and handed
  to TensorFlow once, by the M-th backward pass (the others report None for the
  variables). Handing over M per-micro-batch gradients instead would keep all of
  them alive until TensorFlow's final AddN: M copies of the cell's weights.
  Every call's backward pass does run: the pipeline's outputs are the concatenation
  of every micro-batch's, and cells pass zero gradients to unconnected inputs.
  """

  def __init__(self, num_calls: int):
    self.num_calls = num_calls
    self._reset()

  def _reset(self) -> None:
    self.done = 0
    self.variable_grads: list | None = None
    self.previous: list[tf.Tensor] = []

  def add(self, input_grads: list, variable_grads: list) -> list:
    """Records one backward pass; returns what to report for the variables."""
    # Embedding gradients come as IndexedSlices; summed densely, the running sum stays
    # one table-sized buffer instead of growing by every micro-batch's rows.
    variable_grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g
                      for g in variable_grads]
    if self.variable_grads is None:
      self.variable_grads = variable_grads
    else:
      self.variable_grads = [a + b for a, b in zip(self.variable_grads, variable_grads)]
    self.done += 1
    self.previous = [g for g in input_grads + self.variable_grads if g is not None]
    if self.done < self.num_calls:
      return [None] * len(variable_grads)
    total = self.variable_grads
    self._reset()  # a second gradient computation over the same forward starts afresh
    return total


def cell_call(layers: Sequence[BaseLayer], inputs: Any, device: str | None,
              recompute: bool, backward: CellBackward | None = None,
              cell_index: int = 0, after: Any = None, input_device: str | None = None) -> Any:
  """Runs `layers` on `inputs` on `device` with a device-pinned custom gradient.

  inputs and outputs may be nested structures of tensors; integer tensors get no
  gradient. `backward` orders and accumulates the backward passes of the calls of
  one cell (see CellBackward); None means this call stands alone. `after`: tensors
  (the cell's outputs on the previous micro-batch) this call's forward waits for.
  `input_device`: where the inputs come from; when it is another device, the next
  backward pass of this cell waits until this one's input gradients have arrived
  there (see `_arrived`).
  When the context has a `schedule`, the forward and the backward pass each record
  a timeline.Span (cell `cell_index`, the context's micro-batch).
  """
  ctx = base_layer.current_context()
  backward = backward or CellBackward(num_calls=1)
  output_structure = []

  def run(flat_inputs):
    return _call_layers(layers, tf.nest.pack_sequence_as(inputs, flat_inputs))

  @tf.custom_gradient
  def cell(*flat_inputs):
    tape = None
    float_inputs = [t for t in flat_inputs if t.dtype.is_floating]
    if recompute:
      outputs = run(flat_inputs)
    else:
      with tf.GradientTape() as tape:
        tape.watch(float_inputs)
        outputs = run(flat_inputs)
    output_structure.append(outputs)
    flat_outputs = tf.nest.flatten(outputs)

    def grad(*output_grads, variables=None):
      variables = list(variables or [])
      output_grads = _zeros_if_none(output_grads, flat_outputs)
      with tf.device(device):
        span = timeline.SpanRecorder(ctx.schedule, cell_index, ctx.micro_batch,
                                     timeline.BACKWARD, device)
        # One gate, so that each op of the backward pass carries one control input
        # (not one per tensor waited for; that made tracing quadratic).
        gate = tf.group(*output_grads, *backward.previous)
        with tf.control_dependencies([gate]):
          gated_inputs = [tf.identity(t) for t in flat_inputs]
          output_grads = [tf.identity(g) for g in output_grads]
        num_inputs = len(flat_inputs)
        gated = span.begin(gated_inputs + output_grads)
        gated_inputs, output_grads = gated[:num_inputs], gated[num_inputs:]
        if recompute:
          with base_layer.step_context(training=ctx.training, step=ctx.step,
                                       micro_batch=ctx.micro_batch,
                                       example_offset=ctx.example_offset, layer_stats=None):
            with tf.GradientTape() as recompute_tape:
              recompute_tape.watch([t for t in gated_inputs if t.dtype.is_floating])
              differentiated = tf.nest.flatten(run(gated_inputs))
          sources, active_tape = gated_inputs + variables, recompute_tape
        else:
          differentiated = flat_outputs
          sources, active_tape = list(flat_inputs) + variables, tape
        grads = active_tape.gradient(differentiated, sources, output_gradients=output_grads,
                                     unconnected_gradients=tf.UnconnectedGradients.ZERO)
        grads = span.end([g if t.dtype.is_floating else None for g, t in zip(grads, sources)])
        input_grads = grads[:num_inputs]
        variable_grads = backward.add(_arrived(input_grads, device, input_device),
                                      grads[num_inputs:])
        return input_grads, variable_grads

    return flat_outputs, grad

  with tf.device(device):
    flat_inputs = tf.nest.flatten(inputs)
    if after is not None:
      with tf.control_dependencies([tf.group(*tf.nest.flatten(after))]):
        flat_inputs = [tf.identity(t) for t in flat_inputs]
    span = timeline.SpanRecorder(ctx.schedule, cell_index, ctx.micro_batch, timeline.FORWARD,
                                 device)
    flat = cell(*span.begin(flat_inputs))
    flat = span.end(list(flat) if isinstance(flat, (list, tuple)) else [flat])
  return tf.nest.pack_sequence_as(output_structure[0], flat)


class PipeliningLayer(BaseLayer):
  """GPipe over `layers`: K cells on K devices, M micro-batches, re-materialization.

  The children are named and tracked exactly as `Sequential`'s (self.layers), so a
  checkpoint of the unpipelined model restores into the pipelined one and back.
  """

  @classmethod
  def Params(cls):  # noqa: N802
    p = super().Params()
    p.define("layers", [], "Params of the layers, in order; a tuple output is passed on "
             "as positional arguments (e.g. AmoebaNet's (previous, previous-previous)).")
    p.define("num_micro_batches", 1, "M: micro-batches per mini-batch (GPipe uses M >= 4K).")
    p.define("num_cells", 0, "K: cells made by the partitioner (0: len(splits) or 1).")
    p.define("splits", [], "Explicit partition: the end index of each cell, increasing, "
             "the last equal to the number of layers. Overrides num_cells.")
    p.define("devices", [], "Device of each cell (empty: the devices set up by --devices).")
    p.define("round_robin_devices", False, "Allow more cells than devices, placed round-robin.")
    p.define("recompute", "always", f"Re-materialization policy: {RECOMPUTE_POLICIES}.")
    p.define("partition_cost", "params", f"Cost the partitioner balances: {PARTITION_COSTS}.")
    p.define("input_specs", None, "Nested tf.TensorSpec of the pipeline input with the batch "
             "size (needed by partition_cost='flops').")
    p.define("layer_costs", [], "Per-layer costs for partition_cost='given' (e.g. measured by "
             "partition.profile_layer_costs).")
    p.define("memory_cap_bytes", None, "If set, the most bytes of weights and optimizer state "
             "one cell may hold; see bytes_per_param.")
    p.define("bytes_per_param", 12, "Bytes per parameter for the memory cap (float32 weight "
             "plus two optimizer slots).")
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    if not p.layers:
      raise PipelineError(f"{self.path}: PipeliningLayer needs at least one layer")
    if p.num_micro_batches < 1:
      raise PipelineError(f"{self.path}: num_micro_batches must be >= 1, "
                          f"got {p.num_micro_batches}")
    if p.recompute not in RECOMPUTE_POLICIES:
      raise PipelineError(f"{self.path}: recompute must be one of {RECOMPUTE_POLICIES}, "
                          f"got {p.recompute!r}")
    if p.partition_cost not in PARTITION_COSTS:
      raise PipelineError(f"{self.path}: partition_cost must be one of {PARTITION_COSTS}, "
                          f"got {p.partition_cost!r}")
    self.cells = self._partition()
    self.cell_devices = self._assign_devices(len(self.cells))
    layer_devices = [self.cell_devices[k] for k, cell in enumerate(self.cells)
                     for _ in range(cell.start, cell.end)]
    self.create_children("layers", p.layers, devices=layer_devices)

  # -- partition and placement ----------------------------------------------------

  def layer_costs(self) -> list[float]:
    """The cost of each layer the partitioner balances (no variables are allocated)."""
    p = self.params
    if p.partition_cost == "given":
      if len(p.layer_costs) != len(p.layers):
        raise PipelineError(f"{self.path}: layer_costs has {len(p.layer_costs)} entries for "
                            f"{len(p.layers)} layers")
      return [float(c) for c in p.layer_costs]
    if p.partition_cost == "params":
      return [float(n) for n in model_stats.param_counts(p.layers)]
    if p.input_specs is None:
      raise PipelineError(f"{self.path}: partition_cost='flops' needs input_specs (the "
                          "pipeline input's nested tf.TensorSpec, batch size included)")
    from lingvo_gpipe.core import layers as layers_lib

    seq = layers_lib.Sequential.Params().set(name="cost_probe", layers=p.layers)
    specs = p.input_specs if isinstance(p.input_specs, tuple) else (p.input_specs,)
    stats = model_stats.analyze(seq, *specs, max_depth=1)
    return [float(s.flops) for s in stats[1:]]

  def _partition(self) -> list[partition.Cell]:
    p = self.params
    num_layers = len(p.layers)
    if p.splits:
      return partition.cells_from_splits(p.splits, self.layer_costs())
    num_cells = p.num_cells or 1
    if num_cells > num_layers:
      raise PipelineError(f"{self.path}: num_cells={num_cells} is more than the {num_layers} "
                          "layers; each cell needs at least one layer")
    costs = self.layer_costs()
    memory = None
    if p.memory_cap_bytes is not None:
      memory = [n * p.bytes_per_param for n in model_stats.param_counts(p.layers)]
    names = [lp.name for lp in p.layers]
    return partition.balance(costs, num_cells, memory=memory, memory_cap=p.memory_cap_bytes,
                             layer_names=names)

  def _assign_devices(self, num_cells: int) -> list[str]:
    p = self.params
    devices = list(p.devices) or cluster.default_devices()
    if num_cells > len(devices) and not p.round_robin_devices:
      raise PipelineError(
          f"{self.path}: {num_cells} cells but only {len(devices)} device(s) {devices}; "
          "give more devices (e.g. --devices=cpu:N) or set round_robin_devices=True")
    return [devices[k % len(devices)] for k in range(num_cells)]

  @property
  def output_device(self) -> str:
    return self.cell_devices[-1]

  def cell_layers(self, k: int) -> list[BaseLayer]:
    return list(self.layers[self.cells[k].start:self.cells[k].end])

  def _recompute_cell(self, k: int) -> bool:
    policy = self.params.recompute
    return policy == "always" or (policy == "except_last" and k < len(self.cells) - 1)

  # -- forward ----------------------------------------------------------------------

  def fprop(self, *inputs: Any) -> Any:
    """inputs: tensors (or nested structures) of batch-major [B, ...] → outputs [B, ...]."""
    structure = inputs[0] if len(inputs) == 1 else tuple(inputs)
    flat = tf.nest.flatten(structure)
    batch = flat[0].shape[0]
    if batch is None:
      raise PipelineError(f"{self.path}: the batch dimension must be static to split it into "
                          "micro-batches")
    ctx = base_layer.current_context()
    # Eval keeps no activations for a backward pass, so splitting the batch would only
    # multiply the traced graph by M (an 84B-parameter model inspected at M=512).
    num_micro_batches = self.params.num_micro_batches if ctx.training else 1
    sizes = micro_batch_sizes(batch, num_micro_batches)
    with tf.device(self.cell_devices[0]):
      parts = [tf.split(t, sizes, axis=0) for t in flat]
    outputs = []
    offset = 0
    backwards = [CellBackward(num_calls=len(sizes)) for _ in self.cells]
    # Each cell runs its micro-batches one after the other, as an accelerator would.
    # Left free, an executor runs all of a cell's micro-batches breadth-first: none
    # finishes before the last, the next cell idles meanwhile (measured: no overlap
    # at all in the forward pass), and every micro-batch's activations would be alive at
    # once.
    previous_outputs: list[Any] = [None] * len(self.cells)
    devices = self.cell_devices
    for m, size in enumerate(sizes):
      x = tf.nest.pack_sequence_as(structure, [part[m] for part in parts])
      with base_layer.step_context(micro_batch=m,
                                   example_offset=ctx.example_offset + offset):
        for k in range(len(self.cells)):
          if ctx.training:
            x = cell_call(self.cell_layers(k), x, devices[k], self._recompute_cell(k),
                          backwards[k], cell_index=k, after=previous_outputs[k],
                          input_device=devices[k - 1] if k else None)
            x = _arrived(x, devices[k], devices[k + 1] if k + 1 < len(self.cells) else None)
            previous_outputs[k] = x
          else:
            with tf.device(self.cell_devices[k]):
              x = _call_layers(self.cell_layers(k), x)
      outputs.append(x)
      offset += size
    if len(outputs) == 1:
      return outputs[0]
    with tf.device(self.output_device):
      return tf.nest.map_structure(lambda *ts: tf.concat(ts, axis=0), *outputs)

  def describe_cells(self) -> list[dict]:
    """Per cell: its layers, device, parameter count and cost share."""
    counts = model_stats.param_counts(self.params.layers)
    return [{"cell": k, "layers": [lp.name for lp in self.params.layers[c.start:c.end]],
             "device": self.cell_devices[k], "params": int(sum(counts[c.start:c.end])),
             "cost_share": round(c.cost_share, 6)}
            for k, c in enumerate(self.cells)]

