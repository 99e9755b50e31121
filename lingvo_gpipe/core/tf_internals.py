"""Every place the engine relies on TensorFlow behaviour beyond its documented API.

Checked on TensorFlow `TENSORFLOW_CHECKED` (a major.minor version; patch releases
are taken to keep these behaviours). On a new minor version,
`tests/tf_internals_test.py` fails until each item below has been re-checked with the
test named beside it, then `TENSORFLOW_CHECKED` is updated.

1. `NOT_INLINED`, the function attribute `_noinline` on the cells' functions
   (`tf.function(..., experimental_attributes=NOT_INLINED)`). TensorFlow inlines
   function calls by default (its runtime before placement, and Grappler's function
   optimizer) and re-optimizes the flattened graph, where common-subexpression
   elimination merges a recomputed forward into the forward (on 2.21 it merges the
   repeated ops of two inlined calls), undoing re-materialization.
   Pinned by `tests/tf_internals_test.py::test_calls_marked_not_inlined_stay_calls`
   (in the graph TensorFlow runs, a marked call stays a call; an unmarked one is
   inlined) and `tests/pipeline_graph_test.py::test_cell_calls_are_not_inlined` (the
   cells' calls carry the attribute).
2. `disable_function_specialization()`: Grappler's function optimizer off,
   process-wide (`tf.config.optimizer.set_experimental_options`; there is no
   per-function switch). It specializes a body copy per call site with a constant
   input, so the first step's cost grew with layers × micro-batches. Pinned by
   `tests/tf_internals_test.py::test_function_specialization_copies_a_body_per_call_site_unless_disabled`
   (two call sites run two specialized copies; disabled, one body), and its cost by
   `bench/startup_time.py`.
3. `unlowered(build)`: the attribute `_lower_using_switch_merge` = False on the While
   and Case ops `build` creates, set while the step is traced (setting it on a traced
   graph afterwards has no effect). Lowered to Switch/Merge, each device's loop is a
   frame of its own and Send/Recv inside two loops never match: the step hangs.
   Functional, each iteration runs its body as a function with the step's rendezvous,
   and a Case runs only the chosen branch (a Recv in a branch not taken never waits).
   Pinned by `tests/tf_internals_test.py::test_sends_and_receives_in_two_device_loops_match`.
4. `send` / `recv`: `tf.raw_ops.Send` / `Recv` (raw ops kept for Lingvo, outside the
   public API's promises) with full device names. Within one step, the i-th Recv of a
   tensor name gets the i-th Send's tensor (first in, first out), also when both run
   inside loops; across processes, `send_device_incarnation` must be the sending
   device's real incarnation (0 fails with "RecvTensor expects a different device
   incarnation"). Pinned by the same test (order) and `tests/loopback_test.py`
   (two worker processes).
5. `forward_backward_pair(concrete)`: TensorFlow's own pair for differentiating a call
   of a function (`ConcreteFunction._delayed_rewrite_functions.forward_backward()`): a
   forward that also returns the intermediates its gradient needs, and a backward that
   takes them. A cell that is not re-materialized keeps those intermediates per
   micro-batch between its forward and backward actions (a tape cannot span loop
   iterations). Pinned by
   `tests/tf_internals_test.py::test_forward_backward_pair_gives_the_gradient` and the
   recompute=never rows of `tests/gpipe_test.py`.
6. `host_address_space()`: this process's /job:…/replica:…/task:… from the eager
   context (`context.context().host_address_space()`), the prefix of a local device's
   full name. Pinned by `tests/tf_internals_test.py`.
7. `tf.raw_ops.CollectiveReduceV2` (`hybrid.CollectiveMean`; a raw op, outside the
   `tf.distribute` API), one op per device of a group: with merge_op "Add" and
   final_op "Div" every device gets the mean of the group's tensors; `group_key`
   names one set of devices for the whole process, `instance_key` one all-reduce in
   the group (the same key is used again by every call of the step). Its
   `ordering_token` input, given a resource on the op's own device, makes
   tf.function's automatic control dependencies order the collectives per device;
   without one they are chained in program order across devices, so the op on the
   second device waits for the first one, which waits for its peer: a deadlock.
   Pinned by `tests/tf_internals_test.py::test_collective_reduce_is_a_mean_ordered_per_device`
   and `tests/hybrid_test.py` (the all-reduce test and the two-replica equivalence).
8. `step_options()`: Grappler settings for the training step only, through the
   thread's function call options (`context.context().function_call_options`, not
   public API): each function call op made or run while they are set carries them in
   its `config_proto` attribute, and TensorFlow optimizes that function with them when
   it instantiates it. Measured on `lm.Transformer48`'s shape (docs/benchmarks_history.md,
   "Layers of one kind traced once (2026-11-23)"):
   the TFG passes (attribute consolidation, topological sort, shape inference) and
   the memory optimizer changed no node of any of the step's 550 function instances
   and took 4 of Grappler's 10 s; the second meta-optimizer iteration removed 31 of
   18,693 nodes. Off, the first call took 7.9 s instead of 14.9 s, the steady step no
   slower; Grappler entirely off was slower in the steady step (its remapper fusions and
   arithmetic rewrites pay). Pinned by
   `tests/tf_internals_test.py::test_step_options_reach_nested_calls`. `step_function`
   wraps a step called outside the trainer (the planner's calibration, the tests) in them.
9. The Philox counter layout of `tf.raw_ops.StatelessRandomUniformV2`
   (`layers.position_keyed_uniform`, the dropout masks; `alg` 1 is Philox): given the
   key of `StatelessRandomGetKeyCounter(seed)` and the counter [c, 0] (uint64 low,
   high), element i of a float32 draw is made from 32-bit word i mod 4 of
   Philox-4x32-10(key, c + i div 4), as (word's low 23 bits | 1.0's exponent) − 1.
   So the stream of one seed can be started at any element (counter block
   start div 4, then drop start mod 4 elements) without drawing what comes before:
   a micro-batch draws its rows of the whole batch's mask. One word per element holds
   for float32, float16 and bfloat16; float64 takes two (two elements per block,
   which `position_keyed_uniform` counts). Pinned by
   `tests/tf_internals_test.py::test_philox_counter_layout_of_position_keyed_masks`
   (against Philox computed in numpy) and, per dtype,
   `tests/layers_test.py::test_position_keyed_uniform_matches_one_long_draw`.
10. `tf.raw_ops.InplaceAdd(x, i, v)` (a raw op; the public `inplace_add` wrappers
    copy first) writes v into rows i of x's own buffer and returns that buffer, whoever
    else holds x; `tf.raw_ops.DeepCopy` makes a buffer nothing else holds. A cell's
    gradient sums (`gradient_sums.StackedLayout`) copy once per backward, then add
    each gradient into its row of the copy in place, so a backward never holds all its
    gradients packed beside the sums (a weight-sized buffer or two less at its end;
    docs/benchmarks_history.md, "Mixed precision (2026-11-25)"). If InplaceAdd copied,
    every add would copy a whole stack; if DeepCopy were folded away, the sums would be
    written into a buffer a later step reads. Pinned by
    `tests/tf_internals_test.py::test_inplace_add_writes_into_its_input`
    and the equivalence grid of `tests/gpipe_test.py` (two training steps included).
11. `tf.unstack` of a variable's read [n, *shape] (`stacked_variables.bound`) returns
    rows that share the read's buffer when each row's bytes keep the allocator's
    alignment (rows of 64-byte multiples on these machines; smaller rows are copied,
    and are small): a cell reads each of its stacked weights once per call without
    copying them. If it copied, every forward and recompute would hold a second copy
    of its cell's weights. Pinned by
    `tests/tf_internals_test.py::test_unstacking_a_variable_read_copies_nothing`.
12. Trackable's `_serialize_to_tensors` / `_restore_from_tensors` (protected) and
    tf.Module's `_flatten` (private): a `stacked_variables.RowVariable` saves and
    restores under its layer's own checkpoint key, and `trainable_weights` walks a
    module's attributes for its rows in tf.Module's order. Pinned by
    `tests/stacked_variables_test.py` (a checkpoint of one tf.Variable per weight
    restored bit for bit; the weights listed in the unstacked model's order).
13. `registered_kernel(node_def)`: the kernel registry's `TryFindKernelClass`
    (`tensorflow.python.util._pywrap_kernel_registry`, private), TensorFlow's own match
    of a NodeDef (its device's type, its attributes against each kernel's type
    constraints, a DEFAULT kernel as any device's fallback) → the kernel's class name,
    or b"" where none admits it. It reads only what this build registered: the full
    `tensorflow` wheel registers its GPU kernels without a GPU, `tensorflow-cpu` none.
    Pinned by `tests/tf_internals_test.py::test_kernel_registry_matches_type_constraints`.
14. `called_functions(graph)`: the functions a traced graph calls, with each one's
    FuncGraph, from `Graph._functions` (private; nested calls register theirs in the
    outer graph) and `AtomicFunction.graph`: the Python ops of every function body, so
    an op found there has its creating frame (`Operation.traceback`). Pinned by
    `tests/placement_audit_test.py` (an op inside a Case inside a While inside a
    tf.function call is found with its frame).
15. An attribute of our own on traced ops (`set_attr`; its name starts with '_', like
    TensorFlow's internal ones, which kernels do not constrain and which stay on the
    node in the function library): `placement_audit.on_host` records there why an op
    runs on the host. Pinned by `tests/placement_audit_test.py` (the reason is read
    back from the traced step's library, and the step's results are unchanged).
16. A functional While's (or Case's, If's) body runs as a single-device function: every
    op of it runs on the loop's device, whatever device the op names; a function call
    (PartitionedCall) partitions its body by the devices its ops name. So an op that
    must run elsewhere than the loop's device (the timeline's host clock,
    `device_loop._host_clock`) goes through a never-inlined call, and
    `placement_audit` ignores the named devices of ops in control-flow bodies. Seen
    first on an H200 (a Timestamp named on the host ran on the GPU, which has no
    kernel for it). Pinned by
    `tests/tf_internals_test.py::test_a_loop_body_runs_on_the_loops_device_and_a_call_keeps_its_own`
    (from what executed, on logical CPUs).
17. `zeros(shape, dtype, zero=None)`: zeros Grappler does not fold. Its constant
    folding turns a `tf.zeros` of a static shape (up to 10 MB) into a Const node that
    the function's instantiation holds for as long as the function lives: a
    weight-sized buffer per cell for the gradient sums' initial zeros, and an
    activation-sized one per zero gradient seed, held between steps on every device.
    `tf.raw_ops.Empty(init=True)` (registered for CPU and GPU) is not folded: its
    zeros are made when it runs and freed after. But Empty is registered stateful
    (that is why it is not folded), and tf.function's automatic control dependencies
    chain stateful ops without resources in program order: in the step's own graph,
    an Empty for cell k's state waits for the ops traced before it, device k−1's
    loop included, which waits for cell k: the step hangs (seen: zb_h1 at K=4). So
    zeros made outside a device's loop take `zero`, a scalar the graph cannot know is
    0 (`runtime_zero`), and are a Fill of it: stateless, and not foldable. Pinned by
    `tests/tf_internals_test.py::test_zeros_in_a_loop_state_are_not_folded_into_a_constant`
    (the allocator's bytes held after calls: a weight-sized tensor with `tf.zeros`,
    none with `zeros`, either way) and the zb_h1 K=4 rows of
    `tests/keras_masks_test.py`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2
from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2
from tensorflow.python.eager import context
from tensorflow.python.util import _pywrap_kernel_registry

TENSORFLOW_CHECKED = "2.21"  # major.minor

NOT_INLINED = {"_noinline": True}

_FUNCTIONAL_CONTROL_FLOW = ("While", "StatelessWhile", "Case", "StatelessCase")


def disable_function_specialization() -> None:
  """Turns Grappler's function optimizer off for the process (item 2 above)."""
  if tf.config.optimizer.get_experimental_options().get("function_optimization") is False:
    return  # (setting it again would drop the thread's step_options)
  tf.config.optimizer.set_experimental_options({"function_optimization": False})


# Item 8: what the training step's Grappler skips (fields of RewriterConfig).
STEP_REWRITES = {"disable_tfg_optimizer": True,
                 "memory_optimization": rewriter_config_pb2.RewriterConfig.NO_MEM_OPT,
                 "meta_optimizer_iterations": rewriter_config_pb2.RewriterConfig.ONE}


@contextlib.contextmanager
def step_options() -> Iterator[None]:
  """Within (this thread), functions traced or called are optimized with the
  process's Grappler settings changed by STEP_REWRITES (item 8 above). Enter it both
  to trace the step and to call it: the settings are part of what TensorFlow keys
  its instantiations by."""
  disable_function_specialization()  # first: changing the options resets the thread's
  ctx = context.context()
  previous = ctx.function_call_options
  config = config_pb2.ConfigProto.FromString(previous.config_proto_serialized)
  for field, value in STEP_REWRITES.items():
    setattr(config.graph_options.rewrite_options, field, value)
  ctx.function_call_options = context.FunctionCallOptions(
      executor_type=previous.executor_type, config_proto=config)
  try:
    yield
  finally:
    ctx.function_call_options = previous


def step_function(step: Callable[..., Any]) -> StepFunction:
  """`step` (a tf.function, or a callable to wrap in one) traced and called within
  `step_options()`, as the trainer traces and calls its steps: for a training step
  called outside the trainer (the planner's calibration, the tests)."""
  return StepFunction(step if hasattr(step, "get_concrete_function") else tf.function(step))


class StepFunction:
  """`step_function`'s callable: the tf.function's calls and traces within step_options."""

  def __init__(self, function: Any):
    self._function = function

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    with step_options():
      return self._function(*args, **kwargs)

  def get_concrete_function(self, *args: Any, **kwargs: Any) -> Any:
    with step_options():
      return self._function.get_concrete_function(*args, **kwargs)


@contextlib.contextmanager
def new_ops() -> Iterator[list[tf.Operation]]:
  """Yields a list that holds, once the block is left, the ops made within it in the
  graph being traced (none when executing eagerly)."""
  graph = tf.compat.v1.get_default_graph()
  before = len(graph.get_operations())
  made: list[tf.Operation] = []
  yield made
  made.extend(graph.get_operations()[before:])


def set_attr(op: tf.Operation, name: str, value: attr_value_pb2.AttrValue) -> None:
  """Sets an attribute of a traced op; `name` starts with '_' (TensorFlow's internal
  attributes, which no kernel constrains). Items 3 and 15 above."""
  op._set_attr(name, value)  # noqa: SLF001


def unlowered(build: Callable[[], Any]) -> Any:
  """Runs `build` (which makes a tf.while_loop or tf.switch_case in the graph being
  traced) and keeps the While and Case ops it made functional (item 3 above)."""
  with new_ops() as made:
    result = build()
  for op in made:
    if op.type in _FUNCTIONAL_CONTROL_FLOW:
      set_attr(op, "_lower_using_switch_merge", attr_value_pb2.AttrValue(b=False))
  return result


def send(tensor: tf.Tensor, name: str, sender: str, sender_incarnation: int,
         receiver: str) -> tf.Operation:
  """Hands `tensor` to the `recv` of the same name on `receiver` (item 4 above)."""
  return tf.raw_ops.Send(tensor=tensor, tensor_name=name, send_device=sender,
                         send_device_incarnation=sender_incarnation, recv_device=receiver,
                         client_terminated=False)


def recv(spec: tf.TensorSpec, name: str, sender: str, sender_incarnation: int,
         receiver: str) -> tf.Tensor:
  """The tensor the next `send` of `name` hands over, with `spec`'s static shape."""
  tensor = tf.raw_ops.Recv(tensor_type=spec.dtype, tensor_name=name, send_device=sender,
                           send_device_incarnation=sender_incarnation, recv_device=receiver,
                           client_terminated=False)
  tensor.set_shape(spec.shape)
  return tensor


def host_address_space() -> str:
  """This process's '/job:J/replica:R/task:T' (item 6 above)."""
  ctx = context.context()
  ctx.ensure_initialized()
  return ctx.host_address_space()


@dataclasses.dataclass
class ForwardBackwardPair:
  """Differentiating one concrete function without a tape (item 5 above).

  forward(*flat_args) → its outputs and then `kept`: the intermediates the backward
  needs. backward(output_grads, kept) → the gradient of every input of the function:
  its flat arguments, then its captured inputs (`captured_inputs`, e.g. variable
  handles), None where there is none. output_grads: one per floating output, in order.
  """
  forward_call: Callable[..., Sequence[tf.Tensor]]
  backward_fn: Any
  num_outputs: int
  kept_positions: list[int]   # per kept intermediate, its index in forward's outputs
  backward_captures: list[Any]  # per backward capture: an index into kept, or the tensor
  captured_inputs: list[Any]
  trainable_outputs: list[int]  # indices of the outputs that take a gradient

  def forward(self, flat_args: Sequence[tf.Tensor]) -> tuple[list[tf.Tensor], list[tf.Tensor]]:
    """→ (the function's outputs, the intermediates to keep for `backward`)."""
    outputs = list(self.forward_call(*flat_args, *self.captured_inputs))
    return outputs[:self.num_outputs], [outputs[i] for i in self.kept_positions]

  def captured_gradients(self) -> list[Any]:
    """Per captured input, what `backward` gives as its gradient, as traced: a tensor
    of the backward's graph, or None where it gives none (in every call)."""
    flat = tf.nest.flatten(self.backward_fn.structured_outputs, expand_composites=False)
    return flat[len(flat) - len(self.captured_inputs):]

  def backward(self, output_grads: Sequence[tf.Tensor], kept: Sequence[tf.Tensor]) -> list[Any]:
    captures = [kept[c] if isinstance(c, int) else c for c in self.backward_captures]
    return tf.nest.flatten(self.backward_fn._call_flat(list(output_grads), captures),  # noqa: SLF001
                           expand_composites=False)


def forward_backward_pair(concrete: Any) -> ForwardBackwardPair:
  """TensorFlow's forward (with intermediates) and backward of `concrete`, a
  ConcreteFunction whose outputs are a flat list of tensors (item 5 above)."""
  # The function's own outputs: once a gradient of it was taken (a pair made before,
  # or TensorFlow's gradient of a call), the graph's outputs also hold the kept ones.
  num_outputs = sum(isinstance(t, tf.Tensor) for t in tf.nest.flatten(
      concrete.structured_outputs, expand_composites=True))
  graph_outputs = list(concrete.graph.outputs)[:num_outputs]
  trainable = [i for i, t in enumerate(graph_outputs) if t.dtype.is_floating]
  forward, backward = concrete._delayed_rewrite_functions.forward_backward()  # noqa: SLF001
  outputs = {id(t): i for i, t in enumerate(concrete.graph.outputs)}  # now with the kept ones
  kept_positions: list[int] = []
  backward_captures: list[Any] = []
  for internal_source in backward.captured_inputs:
    position = outputs.get(id(internal_source))
    if position is None:
      backward_captures.append(internal_source)
    else:
      if position not in kept_positions:
        kept_positions.append(position)
      backward_captures.append(kept_positions.index(position))
  return ForwardBackwardPair(forward.call_flat, backward, num_outputs, kept_positions,
                             backward_captures, list(concrete.captured_inputs), trainable)


def registered_kernel(node_def: Any) -> bytes:
  """The class of the kernel TensorFlow would run for `node_def` (a NodeDef whose
  device names the device type), b"" where none is registered (item 13 above)."""
  return _pywrap_kernel_registry.TryFindKernelClass(node_def.SerializeToString())


def called_functions(graph: Any) -> dict[str, Any]:
  """Name → FuncGraph of each function `graph` calls, directly or not (item 14 above);
  a function kept only as a FunctionDef maps to None."""
  found: dict[str, Any] = {}
  pending = [graph]
  while pending:
    for name, function in pending.pop()._functions.items():  # noqa: SLF001
      if name not in found:
        found[name] = getattr(function, "graph", None)
        if found[name] is not None:
          pending.append(found[name])
  return found


# Dtypes `tf.raw_ops.Empty` has kernels for on both CPU and GPU (inplace_ops.cc).
_EMPTY_DTYPES = frozenset({tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.complex64,
                           tf.complex128, tf.int8, tf.uint8, tf.int32, tf.int64, tf.uint64})


def zeros(shape: Any, dtype: tf.DType, zero: tf.Tensor | None = None) -> tf.Tensor:
  """Zeros of a static `shape` that Grappler does not fold into a constant held by the
  function (item 17): made when the op runs, freed when no longer used. Inside a
  device's loop or a cell's function: `Empty`. In the step's own graph, outside the
  loops: pass `zero` (`runtime_zero`), filled, since an Empty there is ordered after
  the ops before it. Strings, shapes not fully known, and without `zero` the dtypes
  Empty has no kernel for (bool): `tf.zeros`."""
  shape = tf.TensorShape(shape)
  dtype = tf.as_dtype(dtype)
  if not shape.is_fully_defined() or dtype == tf.string:
    return tf.zeros(shape, dtype)
  if zero is not None:
    return tf.fill(shape.as_list(), tf.cast(zero, dtype))
  if dtype not in _EMPTY_DTYPES:
    return tf.zeros(shape, dtype)
  out = tf.raw_ops.Empty(shape=tf.constant(shape.as_list(), tf.int32), dtype=dtype, init=True)
  out.set_shape(shape)
  return out


def runtime_zero(step: tf.Tensor) -> tf.Tensor:
  """0, from the global step (≥ 0), as a scalar the graph cannot fold: what `zeros`
  fills with outside the device loops."""
  return tf.minimum(step, tf.zeros([], step.dtype))
