"""Shapes, parameter counts and FLOP estimates of a layer tree, without allocating.

`analyze(params, *input_specs)` builds the layers inside a scratch `tf.Graph`: there,
creating a variable only adds graph nodes (its initializer never runs), so an
83.9B-parameter model can be inspected on a laptop. The forward pass is then traced
on placeholders of the given specs, and every graph op it creates is attributed to
the innermost layer call that was open when the op was created (and, inclusively,
to all enclosing calls). FLOPs are estimated from the static shapes of those ops.

The estimate counts one forward pass: 2·m·k·n for a matmul-like op, 2·out·window for
convolutions, one per output element for element-wise ops and one per input
element for reductions; data movement (reshape, gather, concat, ...) is free. The
backward pass costs about twice the forward one, so ratios between layers, which
is what the partitioner needs, are unchanged.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from lingvo_gpipe.core import base_layer
from lingvo_gpipe.core.hyperparams import InstantiableParams

_FREE_OPS = frozenset({
    "Placeholder", "Const", "VarHandleOp", "ReadVariableOp", "Identity", "IdentityN",
    "Shape", "ShapeN", "Size", "Rank", "Reshape", "StridedSlice", "Slice", "Pack",
    "Unpack", "ConcatV2", "Split", "SplitV", "Transpose", "Fill", "NoOp", "Squeeze",
    "ExpandDims", "GatherV2", "ResourceGather", "Tile", "ZerosLike", "OnesLike",
    "StopGradient", "Cast", "Range", "OneHot", "BroadcastTo", "Prod", "PadV2", "Pad",
})
_REDUCTIONS = frozenset({"Mean", "Sum", "Max", "Min", "AvgPool", "MaxPool", "ArgMax",
                         "Softmax", "LogSoftmax", "SoftmaxCrossEntropyWithLogits",
                         "SparseSoftmaxCrossEntropyWithLogits"})


def _elements(tensor: tf.Tensor) -> int | None:
  dims = tensor.shape.as_list() if tensor.shape.rank is not None else None
  if dims is None or any(d is None for d in dims):
    return None
  return math.prod(dims)


def _einsum_flops(op: tf.Operation, out_elements: int) -> int:
  equation = op.get_attr("equation").decode()
  inputs_part, output_part = equation.replace(" ", "").split("->")
  sizes: dict[str, int] = {}
  for labels, tensor in zip(inputs_part.split(","), op.inputs):
    dims = tensor.shape.as_list()
    labels = labels.replace("...", "")
    # Explicit labels are the last len(labels) dims when '...' leads, else the first.
    offset = len(dims) - len(labels)
    for i, label in enumerate(labels):
      sizes[label] = dims[offset + i] or 1
  contracted = set(sizes) - set(re.sub(r"\.\.\.", "", output_part))
  return 2 * out_elements * math.prod(sizes[c] for c in contracted)


def op_flops(op: tf.Operation) -> int:
  """Estimated FLOPs of one graph op from its static shapes (0 if unknown or free)."""
  if op.type in _FREE_OPS or not op.outputs:
    return 0
  out = op.outputs[0]
  if not out.dtype.is_floating:
    return 0
  out_elements = _elements(out)
  if out_elements is None:
    return 0
  if op.type == "MatMul":
    a = op.inputs[0].shape.as_list()
    k = a[0] if op.get_attr("transpose_a") else a[1]
    return 2 * out_elements * k
  if op.type in ("BatchMatMul", "BatchMatMulV2", "BatchMatMulV3"):
    a = op.inputs[0].shape.as_list()
    k = a[-2] if op.get_attr("adj_x") else a[-1]
    return 2 * out_elements * k
  if op.type == "Einsum":
    return _einsum_flops(op, out_elements)
  if op.type == "Conv2D":
    kh, kw, cin, _ = op.inputs[1].shape.as_list()
    return 2 * out_elements * kh * kw * cin
  if op.type == "DepthwiseConv2dNative":
    kh, kw, _, _ = op.inputs[1].shape.as_list()
    return 2 * out_elements * kh * kw
  if op.type in _REDUCTIONS:
    return _elements(op.inputs[0]) or 0
  return out_elements


def param_counts(params_list: Sequence[InstantiableParams]) -> list[int]:
  """Trainable parameters of each layer, from shapes only (nothing is created); layers
  whose params differ only in their name are built once (a deep stack has a few kinds
  of layer: 512 Transformer layers took 1.2 s built one by one, 0.03 s by kind)."""
  by_kind: dict[tuple, int] = {}
  counts = []
  with base_layer.shapes_only(), base_layer.stand_in_ties():  # (a tied weight counts)
    for params in params_list:
      kind = base_layer.params_kind(params)
      if kind not in by_kind:
        by_kind[kind] = params.instantiate().num_params()
      counts.append(by_kind[kind])
  return counts


@dataclasses.dataclass
class LayerStats:
  """What `analyze` found for one layer (inclusive of its children)."""
  path: str
  layer_class: str
  depth: int
  num_params: int
  flops: int
  output_shapes: Any = None  # nested lists of ints, as the layer's outputs are nested
  layer: Any = None  # the layer object, built in the scratch graph (no real variables)
  fprop_dtype: str = "float32"  # what the layer computes in (BaseLayer.fprop_dtype)


def analyze(params: InstantiableParams, *input_specs: Any,
            max_depth: int | None = None) -> list[LayerStats]:
  """Builds `params` in a scratch graph and traces one forward pass (eval mode).

  Args:
    params: params of the root layer.
    *input_specs: positional inputs of the root's fprop, as nested `tf.TensorSpec`s
      with fully defined shapes (batch size included, since FLOPs depend on it).
    max_depth: only layers at most this deep below the root are reported.

  Returns:
    One LayerStats per layer in depth-first creation order; the first is the root.
  """
  graph = tf.Graph()
  open_calls: list[tuple[base_layer.BaseLayer, int]] = []
  spans: dict[int, list[tuple[int, int]]] = {}
  outputs_of: dict[int, Any] = {}

  # graph.version counts the ops created so far, and get_operations() lists them in
  # creation order, so a call's ops are get_operations()[version_at_enter:version_at_exit].
  def on_enter(layer):
    open_calls.append((layer, graph.version))

  def on_exit(layer, outputs):
    _, start = open_calls.pop()
    spans.setdefault(id(layer), []).append((start, graph.version))
    outputs_of.setdefault(id(layer), outputs)

  observer = (on_enter, on_exit)
  with graph.as_default(), base_layer.shapes_only(False):  # graph variables: fprop runs
    root = params.instantiate()
    placeholders = tf.nest.map_structure(
        lambda s: tf.compat.v1.placeholder(s.dtype, s.shape), list(input_specs))
    base_layer._CALL_OBSERVERS.append(observer)  # noqa: SLF001
    try:
      with base_layer.step_context(training=False):
        root(*placeholders)
    finally:
      base_layer._CALL_OBSERVERS.remove(observer)  # noqa: SLF001

  # FLOPs per op, then prefix sums so that each call span costs O(1).
  prefix = [0]
  for op in graph.get_operations():
    prefix.append(prefix[-1] + op_flops(op))

  def span_flops(start: int, end: int) -> int:
    return prefix[end] - prefix[start]

  stats = []
  root_depth = root.path.count("/")
  for layer in root.walk():
    depth = layer.path.count("/") - root_depth
    if max_depth is not None and depth > max_depth:
      continue
    outputs = outputs_of.get(id(layer))
    stats.append(LayerStats(
        path=layer.path,
        layer_class=type(layer).__name__,
        depth=depth,
        num_params=layer.num_params(),
        flops=sum(span_flops(s, e) for s, e in spans.get(id(layer), [])),
        output_shapes=None if outputs is None else tf.nest.map_structure(
            lambda t: t.shape.as_list(), outputs),
        layer=layer,
        fprop_dtype=layer.fprop_dtype.name,
    ))
  return stats


def human_count(n: float) -> str:
  """12345678 → '12.35M'."""
  for unit in ("", "K", "M", "G", "T"):
    if abs(n) < 1000:
      return f"{n:.4g}{unit}"
    n /= 1000.0
  return f"{n:.4g}P"


def format_table(stats: Sequence[LayerStats]) -> str:
  """A readable table: one row per layer, indented by depth, with the dtype it
  computes in (its variables are float32 whatever that is)."""
  rows = [("layer", "class", "output shape", "compute", "params", "FLOPs")]
  for s in stats:
    rows.append(("  " * s.depth + s.path.rsplit("/", 1)[-1], s.layer_class,
                 str(s.output_shapes) if s.output_shapes is not None else "-",
                 s.fprop_dtype, f"{s.num_params:,}", human_count(s.flops)))
  widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
  lines = []
  for n, row in enumerate(rows):
    cells = [c.ljust(w) if i < 4 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))]
    lines.append("  ".join(cells).rstrip())
    if n == 0:
      lines.append("  ".join("-" * w for w in widths))
  return "\n".join(lines)


def format_cells(cells: Sequence[dict]) -> str:
  """A table of pipeline cells: index, device, parameters, cost share (of what the
  partitioner balanced: `cost_by`), layers."""
  by = cells[0].get("cost_by", "cost") if cells else "cost"
  rows = [("cell", "device", "params", f"share of {by}", "layers")]
  for c in cells:
    names = c["layers"]
    shown = names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]} ({len(names)})"
    rows.append((str(c["cell"]), c["device"], f"{c['params']:,}",
                 f"{100 * c['cost_share']:.1f}%", shown))
  widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
  lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
  lines.insert(1, "  ".join("-" * w for w in widths))
  return "\n".join(lines)
