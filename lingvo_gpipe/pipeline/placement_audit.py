"""Where every op of a traced step would run, and whether a GPU kernel admits it.

TensorFlow picks an op's kernel when the step first runs. An op placed on a GPU whose
dtypes no GPU kernel admits either fails then, or (soft placement, tf.function's
default) runs on the host, with a copy across PCIe for each tensor it takes from or
hands to the device: silently, every action. This module finds such ops from the
traced step alone, before any GPU is there:

  audit(graph, gpu_index)
    walk `graph` and every function it calls (the cells' calls, the devices' While
    loops, their Case branches, gradient functions), each function once per device it
    runs on; an op without a device of its own runs on the device of the op that calls
    its function; a device of its own is merged over that one, field by field, in a
    function call's body, and ignored in a While's, Case's or If's body (those run
    every op on the loop's device: an op there cannot be put on the host)
    → every op whose device is a GPU (gpu_index(device) is its index) is checked
      against the kernel registry as it would be on that GPU (its type, its dtypes);
      host ops are sorted into deliberate ones (made within `on_host`, which states
      why on the op itself) and unexplained ones; ops no device reaches are listed
      where the placer would have to put them on the host (no GPU kernel); and every
      Case or If on a GPU that takes or returns an int32 (below).

An int32 must not cross a Case's or If's boundary on a GPU. TensorFlow treats int32
tensors as host memory at a function's arguments and results (`_Arg`, `_Retval`) and at
a While's, but as device memory at a Case's or If's inputs and outputs (their GPU
kernels mark only the branch index host memory; memory_types.cc lists While, not Case,
among the function calls whose int32 stay on the host). A branch then receives a GPU
buffer it takes for a host one, and the first int32 host kernel in it (a Slice, a
TensorList's index) reads it on the CPU: a segmentation fault, seen on an H200
(docs/benchmarks_history.md, "The second GPU contact", 2026-11-27). Carry int64 across,
and cast inside.

`gpu_index` lets a step traced on logical CPU devices stand in for GPUs (the tool
`tools/gpu_audit.py` traces with cells on CPU:1..N standing for GPU:0..N-1, CPU:0 the
host), so the variables, their optimizer updates and every cell op are where they
would be on GPUs. Kernels are looked up by TensorFlow's own matcher
(`tf_internals.registered_kernel`), which knows the GPU kernels only in a build with
CUDA (the full `tensorflow` wheel; `tf.test.is_built_with_cuda()`).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import sysconfig
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2

from lingvo_gpipe.core import tf_internals
from lingvo_gpipe.runtime.devices import host_of

# Frames in these folders are TensorFlow's or Python's own: an op's frame is the first
# one outside them (the library's, a param file's or a test's line that made it).
_FOREIGN_FOLDERS = (os.path.dirname(tf.__file__) + os.sep,
                    sysconfig.get_paths()["stdlib"] + os.sep)

# Ops checked only where they are on a GPU (their kernel), never listed as host ops.
_COMPUTES_NOTHING = ("Placeholder", "NoOp", "Const")

# node_def (its device set to a GPU) → whether a kernel admits it.
KernelCheck = Callable[[Any], bool]

# The attribute `on_host` sets on each op it places: why that op runs on the host.
HOST_REASON = "_host_placement_reason"


@contextlib.contextmanager
def on_host(device: str | None, reason: str) -> Iterator[None]:
  """Ops made within (while tracing) run on `device`'s host CPU on purpose, for
  `reason`: one line saying why the host, not the accelerator. On a GPU each tensor
  such an op exchanges with the device is a copy across PCIe, so every use states
  why that is worth it; the reason stays on each op (HOST_REASON), where the audit
  reads it."""
  with tf_internals.new_ops() as made, tf.device(host_of(device)):
    yield
  for op in made:
    tf_internals.set_attr(op, HOST_REASON, attr_value_pb2.AttrValue(s=reason.encode()))


@dataclasses.dataclass(frozen=True)
class PlacedOp:
  """Ops of one kind found in one place: their type and dtype attributes, where they
  would run, the Python frame that made them and, for deliberate host ops, why."""
  op_type: str
  dtypes: str    # 'T=float32, Tidx=int32' (the op's type attributes)
  device: str    # 'GPU:1', 'host', 'unplaced'
  frame: str     # 'lingvo_gpipe/pipeline/device_loop.py:684 in _timestamp'
  reason: str = ""


@dataclasses.dataclass
class AuditReport:
  """What `audit` found; each list entry is one PlacedOp with its count."""
  gpu_ops: int = 0  # ops checked on a GPU
  without_kernel: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  on_host: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  unexplained_host: collections.Counter = dataclasses.field(
      default_factory=collections.Counter)
  unplaced_host: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  int32_across_branches: collections.Counter = dataclasses.field(
      default_factory=collections.Counter)  # Case / If on a GPU taking or giving int32
  unreadable_functions: set = dataclasses.field(default_factory=set)

  @property
  def clean(self) -> bool:
    """No op meant for a GPU lacks a kernel, no int32 crosses a GPU's Case or If, and
    every host op says why."""
    return not (self.without_kernel or self.unexplained_host or self.int32_across_branches
                or self.unreadable_functions)

  def merge(self, other: AuditReport) -> None:
    self.gpu_ops += other.gpu_ops
    for mine, theirs in ((self.without_kernel, other.without_kernel),
                         (self.on_host, other.on_host),
                         (self.unexplained_host, other.unexplained_host),
                         (self.unplaced_host, other.unplaced_host),
                         (self.int32_across_branches, other.int32_across_branches)):
      mine.update(theirs)
    self.unreadable_functions |= other.unreadable_functions


def gpu_kernel_exists(node_def: Any) -> bool:
  """Whether a GPU (or DEFAULT) kernel of this build admits `node_def` as placed."""
  return bool(tf_internals.registered_kernel(node_def))


def audit(graph: Any, gpu_index: Callable[[tf.DeviceSpec], int | None],
          has_kernel: KernelCheck = gpu_kernel_exists) -> AuditReport:
  """Walks `graph` (a traced function's FuncGraph) and every function it calls.

  gpu_index(spec): the GPU an op on device `spec` stands for, or None (the host, or a
  device that is not a GPU). has_kernel(node_def): whether a kernel admits the NodeDef
  with its device set to that GPU (tests pass their own).
  """
  walker = _Walker(tf_internals.called_functions(graph), gpu_index, has_kernel)
  walker.walk(graph, tf.DeviceSpec(), explicit=False, reason="", single_device=False)
  return walker.report


# Ops whose functions run as single-device functions on the op's own device: every op
# of the body there, whatever device it names (tf_internals item 16). A function call
# (PartitionedCall, StatefulPartitionedCall) partitions its function by the devices
# its ops name.
_SINGLE_DEVICE_BODIES = ("While", "StatelessWhile", "Case", "StatelessCase", "If",
                         "StatelessIf")


_BRANCHES = ("Case", "StatelessCase", "If", "StatelessIf")


def _passes_int32(node_def: Any) -> bool:
  """Whether a Case or If takes (besides its branch index or condition) or returns an
  int32."""
  return any(tf.dtypes.as_dtype(t) == tf.int32
             for key in ("Tin", "Tout") for t in node_def.attr[key].list.type)


class _Walker:
  def __init__(self, functions: dict[str, Any], gpu_index, has_kernel: KernelCheck):
    self.functions = functions
    self.gpu_index = gpu_index
    self.has_kernel = has_kernel
    self.report = AuditReport()
    self._walked: set[tuple[str, str, bool, str, bool]] = set()
    self._kernels: dict[tuple, bool] = {}

  def walk(self, graph: Any, device: tf.DeviceSpec, explicit: bool, reason: str,
           single_device: bool) -> None:
    """graph's ops run on `device` unless they name their own (and `single_device` is
    false: the body of a While, Case or If runs all its ops on the caller's device);
    `explicit`: some op up the call chain named a device (else the placer chooses);
    `reason`: why the op calling this graph runs on the host ("" if it does not say)."""
    for op in graph.get_operations():
      node_def = op.node_def
      own = (tf.DeviceSpec.from_string(node_def.device)
             if node_def.device and not single_device else None)
      placed = device.make_merged_spec(own) if own is not None else device
      named = explicit or own is not None
      if HOST_REASON in node_def.attr:
        op_reason = node_def.attr[HOST_REASON].s.decode()
      else:
        op_reason = reason if own is None or own.device_type is None else ""
      self._check(op, node_def, placed, named, op_reason)
      one_device = op.type in _SINGLE_DEVICE_BODIES
      for name in _called(node_def):
        key = (name, placed.to_string(), named, op_reason, one_device)
        if key in self._walked:
          continue
        self._walked.add(key)
        body = self.functions.get(name)
        if body is None:
          self.report.unreadable_functions.add(name)
        else:
          self.walk(body, placed, named, op_reason, one_device)

  def _check(self, op: Any, node_def: Any, placed: tf.DeviceSpec, named: bool,
             reason: str) -> None:
    gpu = self.gpu_index(placed) if named else None
    if op.type in _COMPUTES_NOTHING and gpu is None:
      return  # a function's arguments, constants: on the host they cost nothing
    if gpu is not None:
      self.report.gpu_ops += 1
      if not self._kernel(node_def, gpu):
        self.report.without_kernel[self._entry(op, node_def, f"GPU:{gpu}")] += 1
      if op.type in _BRANCHES and _passes_int32(node_def):
        self.report.int32_across_branches[self._entry(op, node_def, f"GPU:{gpu}")] += 1
      return
    if named and placed.device_type == "CPU":
      if reason:
        self.report.on_host[self._entry(op, node_def, "host", reason)] += 1
      else:
        self.report.unexplained_host[self._entry(op, node_def, "host")] += 1
    elif not named and not self._kernel(node_def, 0):
      self.report.unplaced_host[self._entry(op, node_def, "unplaced")] += 1

  def _kernel(self, node_def: Any, gpu: int) -> bool:
    key = (node_def.op, _type_attrs(node_def))
    if key not in self._kernels:
      on_gpu = type(node_def)()
      on_gpu.CopyFrom(node_def)
      on_gpu.device = f"/device:GPU:{gpu}"
      self._kernels[key] = self.has_kernel(on_gpu)
    return self._kernels[key]

  @staticmethod
  def _entry(op: Any, node_def: Any, device: str, reason: str = "") -> PlacedOp:
    return PlacedOp(op.type, _type_attrs(node_def), device, creating_frame(op), reason)


def _called(node_def: Any) -> Iterable[str]:
  """Names of the functions an op runs (While's cond and body, Case's branches, a
  call's f, a gradient's): any attribute holding a function or a list of them."""
  for value in node_def.attr.values():
    if value.HasField("func"):
      yield value.func.name
    elif value.HasField("list"):
      yield from (f.name for f in value.list.func)


def _type_attrs(node_def: Any) -> str:
  """'T=float32, Tidx=int32': the op's dtype attributes (what kernels constrain)."""
  parts = []
  for name in sorted(node_def.attr):
    value = node_def.attr[name]
    if value.HasField("type"):
      parts.append(f"{name}={tf.dtypes.as_dtype(value.type).name}")
    elif value.HasField("list") and value.list.type:
      parts.append(f"{name}=[{','.join(tf.dtypes.as_dtype(t).name for t in value.list.type)}]")
  return ", ".join(parts)


def creating_frame(op: Any) -> str:
  """'path:line in function' of the innermost frame outside TensorFlow and Python that
  made `op` (paths relative to the working directory where below it)."""
  for frame in reversed(op.traceback):
    filename = frame.filename
    if filename.startswith(_FOREIGN_FOLDERS) or filename.startswith("<"):
      continue
    shown = os.path.relpath(filename) if filename.startswith(os.getcwd()) else filename
    return f"{shown}:{frame.lineno} in {frame.name}"
  return "(no frame outside TensorFlow)"


def table(entries: collections.Counter, with_reason: bool = False) -> list[str]:
  """Markdown rows (count, op, dtypes, device, frame[, reason]), most frequent first."""
  header = "| ops | type | dtypes | device | made at |" + (" why |" if with_reason else "")
  rows = [header, "|" + " --- |" * (6 if with_reason else 5)]
  for entry, count in sorted(entries.items(), key=lambda e: (-e[1], e[0].frame)):
    row = (f"| {count} | {entry.op_type} | {entry.dtypes or '-'} | {entry.device} | "
           f"{entry.frame} |")
    rows.append(row + (f" {entry.reason} |" if with_reason else ""))
  return rows
