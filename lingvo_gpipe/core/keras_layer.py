"""`Keras`: one Keras 3 layer (or a functional block of them) as a library layer.

A Keras layer then sits in any Params stack and is pipelined, checkpointed, planned,
cast and exported like a native one. How each concern is met:

- **Params.** `layer` takes a `keras.layers.Layer` or its `keras.layers.serialize`
  dict and keeps the dict (its own `name` dropped: the library layer's `name` names it),
  so params.txt records the layer and reads it back.
- **Weights.** The layer is rebuilt from its config inside `tf.variable_creator_scope`:
  every floating weight Keras creates is made by `BaseLayer.create_variable` instead,
  named by its path inside the layer (`kernel`, `query_kernel`), on the device of the
  enclosing scope (the cell's), stackable, cast by the trainer's dtype rules. Keras's
  random initializers get seeds drawn from the layer's seed and path, so two builds of
  the same params give the same weights, as for native layers.
- **Forward.** `fprop` calls the Keras layer inside `keras.StatelessScope`, mapping
  each Keras weight to the library variable the layer reads now (a pipeline's traced
  function swaps them for its arguments: `base_layer.variables_read_as`). So layers of
  one kind share one traced function and a stacked weight's row is what is read.
- **Randomness.** Each of the layer's Keras seed generators (dropout inside attention,
  for instance) is mapped to a state drawn from (layer, step, the batch's first
  example), so a re-materialized forward draws the masks of the first one. Micro-batches
  draw their own masks (not those of the unsplit batch: Keras draws a mask for the
  shape it sees). `from_keras` turns a `keras.layers.Dropout` of a chain into the
  library's `Dropout`, whose masks are those of unpartitioned training.
- **Mixed precision.** The Keras dtype policy comes from `fprop_dtype` (bfloat16 →
  "mixed_bfloat16", float16 → "mixed_float16"): Keras casts the inputs and reads the
  float32 weights cast, and its own layers keep float32 where they choose to
  (normalizations, softmax).
- **Refused** in one line naming the layer: a BatchNormalization inside the layer
  (its moving statistics are assigned in `call`, once per micro-batch and again in a
  recompute; a chain's own BatchNormalization becomes `layers.BatchNorm` through
  `from_keras`), a stateful RNN, a regularizer (Keras's model.losses, which no task
  reads), integer state other than seed generators, losses added in `call`, weights
  created on the first call rather than at build (give `input_shape`), and a call
  that assigns to its weights in training (docs/keras.md).
"""

from __future__ import annotations

import ast
import contextlib
import copy
import random
import re
from collections.abc import Iterator
from typing import Any

import keras
import numpy as np
import tensorflow as tf
from keras.src.backend import get_keras_mask, set_keras_mask

from lingvo_gpipe.core import base_layer
from lingvo_gpipe.core.base_layer import BaseLayer
from lingvo_gpipe.core.hyperparams import ParamsError

# The Keras dtype policy a library compute dtype maps to, with float32 weights.
_POLICIES = {tf.float32: "float32", tf.bfloat16: "mixed_bfloat16",
             tf.float16: "mixed_float16"}
_POLICY_CLASSES = ("DTypePolicy", "FloatDTypePolicy")
# The compute dtype a Keras policy name stands for (from_keras reads a model's).
POLICY_FPROP_DTYPES = {"float32": None, "mixed_bfloat16": "bfloat16",
                       "mixed_float16": "float16", "bfloat16": "bfloat16",
                       "float16": "float16"}
_SEED_STATE = "seed_generator_state"


def keras_config(value: Any) -> dict:
  """`value` (a Keras layer or its `keras.layers.serialize` dict) as the config a
  Keras layer's params keep: the serialized dict without the layer's own name.

  Raises:
    ParamsError: for anything else, or a layer Keras cannot serialize.
  """
  if isinstance(value, keras.layers.Layer):
    try:
      value = keras.layers.serialize(value)
    except Exception as e:  # noqa: BLE001 (Keras raises many kinds; each means the same)
      raise ParamsError(f"Keras layer {value.name!r} ({type(value).__name__}) cannot be "
                        f"serialized, so params.txt could not record it: {e}") from None
  if not isinstance(value, dict) or "class_name" not in value or not isinstance(
      value.get("config"), dict):
    raise ParamsError(f"layer must be a keras.layers.Layer or its keras.layers.serialize "
                      f"dict, got {type(value).__name__} {str(value)[:80]!r}")
  config = copy.deepcopy(value)
  config["config"].pop("name", None)
  _rename_inner_layers(config)
  return config


def literal_call_arguments(value: Any, what: str, keyword: bool) -> list | dict:
  """`value` checked: the positional call arguments (a list) or the keyword ones (a
  dict of str keys), each a Python literal (what params.txt can write and read back; a
  NumPy scalar becomes its Python value), none named `training` (the pipeline's).

  Raises:
    ParamsError: naming the first argument that is not.
  """
  if keyword and isinstance(value, dict) and all(isinstance(k, str) for k in value):
    items = sorted(value.items())
  elif not keyword and isinstance(value, (list, tuple)):
    items = list(enumerate(value))
  else:
    raise ParamsError(f"{what} must be {'a dict of str keys' if keyword else 'a list'}, got "
                      f"{type(value).__name__} {str(value)[:60]!r}")
  checked = []
  for key, item in items:
    if key == "training":
      raise ParamsError(f"{what}: 'training' is the pipeline's to pass (True in training, "
                        "False in eval and serving); leave it out")
    if isinstance(item, np.generic):
      item = item.item()
    try:
      readable = ast.literal_eval(repr(item)) == item
    except (ValueError, SyntaxError):
      readable = False
    if not readable:
      raise ParamsError(f"{what}[{key!r}] = {str(item)[:60]!r} ({type(item).__name__}) is "
                        "not a Python literal that params.txt can record; pass a number, "
                        "string, bool, None or a list/dict of those")
    checked.append((key, item))
  return [item for _, item in checked] if isinstance(value, (list, tuple)) else dict(checked)


def _rename_inner_layers(config: dict) -> None:
  """A Sequential's or functional model's config with its layers renamed by position
  and class (`dense_2`), in place, references included. Keras names layers from
  process-wide counters (`dense_7`, the `keras_tensor_12CLONE` input of a block cut from
  a model), so the same model would give another config in another process, and two
  identical blocks two kinds of layer; renamed, they give one."""
  layers = config["config"].get("layers")
  if not isinstance(layers, list) or not all(isinstance(layer, dict) for layer in layers):
    return
  names = {}
  for i, layer in enumerate(layers):
    old = layer.get("name", layer.get("config", {}).get("name"))
    if isinstance(old, str):
      names[old] = f"{_snake(layer.get('class_name', 'layer'))}_{i}"

  def rename(node: Any) -> Any:
    if isinstance(node, dict):
      out = {key: rename(value) for key, value in node.items()}
      if isinstance(out.get("name"), str) and out["name"] in names:
        out["name"] = names[out["name"]]
      history = out.get("keras_history")
      if isinstance(history, list) and history and history[0] in names:
        out["keras_history"] = [names[history[0]], *history[1:]]
      return out
    if isinstance(node, (list, tuple)):
      return type(node)(rename(item) for item in node)
    return node

  inner = rename(config["config"])
  for key in ("input_layers", "output_layers"):
    if key in inner:
      inner[key] = _renamed_endpoints(inner[key], names)
  config["config"] = inner


def _renamed_endpoints(value: Any, names: dict) -> Any:
  """input_layers / output_layers ([name, node, tensor], or a list of them) renamed."""
  if isinstance(value, list) and len(value) == 3 and isinstance(value[0], str):
    return [names.get(value[0], value[0]), *value[1:]]
  if isinstance(value, list):
    return [_renamed_endpoints(item, names) for item in value]
  return value


def _snake(name: str) -> str:
  return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def _nested_dicts(value: Any) -> Iterator[dict]:
  """Every dict in `value` (dicts and lists, depth first, in order)."""
  if isinstance(value, dict):
    yield value
    for item in value.values():
      yield from _nested_dicts(item)
  elif isinstance(value, (list, tuple)):
    for item in value:
      yield from _nested_dicts(item)


@contextlib.contextmanager
def _python_random_seeded(seed: int) -> Iterator[None]:
  """Python's `random` seeded with `seed` inside, its state as it was after. Keras 3
  draws the seed of an initializer made without one from it: a layer whose own build
  makes one (`RandomNormal(stddev=0.02)` in a custom layer's `build`), which no config
  shows, then draws the same weights from the same params (`_built_config` seeds
  those the config holds)."""
  state = random.getstate()
  random.seed(seed)
  try:
    yield
  finally:
    random.setstate(state)


def _built_config(layer: Keras, config: dict, policy: str) -> dict:
  """The params' config as this layer builds it: named as the layer, every dtype
  policy inside set to `policy`, and every Keras initializer without a seed seeded
  from the layer's seed, path and the initializer's place in the config (so the
  same params draw the same weights, and two units of one config different ones)."""
  config = copy.deepcopy(config)
  config["config"]["name"] = layer.name  # (a functional model's config needs one)
  for i, node in enumerate(_nested_dicts(config)):
    if node.get("class_name") in _POLICY_CLASSES and node.get("module") == "keras":
      node["config"] = {"name": policy}
    elif node.get("module") == "keras.initializers" and isinstance(node.get("config"), dict) \
        and "seed" in node["config"] and node["config"]["seed"] is None:
      node["config"]["seed"] = layer.seed_for(f"keras_init_{i}")
  return config


def _frozen_scope() -> bool:
  """Whether the weight Keras is creating now belongs to a frozen layer
  (`trainable=False`, on it or on a layer around it): Keras creates every weight with
  add_weight's `trainable`, True by default, and leaves a frozen layer's out of
  `trainable_weights` only afterwards, so the layer making it must be asked (Keras 3
  enters `name_scope(layer.name, caller=layer)` in build and add_weight)."""
  from keras.src.backend.common import global_state  # noqa: PLC0415

  stack = global_state.get_global_attribute("name_scope_stack") or []
  return any(getattr(scope, "caller", None) is not None
             and getattr(scope.caller, "trainable", True) is False for scope in stack)


def _check_supported(path: str, layer: keras.layers.Layer) -> None:
  """Raises ParamsError naming the first sublayer of `layer` that a pipeline cannot run
  faithfully (module docstring)."""
  for sub in layer._flatten_layers(include_self=True, recursive=True):  # noqa: SLF001
    where = f"{path}: Keras layer {sub.name!r} ({type(sub).__name__})"
    if isinstance(sub, keras.layers.BatchNormalization) and sub.trainable:
      # (A frozen one runs in inference mode, `training and self.trainable`: no assign.)
      raise ParamsError(
          f"{where} assigns its moving statistics in call, once per micro-batch and again "
          "in a recompute; put it in the chain itself (g.from_keras makes it "
          "g.layers.BatchNorm, statistics per micro-batch, averages per step) or use "
          "g.layers.BatchNorm")
    regularized = [key for key in ("kernel_regularizer", "bias_regularizer",
                                   "activity_regularizer", "embeddings_regularizer",
                                   "gamma_regularizer", "beta_regularizer")
                   if getattr(sub, key, None) is not None]
    if regularized:
      raise ParamsError(f"{where} has {regularized[0]}: Keras adds it to model.losses, "
                        "which the task's loss does not read; add the penalty to the "
                        "task's loss instead")
    if getattr(sub, "stateful", False):
      raise ParamsError(f"{where} is stateful (it keeps state across batches), which "
                        "micro-batches would interleave; use stateful=False")


class Keras(BaseLayer):
  """One Keras layer: inputs (x, [x's Keras mask if keras_mask_in], *others) →
  `layer(*(x, *others)[:num_inputs], *call_args, training=..., **call_kwargs, [its
  padding-mask keyword: 1 - the last input])`, followed by its output's Keras mask if
  keras_mask_out, then the last `pass_through` inputs, unchanged. Shapes are the Keras
  layer's, batch first; masks [B, T] float, 1 = kept."""

  params_outside_kind = ("keras_saved_as",)  # (where a weights file holds its weights)

  @classmethod
  def Params(cls):  # noqa: N802
    p = super().Params()
    p.define("layer", None, "The Keras layer: a keras.layers.Layer (a Sequential or "
             "functional model too) or its keras.layers.serialize dict; kept, and written "
             "to params.txt, as that dict without the layer's name.", convert=keras_config)
    p.define("input_shape", None, "The shape of one example's input, without the batch "
             "axis (e.g. [64]); for a layer whose build takes several, a dict of them "
             "(MultiHeadAttention: {'query_shape': [T, D], 'value_shape': [T, D]}). "
             "None: the layer's own build config (a built layer has one), or none needed "
             "(a layer without weights).")
    p.define("num_inputs", None, "How many of the inputs the stack passes go to the "
             "layer, the first ones (e.g. 1: a language model's ids without the task's "
             "paddings); None: all.")
    p.define("pass_through", 0, "How many of the last inputs are returned after the "
             "layer's output, unchanged: 1 for (x, mask) stacks whose every block reads "
             "the mask and passes it on.")
    p.define("call_args", [], "Positional constants passed after the inputs at each call "
             "(the node's own, from_keras records them; e.g. [None]).",
             convert=lambda v: literal_call_arguments(v, "call_args", keyword=False))
    p.define("call_kwargs", {}, "Keyword constants passed at each call (the node's own, "
             "from_keras records them; e.g. {'use_causal_mask': False}); `training` is "
             "the pipeline's.",
             convert=lambda v: literal_call_arguments(v, "call_kwargs", keyword=True))
    p.define("tie_to", None, "The name of an earlier unit of this stack built from the "
             "same Keras layer (a layer called at several nodes: GPT-2's embedding "
             "reused as the output projection): this unit reads that unit's weights, "
             "one weight set trained from both uses (pipeline/tied_weights.py across "
             "cells). None: weights of its own.")
    p.define("padding_mask", None, "Where the layer takes a padding mask made from the "
             "stack's last input, the task's paddings [B, T] (1 = padded): the keyword "
             "it is passed as (KerasHub's 'decoder_padding_mask', 'padding_mask'), or "
             "'inputs' for a functional block whose second input it is. The mask is "
             "1 - paddings (1 = a real token) in padding_mask_dtype. None: none.")
    p.define("padding_mask_dtype", "int32", "The dtype the padding mask is passed in "
             "(the Keras model's padding-mask input's): int32, bool or a float.")
    p.define("keras_mask_in", False, "Whether the input after x is the Keras mask of x "
             "(float [B, T], 1 = kept: an Embedding(mask_zero=True) or Masking earlier "
             "in the stack), attached to x as Keras attaches it, so that the layer sees "
             "it as it would unpipelined.")
    p.define("keras_saved_as", None, "Where a Keras weights file of the model this unit "
             "was made from (`model.save_weights('m.weights.h5')`) holds its layer's "
             "weights: a path (e.g. 'layers/dense_1'), or for a block a list, one per "
             "inner layer, in order; from_keras records them (task.train.init_from_keras). "
             "None: not made by from_keras.")
    p.define("keras_mask_out", False, "Whether the Keras mask of the layer's output is "
             "returned after it (float [B, T], 1 = kept), for the next unit.")
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    if p.layer is None:
      raise ParamsError(f"{self.path}: layer is not set (a Keras layer or its "
                        "keras.layers.serialize dict)")
    if p.num_inputs is not None and (not isinstance(p.num_inputs, int) or p.num_inputs < 1):
      raise ParamsError(f"{self.path}: num_inputs must be None or an int >= 1, got "
                        f"{p.num_inputs!r}")
    if not isinstance(p.pass_through, int) or p.pass_through < 0:
      raise ParamsError(f"{self.path}: pass_through must be an int >= 0, got "
                        f"{p.pass_through!r}")
    if p.padding_mask is not None and (not isinstance(p.padding_mask, str)
                                       or not p.padding_mask.isidentifier()):
      raise ParamsError(f"{self.path}: padding_mask must be None, a keyword the layer "
                        f"takes or 'inputs', got {p.padding_mask!r}")
    try:
      mask_dtype = tf.as_dtype(p.padding_mask_dtype)
    except TypeError:
      mask_dtype = None
    if mask_dtype is None or not (mask_dtype.is_floating or mask_dtype.is_integer
                                  or mask_dtype == tf.bool):
      raise ParamsError(f"{self.path}: padding_mask_dtype must be an int, bool or float "
                        f"dtype name, got {p.padding_mask_dtype!r}")
    if p.tie_to is not None and (not isinstance(p.tie_to, str) or not p.tie_to
                                 or p.tie_to == p.name):
      raise ParamsError(f"{self.path}: tie_to must be None or the name of another, "
                        f"earlier unit, got {p.tie_to!r}")
    policy = self._policy()
    # (Keras variable, the attribute holding the library variable it reads), and the
    # Keras seed generators' states: set by _build_keras.
    self._bound: tuple[tuple[Any, str], ...]
    self._seed_states: tuple[Any, ...]
    self._building, self._creating = True, False
    config = _built_config(self, p.layer, policy)
    if getattr(base_layer._STATE, "shapes_only", False):  # noqa: SLF001
      # Only shapes are wanted: Keras builds in a scratch graph (nothing allocated).
      with tf.Graph().as_default():
        layer = self._build_keras(config, policy)
    else:
      layer = self._build_keras(config, policy)
    self._building = False
    # Held past tf.Module's tracking: the library variables are this layer's own
    # attributes already, and a second path to them would give a checkpoint two keys.
    object.__setattr__(self, "keras_layer", layer)

  def _policy(self) -> str:
    """The Keras dtype policy of this layer's compute dtype and variable dtype."""
    if self.params.dtype == tf.float64 and self.fprop_dtype == tf.float64:
      return "float64"
    if self.params.dtype != tf.float32 or self.fprop_dtype not in _POLICIES:
      raise ParamsError(
          f"{self.path}: a Keras layer takes dtype=float32 with fprop_dtype in "
          f"{[d.name for d in _POLICIES]} (or float64 with float64), got dtype="
          f"{self.params.dtype.name}, fprop_dtype={self.fprop_dtype.name}")
    return _POLICIES[self.fprop_dtype]

  def _build_keras(self, config: dict, policy: str) -> keras.layers.Layer:
    """The Keras layer from `config` (its dtype policy `policy`), built, its weights
    library variables."""
    p = self.params
    with tf.variable_creator_scope(self._create_variable), \
        _python_random_seeded(self.seed_for("keras_python_random")):
      layer, config = self._deserialized(config)
      _check_supported(self.path, layer)
      if isinstance(layer, keras.Model) and not isinstance(layer, keras.Sequential):
        # A functional block's input spec is its source tensor's shape, sequence length
        # included; its layers check what they need (a generate step runs the stack on
        # other lengths).
        layer.input_spec = None
        if p.keras_mask_in or p.keras_mask_out:
          # (A Functional says it does not, and drops the mask its layers computed; in
          # the whole model, Keras passes it on between them.)
          layer.supports_masking = True
      if isinstance(layer, keras.Model):
        # (A model's config has no dtype of its own: its layers' are set in the config.)
        layer.dtype_policy = policy
      self._build(layer, config)
    ours = {id(getattr(self, name)): name for name in self._var_names + self._tied_names}
    bound, seeds = [], []
    keras_trainable = {id(variable) for variable in layer.trainable_weights}
    for variable in layer.variables:
      value = getattr(variable, "_value", None)
      if id(value) in ours:
        bound.append((variable, ours[id(value)]))
        if (id(variable) in keras_trainable) != bool(getattr(value, "trainable", True)):
          raise ParamsError(
              f"{self.path}: Keras weight {variable.path!r} is "
              f"{'' if id(variable) in keras_trainable else 'not '}trainable in Keras, "
              "but its layer's config (trainable) says otherwise when the weight is made; "
              "set trainable on the layer before it is built")
      elif variable.name == _SEED_STATE:
        seeds.append(variable)
    # (Past tf.Module's tracking, as keras_layer.)
    object.__setattr__(self, "_bound", tuple(bound))
    object.__setattr__(self, "_seed_states", tuple(seeds))
    return layer

  def _deserialized(self, config: dict) -> tuple[keras.layers.Layer, dict]:
    """(the Keras layer of `config`, unbuilt; the config it builds by, without the
    build config where input_shape is given: it wins over that one, which Keras would
    use)."""
    if self.params.input_shape is not None:
      config = {key: value for key, value in config.items() if key != "build_config"}
    try:
      return keras.layers.deserialize(config), config
    except Exception as e:  # noqa: BLE001
      raise ParamsError(f"{self.path}: Keras cannot build {config['class_name']!r} from "
                        f"its config: {e}") from None

  def _build(self, layer: keras.layers.Layer, config: dict) -> None:
    """Builds `layer` (deserialized from `config`) for input_shape, or its build config."""
    p = self.params
    build_config = config.get("build_config")
    try:
      if isinstance(p.input_shape, dict):
        layer.build(**{k: (None, *v) for k, v in p.input_shape.items()})
      elif p.input_shape is not None:
        layer.build((None, *p.input_shape))
      elif build_config and not layer.built:
        layer.build_from_config(build_config)
    except ParamsError:
      raise
    except Exception as e:  # noqa: BLE001
      raise ParamsError(f"{self.path}: Keras layer {config['class_name']!r} cannot be "
                        f"built for input_shape={p.input_shape!r}: {e}") from None

  def keras_copy(self) -> keras.layers.Layer:
    """A Keras layer of this unit's config, built, its weights Keras's own (not this
    unit's), float32: to load saved weights into, then `assign_from` it."""
    layer, config = self._deserialized(_built_config(self, self.params.layer, "float32"))
    self._build(layer, config)
    return layer

  def _create_variable(self, next_creator: Any, **kwargs: Any) -> Any:
    """tf.variable_creator_scope's creator: a floating weight becomes a library variable
    named by its path inside the Keras layer; a seed generator's state stays Keras's."""
    if self._creating:  # create_variable's own tf.Variable
      return next_creator(**kwargs)
    dtype = tf.as_dtype(kwargs.get("dtype") or tf.float32)
    name = kwargs.get("name") or "weight"
    if not dtype.is_floating:
      if name == _SEED_STATE:
        return next_creator(**kwargs)
      raise ParamsError(f"{self.path}: the Keras layer keeps {dtype.name} state {name!r}, "
                        "which a pipeline cannot carry between micro-batches")
    if not self._building:
      raise ParamsError(
          f"{self.path}: the Keras layer creates weight {name!r} on its first call; give "
          "input_shape (one example's shape, without the batch axis) so that it is built "
          "with the model")
    from keras.src.backend.common.name_scope import current_path  # noqa: PLC0415
    parts = [*current_path().split("/")[1:], name]  # the layer's own name dropped
    attribute = re.sub(r"\W", "_", "_".join(part for part in parts if part))
    while attribute in self._var_names or hasattr(self, attribute):
      attribute += "_"
    initial = kwargs["initial_value"]
    initial_fn = initial if callable(initial) else (lambda: initial)
    with tf.Graph().as_default():
      shape = tf.convert_to_tensor(initial_fn()).shape
    trainable = kwargs.get("trainable", True)
    trainable = (True if trainable is None else bool(trainable)) and not _frozen_scope()
    self._creating = True
    try:
      if self.params.tie_to:
        # The same Keras layer as unit `tie_to` (same config, so the same weights in the
        # same order, named alike): its variable, read here too.
        variable = self.tie_variable(attribute, f"{self.params.tie_to}/{attribute}",
                                     shape.as_list())
      else:
        variable = self.create_variable(
            attribute, shape.as_list(), dtype=self.params.dtype, trainable=trainable,
            make_initial=lambda: tf.cast(initial_fn(), self.params.dtype))
    finally:
      self._creating = False
    if isinstance(variable, base_layer.VariableShape):
      return next_creator(**kwargs)  # (shapes only: Keras gets a scratch-graph variable)
    return variable

  def _seed_value(self, index: int) -> tf.Tensor:
    """int64 [2]: the state of the layer's seed generator `index` for this forward pass,
    from (layer, step, the batch's first example): a recompute draws the same."""
    ctx = base_layer.current_context()
    step = tf.cast(ctx.step, tf.int64)
    offset = tf.cast(ctx.example_offset, tf.int64)
    return tf.stack([base_layer.seed_tensor(self, f"keras_seed_{index}"),
                     step * (1 << 32) + offset])

  def _build_on_first_call(self, inputs: tuple) -> None:
    """Builds a layer that had neither input_shape nor a build config from the shapes
    of its first inputs, symbolically (Keras's own build path), under the creator that
    refuses a weight made now: one made inside a traced step would escape the cell's
    device, the checkpoint and the optimizer."""
    symbolic = tf.nest.map_structure(
        lambda x: keras.KerasTensor(x.shape, x.dtype.name) if isinstance(x, tf.Tensor)
        else x, inputs)
    with tf.variable_creator_scope(self._create_variable):
      self.keras_layer(*symbolic, *(self.params.call_args or []),
                       **(self.params.call_kwargs or {}))

  def _layer_inputs(self, inputs: tuple) -> tuple[tuple, dict, tuple]:
    """(the layer's positional inputs, its tensor keyword arguments, the inputs passed
    through) from the stack's `inputs`: (x, [x's Keras mask, keras_mask_in], *others),
    the padding mask (if any) made from the last of them."""
    p = self.params
    passed = inputs[len(inputs) - p.pass_through:] if p.pass_through else ()
    paddings = inputs[-1]
    if p.keras_mask_in:
      x, mask, *others = inputs
      # (Keras's own mask attribute: its layers read it, as on a tensor they made.)
      set_keras_mask(x, tf.cast(mask, tf.bool))
      inputs = (x, *others)
    inputs = inputs[:p.num_inputs]
    keywords = {}
    if p.padding_mask is not None:
      dtype = tf.as_dtype(p.padding_mask_dtype)
      real = tf.cast(paddings, tf.float32) < 0.5  # [B, T], True at a real token
      mask = real if dtype == tf.bool else tf.cast(real, dtype)
      if p.padding_mask == "inputs":
        inputs = ([inputs[0], mask],)
      else:
        keywords[p.padding_mask] = mask
    return inputs, keywords, passed

  def _with_keras_mask(self, outputs: Any) -> tuple:
    """(outputs, their Keras mask as float [B, T]): keras_mask_out."""
    mask = get_keras_mask(outputs)
    if mask is None:
      raise ParamsError(f"{self.path}: keras_mask_out is set, but the Keras layer's "
                        "output carries no mask")
    return outputs, tf.cast(mask, tf.float32)

  def fprop(self, *inputs: Any) -> Any:
    ctx = base_layer.current_context()
    inputs, keywords, passed = self._layer_inputs(inputs)
    if not self.keras_layer.built:
      self._build_on_first_call(inputs)
    # (A stacked row converts to its slice: stacked_variables' conversion function.)
    weights = [(variable, tf.convert_to_tensor(getattr(self, name)))
               for variable, name in self._bound]
    seeds = [(state, self._seed_value(i)) for i, state in enumerate(self._seed_states)]
    with keras.StatelessScope(state_mapping=weights + seeds, collect_losses=True) as scope:
      # (What the scope holds for each weight: the value given, or its cast to the Keras
      # variable's dtype, as for a half-precision serving copy's weights.)
      entered = [(variable, scope.get_current_value(variable)) for variable, _ in weights]
      outputs = self.keras_layer(*inputs, *(self.params.call_args or []),
                                 training=bool(ctx.training),
                                 **(self.params.call_kwargs or {}), **keywords)
    if scope.losses:
      raise ParamsError(f"{self.path}: the Keras layer adds a loss in call, which a "
                        "pipeline's task loss does not see; add it to the task's loss")
    for variable, value in entered:
      if scope.get_current_value(variable) is not value:
        raise ParamsError(f"{self.path}: the Keras layer assigns to its weight "
                          f"{variable.path!r} in call; a pipeline runs call once per "
                          "micro-batch and again in a recompute")
    outputs = self._with_keras_mask(outputs) if self.params.keras_mask_out else (outputs,)
    return (*outputs, *passed) if len(outputs) + len(passed) > 1 else outputs[0]

  def _paired(self, source: keras.layers.Layer) -> list[tuple[Any, str]]:
    """[(`source`'s weight, the attribute of this layer's that it pairs with)], in
    Keras's order, which the config fixes (`source` is a Keras layer of the same
    config, its inner layers perhaps named otherwise).

    Raises:
      ParamsError: when `source`'s weights differ in number or shape.
    """
    theirs = [v for v in source.variables if v.name != _SEED_STATE]
    names = [name for _, name in self._bound]
    if [tuple(v.shape) for v in theirs] != [tuple(getattr(self, n).shape) for n in names]:
      raise ParamsError(
          f"{self.path}: Keras layer {source.name!r} is not the one this unit was made "
          f"from: weights {[tuple(v.shape) for v in theirs]}, this unit's "
          f"{[tuple(getattr(self, n).shape) for n in names]}")
    return list(zip(theirs, names))

  def assign_from(self, source: keras.layers.Layer) -> None:
    """Sets this layer's weights to those of `source` (see `_paired`)."""
    for value, name in self._paired(source):
      getattr(self, name).assign(tf.cast(value.value, self.params.dtype))

  def keras_weight_paths(self, source: keras.layers.Layer) -> dict[str, str]:
    """{attribute of each weight: the path of `source`'s weight it is loaded from}."""
    return {name: value.path for value, name in self._paired(source)}
