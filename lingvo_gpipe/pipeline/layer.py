"""`PipeliningLayer`: GPipe's cells on devices, micro-batches and re-materialization.

The layers are cut into K cells (explicit `splits`, or `partition.balance` on their
costs); cell k's variables are created on its device: device k by default, with
`virtual_stages` V where the schedule places it (`schedule.placement`: k mod D for
interleaved_1f1b and interleaved_zb, D = K / V devices; zbv's V), or round-robin with
`round_robin_devices`. Training goes through `forward_backward(inputs, head,
head_inputs)`:

  batch [B, ...] → M micro-batches of near-equal size (axis 0) → for each device, one
  loop running its cells' actions in the order `task.pipeline.schedule` gives
  (schedule.py: gpipe, 1f1b, zb_h1, interleaved_1f1b, zbv, interleaved_zb;
  device_loop.py), each a call of a cell's forward, backward or deferred
  weight-gradient function, traced once per unit shape (cell_function.py; layers of
  one kind share one traced function, layer_function.py), hand-offs through Send/Recv
  (channels.py) → the whole batch's metrics and every variable's gradient of the
  whole batch's loss, summed over micro-batches on its device.

The backward of a re-materialized cell (`recompute`: always, except_last, never)
recomputes its forward from the kept inputs, so peak activation memory is
O(B + (L/K)·(B/M)) per device instead of O(B·L); with 1F1B a cell keeps at most K
micro-batches' inputs instead of M.

`fprop` (eval, or a caller that differentiates it itself) runs the same cells: in
eval on the whole batch, layer by layer on each cell's device; in training through
the traced forward functions per micro-batch, differentiable by any gradient API but
without re-materialization or a schedule.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from lingvo_gpipe.core import (
  base_layer,
  hyperparams,
  model_stats,
  near_equal,
  stacked_variables,
  tf_internals,
  token_slices,
)
from lingvo_gpipe.core.base_layer import BaseLayer
from lingvo_gpipe.core.hyperparams import ParamsError
from lingvo_gpipe.pipeline import (
  channels,
  device_loop,
  layer_profiler,
  partition,
  schedule,
  tied_weights,
)
from lingvo_gpipe.pipeline.cell_function import CellFunctions, Head, call_layers
from lingvo_gpipe.pipeline.layer_function import LayerFunctions
from lingvo_gpipe.runtime.devices import available_devices, default_devices, known_device

RECOMPUTE_POLICIES = ("always", "except_last", "never")
PARTITION_COSTS = ("params", "flops", "measured", "given")
NEEDS_INPUT_SPECS = ("flops", "measured")


class PipelineError(ParamsError):
  """Bad pipelining params or inputs; the message names the value."""


def measured_costs(layer_params: Sequence[Any], input_specs: Any) -> list[float]:
  """Each layer's forward + backward seconds on this machine, as the partitioner
  weighs them (`layer_profiler.partition_costs`: each layer built and run alone, a few
  times): the one way tasks and pipelines ask the profiler for partition costs."""
  return layer_profiler.partition_costs(layer_params, input_specs)


def micro_batch_sizes(batch_size: int, num_micro_batches: int) -> list[int]:
  """Near-equal sizes summing to batch_size; the first (batch_size % M) get one more."""
  if num_micro_batches < 1:
    raise PipelineError(f"num_micro_batches must be >= 1, got {num_micro_batches}")
  if num_micro_batches > batch_size:
    raise PipelineError(f"num_micro_batches={num_micro_batches} is larger than the batch "
                        f"size {batch_size}; use at most {batch_size} micro-batches")
  return near_equal.sizes(batch_size, num_micro_batches)


def recomputes(policy: str, k: int, num_cells: int) -> bool:
  """Whether cell k of K is re-materialized under the recompute `policy`
  (RECOMPUTE_POLICIES): always, every cell but the last, or never."""
  return policy == "always" or (policy == "except_last" and k < num_cells - 1)


def requested_cells(p: hyperparams.Params) -> int:
  """K that pipeline params (PipeliningLayer's, or a task's `pipeline`) ask for:
  len(splits) when splits are given, else num_cells; 0 means no pipelining (a negative
  num_cells is refused by check_pipeline_params, which every task runs)."""
  return len(p.splits) or p.num_cells


def check_pipeline_params(p: hyperparams.Params, path: str) -> None:
  """Raises PipelineError naming the first value of pipeline params (PipeliningLayer's,
  or a task's `pipeline`, checked whether or not it pipelines) that no run accepts;
  `path` prefixes the message. What depends on the model (splits against its layers,
  K against the devices) is checked where the cells are made (partition.py)."""
  def bad(key: str, valid: str) -> PipelineError:
    return PipelineError(f"{path}: {key} must be {valid}, got {getattr(p, key)!r}")

  if not isinstance(p.num_cells, int) or p.num_cells < 0:
    raise bad("num_cells", "an int >= 0 (0: no pipelining unless splits are given)")
  if not isinstance(p.num_micro_batches, int) or p.num_micro_batches < 1:
    raise bad("num_micro_batches", "an int >= 1")
  if p.recompute not in RECOMPUTE_POLICIES:
    raise bad("recompute", f"one of {RECOMPUTE_POLICIES}")
  if p.schedule not in schedule.SCHEDULES:
    raise bad("schedule", f"one of {sorted(schedule.SCHEDULES)}")
  if not isinstance(p.weight_gradient_group, int) or p.weight_gradient_group < 1:
    raise bad("weight_gradient_group", "an int >= 1")
  if p.schedule in schedule.SPLIT_BACKWARD and p.weight_gradient_group != 1:
    raise bad("weight_gradient_group", f"1 with schedule={p.schedule!r} (it places one W per "
              "backward itself)")
  if not isinstance(p.virtual_stages, int) or p.virtual_stages < 1:
    raise bad("virtual_stages", "an int >= 1")
  if not schedule.takes_virtual_stages(p.schedule, p.virtual_stages):
    rules = ", ".join(f"{s} {v}" for s, v in schedule.VIRTUAL_STAGES.items())
    raise bad("virtual_stages", f"{schedule.VIRTUAL_STAGES.get(p.schedule, '1')} with "
              f"schedule={p.schedule!r} (cells per device: {rules}, any other 1)")
  if p.partition_cost not in PARTITION_COSTS:
    raise bad("partition_cost", f"one of {PARTITION_COSTS}")
  if p.memory_cap_bytes is not None and not p.memory_cap_bytes > 0:
    raise bad("memory_cap_bytes", "None or > 0")
  if not p.bytes_per_param > 0:
    raise bad("bytes_per_param", "> 0")
  if not isinstance(p.share_layer_functions, bool):
    raise bad("share_layer_functions", "True or False")
  if not isinstance(p.stack_variables, bool):
    raise bad("stack_variables", "True or False")
  if not isinstance(p.scan_layers, bool):
    raise bad("scan_layers", "True or False")
  if p.scan_layers and not (p.share_layer_functions and p.stack_variables):
    raise bad("scan_layers", "False unless share_layer_functions and stack_variables are "
              "True (a loop calls one shared function on rows of the stacks)")
  if not schedule.is_slice_count(p.num_token_slices):
    raise bad("num_token_slices", "an int >= 1")
  lengths = p.token_slice_lengths
  if lengths is not None and (
      not isinstance(lengths, (list, tuple)) or len(lengths) != p.num_token_slices or
      any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in lengths)):
    raise bad("token_slice_lengths", f"None or a list of num_token_slices="
              f"{p.num_token_slices} ints >= 1 (the slices' lengths in tokens)")
  if p.num_token_slices > 1 and p.schedule not in schedule.SLICED_SCHEDULES:
    raise bad("schedule", f"one of {schedule.SLICED_SCHEDULES} with num_token_slices="
              f"{p.num_token_slices} (token slices run on those)")
  for device in p.devices:
    if not known_device(device):
      raise PipelineError(f"{path}: devices names {device!r}, which this process does "
                          f"not have; its devices: {available_devices()}")


def token_slice_lengths(p: hyperparams.Params, length: int, path: str) -> list[int]:
  """The lengths of pipeline params `p`'s num_token_slices slices of a `length`-token
  sequence: token_slice_lengths (which must sum to it) or near-equal ones (at most
  one slice per token). Raises PipelineError naming the value."""
  given = p.token_slice_lengths
  if given is not None:
    if sum(given) != length:
      raise PipelineError(f"{path}: token_slice_lengths={list(given)} must sum to the "
                          f"sequence length {length}, not {sum(given)}")
    return list(given)
  try:
    return token_slices.slice_lengths(length, p.num_token_slices)
  except ValueError as e:
    raise PipelineError(f"{path}: {e}") from None


def assign_devices(p: hyperparams.Params, num_cells: int, devices: Sequence[str],
                   path: str) -> list[str]:
  """The device of each of `num_cells` cells of pipeline params `p` among `devices`:
  with virtual stages V, the schedule's placement (`schedule.placement`: k mod K/V
  round-robin, zbv's V), else k (wrapping only with round_robin_devices). Raises
  PipelineError, prefixed by `path`, when there are too few devices."""
  devices = list(devices)
  if p.virtual_stages > 1:
    if num_cells % p.virtual_stages:
      raise PipelineError(f"{path}: virtual_stages={p.virtual_stages} must divide the "
                          f"{num_cells} cells (each device holds V of them)")
    num_devices = num_cells // p.virtual_stages
    if num_devices > len(devices):
      raise PipelineError(f"{path}: {num_cells} cells at virtual_stages="
                          f"{p.virtual_stages} need {num_devices} devices; only "
                          f"{len(devices)}: {devices}")
    return [devices[d] for d in schedule.placement(p.schedule, num_cells, p.virtual_stages)]
  if num_cells > len(devices) and not p.round_robin_devices:
    raise PipelineError(
        f"{path}: {num_cells} cells but only {len(devices)} device(s) {devices}; "
        "give more devices (e.g. --devices=cpu:N; an export's --export_devices) or set "
        "round_robin_devices=True")
  return [devices[k % len(devices)] for k in range(num_cells)]


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
    p.define("schedule", "gpipe", "Order of each cell's forward and backward calls: "
             f"{sorted(schedule.SCHEDULES)} (pipeline/schedule.py). 1f1b has GPipe's bubble "
             "but holds at most K micro-batches per cell in flight instead of M; zb_h1 "
             "splits every backward into input and weight gradients and runs the weight "
             "gradients in 1F1B's cool-down (idle (K-1)(F+B-W) instead of (K-1)(F+B+W); "
             "up to K micro-batches held on every cell, and each backward's "
             "weight-gradient inputs until its W); interleaved_1f1b puts virtual_stages "
             "cells on each device (bubble / V, V× the hand-offs).")
    p.define("virtual_stages", 1, "V: cells per device, the K cells on K/V devices where "
             "the schedule places them (schedule.placement): interleaved_1f1b and "
             "interleaved_zb V >= 2, cell k on device k mod (K/V); zbv V = 2, cells k and "
             "K-1-k on device k; any other schedule 1.")
    p.define("weight_gradient_group", 1, "G: re-materialized cells compute the weight "
             "gradients of their projections (layers.project: Linear, attention, softmax) "
             "over G micro-batches at once, in one call after every G-th backward: one "
             "[G·b, I]ᵀ·[G·b, O] product instead of G products of b rows summed (faster "
             "for small micro-batches), at the cost of keeping each projection's input "
             "and output gradient for G micro-batches. 1: per micro-batch.")
    p.define("partition_cost", "params", f"Cost the partitioner balances: {PARTITION_COSTS}. "
             "'measured': each layer's forward + backward time on this machine, profiled "
             "when the pipeline is built unless layer_costs holds them already "
             "(layer_profiler.measure_layer_costs; the trainer measures before it builds).")
    p.define("input_specs", None, "Nested tf.TensorSpec of the pipeline input with the batch "
             "size (needed by partition_cost='flops' and 'measured'; the trainer derives "
             "it from the training input).")
    p.define("layer_costs", [], "Per-layer costs for partition_cost='given' (e.g. measured by "
             "layer_profiler.measure_layer_costs).")
    p.define("share_layer_functions", True, "Layers of one kind (class and params, name "
             "aside) share one traced function, called with each layer's variables and "
             "dropout seeds (pipeline/layer_function.py): tracing and the first step's "
             "cost grow with the kinds of layer, not their number. False: each layer is "
             "traced into its cell's functions on its own.")
    p.define("scan_layers", False, "Within a cell, consecutive layers of one kind run as "
             "one loop over their stacked weights (pipeline/layer_function.py "
             "`_KindFunction.scan`): the graph holds one call per run, not one per layer. "
             "Needs share_layer_functions and stack_variables; runs on token slices and "
             "calls that defer weight products (zb_h1, zbv, interleaved_zb, "
             "weight_gradient_group > 1) still call their layers one by one.")
    p.define("stack_variables", True, "A cell's trainable weights of one shape and dtype are "
             "rows of one variable, and so are their optimizer slots "
             "(core/stacked_variables.py): the step's variables grow with the cells and "
             "kinds of weight, not the layers. Each layer's weights are still its "
             "attributes (RowVariables: read, assign, numpy) and checkpoints keep one "
             "key per weight (they restore across this setting), but tf.Module's "
             "variable lists hold the stacks: a layer inside the pipeline lists none "
             "(stacked_variables.trainable_weights lists one entry per weight). "
             "False: one tf.Variable per weight.")
    p.define("num_token_slices", 1, "S: each micro-batch is also cut along the sequence "
             "(axis 1 of every input) into S slices of near-equal length that flow "
             "through the cells one after another (TeraPipe; core/token_slices.py, "
             "pipeline/schedule.py): the bubble of M micro-batches becomes that of M·S "
             "units of 1/S the work. Causal sequence models only (every layer declares "
             "token_slicing); schedules gpipe and 1f1b. Each cell keeps its causal "
             "layers' keys and values of the whole sequence per micro-batch in flight. "
             "Pair with weight_gradient_group=S (one weight-gradient product for a "
             "micro-batch's S slices).")
    p.define("token_slice_lengths", None, "With num_token_slices S > 1: the S slices' "
             "lengths in tokens, first to last, summing to the sequence length "
             "(TeraPipe's uneven slices: a slice attends to the keys up to its own end, "
             "so later slices cost more and earlier ones may be made longer to even "
             "the units out). None: near-equal, the first T mod S one token longer. "
             "The planner plans near-equal slices.")
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
    check_pipeline_params(p, self.path)
    self.cells = self._partition()
    self.cell_devices = self._assign_devices(len(self.cells))
    layer_devices = [self.cell_devices[k] for k, cell in enumerate(self.cells)
                     for _ in range(cell.start, cell.end)]
    # A weight another layer ties to (a softmax reading the embedding) is read by two
    # cells, on their own devices: it stays a variable of its own, never a row of its
    # cell's stack, which only that cell's bodies bind.
    tie_targets = [value for lp in p.layers for key, value in lp.flatten()
                   if key.rsplit(".", 1)[-1] == "tie_to" and value]
    with stacked_variables.deferred(p.stack_variables, kept_whole=tie_targets):
      self.create_children("layers", p.layers, devices=layer_devices)
    if p.num_token_slices > 1:
      try:
        token_slices.check_layers(self.layers, self.path)
      except ValueError as e:
        raise PipelineError(str(e)) from None
    self._function_cache = _FunctionCache(p.share_layer_functions, p.scan_layers)
    self._function_cache.stacks = self._stack_variables()
    self._function_cache.tied = tied_weights.make_copies(
        [self.cell_layers(k) for k in range(len(self.cells))], self.cell_devices)
    self._channel_prefix = channels.channel_prefix(self.path)
    # Made once (a schedule these cells and micro-batches cannot run fails here).
    self._function_cache.plan = self._make_plan()

  def _stack_variables(self) -> list[list[stacked_variables.VariableStack]]:
    """Per cell, the stacks holding its layers' deferred variables (none unless
    params.stack_variables), created on the cell's device. Kept where tf.Module finds
    them (self.variables) but does not checkpoint them: the rows are checkpointed."""
    stacks = []
    for k in range(len(self.cells)):
      # With scan_layers, a stack per weight of a kind of layer: a run of that kind
      # reads each weight's rows as one whole stack (layer_function.py).
      scan = self.params.scan_layers
      rows, keys = [], []
      for layer in self.cell_layers(k):
        kind = base_layer.params_kind(layer.params) if scan else None
        weights = [v for sublayer in layer.walk() for v in sublayer.own_variables()]
        for j, v in enumerate(weights):
          if isinstance(v, stacked_variables.RowVariable):
            rows.append(v)
            keys.append((kind, j))
      with tf.device(self.cell_devices[k]):
        stacks.append(stacked_variables.stack(rows, name=f"{self.path}/cell_{k}",
                                              keys=keys if scan else None))
    object.__setattr__(self, "_variable_stacks", [s.variable for cell in stacks for s in cell])
    return stacks

  # -- partition and placement ----------------------------------------------------

  def layer_costs(self) -> list[float]:
    """The cost of each layer the partitioner balances (no variables are allocated)."""
    p = self.params
    if p.partition_cost == "given" or (p.partition_cost == "measured" and p.layer_costs):
      if len(p.layer_costs) != len(p.layers):
        raise PipelineError(f"{self.path}: layer_costs has {len(p.layer_costs)} entries for "
                            f"{len(p.layers)} layers")
      return [float(c) for c in p.layer_costs]
    if p.partition_cost == "params":
      return [float(n) for n in model_stats.param_counts(p.layers)]
    if p.input_specs is None:
      raise PipelineError(f"{self.path}: partition_cost={p.partition_cost!r} needs "
                          "input_specs (the pipeline input's nested tf.TensorSpec, batch size "
                          "included)")
    if p.partition_cost == "measured":
      if not tf.executing_eagerly():
        raise PipelineError(f"{self.path}: partition_cost='measured' profiles the layers, "
                            "which needs eager execution; build the pipeline eagerly, or "
                            "measure first and give the costs (partition_cost='given')")
      return measured_costs(
          [base_layer.inherit_fprop_dtype(lp, self.fprop_dtype) for lp in p.layers],
          p.input_specs)
    from lingvo_gpipe.core import layers as layers_lib

    seq = layers_lib.Sequential.Params().set(name="cost_probe", layers=p.layers,
                                             fprop_dtype=self.fprop_dtype)
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
    return assign_devices(self.params, num_cells, list(self.params.devices) or default_devices(),
                          self.path)

  @property
  def output_device(self) -> str:
    return self.cell_devices[-1]

  def cell_layers(self, k: int) -> list[BaseLayer]:
    return list(self.layers[self.cells[k].start:self.cells[k].end])

  def _recompute_cell(self, k: int) -> bool:
    return recomputes(self.params.recompute, k, len(self.cells))

  # -- forward and backward ------------------------------------------------------------

  def _split(self, structure: Any, sizes: list[int], device: str | None) -> list[Any]:
    """Nested tensors [B, ...] → one nested structure [b_m, ...] per micro-batch."""
    flat = tf.nest.flatten(structure)
    with tf.device(device):
      parts = [tf.split(t, sizes, axis=0) for t in flat]
    return [tf.nest.pack_sequence_as(structure, [part[m] for part in parts])
            for m in range(len(sizes))]

  def _micro_batches(self, structure: Any, num_micro_batches: int
                     ) -> tuple[list[int], list[int]]:
    """(sizes, offsets): each micro-batch's size and its first example's position."""
    batch = tf.nest.flatten(structure)[0].shape[0]
    if batch is None:
      raise PipelineError(f"{self.path}: the batch dimension must be static to split it into "
                          "micro-batches")
    try:
      sizes = micro_batch_sizes(batch, num_micro_batches)
    except PipelineError as e:
      raise PipelineError(f"{self.path}: {e}") from None
    return sizes, [0, *itertools.accumulate(sizes[:-1])]

  def cell_functions(self, head: Head | None = None) -> list[CellFunctions]:
    """The traced-once functions of each cell; the last one ends in `head` (if given).

    Built once per head and kept, so that every step (and every retrace of the
    training step) calls the same traced bodies.
    """
    cache = self._function_cache.by_head
    if head not in cache:
      last = len(self.cells) - 1
      cache[head] = [CellFunctions(self.cell_layers(k), self.cell_devices[k], k,
                                   self._recompute_cell(k), head if k == last else None,
                                   needs_input_grads=k > 0,
                                   defer_weight_gradients=self.plan().defers(k),
                                   run_layers=self._function_cache.call_layers,
                                   stacks=self._function_cache.stacks[k])
                     for k in range(len(self.cells))]
    return cache[head]

  @tf.autograph.experimental.do_not_convert  # plain Python on static values
  def forward_backward(self, inputs: Any, head: Head, head_inputs: Any
                       ) -> device_loop.StepGradients:
    """One training step's forward and backward, scheduled per params.schedule.

    inputs: the pipeline's nested inputs [B, ...]; head(outputs, head_inputs) → metrics
    {name: (value, weight)} of one micro-batch, computed on the last cell's device, with
    metrics['loss'] = (mean loss, its weight); head_inputs: nested [B, ...] (labels...).
    Returns the whole batch's metrics and the gradient of its loss for every variable
    the cells and the head read. Batch statistics go to the StepContext's layer_stats, each
    call's timestamps to its spans.
    """
    tf_internals.disable_function_specialization()
    sizes, offsets = self._micro_batches(inputs, self.params.num_micro_batches)
    lengths = self._slice_lengths(inputs, head_inputs)
    inputs = self._in_fprop_dtype(inputs)
    # A weight tied across devices is read through its copy on each reading cell's
    # device, refreshed here once per step (tied_weights.py).
    copies = self._function_cache.tied
    tied_weights.refresh(copies)
    with tied_weights.read_as_copies(copies):
      # Hand-offs are matched by name within one step id, so each traced step gets names
      # of its own: two steps traced into one function (task.train.steps_per_call)
      # would otherwise take each other's hand-offs (they deadlocked).
      result = device_loop.run(self.cell_functions(head), self.plan(), inputs, head_inputs,
                               sizes, offsets, channels.channel_prefix(self._channel_prefix),
                               lengths)
    if copies:
      result.variables, result.gradients = tied_weights.onto_variables(
          result.variables, result.gradients, copies)
    return result

  def _slice_lengths(self, inputs: Any, head_inputs: Any) -> list[int] | None:
    """The token slices' lengths (params.num_token_slices > 1; else None): those of
    token_slice_lengths, or near-equal ones; every input and head input must be
    [B, T, ...] with one static T."""
    num_slices = self.params.num_token_slices
    if num_slices == 1:
      return None
    lengths = {(t.shape[1] if t.shape.rank and t.shape.rank >= 2 else None)
               for t in tf.nest.flatten((inputs, head_inputs))}
    if len(lengths) != 1 or None in lengths:
      raise PipelineError(f"{self.path}: num_token_slices={num_slices} needs every input "
                          "and head input shaped [batch, tokens, ...] with one static "
                          f"number of tokens; their axis 1: {sorted(map(str, lengths))}")
    return token_slice_lengths(self.params, lengths.pop(), self.path)

  def _in_fprop_dtype(self, inputs: Any) -> Any:
    """The pipeline's nested inputs [B, ...] with the floating ones cast to the compute
    dtype on the first cell's device: the micro-batches are split from them, so they
    travel to the first cell and wait in its stash in it (half the bytes of float32
    under mixed precision)."""
    with tf.device(self.cell_devices[0]):
      return tf.nest.map_structure(self.to_fprop_dtype, inputs)

  def plan(self) -> schedule.PipelineSchedule:
    """The actions of each cell in a training step and each device's order (see
    `_make_plan`)."""
    return self._function_cache.plan

  def _make_plan(self) -> schedule.PipelineSchedule:
    """The actions of each cell in a training step and each device's order
    (schedule.build, which the planner predicts with: params.schedule; with
    weight_gradient_group G > 1, a W after every G-th backward of each
    re-materialized cell and after its last). Cells that share a device run in one
    loop, in the order of the schedule (interleaved_1f1b) or, placed there
    round-robin, in the order their actions start in the simulated timeline."""
    p = self.params
    device_index = {d: i for i, d in enumerate(dict.fromkeys(self.cell_devices))}
    try:
      return schedule.build(
          p.schedule, len(self.cells), p.num_micro_batches, virtual_stages=p.virtual_stages,
          weight_gradient_group=p.weight_gradient_group,
          recomputed=tuple(self._recompute_cell(k) for k in range(len(self.cells))),
          num_token_slices=p.num_token_slices,
          device_of=tuple(device_index[d] for d in self.cell_devices))
    except schedule.ScheduleError as e:
      raise PipelineError(f"{self.path}: {e}") from None

  def fprop(self, *inputs: Any) -> Any:
    """inputs: tensors (or nested structures) of batch-major [B, ...] → outputs [B, ...].

    Eval runs the whole batch layer by layer on each cell's device (no backward pass
    to keep activations for, so micro-batches would only lengthen the graph). Training
    runs each micro-batch through the cells' traced forward functions; the caller may
    differentiate the result (TensorFlow's gradient of each call: no re-materialization,
    no schedule; `forward_backward` is the pipelined training step).
    """
    structure = inputs[0] if len(inputs) == 1 else tuple(inputs)
    ctx = base_layer.current_context()
    if not ctx.training:
      x = structure
      for k in range(len(self.cells)):
        with tf.device(self.cell_devices[k]), \
            stacked_variables.bound(self._function_cache.stacks[k]):
          x = self._function_cache.call_layers(self.cell_layers(k), x)
      return x
    sizes, offsets = self._micro_batches(structure, self.params.num_micro_batches)
    structure = self._in_fprop_dtype(structure)
    cells = self.cell_functions()
    step = tf.cast(ctx.step, tf.int64)
    outputs = []
    for m, x in enumerate(self._split(structure, sizes, self.cell_devices[0])):
      call_info = tf.stack([tf.cast(ctx.example_offset, tf.int64) + offsets[m],
                            tf.constant(0, tf.int64)])  # whole sequences: token offset 0
      for cell in cells:
        x, stats = cell.call_forward(x, None, step, call_info)
        if ctx.layer_stats is not None:
          ctx.layer_stats.extend(stats)
      outputs.append(x)
    if len(outputs) == 1:
      return outputs[0]
    with tf.device(self.output_device):
      return tf.nest.map_structure(lambda *ts: tf.concat(ts, axis=0), *outputs)

  def infer(self, *inputs: Any, num_micro_batches: int) -> Any:
    """Forward-only pipeline (serving): inputs [B, ...] (B may be unknown) → outputs.

    The batch is cut into `num_micro_batches` near-equal parts (the first B mod M one
    example larger; empty parts when B < M); micro-batch m runs through cell k on
    cell k's device, cell by cell. Nothing but the data orders the calls: TensorFlow's
    executor runs cell k on micro-batch m + 1 while cell k + 1 runs on micro-batch m,
    GPipe's forward pipeline without a schedule (there is no backward to interleave;
    control dependencies that made each device take the micro-batches in order
    removed the overlap altogether, docs/benchmarks_history.md, "Serving (2026-11-26)").
    Variables are read as the layers' attributes hold them (a serving model reads its
    own copies through `base_layer.variables_read_as`). On a token slice (a generate
    step) the whole batch is one micro-batch: the slice cache holds whole-batch entries.
    """
    structure = inputs[0] if len(inputs) == 1 else tuple(inputs)
    if base_layer.current_context().token_slice is not None:
      num_micro_batches = 1
    flat = tf.nest.flatten(structure)
    with tf.device(self.cell_devices[0]):
      batch = tf.shape(flat[0], out_type=tf.int32)[0]
      sizes = near_equal.tensor_sizes(batch, num_micro_batches)
      parts = [tf.split(t, sizes, num=num_micro_batches, axis=0) for t in flat]
    outputs = []
    for m in range(num_micro_batches):
      x = tf.nest.pack_sequence_as(structure, [part[m] for part in parts])
      for k in range(len(self.cells)):
        with tf.device(self.cell_devices[k]):
          x = self._function_cache.call_layers(self.cell_layers(k), x)
      outputs.append(x)
    if len(outputs) == 1:
      return outputs[0]
    with tf.device(self.output_device):
      return tf.nest.map_structure(lambda *ts: tf.concat(ts, axis=0), *outputs)

  def describe_cells(self) -> list[dict]:
    """Per cell: its layers, device, parameter count, and its share of the cost the
    partitioner balanced (`cost_by`: partition_cost, e.g. 'params' or 'flops')."""
    counts = model_stats.param_counts(self.params.layers)
    return [{"cell": k, "layers": [lp.name for lp in self.params.layers[c.start:c.end]],
             "device": self.cell_devices[k], "params": int(sum(counts[c.start:c.end])),
             "cost_share": round(c.cost_share, 6), "cost_by": self.params.partition_cost}
            for k, c in enumerate(self.cells)]


class _FunctionCache:
  """Holds a pipeline's CellFunctions per head, the functions its kinds of layer
  share (None: not shared) and its schedule; a plain object, so that tf.Module's attribute tracking
  (checkpoints, variable collection) does not walk into it."""

  def __init__(self, share_layer_functions: bool, scan_layers: bool = False):
    self.by_head: dict[Any, list[CellFunctions]] = {}
    self.layers = LayerFunctions(scan_layers) if share_layer_functions else None
    # `layers` in order on x, through the shared functions when there are some.
    self.call_layers = self.layers.call_layers if self.layers is not None else call_layers
    self.plan: schedule.PipelineSchedule | None = None
    # Per cell, its stacked variables (stacked_variables.VariableStack).
    self.stacks: list[list[stacked_variables.VariableStack]] = []
    # Copies of weights tied across devices, where their readers run (tied_weights.py).
    self.tied: list[tied_weights.TiedCopy] = []
