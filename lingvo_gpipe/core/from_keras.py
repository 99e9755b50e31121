"""`from_keras(model)`: a Keras Sequential or functional model as a Params stack.

The stack is a `layers.Sequential` whose units the pipeline can cut between: the
model's graph cut at every tensor that all later layers are reached through (the single
tensor alive between two layers, in the order Keras runs them; a Sequential: between
every two layers). Between two cuts lies a block with one input and one output: a
single layer is its own unit, several (a residual branch and its Add) become one unit,
a functional model of those layers. A model whose graph has no such cut between its
input and output is one unit.

- **Shared layers.** A layer called at several nodes (one weight set) is a unit per
  node when each node is a block of its own: the later ones `tie_to` the first (one
  variable; across cells a copy, pipeline/tied_weights.py). Otherwise (its nodes inside
  blocks) no cut falls between its first and last node, so they share one unit.
- **Padding masks.** A model whose second input is named `padding_mask` (KerasHub's
  backbones) takes the stack's (ids, paddings); a node that took the mask by keyword
  gets 1 - paddings (`Keras.padding_mask`).
- **Keras's masks** (Embedding(mask_zero=True), Masking): carried beside the
  activations between units where a cut tensor has one (`keras_mask_in`/`_out`); the
  ops Keras adds to compute them are not nodes of the chain (each unit's layers compute
  their masks again).

Each unit is a `layers.Keras` holding the layer's config (its build config gives the
input shape), except two layers that a pipeline must treat as the library's own:

- `Dropout` → `layers.Dropout`: stateless masks keyed by example, so a
  re-materialized forward draws the first forward's mask and any number of
  micro-batches draws the unsplit batch's masks;
- `BatchNormalization` (last axis, center and scale, default initializers) →
  `layers.BatchNorm`: statistics per micro-batch in training, moving averages updated
  once per step from the whole mini-batch's statistics with Keras's momentum and
  epsilon; a frozen one (`trainable=False`) → `frozen=True`, its moving averages in
  training too, as Keras runs it.

(In a stack carrying masks both stay Keras's, a trainable batch norm refused: the
library's take one tensor.) A frozen layer (`trainable=False`, on it or on a model
around it) keeps its weights as non-trainable variables: no gradient, no optimizer
slots, still checkpointed.

A model with several outputs or other inputs, a subclassed model (its call is Python
that no config records) and a layer that cannot be serialized are refused in one line
naming them. Weights are not carried by the params (params.txt holds configs, and each
unit's place in the model's weights file): `load_keras_weights` copies a Keras model's
weights into the built stack, `load_saved_keras_weights` a saved model's or weights
file's.
"""

from __future__ import annotations

import copy
import os
from typing import Any, NamedTuple

import keras
import tensorflow as tf
from keras.src.backend import get_keras_mask

from lingvo_gpipe.core import layers
from lingvo_gpipe.core.base_layer import BaseLayer
from lingvo_gpipe.core.hyperparams import InstantiableParams, ParamsError
from lingvo_gpipe.core.keras_layer import POLICY_FPROP_DTYPES, Keras

_BN_DEFAULTS = {"gamma_initializer": "Ones", "beta_initializer": "Zeros",
                "moving_mean_initializer": "Zeros", "moving_variance_initializer": "Ones"}


def from_keras(model: keras.Model, name: str = "body") -> InstantiableParams:
  """Params of a `layers.Sequential` named `name` running `model`'s layers as units
  (module docstring). The model must be built (made with `keras.Input`, or called
  once), so that each unit knows its input shape.

  Raises:
    ParamsError: naming what cannot be pipelined.
  """
  if not isinstance(model, keras.Model):
    raise ParamsError(f"from_keras takes a keras.Sequential or a functional keras.Model, "
                      f"got {type(model).__name__}; wrap a single layer as "
                      "g.layers.Keras.Params().set(layer=...)")
  if isinstance(model, keras.Sequential):
    if not model.built:
      raise ParamsError(f"Keras model {model.name!r} is not built: start it with "
                        "keras.Input(shape) (or call it once) so that each layer knows "
                        "its input shape")
    graph = getattr(model, "_functional", None)
    if graph is None:  # (a Sequential Keras could not trace symbolically)
      _refuse_repeated_layers(model)
      saved = saved_paths(model)
      units = [unit_params(_Block(layer, layer.name, saved_as=saved[id(layer)]))
               for layer in model.layers]
      return layers.Sequential.Params().set(name=name, layers=units if model.trainable
                                            else [_frozen(unit) for unit in units])
    blocks = _blocks(graph, model.name, saved_paths(model))
  elif _is_functional(model):
    blocks = _blocks(model, model.name, saved_paths(model))
  else:
    raise ParamsError(f"Keras model {model.name!r} ({type(model).__name__}) is subclassed: "
                      "its call is Python that no config records, so it cannot be cut; "
                      "build it as a keras.Sequential or a functional model, or run it as "
                      "one unit with g.layers.Keras.Params().set(layer=model)")
  carrying = any(block.padding_mask_dtype or block.keras_mask_in or block.keras_mask_out
                 for block in blocks)
  units = [unit_params(block, carrying) for block in blocks]
  if not model.trainable:
    # A frozen model trains nothing (Keras: its trainable_weights is empty, whatever
    # its layers' flags say), so no unit does.
    units = [_frozen(unit) for unit in units]
  if any(block.padding_mask_dtype for block in blocks):
    # The stack takes (ids, paddings): each unit its x, passing the paddings on to the
    # next; the last returns its output alone.
    for i, unit in enumerate(units):
      unit.set(num_inputs=1, pass_through=int(i < len(units) - 1))
  return layers.Sequential.Params().set(name=name, layers=units)


def _frozen(unit: InstantiableParams) -> InstantiableParams:
  """`unit` with its weights frozen: a Keras unit's layer config trainable=False, a
  batch norm frozen (a Dropout has none)."""
  if unit.cls is layers.BatchNorm:
    return unit.set(frozen=True)
  if unit.cls is Keras:
    config = copy.deepcopy(unit.layer)
    _set_untrainable(config)
    return unit.set(layer=config)
  return unit


def _set_untrainable(config: Any) -> None:
  """Every layer config in the serialized `config` (a block's inner layers too, which
  Keras builds before it sets the block's own flag) made trainable=False, in place."""
  if isinstance(config, dict):
    if isinstance(config.get("config"), dict) and "trainable" in config["config"]:
      config["config"]["trainable"] = False
    for value in config.values():
      _set_untrainable(value)
  elif isinstance(config, list):
    for value in config:
      _set_untrainable(value)


def _is_functional(model: keras.Model) -> bool:
  return not isinstance(model, keras.Sequential) and hasattr(model, "_nodes_by_depth")


def unit_params(block: _Block, carrying: bool = False) -> InstantiableParams:
  """The library params of one unit: `layers.Dropout` or `layers.BatchNorm` for those
  Keras layers (module docstring), else a `layers.Keras` holding `block.layer`, called
  with the node's constant arguments and its padding and Keras masks (`_Block`). With
  `carrying` (the stack carries masks beside x), a Dropout stays Keras's and a frozen
  BatchNormalization a Keras unit (the library's take x alone).

  Raises:
    ParamsError: arguments to Dropout or BatchNormalization (the library's own layers
      take none), a trainable BatchNormalization in a stack carrying masks, a
      non-literal argument, or a weight frozen apart from its layer.
  """
  layer = block.layer
  _refuse_weights_frozen_alone(layer)
  call_kwargs = dict(block.call_kwargs)
  # A node's own `training` is dropped, as Keras 3 drops it: a functional model called
  # with training=True or False (fit passes True) passes that to every node that takes it
  # (tests/keras_test.py, test_a_nodes_training_argument_gives_way_as_in_keras).
  call_kwargs.pop("training", None)
  ours = {keras.layers.Dropout: "Dropout", keras.layers.BatchNormalization: "BatchNorm"}
  kind = next((ours[cls] for cls in ours if isinstance(layer, cls)), None)
  if kind == "BatchNorm" and carrying and layer.trainable:
    raise ParamsError(f"Keras layer {layer.name!r} (BatchNormalization) trains in a model "
                      "whose units carry a mask beside their activations, which "
                      "g.layers.BatchNorm does not take (and inside a unit it would "
                      "assign its moving statistics per micro-batch); freeze it, or build "
                      "the model without the mask")
  if kind is not None and not carrying:
    passed = [*(a for a in block.call_args if a is not None),
              *(f"{k}={v!r}" for k, v in call_kwargs.items() if v is not None)]
    if passed:
      raise ParamsError(f"Keras layer {layer.name!r} ({type(layer).__name__}) is called "
                        f"with {passed[0]}, which g.layers.{kind} does not take; call it "
                        "with its input alone")
    if kind == "Dropout":
      return _dropout_params(layer)
    return _batch_norm_params(layer).set(keras_saved_as=block.saved_as)
  p = Keras.Params().set(name=block.name, layer=layer, tie_to=block.tie_to,
                         keras_mask_in=block.keras_mask_in,
                         keras_mask_out=block.keras_mask_out,
                         keras_saved_as=block.saved_as)
  if block.padding_mask:
    p.set(padding_mask=block.padding_mask, padding_mask_dtype=block.padding_mask_dtype)
  try:
    p.set(call_args=list(block.call_args), call_kwargs=call_kwargs)
  except ParamsError as e:
    raise ParamsError(f"Keras layer {layer.name!r} is called with {e}") from None
  policy = getattr(layer, "dtype_policy", None)
  policy_name = getattr(policy, "name", "float32")
  if policy_name not in POLICY_FPROP_DTYPES:
    raise ParamsError(f"Keras layer {layer.name!r} has dtype policy {policy_name!r}; a "
                      f"pipeline takes {sorted(POLICY_FPROP_DTYPES)}")
  if POLICY_FPROP_DTYPES[policy_name] is not None:
    p.fprop_dtype = POLICY_FPROP_DTYPES[policy_name]
  return p


def _refuse_weights_frozen_alone(layer: keras.layers.Layer) -> None:
  """Raises ParamsError naming a weight of `layer` (or of a layer inside it) frozen on
  its own (`layer.kernel.trainable = False`) while its layer trains: params.txt records
  layers' configs, where only a layer's `trainable` is kept, so the unit would train it."""
  for sub in layer._flatten_layers(include_self=True, recursive=True):  # noqa: SLF001
    if not sub.trainable:
      continue
    for variable in sub._trainable_variables:  # noqa: SLF001 (made trainable by add_weight)
      if not variable.trainable:
        raise ParamsError(
            f"Keras weight {variable.path!r} is frozen on its own (trainable=False on the "
            f"weight) while its layer {sub.name!r} trains; params.txt records only a "
            "layer's trainable: freeze the whole layer (layer.trainable = False) or none "
            "of its weights")


def _dropout_params(layer: keras.layers.Dropout) -> InstantiableParams:
  noise_shape = layer.noise_shape
  broadcast = None if noise_shape is None else [
      axis for axis, size in enumerate(noise_shape) if size == 1]
  return layers.Dropout.Params().set(name=layer.name, keep_prob=1.0 - float(layer.rate),
                                     noise_shape_broadcast_dims=broadcast)


def _batch_norm_params(layer: keras.layers.BatchNormalization) -> InstantiableParams:
  config = layer.get_config()
  shape = _input_shape(layer)
  rank = len(shape) if shape is not None else None
  axis = config["axis"]
  initializers = {key: keras.initializers.serialize(getattr(layer, key))["class_name"]
                  for key in _BN_DEFAULTS}
  unsupported = {
      "axis": axis not in (-1, None if rank is None else rank - 1),
      "center": not config["center"], "scale": not config["scale"],
      "renorm": bool(config.get("renorm")), "synchronized": bool(config.get("synchronized")),
      **{key: initializers[key] != value for key, value in _BN_DEFAULTS.items()},
      **{key: config.get(key) is not None for key in (
          "beta_regularizer", "gamma_regularizer", "beta_constraint", "gamma_constraint")},
  }
  bad = [key for key, is_bad in unsupported.items() if is_bad]
  if bad or shape is None:
    why = f"its {bad[0]}={config.get(bad[0], initializers.get(bad[0]))!r}" if bad else \
        "no input shape (the model is not built)"
    raise ParamsError(f"Keras layer {layer.name!r} (BatchNormalization) cannot become "
                      f"g.layers.BatchNorm: {why}; supported: the last axis, center and "
                      "scale, default initializers, no renorm, regularizer or constraint")
  return layers.BatchNorm.Params().set(name=layer.name, dim=int(shape[-1]),
                                       decay=float(config["momentum"]),
                                       epsilon=float(config["epsilon"]),
                                       frozen=not layer.trainable)


def _input_shape(layer: keras.layers.Layer) -> tuple | None:
  try:
    return tuple(layer.input.shape)
  except (AttributeError, ValueError):
    return None


class _Block(NamedTuple):
  """One unit of a chain: a layer called at one node with its constant arguments after
  the input, or a functional block of several nodes (whose config keeps theirs).

  name: the unit's (the layer's; `<layer>_call<k>` for its k-th node after the first).
  tie_to: the unit of the layer's first node, when this is a later one (one weight set).
  padding_mask: the keyword the node passes the model's padding-mask input as, or
    'inputs' (a block whose second input it is); padding_mask_dtype: that input's dtype
    ('' when the model has none).
  keras_mask_in, keras_mask_out: whether the tensor before, after the unit carries a
    Keras mask (Embedding(mask_zero=True), Masking) that later layers read.
  saved_as: where a weights file of the model holds the layer's weights (a str), or a
    block's: each inner layer's, in order (a list; `saved_paths`).
  """
  layer: keras.layers.Layer
  name: str
  call_args: tuple = ()
  call_kwargs: dict = {}  # (a NamedTuple's default: never mutated)
  tie_to: str | None = None
  padding_mask: str | None = None
  padding_mask_dtype: str = ""
  keras_mask_in: bool = False
  keras_mask_out: bool = False
  saved_as: str | list = ""


# The name of the input a functional model takes a padding mask by (KerasHub's
# backbones: {"token_ids", "padding_mask"}).
PADDING_MASK_INPUT = "padding_mask"


def _chain_inputs(model: keras.Model, name: str) -> tuple[Any, Any]:
  """(the input the chain starts from, the padding-mask input or None)."""
  inputs = list(model.inputs)
  if len(model.outputs) == 1 and len(inputs) == 1:
    return inputs[0], None
  if len(model.outputs) == 1 and len(inputs) == 2:
    struct = getattr(model, "_inputs_struct", None)
    named = dict(struct) if isinstance(struct, dict) else {
        getattr(t, "name", ""): t for t in inputs}
    side = named.get(PADDING_MASK_INPUT)
    if side is not None:
      return next(t for t in inputs if t is not side), side
  raise ParamsError(f"Keras model {name!r} has {len(inputs)} inputs and "
                    f"{len(model.outputs)} outputs; from_keras takes one output and one "
                    f"input, or two: the ids and an input named {PADDING_MASK_INPUT!r} "
                    "(KerasHub's backbones)")


def saved_paths(model: keras.Model) -> dict[int, str]:
  """{id(layer): where `model.save_weights` puts its weights} for `model.layers`: Keras
  addresses each by its class in snake case, numbered in the order of model.layers
  ('layers/dense', 'layers/dense_1'), not by its name (keras.src.saving.saving_lib)."""
  from keras.src.utils import naming  # noqa: PLC0415

  used: dict[str, int] = {}
  paths = {}
  for layer in model.layers:
    base = naming.to_snake_case(type(layer).__name__)
    used[base] = used[base] + 1 if base in used else 0
    # (A layer listed twice is saved at its first place; the count still moves on.)
    paths.setdefault(id(layer), f"layers/{base}" + (f"_{used[base]}" if used[base] else ""))
  return paths


def _blocks(model: keras.Model, name: str, saved: dict[int, str]) -> list[_Block]:
  """The units of a functional model (or a Sequential's graph): its graph cut at each
  tensor that all later layers are reached through, a padding-mask input aside (module
  docstring); `saved`: where a weights file holds each layer's (saved_paths)."""
  start, side = _chain_inputs(model, name)
  nodes = _computing_nodes(model)
  calls: dict[int, list[int]] = {}  # a layer → the indices of its nodes
  holders: dict[int, list[int]] = {}  # a layer → the nodes whose layer holds it (nested)
  for i, node in enumerate(nodes):
    calls.setdefault(id(node.operation), []).append(i)
    for layer in {id(sub): sub for sub in _layer_tree(node.operation)}:
      holders.setdefault(layer, []).append(i)
  # A layer called at several nodes becomes one unit per node, the later ones tied to
  # the first, when each node is a block of its own and calls it itself (not through a
  # model holding it too); otherwise no cut falls between the first and last node
  # holding it (a span), so those nodes share one block and it stays one layer. Spans
  # merge blocks, which can leave another shared layer's node not alone: repeated until
  # none does.
  _refuse_layers_held_twice(nodes, holders, name)
  spans: set[tuple[int, int]] = set()
  skipped = _mask_tensors(nodes) | ({id(side)} if side is not None else set())
  while True:
    cuts, starts = _cuts(nodes, start, skipped, model.outputs[0], spans)
    alone = {starts[b] for b in range(len(cuts) - 1) if starts[b + 1] == starts[b] + 1
             and _single(nodes[starts[b]], cuts[b], skipped)}
    needed = {(indices[0], indices[-1]) for indices in holders.values()
              if len(indices) > 1 and not _tied_calls(nodes, indices, calls, alone)}
    if needed <= spans:
      break
    spans |= needed
  taken = {layer.name for layer in model.layers}
  named: dict[int, str] = {}  # a shared layer → its first node's unit
  blocks = []
  for b in range(len(cuts) - 1):
    inside = nodes[starts[b]:starts[b + 1]]
    masks = {"keras_mask_in": b > 0 and get_keras_mask(cuts[b]) is not None,
             "keras_mask_out": b + 2 < len(cuts) and get_keras_mask(cuts[b + 1]) is not None,
             "padding_mask_dtype": "" if side is None else side.dtype}
    if starts[b] in alone:
      node = inside[0]
      layer = node.operation
      unit, tie_to = layer.name, named.get(id(layer))
      if tie_to is None:
        named[id(layer)] = unit
      else:
        unit = _unused(f"{layer.name}_call{calls[id(layer)].index(starts[b])}", taken)
      args, kwargs, padding_mask = _constant_arguments(node, side, skipped, name)
      blocks.append(_Block(layer, unit, args, kwargs, tie_to, padding_mask, **masks,
                           saved_as=saved.get(id(layer), "")))
      continue
    names = [node.operation.name for node in inside]
    uses_side = side is not None and any(
        any(t is side for t in node.input_tensors) for node in inside)
    try:
      block = keras.Model([cuts[b], side] if uses_side else cuts[b], cuts[b + 1],
                          name=f"{names[0]}_to_{names[-1]}")
    except Exception as e:  # noqa: BLE001
      raise ParamsError(f"Keras model {name!r}: the layers {names} cannot form one "
                        f"block: {e}") from None
    inner = [layer for layer in block.layers if not isinstance(layer, keras.layers.InputLayer)]
    blocks.append(_Block(block, block.name, padding_mask="inputs" if uses_side else None,
                         **masks, saved_as=[saved.get(id(layer), "") for layer in inner]))
  return blocks


def _mask_tensors(nodes: list) -> set[int]:
  """The ids of the Keras masks of `nodes`' outputs (KerasTensors Keras passes as a
  layer's `mask` argument; each unit's layers make their own)."""
  return {id(mask) for node in nodes for tensor in node.output_tensors
          if (mask := get_keras_mask(tensor)) is not None}


def _computing_nodes(model: keras.Model) -> list:
  """The model's nodes in the order Keras runs them, without its inputs and the ops
  Keras adds to compute masks (`not_equal` for Embedding(mask_zero=True), `logical_or`
  merging an Add's): a unit's layers compute their masks themselves when called."""
  nodes = [node for depth in sorted(model._nodes_by_depth, reverse=True)  # noqa: SLF001
           for node in model._nodes_by_depth[depth]  # noqa: SLF001
           if not isinstance(node.operation, keras.layers.InputLayer)]
  masks = _mask_tensors(nodes)
  outputs = {id(tensor) for tensor in model.outputs}
  readers: dict[int, list[int]] = {}  # tensor → the nodes reading it
  for node in nodes:
    for tensor in node.input_tensors:
      readers.setdefault(id(tensor), []).append(id(node))
  mask_only: set[int] = set()  # nodes whose outputs are masks or feed mask ops only
  for node in reversed(nodes):
    produced = [id(t) for t in node.output_tensors]
    read_by = [reader for t in produced for reader in readers.get(t, [])]
    if (all(t not in outputs and t in masks for t in produced)
        or (read_by and all(reader in mask_only for reader in read_by))):
      mask_only.add(id(node))
  return [node for node in nodes if id(node) not in mask_only]


def _layer_tree(operation: Any) -> list:
  """`operation` and every layer inside it (a nested model's, a block's sublayers)."""
  flatten = getattr(operation, "_flatten_layers", None)
  return list(flatten(include_self=True, recursive=True)) if flatten else [operation]


def _refuse_layers_held_twice(nodes: list, holders: dict[int, list[int]], name: str
                              ) -> None:
  """Raises ParamsError naming a layer that two different layers' nodes hold (itself
  and a nested model around it, or two nested models): a Keras config records it once
  in each, so Keras's own from_config makes two layers of it (load_model fails), and
  a unit's config would too."""
  for indices in holders.values():
    operations = {id(nodes[i].operation): nodes[i].operation for i in indices}
    if len(operations) > 1:
      outer = [op for op in operations.values() if isinstance(op, keras.Model)]
      shared = next(sub for sub in _layer_tree(outer[0])
                    if holders.get(id(sub)) is indices) if outer else None
      what = repr(shared.name) if shared is not None else "a layer"
      raise ParamsError(
          f"Keras model {name!r}: layer {what} is used inside "
          f"{' and '.join(repr(op.name) for op in operations.values())} at once; a "
          "Keras config records it in each (keras.Model.from_config makes two layers "
          "of it, load_model fails), so a unit's config cannot hold it once; call it at "
          "nodes of one model")


def _tied_calls(nodes: list, indices: list[int], calls: dict[int, list[int]],
                alone: set[int]) -> bool:
  """Whether the nodes `indices` (those holding one layer) can be units tied to the
  first: all call one layer (the shared one, or one holding it) at exactly these nodes,
  each node a block of its own, and not a BatchNormalization (whose units are the
  library's own, untied)."""
  operation = nodes[indices[0]].operation
  return (all(nodes[i].operation is operation for i in indices)
          and calls[id(operation)] == indices and all(i in alone for i in indices)
          and not isinstance(operation, keras.layers.BatchNormalization))


def _cuts(nodes: list, start: Any, skipped: set[int], output: Any,
          spans: set[tuple[int, int]]) -> tuple[list, list[int]]:
  """([the tensors between blocks, in order, `start` first and `output` last], [the
  index of each block's first node, and len(nodes)]): a cut wherever one tensor alone
  is still needed (those in `skipped` aside: the padding-mask input, Keras's masks),
  never inside a span."""
  consumers: dict[int, int] = {}  # tensor → index of its last consuming node
  for i, node in enumerate(nodes):
    for tensor in node.input_tensors:
      if id(tensor) not in skipped:
        consumers[id(tensor)] = i
  consumers[id(output)] = len(nodes)
  live = {id(start): start}
  cuts, starts = [start], [0]
  for i, node in enumerate(nodes):
    for tensor in node.output_tensors:
      if consumers.get(id(tensor), -1) > i:
        live[id(tensor)] = tensor
    live = {key: t for key, t in live.items() if consumers.get(key, -1) > i}
    # (after the last node: the output, consumed "after" all)
    if len(live) == 1 and not any(first <= i < last for first, last in spans):
      cuts.append(next(iter(live.values())))
      starts.append(i + 1)
  return cuts, starts


def _single(node: Any, cut: Any, skipped: set[int]) -> bool:
  """Whether `node` alone makes a unit: called with `cut` first, its other arguments
  constants (or tensors in `skipped`: the padding mask, Keras's masks)."""
  tensors = [t for t in node.input_tensors if id(t) not in skipped]
  args = node.arguments.args
  return len(tensors) == 1 and tensors[0] is cut and bool(args) and args[0] is cut


def _constant_arguments(node: Any, side: Any, skipped: set[int], name: str
                        ) -> tuple[tuple, dict, str | None]:
  """(the node's positional arguments after its input, its keyword arguments but the
  Keras masks Keras filled in (the unit's layer gets them from its input again), the
  keyword the padding mask `side` is passed as, or None)."""
  args = tuple(node.arguments.args[1:])
  kwargs = {k: v for k, v in node.arguments.kwargs.items()
            if v is side or id(v) not in skipped}
  if side is not None and any(a is side for a in args):
    raise ParamsError(f"Keras model {name!r}: layer {node.operation.name!r} takes the "
                      f"padding mask as a positional argument; pass it by keyword "
                      "(KerasHub's decoder_padding_mask=...)")
  keyword = next((k for k, v in kwargs.items() if side is not None and v is side), None)
  if keyword is not None:
    del kwargs[keyword]
  return args, kwargs, keyword


def _unused(name: str, taken: set[str]) -> str:
  """`name`, with underscores added until no layer of the model has it; then taken."""
  while name in taken:
    name += "_"
  taken.add(name)
  return name


def _refuse_repeated_layers(model: keras.Sequential) -> None:
  """Raises ParamsError naming a layer a Sequential without a graph holds twice (one
  weight set): its entries would become units with weights of their own."""
  seen: set[int] = set()
  for layer in model.layers:
    if id(layer) in seen:
      raise ParamsError(f"Keras layer {layer.name!r} appears more than once in Sequential "
                        f"{model.name!r}, sharing its weights; build the model with "
                        "keras.Input first, or as a functional one")
    seen.add(id(layer))


def load_keras_weights(stack: BaseLayer, model: keras.Model) -> None:
  """Sets the weights of `stack` (built from `from_keras(model)`, or a pipeline of it)
  to `model`'s: each unit from the Keras layer (or block) of its name.

  Raises:
    ParamsError: when a unit has no layer of its name in `model`.
  """
  sources = keras_units(model)
  for unit in stack.walk():
    if isinstance(unit, Keras) and unit.params.tie_to:
      continue  # (it reads the weights of unit `tie_to`, loaded there)
    if isinstance(unit, Keras):
      unit.assign_from(_source(sources, unit))
    elif isinstance(unit, layers.BatchNorm):
      source = _source(sources, unit)
      for ours, theirs in ((unit.gamma, source.gamma), (unit.beta, source.beta),
                           (unit.moving_mean, source.moving_mean),
                           (unit.moving_variance, source.moving_variance)):
        ours.assign(tf.cast(theirs.value, ours.dtype))


def load_saved_keras_weights(path: str, stack: BaseLayer,
                             what: str = "task.train.init_from_keras") -> None:
  """Sets the weights of `stack` (from_keras's units, or a pipeline of them) to those
  saved at `path`: a run's start from trained weights (`what`, the param naming it).
  A `.keras` file (the model saved whole): each unit from the layer of its name
  (`load_keras_weights`). A `.weights.h5` file (`model.save_weights`): each unit from
  the place from_keras recorded for its layer (`keras_saved_as`).

  Raises:
    ParamsError: naming `what` and what does not fit: a file of another kind, one
      Keras cannot read, a unit without its layer there, a weight of another shape.
  """
  where = f"{what}={path!r}"
  if path.endswith(".weights.h5"):
    loader = _load_weights_file
  elif path.endswith(".keras"):
    loader = _load_model_file
  else:
    raise ParamsError(f"{where}: neither a .keras file (model.save('name.keras')) nor a "
                      ".weights.h5 file (model.save_weights('name.weights.h5'))")
  try:
    loader(path, stack)
  except ParamsError as e:
    raise ParamsError(f"{where}: {e}") from None
  except OSError as e:  # (h5py: a missing or unreadable file)
    raise ParamsError(f"{where} cannot be read: {_first_line(e)}") from None
  except ValueError as e:  # a weight of another shape, a layer without its weights
    raise ParamsError(f"{where}: a weight does not fit its unit: {_first_line(e)}") from None


def _first_line(error: Exception) -> str:
  return (str(error).strip().splitlines() or [type(error).__name__])[0][:200]


def _load_model_file(path: str, stack: BaseLayer) -> None:
  try:
    model = keras.saving.load_model(path, compile=False)
  except Exception as e:  # noqa: BLE001 (Keras raises many kinds: each means it cannot)
    raise ParamsError(f"cannot be loaded as a Keras model: {_first_line(e)}") from None
  load_keras_weights(stack, model)


def _load_weights_file(path: str, stack: BaseLayer) -> None:
  """Each unit's weights from the weights file at `path`, read at the places its
  `keras_saved_as` names into a Keras copy of its layer (Keras's own loader), then
  assigned. Keras's saving internals (keras.src.saving.saving_lib, Keras 3.15)."""
  import h5py  # noqa: PLC0415 (Keras's own dependency for weights files)
  from keras.src.saving import saving_lib  # noqa: PLC0415

  if not os.path.isfile(path):
    raise ParamsError("no such file" if not os.path.exists(path) else "not a file")
  if not h5py.is_hdf5(path):
    raise ParamsError("not a Keras weights file (HDF5)")
  store = saving_lib.H5IOStore(path, mode="r")
  try:
    for unit in stack.walk():
      if isinstance(unit, Keras) and not unit.params.tie_to:
        places = unit.params.keras_saved_as
        copy = unit.keras_copy()
        # (A layer's place is a str; a block's, one per inner layer.)
        targets = [copy] if isinstance(places, str) else [
            layer for layer in copy.layers if not isinstance(layer, keras.layers.InputLayer)]
        places = [places] if isinstance(places, str) else list(places or [])
        if len(places) != len(targets) or not all(places):
          raise ParamsError(f"{unit.path} records no place in a weights file (a unit "
                            "not made by g.from_keras); save the model whole (.keras)")
        try:
          for layer, place in zip(targets, places):
            _load_layer(store, layer, place, unit)
        except ParamsError:
          raise
        except ValueError as e:  # (Keras: a weight of another shape, or count)
          raise ParamsError(f"{unit.path}: the file's weights do not fit: "
                            f"{_first_line(e)}") from None
        unit.assign_from(copy)
      elif isinstance(unit, layers.BatchNorm) and unit.params.keras_saved_as:
        values = _saved_values(store, unit.params.keras_saved_as, unit, 4)
        for variable, value in zip((unit.gamma, unit.beta, unit.moving_mean,
                                    unit.moving_variance), values):
          variable.assign(tf.cast(value, variable.dtype))
      elif isinstance(unit, layers.BatchNorm):
        raise ParamsError(f"{unit.path} records no place in a weights file (not made by "
                          "g.from_keras); save the model whole (.keras)")
  finally:
    store.close()


def _load_layer(store: Any, layer: keras.layers.Layer, place: str, unit: BaseLayer) -> None:
  """`layer`'s weights from `place` in the weights file `store` (Keras's own walk of
  its sublayers), refusing a place that holds none of a layer that has some."""
  from keras.src.saving import saving_lib  # noqa: PLC0415

  if layer.weights and place not in store.h5_file:
    raise ParamsError(f"{unit.path}: the file holds no weights at {place!r} (the place "
                      f"of Keras layer {layer.name!r} in the model from_keras was given); "
                      "was it saved from another model?")
  saving_lib._load_state(layer, store, None, inner_path=place,  # noqa: SLF001
                         visited_saveables=set())


def _saved_values(store: Any, place: str, unit: BaseLayer, count: int) -> list:
  """The `count` arrays at `place`/vars in the weights file `store`."""
  variables = store.h5_file.get(f"{place}/vars")
  if variables is None or len(variables) != count:
    raise ParamsError(f"{unit.path}: the file holds no {count} weights at {place!r}; was "
                      "it saved from another model?")
  return [variables[str(i)][()] for i in range(count)]


def keras_units(model: keras.Model) -> dict[str, keras.layers.Layer]:
  """{name: the Keras layer (or functional block) of the unit of that name} for the
  units `from_keras(model)` makes (and the model's layers by name)."""
  sources = {layer.name: layer for layer in model.layers}
  graph = getattr(model, "_functional", None) if isinstance(model, keras.Sequential) \
      else model if _is_functional(model) else None
  if graph is not None:
    sources.update({block.name: block.layer for block in _blocks(graph, model.name, {})})
  return sources


def _source(sources: dict[str, Any], unit: BaseLayer) -> keras.layers.Layer:
  if unit.name not in sources:
    raise ParamsError(f"{unit.path}: the Keras model has no layer {unit.name!r}; its "
                      f"layers: {sorted(sources)}")
  return sources[unit.name]
