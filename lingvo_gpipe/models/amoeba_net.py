"""AmoebaNet (Real et al., 2019) as a flat list of pipeline layers, as GPipe trains it.

A cell takes the outputs of the two previous cells (prev, prev_prev), brings both to F
filters (a ReLU-1×1-BN on prev; on prev_prev a factorized reduction when the spatial
size differs or a ReLU-1×1-BN when the channels do), and builds five blocks: each
applies one operation to each of two earlier states and adds the results. The
states no block used are concatenated: the cell's output. A reduction cell applies
stride 2 to the operations on its two inputs and doubles F.

What flows between layers (so any cut into cells is valid):
  images [B, H, W, 3] → stem → x → cell → (out, prev) → cell → (out, prev) → ... → head
and, with the auxiliary head, a third element: aux logits [B, classes] from the tap
before the second reduction, carried to the end. The head returns features [B, C]
(or (features, aux_logits)); the task's softmax makes the logits.

(L, D) as in the GPipe paper: L normal cells in all, L/3 per stack of three stacks
separated by two reduction cells, and D filters in the first stack (2D, 4D after
each reduction). These choices reproduce the paper's parameter counts (Table 1:
AmoebaNet-D (18, 208) has 82M). Genotypes and operations follow the TPU reference
implementation of AmoebaNet: conv operations other than 1×1 and separable ones go
through an F/4 bottleneck.
"""

from __future__ import annotations

import dataclasses
import re

import tensorflow as tf

from lingvo_gpipe.core import base_layer, layers
from lingvo_gpipe.core.base_layer import BaseLayer, InstantiableParams
from lingvo_gpipe.core.hyperparams import ParamsError


@dataclasses.dataclass(frozen=True)
class CellSpec:
  """Five blocks: operations[2i], operations[2i+1] applied to states indices[2i], [2i+1].

  States 0 and 1 are the cell's two inputs; block i's output is state i + 2. The
  output concatenates the states whose `used` flag is 0.
  """
  operations: tuple[str, ...]
  indices: tuple[int, ...]
  used: tuple[int, ...]

  @property
  def concat(self) -> tuple[int, ...]:
    return tuple(i for i, u in enumerate(self.used) if not u)


@dataclasses.dataclass(frozen=True)
class Genotype:
  normal: CellSpec
  reduction: CellSpec


GENOTYPES = {
    "A": Genotype(
        normal=CellSpec(
            ("avg_pool_3x3", "max_pool_3x3", "separable_3x3_2", "none", "none",
             "avg_pool_3x3", "separable_3x3_2", "separable_5x5_2", "avg_pool_3x3",
             "separable_3x3_2"),
            (0, 0, 1, 1, 0, 1, 0, 2, 5, 0), (1, 0, 1, 0, 0, 1, 0)),
        reduction=CellSpec(
            ("separable_3x3_2", "avg_pool_3x3", "max_pool_3x3", "separable_7x7_2",
             "max_pool_3x3", "max_pool_3x3", "separable_3x3_2", "1x7_7x1", "avg_pool_3x3",
             "separable_7x7_2"),
            (1, 0, 0, 2, 1, 0, 4, 0, 1, 0), (1, 1, 0, 0, 0, 0, 0))),
    "B": Genotype(
        normal=CellSpec(
            ("1x1", "max_pool_3x3", "none", "separable_3x3_2", "1x1", "separable_3x3_2",
             "1x1", "none", "avg_pool_3x3", "1x1"),
            (1, 1, 1, 0, 1, 0, 2, 2, 1, 5), (0, 1, 1, 0, 0, 1, 0)),
        reduction=CellSpec(
            ("max_pool_2x2", "max_pool_3x3", "none", "3x3", "dil_2_separable_5x5_2",
             "max_pool_3x3", "none", "separable_3x3_2", "avg_pool_3x3", "1x1"),
            (0, 0, 2, 1, 2, 2, 3, 1, 4, 3), (1, 1, 1, 1, 1, 0, 0))),
    "D": Genotype(
        normal=CellSpec(
            ("1x1", "max_pool_3x3", "none", "1x7_7x1", "1x1", "1x7_7x1", "max_pool_3x3",
             "none", "avg_pool_3x3", "1x1"),
            (1, 1, 1, 0, 0, 0, 2, 2, 1, 5), (0, 1, 1, 0, 0, 1, 0)),
        reduction=CellSpec(
            ("max_pool_2x2", "max_pool_3x3", "none", "3x3", "1x7_7x1", "max_pool_3x3",
             "none", "max_pool_2x2", "avg_pool_3x3", "1x1"),
            (0, 0, 2, 1, 2, 2, 3, 1, 2, 3), (1, 1, 1, 1, 0, 0, 0))),
}

_SEPARABLE = re.compile(r"^(?:dil_(\d+)_)?separable_(\d+)x\d+_(\d+)$")
_POOL = re.compile(r"^(max|avg)_pool_(\d+)x\d+$")
_BOTTLENECK_CONVS = {"3x3": [(3, 3)], "1x7_7x1": [(1, 7), (7, 1)], "1x3_3x1": [(1, 3), (3, 1)]}


def _relu():
  return layers.Activation.Params().set(name="relu", activation="RELU")


def _bn(name: str, dim: int):
  return layers.BatchNorm.Params().set(name=name, dim=dim, decay=0.9, epsilon=1e-3)


def _conv(name: str, kernel: tuple[int, int], in_dim: int, out_dim: int,
          stride: tuple[int, int] = (1, 1)):
  return layers.Conv2D.Params().set(name=name, filter_shape=(*kernel, in_dim, out_dim),
                                    filter_stride=stride)


def relu_conv_bn(in_dim: int, out_dim: int, stride: int = 1) -> list[InstantiableParams]:
  return [_relu(), _conv("conv_1x1", (1, 1), in_dim, out_dim, (stride, stride)),
          _bn("bn", out_dim)]


def operation_layers(operation: str, in_dim: int, filters: int,
                     stride: int) -> list[InstantiableParams]:
  """The layers of one cell operation: [B, H, W, in_dim] → [B, H/stride, W/stride, F]."""
  if operation in ("none", "1x1"):
    if operation == "1x1" or stride > 1 or in_dim != filters:
      return relu_conv_bn(in_dim, filters, stride)
    return []
  pool = _POOL.match(operation)
  if pool:
    result = [layers.Pooling.Params().set(
        name="pool", pooling_type=pool.group(1).upper(),
        window_shape=(int(pool.group(2)),) * 2, window_stride=(stride, stride))]
    if in_dim != filters:
      result += [_conv("conv_1x1", (1, 1), in_dim, filters), _bn("bn", filters)]
    return result
  separable = _SEPARABLE.match(operation)
  if separable:
    dilation, kernel, repeats = (int(separable.group(1) or 1), int(separable.group(2)),
                                 int(separable.group(3)))
    result = []
    for i in range(repeats):
      first = i == 0
      result += [_relu(), layers.DepthwiseSeparableConv2D.Params().set(
          name=f"separable_{i}", kernel_size=kernel, input_dim=in_dim if first else filters,
          output_dim=filters, stride=stride if first else 1, dilation_rate=dilation),
                 _bn(f"bn_{i}", filters)]
    return result
  if operation in _BOTTLENECK_CONVS:
    reduced = max(filters * 3 // 8 if operation == "1x3_3x1" else filters // 4, 1)
    result = [_relu(), _conv("pre_1x1", (1, 1), in_dim, reduced), _bn("pre_bn", reduced),
              _relu()]
    kernels = _BOTTLENECK_CONVS[operation]
    for i, kernel in enumerate(kernels):
      # A factorized (1×k then k×1) conv strides each axis in the conv that spans it.
      conv_stride = (stride, stride) if len(kernels) == 1 else (
          (1, stride) if kernel[0] == 1 else (stride, 1))
      result.append(_conv(f"conv_{kernel[0]}x{kernel[1]}", kernel, reduced, reduced,
                          conv_stride))
      if i + 1 < len(kernels):
        result += [_bn(f"mid_bn_{i}", reduced), _relu()]
    result += [_bn("bn", reduced), _relu(), _conv("post_1x1", (1, 1), reduced, filters),
               _bn("post_bn", filters)]
    return result
  raise ParamsError(f"unknown AmoebaNet operation {operation!r}; valid: none, 1x1, 3x3, "
                   "1x7_7x1, 1x3_3x1, {max,avg}_pool_KxK, [dil_R_]separable_KxK_N")


class FactorizedReduction(BaseLayer):
  """Halves H and W without losing half the pixels: two 1×1 convs on offset grids.

  [B, H, W, C] → [B, ceil(H/2), ceil(W/2), F]: F/2 channels from the even pixels, F/2
  from the odd ones, concatenated and batch-normalized (NASNet's factorized reduction).
  """

  @classmethod
  def Params(cls):  # noqa: N802
    p = super().Params()
    p.define("input_dim", 0, "Input channels C.")
    p.define("output_dim", 0, "Output channels F (even).")
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    if p.output_dim <= 0 or p.output_dim % 2:
      raise ParamsError(f"{self.path}: output_dim must be positive and even, got "
                       f"{p.output_dim}")
    half = p.output_dim // 2
    self.create_child("path1", _conv("path1", (1, 1), p.input_dim, half, (2, 2)))
    self.create_child("path2", _conv("path2", (1, 1), p.input_dim, half, (2, 2)))
    self.create_child("bn", _bn("bn", p.output_dim))

  def fprop(self, x: tf.Tensor) -> tf.Tensor:
    x = tf.nn.relu(x)
    shifted = tf.pad(x, [[0, 0], [0, 1], [0, 1], [0, 0]])[:, 1:, 1:, :]
    return self.bn(tf.concat([self.path1(x), self.path2(shifted)], axis=-1))


def drop_path_keep_prob(base_keep_prob: float, cell_index: int, num_cells: int,
                        step: tf.Tensor, burn_in_steps: int) -> tf.Tensor:
  """Keep probability of a cell's drop-path: lower in deeper cells, ramped in over steps."""
  drop = (1.0 - base_keep_prob) * (cell_index + 1) / num_cells
  if burn_in_steps > 0:
    drop *= tf.minimum(1.0, tf.cast(step, tf.float32) / burn_in_steps)
  return 1.0 - drop


class AmoebaCell(BaseLayer):
  """A normal or reduction cell: (prev [B,H,W,C1], prev_prev [B,H',W',C2], *carry) →
  (out [B,H/s,W/s,F·|concat|], prev, *carry), s = 2 for a reduction cell."""

  @classmethod
  def Params(cls):  # noqa: N802
    p = super().Params()
    p.define("spec", None, "CellSpec of this cell (normal or reduction).")
    p.define("reduction", False, "Stride 2 on the operations applied to the inputs.")
    p.define("filters", 0, "F: channels of every block.")
    p.define("prev_dim", 0, "Channels of prev.")
    p.define("prev_prev_dim", 0, "Channels of prev_prev.")
    p.define("prev_prev_stride", 1, "2 when prev_prev is twice prev's height and width.")
    p.define("drop_path_keep_prob", 1.0, "Drop-path keep probability of the last cell.")
    p.define("cell_index", 0, "Position among all cells (drop-path grows with depth).")
    p.define("num_cells", 1, "Number of cells in the network.")
    p.define("drop_path_burn_in_steps", 0, "Steps over which drop-path ramps in (0: none).")
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    if p.spec is None or p.filters <= 0:
      raise ParamsError(f"{self.path}: spec and positive filters are required")
    f = p.filters
    self.create_child("prev_1x1", layers.Sequential.Params().set(
        layers=relu_conv_bn(p.prev_dim, f)))
    if p.prev_prev_stride == 2:
      self.create_child("prev_prev_reduce", FactorizedReduction.Params().set(
          input_dim=p.prev_prev_dim, output_dim=f))
    elif p.prev_prev_dim != f:
      self.create_child("prev_prev_reduce", layers.Sequential.Params().set(
          layers=relu_conv_bn(p.prev_prev_dim, f)))
    for i, (operation, state) in enumerate(zip(p.spec.operations, p.spec.indices)):
      stride = 2 if p.reduction and state < 2 else 1
      op_layers = operation_layers(operation, f, f, stride)
      if op_layers:
        self.create_child(f"op_{i}", layers.Sequential.Params().set(layers=op_layers))
    # Unused inputs of a reduction cell would have the wrong size in the concat.
    for state in p.spec.concat:
      if p.reduction and state < 2:
        self.create_child(f"concat_reduce_{state}", FactorizedReduction.Params().set(
            input_dim=f, output_dim=f))

  @property
  def output_dim(self) -> int:
    return self.params.filters * len(self.params.spec.concat)

  def _drop_path(self, x: tf.Tensor, i: int) -> tf.Tensor:
    p = self.params
    ctx = base_layer.current_context()
    if not ctx.training or p.drop_path_keep_prob >= 1.0:
      return x
    keep = drop_path_keep_prob(p.drop_path_keep_prob, p.cell_index, p.num_cells, ctx.step,
                               p.drop_path_burn_in_steps)
    shape = tf.stack([tf.shape(x)[0], 1, 1, 1])
    keep_mask = layers.keep_mask(shape, layers.dropout_seed(self, f"drop_path_{i}"),
                                 ctx.example_offset, keep, x.dtype)
    return x * keep_mask / tf.cast(keep, x.dtype)

  def _apply_if_built(self, child_name: str, x: tf.Tensor) -> tf.Tensor:
    """The child `child_name` applied to x; x itself where no such child was needed."""
    child = getattr(self, child_name, None)
    return child(x) if child is not None else x

  def fprop(self, prev: tf.Tensor, prev_prev: tf.Tensor | None = None, *carry: tf.Tensor):
    p = self.params
    prev_prev = prev if prev_prev is None else prev_prev
    states = [self.prev_1x1(prev), self._apply_if_built("prev_prev_reduce", prev_prev)]
    for block in range(5):
      total = 0.0
      for i in (2 * block, 2 * block + 1):
        x = self._apply_if_built(f"op_{i}", states[p.spec.indices[i]])
        if p.spec.operations[i] != "none":
          x = self._drop_path(x, i)
        total = total + x
      states.append(total)
    outputs = [self._apply_if_built(f"concat_reduce_{s}", states[s]) for s in p.spec.concat]
    return (tf.concat(outputs, axis=-1), prev, *carry)


class AuxHead(BaseLayer):
  """Auxiliary classifier tapped mid-network: (prev, prev_prev, ...) → (prev, prev_prev, logits).

  ReLU, 5×5 average pool with stride 3, 1×1 conv to 128, BN, ReLU, a conv over the
  remaining window to 768, BN, ReLU, and a linear layer to the classes (NASNet's).
  """

  @classmethod
  def Params(cls):  # noqa: N802
    p = super().Params()
    p.define("input_dim", 0, "Channels of the tapped state.")
    p.define("input_size", 0, "Its height and width.")
    p.define("num_classes", 0, "Classes.")
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    pooled = max((p.input_size - 5) // 3 + 1, 1)
    self._pool_window = min(5, p.input_size)
    self.create_child("proj", _conv("proj", (1, 1), p.input_dim, 128))
    self.create_child("proj_bn", _bn("proj_bn", 128))
    self.create_child("conv", layers.Conv2D.Params().set(
        filter_shape=(pooled, pooled, 128, 768), padding="VALID"))
    self.create_child("conv_bn", _bn("conv_bn", 768))
    self.create_child("logits", layers.Linear.Params().set(input_dim=768,
                                                           output_dim=p.num_classes))

  def fprop(self, prev: tf.Tensor, prev_prev: tf.Tensor, *carry: tf.Tensor):
    x = tf.nn.avg_pool2d(tf.nn.relu(prev), self._pool_window, 3, "VALID")
    x = tf.nn.relu(self.proj_bn(self.proj(x)))
    x = tf.nn.relu(self.conv_bn(self.conv(x)))
    return (prev, prev_prev, *carry, self.logits(tf.reshape(x, [tf.shape(x)[0], 768])))


class AmoebaHead(BaseLayer):
  """(out [B, H, W, C], prev, [aux_logits]) → features [B, C] (or (features, aux_logits)).

  ReLU, global average pooling and dropout; the task's softmax follows.
  """

  @classmethod
  def Params(cls):  # noqa: N802
    p = super().Params()
    p.define("dense_keep_prob", 1.0, "Keep probability of dropout on the features.")
    return p

  def __init__(self, params):
    super().__init__(params)
    self.create_child("dropout", layers.Dropout.Params().set(
        keep_prob=self.params.dense_keep_prob))

  def fprop(self, out: tf.Tensor, prev: tf.Tensor, *aux: tf.Tensor):
    features = self.dropout(tf.reduce_mean(tf.nn.relu(out), axis=[1, 2]))
    return (features, *aux) if aux else features


class Stem(BaseLayer):
  """3×3 conv and batch norm: images [B, H, W, 3] → [B, H/s, W/s, filters]."""

  @classmethod
  def Params(cls):  # noqa: N802
    p = super().Params()
    p.define("filters", 32, "Output channels.")
    p.define("stride", 2, "2 (ImageNet stem, VALID padding) or 1 (CIFAR stem, SAME).")
    p.define("input_channels", 3, "Image channels.")
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    self.create_child("conv", layers.Conv2D.Params().set(
        filter_shape=(3, 3, p.input_channels, p.filters), filter_stride=(p.stride, p.stride),
        padding="VALID" if p.stride == 2 else "SAME"))
    self.create_child("bn", _bn("bn", p.filters))

  def fprop(self, images: tf.Tensor) -> tf.Tensor:
    return self.bn(self.conv(images))


@dataclasses.dataclass
class AmoebaNetBody:
  """What `amoeba_net` builds: the layer stack and the width of its features."""
  stack: InstantiableParams
  feature_dim: int


def amoeba_net(genotype: str = "D", num_normal_cells: int = 18, filters: int = 208,
               image_size: int = 224, num_classes: int = 1000, stem: str = "imagenet",
               stem_filters: int = 32, drop_path_keep_prob: float = 1.0,
               drop_path_burn_in_steps: int = 0, dense_keep_prob: float = 1.0,
               aux_head: bool = False) -> AmoebaNetBody:
  """AmoebaNet-<genotype> (L=num_normal_cells, D=filters) as one Sequential of layers.

  stem='imagenet': stride-2 conv and two reduction cells at D/4 and D/2 filters
  (images 224, 331, 480, ...); stem='cifar': one stride-1 conv (32×32 images).
  """
  if genotype not in GENOTYPES:
    raise ParamsError(f"unknown AmoebaNet genotype {genotype!r}; valid: {sorted(GENOTYPES)}")
  if num_normal_cells < 3 or num_normal_cells % 3:
    raise ParamsError(f"num_normal_cells must be a positive multiple of 3 (three stacks), "
                     f"got {num_normal_cells}")
  if stem not in ("imagenet", "cifar"):
    raise ParamsError(f"stem must be 'imagenet' or 'cifar', got {stem!r}")
  if filters < 4 or filters % 4:
    raise ParamsError(f"filters must be a positive multiple of 4, got {filters}")
  gene = GENOTYPES[genotype]
  per_stack = num_normal_cells // 3
  # (reduction?, filters) of every cell in order.
  plan: list[tuple[bool, int]] = []
  if stem == "imagenet":
    plan += [(True, filters // 4), (True, filters // 2)]
  for stack in range(3):
    if stack:
      plan.append((True, filters * 2 ** stack))
    plan += [(False, filters * 2 ** stack)] * per_stack
  aux_at = len(plan) - per_stack - 1  # just before the second reduction

  stem_stride = 2 if stem == "imagenet" else 1
  stack = [Stem.Params().set(name="stem", filters=stem_filters, stride=stem_stride)]
  size = (image_size - 1) // 2 if stem_stride == 2 else image_size
  prev_dim = prev_prev_dim = stem_filters
  prev_prev_stride = 1
  counts = {True: 0, False: 0}
  for index, (reduction, cell_filters) in enumerate(plan):
    spec = gene.reduction if reduction else gene.normal
    kind = "reduction" if reduction else "normal"
    stack.append(AmoebaCell.Params().set(
        name=f"{kind}_{counts[reduction]:02d}", spec=spec, reduction=reduction,
        filters=cell_filters, prev_dim=prev_dim, prev_prev_dim=prev_prev_dim,
        prev_prev_stride=prev_prev_stride, drop_path_keep_prob=drop_path_keep_prob,
        cell_index=index, num_cells=len(plan),
        drop_path_burn_in_steps=drop_path_burn_in_steps))
    counts[reduction] += 1
    prev_prev_dim, prev_dim = prev_dim, cell_filters * len(spec.concat)
    prev_prev_stride = 2 if reduction else 1
    if reduction:
      size = (size + 1) // 2
    if aux_head and index == aux_at:
      stack.append(AuxHead.Params().set(name="aux_head", input_dim=prev_dim, input_size=size,
                                        num_classes=num_classes))
  stack.append(AmoebaHead.Params().set(name="head", dense_keep_prob=dense_keep_prob))
  return AmoebaNetBody(layers.Sequential.Params().set(name="body", layers=stack), prev_dim)
