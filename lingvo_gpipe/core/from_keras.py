"""`from_keras(model)`: a Keras Sequential or functional model as a Params stack.

The stack is a `layers.Sequential` whose units the pipeline can cut between:

- a `keras.Sequential`: one unit per layer;
- a functional model: its graph is cut at every tensor that all later layers are
  reached through (the single tensor alive between two layers, in the order Keras runs
  them). Between two cuts lies a block with one input and one output: a single layer is
  its own unit, several (a residual branch and its Add) become one unit, a functional
  model of those layers. A layer called at several nodes (its weights shared) keeps
  all its nodes inside one block. A model whose graph has no such cut between its input
  and output is one unit.

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

A frozen layer (`trainable=False`, on it or on a model around it) keeps its weights as
non-trainable variables: no gradient, no optimizer slots, still checkpointed.

A model with several inputs or outputs, a subclassed model (its call is Python that
no config records) and a layer that cannot be serialized are refused in one line
naming them. Weights are not carried by the params (params.txt holds configs only):
`load_keras_weights` copies a Keras model's weights into the built stack.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import keras
import tensorflow as tf

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
    _refuse_repeated_layers(model)
    units = [unit_params(layer) for layer in model.layers]
  elif _is_functional(model):
    units = [unit_params(block.layer, block.call_args, block.call_kwargs)
             for block in _blocks(model)]
  else:
    raise ParamsError(f"Keras model {model.name!r} ({type(model).__name__}) is subclassed: "
                      "its call is Python that no config records, so it cannot be cut; "
                      "build it as a keras.Sequential or a functional model, or run it as "
                      "one unit with g.layers.Keras.Params().set(layer=model)")
  return layers.Sequential.Params().set(name=name, layers=units)


def _is_functional(model: keras.Model) -> bool:
  return not isinstance(model, keras.Sequential) and hasattr(model, "_nodes_by_depth")


def unit_params(layer: keras.layers.Layer, call_args: tuple = (),
                call_kwargs: dict | None = None) -> InstantiableParams:
  """The library params of one unit: `layers.Dropout` or `layers.BatchNorm` for those
  Keras layers (module docstring), else a `layers.Keras` holding `layer`, called with
  the node's constant arguments `call_args` and `call_kwargs` (after its input).

  Raises:
    ParamsError: arguments to Dropout or BatchNormalization (the library's own layers
      take none), a non-literal argument, or a weight frozen apart from its layer.
  """
  _refuse_weights_frozen_alone(layer)
  call_kwargs = dict(call_kwargs or {})
  # A node's own `training` is dropped, as Keras 3 drops it: a functional model called
  # with training=True or False (fit passes True) passes that to every node that takes it
  # (tests/keras_test.py, test_a_nodes_training_argument_gives_way_as_in_keras).
  call_kwargs.pop("training", None)
  if isinstance(layer, (keras.layers.Dropout, keras.layers.BatchNormalization)):
    passed = [*(a for a in call_args if a is not None),
              *(f"{k}={v!r}" for k, v in call_kwargs.items() if v is not None)]
    if passed:
      ours = "Dropout" if isinstance(layer, keras.layers.Dropout) else "BatchNorm"
      raise ParamsError(f"Keras layer {layer.name!r} ({type(layer).__name__}) is called "
                        f"with {passed[0]}, which g.layers.{ours} does not take; call it "
                        "with its input alone")
    return (_dropout_params if isinstance(layer, keras.layers.Dropout)
            else _batch_norm_params)(layer)
  p = Keras.Params().set(name=layer.name, layer=layer)
  try:
    p.set(call_args=list(call_args), call_kwargs=call_kwargs)
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
  """One unit of a functional model: a layer called at one node with its constant
  arguments after the input, or a functional block of several nodes (whose config
  keeps their arguments; none here)."""
  layer: keras.layers.Layer
  call_args: tuple = ()
  call_kwargs: dict = {}  # (a NamedTuple's default: never mutated)


def _blocks(model: keras.Model) -> list[_Block]:
  """The units of a functional model: its graph cut at each tensor that all later
  layers are reached through (module docstring)."""
  if len(model.inputs) != 1 or len(model.outputs) != 1:
    raise ParamsError(f"Keras model {model.name!r} has {len(model.inputs)} inputs and "
                      f"{len(model.outputs)} outputs; from_keras takes one of each (pass "
                      "a mask through g.layers.Keras with pass_through instead)")
  nodes = [node for depth in sorted(model._nodes_by_depth, reverse=True)  # noqa: SLF001
           for node in model._nodes_by_depth[depth]  # noqa: SLF001
           if not isinstance(node.operation, keras.layers.InputLayer)]
  shared = _shared_spans(nodes)
  consumers: dict[int, int] = {}  # tensor → index of its last consuming node
  for i, node in enumerate(nodes):
    for tensor in node.input_tensors:
      consumers[id(tensor)] = i
  output = model.outputs[0]
  consumers[id(output)] = len(nodes)
  live = {id(model.inputs[0]): model.inputs[0]}
  cuts = [model.inputs[0]]  # the tensors between blocks, in order
  starts = [0]
  for i, node in enumerate(nodes):
    for tensor in node.output_tensors:
      if consumers.get(id(tensor), -1) > i:
        live[id(tensor)] = tensor
    live = {key: t for key, t in live.items() if consumers.get(key, -1) > i}
    # (after the last node: the output, consumed "after" all; never inside a shared
    # layer's span, whose nodes stay in one block)
    if len(live) == 1 and not any(first <= i < last for first, last in shared):
      cuts.append(next(iter(live.values())))
      starts.append(i + 1)
  blocks = []
  for b in range(len(cuts) - 1):
    inside = nodes[starts[b]:starts[b + 1]]
    if len(inside) == 1 and len(inside[0].input_tensors) == 1:
      arguments = inside[0].arguments
      if arguments.args and arguments.args[0] is inside[0].input_tensors[0]:
        blocks.append(_Block(inside[0].operation, tuple(arguments.args[1:]),
                             dict(arguments.kwargs)))
        continue
    names = [node.operation.name for node in inside]
    try:
      block = keras.Model(cuts[b], cuts[b + 1], name=f"{names[0]}_to_{names[-1]}")
    except Exception as e:  # noqa: BLE001
      raise ParamsError(f"Keras model {model.name!r}: the layers {names} cannot form one "
                        f"block: {e}") from None
    blocks.append(_Block(block))
  return blocks


def _refuse_repeated_layers(model: keras.Sequential) -> None:
  """Raises ParamsError naming a layer a Sequential holds twice (one weight set): its
  entries would become units with weights of their own."""
  seen: set[int] = set()
  for layer in model.layers:
    if id(layer) in seen:
      raise ParamsError(f"Keras layer {layer.name!r} appears more than once in Sequential "
                        f"{model.name!r}, sharing its weights; build the model as a "
                        "functional one (a shared layer's nodes then stay in one unit)")
    seen.add(id(layer))


def _shared_spans(nodes: list) -> list[tuple[int, int]]:
  """(first, last) indices into `nodes` of each layer called at several of them (one
  weight set used twice, e.g. a block applied twice): no cut falls between them, so
  the layer stays one layer inside one unit and trains as Keras trains it."""
  calls: dict[int, list[int]] = {}
  for i, node in enumerate(nodes):
    calls.setdefault(id(node.operation), []).append(i)
  return [(indices[0], indices[-1]) for indices in calls.values() if len(indices) > 1]


def load_keras_weights(stack: BaseLayer, model: keras.Model) -> None:
  """Sets the weights of `stack` (built from `from_keras(model)`, or a pipeline of it)
  to `model`'s: each unit from the Keras layer (or block) of its name.

  Raises:
    ParamsError: when a unit has no layer of its name in `model`.
  """
  sources = keras_units(model)
  for unit in stack.walk():
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
  """`load_keras_weights(stack, model)` for the Keras model saved whole at `path` (a
  `.keras` file): a run's start from trained weights (`what`, the param naming `path`).

  Raises:
    ParamsError: naming `what` and what does not fit: a file that is not a saved Keras
      model, a unit without its layer there, a weight of another shape.
  """
  where = f"{what}={path!r}"
  if not path.endswith(".keras"):
    raise ParamsError(f"{where}: not a .keras file; save the Keras model whole with "
                      "model.save('name.keras') (a .weights.h5 file holds no layers to "
                      "match the units with)")
  try:
    model = keras.saving.load_model(path, compile=False)
  except Exception as e:  # noqa: BLE001 (Keras raises many kinds: each means it cannot)
    raise ParamsError(f"{where} cannot be loaded as a Keras model: "
                      f"{str(e).strip().splitlines()[0][:200]}") from None
  try:
    load_keras_weights(stack, model)
  except ParamsError as e:
    raise ParamsError(f"{where}: {e}") from None
  except ValueError as e:  # a weight of another shape
    raise ParamsError(f"{where}: a weight does not fit its unit: "
                      f"{str(e).strip().splitlines()[0][:200]}") from None


def keras_units(model: keras.Model) -> dict[str, keras.layers.Layer]:
  """{name: the Keras layer (or functional block) of the unit of that name} for the
  units `from_keras(model)` makes (and the model's layers by name)."""
  sources = {layer.name: layer for layer in model.layers}
  if _is_functional(model):
    sources.update({block.layer.name: block.layer for block in _blocks(model)})
  return sources


def _source(sources: dict[str, Any], unit: BaseLayer) -> keras.layers.Layer:
  if unit.name not in sources:
    raise ParamsError(f"{unit.path}: the Keras model has no layer {unit.name!r}; its "
                      f"layers: {sorted(sources)}")
  return sources[unit.name]
