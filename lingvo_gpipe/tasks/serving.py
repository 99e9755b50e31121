"""A trained task as a `tf.Module` of serving functions, the object a SavedModel holds.

`ServingModel(task, input_generator, dtype)` copies the task's weights into variables
of its own (cast once to the serving dtype: float32, or bfloat16 or float16 for half the
bytes)
and traces the task's serving functions (`task.serving_functions`: classify; score
and generate; translate) reading those copies (`base_layer.variables_read_as`). The
module tracks only what the functions use: the weights, keyed by their layer paths,
and the task's lookup tables. Loaded with `tf.saved_model.load` in a process that
has never imported this library, it is plain TensorFlow: the functions' graphs,
their variables and assets.

A pipelined task (built with cells on devices) keeps each weight on its cell's device
and its functions run the stack as a forward-only pipeline over micro-batches
(`PipeliningLayer.infer`); an unpipelined task runs the stack on one device.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from collections.abc import Callable
from typing import Any

import tensorflow as tf

from lingvo_gpipe.core import base_layer

SERVING_DTYPES = {"float32": tf.float32, "bfloat16": tf.bfloat16, "float16": tf.float16}


@dataclasses.dataclass
class ServingOptions:
  """How the serving functions are built.

  dtype: what the weights are stored and computed in ('float32', 'bfloat16' or
    'float16'; layer norms, softmaxes and losses keep float32 statistics; outputs
    are float32 either way).
  max_decode_length: the longest sequence (prefix + new tokens) `generate` handles: its
    key/value cache holds this many positions.
  compile_generate: `generate`'s loop is XLA-compiled (LanguageModelTask.generate_tokens)
    where the stack is on one device.
  """
  dtype: str = "float32"
  max_decode_length: int = 128
  compile_generate: bool = True


def serving_dtype(name: str) -> tf.DType:
  """The tf.DType of a SERVING_DTYPES name; ValueError naming the valid ones otherwise."""
  if name not in SERVING_DTYPES:
    raise ValueError(f"serving dtype {name!r} is not one of {sorted(SERVING_DTYPES)}")
  return SERVING_DTYPES[name]


def _weight_key(variable: Any) -> str:
  """A tracked-attribute name for a variable: its layer path ('task/stack/layer_000/
  ff/w:0' → 'stack.layer_000.ff.w'; names are what `tf.Module` tracks, so they carry no
  '/')."""
  name = variable.name.removesuffix(":0")
  name = name.split("/", 1)[1] if "/" in name else name  # the task's own name
  return re.sub(r"[^\w.]", ".", name.replace("/", "."))


class ServingModel(tf.Module):
  """The serving functions of a task and the weights they read.

  Attributes:
    weights: {layer path: tf.Variable}, a copy of every variable of the task, floating
      ones in the serving dtype, each on the device of the variable it copies.
    functions: {signature name: tf.types.experimental.ConcreteFunction}, each called
      with keyword tensors and returning a dict of tensors.
  """

  def __init__(self, task: Any, input_generator: Any, options: ServingOptions):
    super().__init__(name="serving_model")
    dtype = serving_dtype(options.dtype)
    layers = list(task.walk())
    originals = [v for layer in layers for v in layer.own_variables()]
    keys = [_weight_key(v) for v in originals]
    if len(set(keys)) != len(keys):
      raise ValueError("two of the task's variables have one name; cannot key the weights")
    copies = []
    for key, variable in zip(keys, originals):
      value = tf.convert_to_tensor(variable)
      if value.dtype.is_floating:
        value = tf.cast(value, dtype)
      with tf.device(variable.device or None):
        copies.append(tf.Variable(value, trainable=False, name=key))
    self.weights = dict(zip(keys, copies))
    # Each layer reads the copies of what it reads: its own, and a weight it ties to
    # another layer's (a tied softmax reads the embedding table's copy).
    copy_of = {v.ref(): c for v, c in zip(originals, copies)}
    read = [copy_of[v.ref()] for layer in layers for v in layer.read_variables()]
    with base_layer.variables_read_as(layers, read):
      self.functions = {name: fn.get_concrete_function()
                        for name, fn in task.serving_functions(self, input_generator,
                                                               options).items()}

  def __call__(self, name: str, **inputs: Any) -> dict[str, tf.Tensor]:
    """Runs the serving function `name` on `inputs` (numpy or tensors)."""
    function = self.functions[name]
    specs = {spec.name: spec for spec in function.structured_input_signature[0]}
    return function(**{key: tf.convert_to_tensor(value, specs[key].dtype)
                       for key, value in inputs.items()})


def traced(input_signature: dict[str, tf.TensorSpec]) -> Callable[[Callable], Any]:
  """Decorates a serving function of keyword tensors with its input signature (a
  tf.function whose arguments are named as the signature's keys)."""
  names = list(input_signature)
  shapes = [spec.shape for spec in input_signature.values()]

  def decorate(body: Callable) -> Any:
    def function(*args: tf.Tensor) -> dict[str, tf.Tensor]:
      # A loaded signature takes a tensor of any shape; the graph was traced for its
      # spec's, and a kernel that meets another rank may abort the process (oneDNN's
      # "Check failed"). EnsureShape refuses it first, an InvalidArgumentError naming
      # the input (an assert on tf.rank would be folded away by the static shape).
      args = [tf.ensure_shape(arg, shape, name=name)
              for arg, shape, name in zip(args, shapes, names)]
      return body(**dict(zip(names, args)))

    # Named parameters, so that the concrete function (and the SavedModel's signature)
    # takes keyword tensors named as the signature's keys.
    function.__signature__ = inspect.Signature(
        [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD) for name in names])
    function.__name__ = body.__name__
    specs = [tf.TensorSpec(s.shape, s.dtype, name=name) for name, s in input_signature.items()]
    return tf.function(function, input_signature=specs, autograph=False)

  return decorate


def checked_paddings(paddings: tf.Tensor, ids: tf.Tensor, what: str) -> tf.Tensor:
  """`paddings` once it is checked to be ids' shape and every value 0 (a token) or 1
  (padding) (an InvalidArgumentError naming `what` otherwise): a model multiplies by
  1 − paddings, so 7 would scale a score by −6 and NaN would make it NaN."""
  checks = [
      tf.debugging.assert_equal(tf.shape(paddings), tf.shape(ids), message=(
          f"{what} must have the ids' shape [B, T]")),
      tf.debugging.Assert(tf.reduce_all(tf.logical_or(paddings == 0.0, paddings == 1.0)), [
          f"{what} must be 0 (a token) or 1 (padding); got another value:",
          tf.reduce_min(tf.where(tf.logical_or(paddings == 0.0, paddings == 1.0),
                                 tf.zeros_like(paddings), paddings)),
          tf.reduce_max(tf.where(tf.logical_or(paddings == 0.0, paddings == 1.0),
                                 tf.zeros_like(paddings), paddings))]),
  ]
  with tf.control_dependencies(checks):
    return tf.identity(paddings)


def checked_ids(ids: tf.Tensor, bound: Any, what: str) -> tf.Tensor:
  """`ids` once every one is checked to lie in [0, bound.bound) (base_task.IdBound; an
  InvalidArgumentError naming `what` otherwise): an XLA gather clamps an id out of
  range, a CPU gather on another device fails inside a loop; neither says what was
  wrong. With `bound` None (a model of no known vocabulary size) only ids >= 0."""
  checks = [tf.debugging.assert_non_negative(ids, message=f"{what} must be >= 0")]
  if bound is not None:
    checks.append(tf.debugging.assert_less(ids, tf.cast(bound.bound, ids.dtype), message=(
        f"{what} must be < {bound.bound}, the model's vocabulary size ({bound.param})")))
  with tf.control_dependencies(checks):
    return tf.identity(ids)
