"""`BaseLayer`: the Params-built, checkpointable building block of every model.

A layer is a `tf.Module` built from frozen `Params`. It creates its children with
`create_child` and its variables with `create_variable`; both are tracked, so a
`tf.train.Checkpoint` of the root saves and restores the whole tree. `fprop` is the
forward computation; call a layer (`layer(x)`) rather than `layer.fprop(x)` so that
name scopes and model inspection (`model_stats`) see the call.

Per-step information that is not an input tensor (training or eval, the global step,
the micro-batch index, batch-norm statistics to collect) travels in a `StepContext`
set by the trainer or the pipeline, so that layers can draw stateless dropout masks
that a re-materialized forward pass reproduces exactly.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
import threading
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from lingvo_gpipe.core import hyperparams, stacked_variables

Params = hyperparams.Params
InstantiableParams = hyperparams.InstantiableParams

# ---------------------------------------------------------------------------
# Weight initialization.
# ---------------------------------------------------------------------------

INIT_METHODS = ("xavier", "uniform", "gaussian", "gaussian_sqrt_fanin", "constant")


def weight_init(method: str = "xavier", scale: float = 1.0) -> Params:
  """Params of a weight initializer.

  Methods:
    xavier: uniform in ±scale·sqrt(6 / (fan_in + fan_out)) (Glorot & Bengio).
    uniform: uniform in ±scale.
    gaussian: normal with standard deviation `scale`.
    gaussian_sqrt_fanin: normal with standard deviation scale / sqrt(fan_in).
    constant: every element equals `scale`.
  """
  p = Params()
  p.define("method", method, f"One of {INIT_METHODS}.")
  p.define("scale", float(scale), "Scale; its meaning depends on the method.")
  return p


def _fans(shape: Sequence[int]) -> tuple[int, int]:
  """(fan_in, fan_out) of a weight: the last two dims, times a conv's window."""
  if len(shape) == 0:
    return 1, 1
  if len(shape) == 1:
    return shape[0], shape[0]
  receptive = math.prod(shape[:-2])
  return shape[-2] * receptive, shape[-1] * receptive


def initial_value(init: Params, shape: Sequence[int], dtype: tf.DType,
                  seed: tuple[int, int]) -> tf.Tensor:
  """A tensor of `shape` drawn by `init` from a stateless `seed` (reproducible)."""
  shape = list(shape)
  method, scale = init.method, init.scale
  if method == "constant":
    return tf.fill(shape, tf.cast(scale, dtype))
  if method == "xavier":
    fan_in, fan_out = _fans(shape)
    limit = scale * math.sqrt(6.0 / (fan_in + fan_out))
    return tf.random.stateless_uniform(shape, seed, -limit, limit, dtype=dtype)
  if method == "uniform":
    return tf.random.stateless_uniform(shape, seed, -scale, scale, dtype=dtype)
  if method == "gaussian":
    return tf.random.stateless_normal(shape, seed, stddev=scale, dtype=dtype)
  if method == "gaussian_sqrt_fanin":
    fan_in, _ = _fans(shape)
    return tf.random.stateless_normal(shape, seed, stddev=scale / math.sqrt(fan_in),
                                      dtype=dtype)
  raise hyperparams.ParamsError(f"unknown init method {method!r}; valid: {INIT_METHODS}")


# ---------------------------------------------------------------------------
# Compute dtypes (mixed precision).
# ---------------------------------------------------------------------------

# What fprop may compute in. float16 needs loss scaling in training
# (core/loss_scale.py); bfloat16 has float32's range and needs none.
FPROP_DTYPES = (tf.float32, tf.bfloat16, tf.float16, tf.float64)
HALF_DTYPES = (tf.bfloat16, tf.float16)


def resolve_fprop_dtype(value: Any, path: str = "") -> tf.DType:
  """`value` (a tf.DType or its name, e.g. 'bfloat16') as one of FPROP_DTYPES.

  Raises:
    ParamsError: naming the value and the valid ones.
  """
  dtype = None
  # Only names and DTypes: tf.as_dtype also takes TensorFlow's enum numbers (14 is
  # bfloat16, 1 float32, True is 1), which a mistyped override would pass silently.
  if isinstance(value, (str, tf.dtypes.DType)):
    try:
      dtype = tf.as_dtype(value)
    except TypeError:
      pass
  if dtype not in FPROP_DTYPES:
    where = f"{path}: " if path else ""
    raise hyperparams.ParamsError(
        f"{where}fprop_dtype {value!r} is not a compute dtype; valid: "
        f"{[d.name for d in FPROP_DTYPES]} (or None to inherit the parent's)")
  return dtype


def inherit_fprop_dtype(params: InstantiableParams, dtype: tf.DType) -> InstantiableParams:
  """A copy of a layer's `params` that computes in `dtype` unless it names its own
  fprop_dtype: what a parent computing in `dtype` builds it with. For code that builds
  a parent's layers on their own (the partitioner's profile, the planner)."""
  params = params.copy()
  if "fprop_dtype" in params and params.fprop_dtype is None:
    params.fprop_dtype = dtype
  return params


def params_kind(params: InstantiableParams) -> tuple:
  """What layers built from `params` have in common whatever their name: the class and
  every other param (as text) but those its class names in `params_outside_kind`.
  Layers of one kind have the same variables and compute the same function of them."""
  kind = params.copy().set(name="")
  for key in getattr(params.cls, "params_outside_kind", ()):
    kind.set(**{key: None})
  return params.cls, kind.to_text()


# ---------------------------------------------------------------------------
# The step context.
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class StepContext:
  """What a forward pass needs to know besides its inputs.

  Attributes:
    training: True in a training step (dropout on, batch norm uses batch statistics).
    step: the global step as an int64 scalar tensor (or int); seeds dropout.
    example_offset: position in the mini-batch of the first example of the batch this
      forward pass sees. Dropout draws the mask of each example from its position, so
      micro-batches draw different masks, and any split of the mini-batch into
      micro-batches draws exactly the masks of the unsplit batch.
    layer_stats: where layers (batch norm) report statistics of this forward pass:
      a list of (layer, stats) pairs, or None to not collect (e.g. in a recompute).
    spans: where pipelines record the timestamps of each cell call, forward and
      backward (a list of `timeline.CellTimes`; `timeline.MeasuredTimeline` is what they measure),
      or None to not record.
    weight_products: where `layers.project` records each product x·W with a trainable
      variable W (a `WeightProducts`) and keeps the gradient from reaching W through
      it, so that the caller computes that part of W's gradient itself (a pipeline's
      backward pass computes it over several micro-batches at once); None (the
      default): an ordinary product.
    loss_scale: S, a float32 scalar: the backward of the loss is seeded with S
      (core/loss_scale.py) and the summed gradients are divided by it; None: 1.
    token_slice: the slice of the sequences this forward pass computes and the cache
      of the slices before it (`core/token_slices.TokenSlice`), or None: whole
      sequences.
  """
  training: bool = False
  step: Any = 0
  example_offset: Any = 0
  layer_stats: list | None = None
  spans: list | None = None
  weight_products: WeightProducts | None = None
  loss_scale: Any = None
  token_slice: Any = None


@dataclasses.dataclass(frozen=True)
class WeightProduct:
  """outputs = inputs · variable, recorded in a StepContext's weight_products.

  inputs: [n, I], outputs: [n, O] (the 2-D matmul's operands, whatever rank the
  layer's input had); the variable's gradient is inputsᵀ · (gradient of outputs).
  rows: the static shape the n rows were flattened from (the layer input's leading
  dimensions, e.g. [b, T]): products of equal n have equal rows.
  """
  variable: Any
  inputs: Any
  outputs: Any
  rows: Any = None


class WeightProducts:
  """The weight products of a pass, in the order made.

  tape: the tape that differentiates the pass (it watches each product's outputs), or
  None. probes: one tensor [n, O] per product, added to its outputs; a function
  differentiated by TensorFlow's gradient of a call (no tape) gives each product's
  output gradient as its probe's gradient (zeros change nothing).
  """

  def __init__(self, tape: Any = None, probes: Any = None):
    self.tape = tape
    self.probes = None if probes is None else list(probes)
    self.products: list[WeightProduct] = []

  def record(self, variable: Any, inputs: Any, outputs: Any, rows: Any = None) -> Any:
    """Records outputs = inputs · variable (`rows`: WeightProduct's; inputs [n, I]
    themselves give [n] when None); returns the outputs to go on with."""
    if self.probes is not None:
      if len(self.products) >= len(self.probes):
        raise RuntimeError(f"{len(self.probes)} probes for more weight products")
      outputs = outputs + self.probes[len(self.products)]
    if self.tape is not None:
      # Watched, so that the tape can give the outputs' gradient even where nothing
      # the product was made from is watched (a first layer's input).
      self.tape.watch(outputs)
    self.products.append(WeightProduct(variable, inputs, outputs,
                                       inputs.shape[:-1] if rows is None else rows))
    return outputs


_STATE = threading.local()


def current_context() -> StepContext:
  stack = getattr(_STATE, "contexts", None)
  return stack[-1] if stack else StepContext()


@contextlib.contextmanager
def step_context(**changes: Any) -> Iterator[StepContext]:
  """Enters a StepContext that is the current one with `changes` applied."""
  ctx = dataclasses.replace(current_context(), **changes)
  stack = _STATE.__dict__.setdefault("contexts", [])
  stack.append(ctx)
  try:
    yield ctx
  finally:
    stack.pop()


@dataclasses.dataclass(frozen=True)
class VariableShape:
  """Stands in for a variable when layers are built with `shapes_only()`."""
  name: str
  shape: tuple[int, ...]
  dtype: tf.DType
  trainable: bool


@contextlib.contextmanager
def shapes_only(enabled: bool = True) -> Iterator[None]:
  """Layers built inside create no variables (not even graph nodes), only their shapes.

  Enough to count parameters of an 84B-parameter model in seconds; such layers
  cannot run fprop. `shapes_only(False)` turns it off inside (a FLOP estimate built
  while counting shapes needs layers that run).
  """
  with _thread_setting("shapes_only", enabled):
    yield


@contextlib.contextmanager
def _thread_setting(name: str, value: Any) -> Iterator[None]:
  """Within (this thread), the setting `name` of _STATE is `value`."""
  previous = getattr(_STATE, name, None)
  setattr(_STATE, name, value)
  try:
    yield
  finally:
    setattr(_STATE, name, previous)


def seed_tensor(layer: BaseLayer, purpose: str) -> tf.Tensor:
  """int64 scalar: `layer.seed_for(purpose)` as a tensor for a forward pass (dropout).

  A constant, except while a function shared by layers of one kind is traced
  (`pipeline/layer_function.py`): there it is an element of the function's seeds
  argument, so that each layer calling the shared function draws its own masks.
  """
  source = getattr(_STATE, "seed_source", None)
  if source is not None:
    return source(layer, purpose)
  return tf.constant(layer.seed_for(purpose), tf.int64)


@contextlib.contextmanager
def seed_source(source: Callable[[BaseLayer, str], tf.Tensor]) -> Iterator[None]:
  """Within, `seed_tensor(layer, purpose)` returns `source(layer, purpose)`."""
  with _thread_setting("seed_source", source):
    yield


@contextlib.contextmanager
def variables_read_as(layers: Sequence[BaseLayer], variables: Sequence[Any]) -> Iterator[None]:
  """Within, the variables of `layers` (each layer's `read_variables()`, layer after
  layer) are the attributes `variables` instead, e.g. a traced function's variable
  arguments; restored on exit. Checkpoint tracking is not touched (the attributes
  are set past tf.Module's tracking)."""
  replaced = [(layer, name) for layer in layers
              for name in layer._var_names + layer._tied_names]
  if len(replaced) != len(variables):
    raise ValueError(f"{len(variables)} variables given for {len(replaced)}")
  originals = [getattr(layer, name) for layer, name in replaced]
  for (layer, name), variable in zip(replaced, variables):
    object.__setattr__(layer, name, variable)
  try:
    yield
  finally:
    for (layer, name), original in zip(replaced, originals):
      object.__setattr__(layer, name, original)


def _layer_stack() -> list:
  return _STATE.__dict__.setdefault("building", [])


def _built_variables() -> dict[str, Any]:
  """{path: variable} of every variable the layers of the build in progress created
  (the root layer's build: a new root starts an empty one)."""
  built = getattr(_STATE, "built_variables", None)
  if built is None:
    built = _STATE.built_variables = {}
  return built


@contextlib.contextmanager
def stand_in_ties(enabled: bool = True) -> Iterator[None]:
  """Within, layers are built alone (to be measured or counted, each as the only
  layer of its build): a layer tying to another's variable gets one of its own of the
  shape it asks for, standing in for the tied one, which it reads where it runs."""
  # A registry of its own: what layers built alone create is no tie target for the
  # build around them (a probe's embedding must not stand in for the model's).
  with _thread_setting("stand_in_ties", enabled), \
      _thread_setting("built_variables", {} if enabled else _built_variables()):
    yield


class TieError(hyperparams.ParamsError):
  """A layer names a weight to tie to that its build does not hold (or of another
  shape)."""


# Observers notified around every layer call; `model_stats` uses this to attribute
# graph ops to layers. Each is (on_enter(layer), on_exit(layer, outputs)).
_CALL_OBSERVERS: list[tuple[Callable, Callable]] = []


def _module_name(name: str) -> str:
  """A valid tf.Module name (a Python identifier) for `name`."""
  cleaned = re.sub(r"\W", "_", name) or "layer"
  return cleaned if not cleaned[0].isdigit() else f"_{cleaned}"


class BaseLayer(hyperparams.Instantiable, tf.Module):
  """Base class of all layers."""

  # Whether layers of this class with equal params (name aside) may share one traced
  # function in a pipeline (pipeline/layer_function.py): true when fprop depends only
  # on the params, the variables (read as attributes), the inputs and the StepContext,
  # and draws its seeds through `seed_tensor`. A subclass keeping other per-instance
  # state that fprop reads sets it to False.
  shares_traces = True
  # Params that say nothing of what the layer computes or holds (where its weights were
  # saved from): layers differing only in them are one kind (`params_kind`).
  params_outside_kind: tuple[str, ...] = ()
  # How the layer treats the sequence axis of its inputs, for token slices
  # (core/token_slices.py): "tokenwise", "causal", or None (it may mix all positions;
  # a pipeline refuses num_token_slices > 1 over it).
  token_slicing: str | None = None

  @classmethod
  def Params(cls) -> InstantiableParams:  # noqa: N802
    p = super().Params()
    p.define("name", cls.__name__.lower(), "Name of this layer; its variables' scope.")
    p.define("dtype", tf.float32, "Dtype of the variables (the master weights), their "
             "gradients and optimizer slots; also of the computation unless fprop_dtype "
             "says otherwise.")
    p.define("fprop_dtype", None, "Compute dtype of fprop (mixed precision): "
             f"{[d.name for d in FPROP_DTYPES]}, or None to inherit the parent layer's "
             "(a root layer's: dtype). Variables stay `dtype` and are read cast to it; "
             "floating inputs are cast to it; the numerically sensitive parts stay "
             "float32 (see docs/mixed_precision.md).")
    p.define("params_init", weight_init(), "Default initializer of the weights.")
    p.define("random_seed", None,
             "Seed of this layer's initializers and dropout; None inherits the parent's.")
    return p

  def __init__(self, params: InstantiableParams):
    if not isinstance(params.name, str) or not re.match(r"[A-Za-z]", params.name):
      raise hyperparams.ParamsError(
          f"layer name {params.name!r} must start with a letter: it names the layer's "
          "scope and its variables (e.g. 'task', 'conv1')")
    stack = _layer_stack()
    parent = stack[-1] if stack else None
    if parent is None:
      _STATE.built_variables = {}
    super().__init__(params, name=_module_name(params.name))
    self._params = params
    self._parent_path = parent.path if parent is not None else ""
    if params.random_seed is not None:
      self._seed = int(params.random_seed)
    else:
      self._seed = parent._seed if parent is not None else 0
    self._fprop_dtype = resolve_fprop_dtype(
        params.fprop_dtype if params.fprop_dtype is not None else params.dtype, self.path)
    self._child_order: tuple[str, ...] = ()
    self._var_names: tuple[str, ...] = ()
    self._var_shapes: tuple[tuple[tuple[int, ...], bool], ...] = ()
    self._tied_names: tuple[str, ...] = ()
    self._stand_in_names: tuple[str, ...] = ()  # (under stand_in_ties)

  @property
  def params(self) -> InstantiableParams:
    return self._params

  @property
  def fprop_dtype(self) -> tf.DType:
    """The dtype this layer computes in (params.fprop_dtype, inherited; see Params)."""
    return self._fprop_dtype

  def to_fprop_dtype(self, value: Any) -> Any:
    """A floating variable or tensor read as this layer's compute dtype (the master
    weights stay float32; the cast's gradient reaches them in their own dtype);
    anything else as it is."""
    if isinstance(value, stacked_variables.RowVariable):
      value = value.value()
    if not isinstance(value, (tf.Tensor, tf.Variable)) or not value.dtype.is_floating \
        or value.dtype == self._fprop_dtype:
      return value
    return tf.cast(value, self._fprop_dtype)

  def _inherit(self, params: InstantiableParams, name: str) -> InstantiableParams:
    """A child's params: `params` renamed `name`, with this layer's compute dtype where
    they leave fprop_dtype to the parent (so a child's params say what it computes in,
    and layers of one kind compare equal only when they compute in the same dtype)."""
    return inherit_fprop_dtype(params, self._fprop_dtype).set(name=name)

  @property
  def path(self) -> str:
    """Slash-separated names from the root layer, e.g. 'task/body/conv1'."""
    return f"{self._parent_path}/{self.name}" if self._parent_path else self.name

  def seed_for(self, purpose: str) -> int:
    """A stable 31-bit seed for this layer and `purpose`, independent of build order."""
    return zlib.crc32(f"{self._seed}:{self.path}:{purpose}".encode()) & 0x7FFFFFFF

  # -- children ----------------------------------------------------------------

  @contextlib.contextmanager
  def _as_parent(self) -> Iterator[None]:
    """Layers built inside are this layer's children (their path and seed follow it)."""
    stack = _layer_stack()
    stack.append(self)
    try:
      yield
    finally:
      stack.pop()

  def create_child(self, name: str, params: InstantiableParams) -> BaseLayer:
    """Builds a child layer from `params` (renamed `name`) and tracks it as self.<name>."""
    if name in self._child_order or hasattr(self, name):
      raise hyperparams.ParamsError(f"{self.path}: child name {name!r} is already used")
    with self._as_parent():
      child = self._inherit(params, name).instantiate()
    setattr(self, name, child)
    self._child_order = self._child_order + (name,)
    return child

  def create_children(self, name: str, params_list: Sequence[InstantiableParams],
                      devices: Sequence[str | None] | None = None) -> list[BaseLayer]:
    """Builds one child per params and tracks the list as self.<name>.

    Children keep their params' names when those are unique; otherwise each gets
    its index appended (`conv_0`, `conv_1`, ...). `devices`, if given, is where each
    child's variables are created.
    """
    names = [_module_name(p.name or name) for p in params_list]
    if len(set(names)) != len(names):
      names = [f"{n}_{i}" for i, n in enumerate(names)]
    devices = list(devices) if devices is not None else [None] * len(params_list)
    children = []
    with self._as_parent():
      for child_name, p, device in zip(names, params_list, devices):
        # tf.device(None) would clear an enclosing device scope: the children of a
        # layer built under `with tf.device(d)` stay on d unless given their own.
        with tf.device(device) if device is not None else contextlib.nullcontext():
          children.append(self._inherit(p, child_name).instantiate())
    setattr(self, name, children)
    self._child_order = self._child_order + (name,)
    return getattr(self, name)

  def children(self) -> list[BaseLayer]:
    """Direct child layers in creation order (lists flattened)."""
    result = []
    for name in self._child_order:
      value = getattr(self, name)
      result.extend(value if isinstance(value, (list, tuple)) else [value])
    return result

  def stand_in_variables(self) -> list[tf.Variable]:
    """The variables this layer and those below it made under `stand_in_ties` for the
    weights they tie to another layer's (where it runs: a copy of that weight, which
    no optimizer slot goes with)."""
    return [getattr(layer, n) for layer in self.walk() for n in layer._stand_in_names]

  def walk(self) -> Iterator[BaseLayer]:
    """This layer and all layers below it, depth first, in creation order."""
    yield self
    for child in self.children():
      yield from child.walk()

  # -- variables ------------------------------------------------------------------

  def create_variable(self, name: str, shape: Sequence[int], init: Params | None = None,
                      dtype: tf.DType | None = None, trainable: bool = True,
                      make_initial: Callable[[], tf.Tensor] | None = None) -> tf.Variable:
    """Creates variable self.<name> of `shape`, drawn by `init` (default params_init),
    or by `make_initial` (a function returning a tensor of `shape`) when given.

    The initial value is a function of (layer seed, layer path, name) only, so two
    builds of the same params give the same weights whatever else is built (a
    `make_initial` must keep that promise: core/keras_layer.py seeds Keras's
    initializers so). Under a `tf.Graph` (see model_stats) nothing is allocated: only
    the graph is built.
    """
    if name in self._var_names or hasattr(self, name):
      raise hyperparams.ParamsError(f"{self.path}: variable name {name!r} is already used")
    init = init if init is not None else self.params.params_init
    dtype = dtype or self.params.dtype
    shape = [int(d) for d in shape]
    self._var_names = self._var_names + (name,)
    self._var_shapes = self._var_shapes + ((tuple(shape), trainable),)
    path = f"{self.path}/{name}"
    if getattr(_STATE, "shapes_only", False):
      var = VariableShape(path, tuple(shape), dtype, trainable)
    else:
      seed = (self.seed_for(name), 0)
      if make_initial is None:
        def make_initial() -> tf.Tensor:
          return initial_value(init, shape, dtype, seed)
      if (stacked_variables.deferring(path) and trainable
          and tf.as_dtype(dtype).is_floating):
        # A row of its cell's stacked variable, made by the pipeline once its cell is
        # built.
        var = stacked_variables.RowVariable(path, shape, dtype, trainable,
                                            initial_value=make_initial)
      else:
        var = tf.Variable(make_initial, trainable=trainable, name=path, dtype=dtype)
    setattr(self, name, var)
    _built_variables()[path] = var
    return var

  def tie_variable(self, name: str, to: str, shape: Sequence[int]) -> Any:
    """Makes self.<name> the variable another layer of this build created at path
    `to`, relative to the nearest enclosing layer that holds one there (e.g.
    'embedding/emb/emb' from a softmax inside the stack whose layer 'embedding' made
    it): one variable, read by both layers (in a pipeline, on whichever devices their
    cells run), its gradient the sum of both uses. It must exist already (its layer
    built first) and have `shape`. It is not this layer's own: not in
    `own_variables()`, not counted by `num_params()`. Under `stand_in_ties()` it is a
    new variable of `shape` instead (a layer built alone).

    Raises:
      TieError: no such variable, or one of another shape.
    """
    if name in self._var_names or name in self._tied_names or hasattr(self, name):
      raise hyperparams.ParamsError(f"{self.path}: variable name {name!r} is already used")
    built = _built_variables()
    parts = self.path.split("/")
    enclosing = ["/".join(parts[:n]) for n in range(len(parts) - 1, 0, -1)]
    if getattr(_STATE, "stand_in_ties", False):
      stand_in = self.create_variable(name, shape)
      self._stand_in_names = self._stand_in_names + (name,)
      return stand_in
    found = next((f"{a}/{to}" for a in enclosing if f"{a}/{to}" in built), None)
    if found is None:
      tried = ", ".join(f"{a}/{to}" for a in enclosing)
      raise TieError(f"{self.path}: cannot tie {name!r} to {to!r}: no variable built before "
                     f"it is at {tried}; the layer owning it must come first, and `to` is "
                     "its path below an enclosing layer (e.g. 'embedding/emb/emb')")
    var = built[found]
    if tuple(var.shape) != tuple(int(d) for d in shape):
      raise TieError(f"{self.path}: cannot tie {name!r} to {found}: its shape is "
                     f"{list(var.shape)}, this layer needs {list(shape)}")
    setattr(self, name, var)
    self._tied_names = self._tied_names + (name,)
    return var

  def own_variables(self) -> list[tf.Variable]:
    """Variables created by this layer itself (not its children)."""
    return [getattr(self, n) for n in self._var_names]

  def ties(self) -> list[tuple[str, Any]]:
    """(attribute name, variable) of each variable this layer ties to (`tie_variable`)."""
    return [(n, getattr(self, n)) for n in self._tied_names]

  def read_variables(self) -> list[Any]:
    """Every variable this layer itself reads: its own, then those it ties to
    (`tie_variable`), as its attributes hold them now."""
    return [getattr(self, n) for n in self._var_names + self._tied_names]

  def num_params(self) -> int:
    """Number of trainable weights in this layer and its children (from their shapes)."""
    return sum(math.prod(shape) for layer in self.walk()
               for shape, trainable in layer._var_shapes if trainable)

  # -- forward ------------------------------------------------------------------------

  # Layers use Python control flow on static values only; letting AutoGraph convert
  # them made tracing a 32-layer, 8-micro-batch pipeline take minutes.
  @tf.autograph.experimental.do_not_convert
  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    """Runs fprop in this layer's name scope; numpy array inputs become tensors, and
    floating inputs are cast to the layer's compute dtype (`fprop_dtype`)."""
    args = tf.nest.map_structure(
        lambda x: tf.convert_to_tensor(x) if isinstance(x, np.ndarray) else x, args)
    for on_enter, _ in _CALL_OBSERVERS:
      on_enter(self)
    args, kwargs = tf.nest.map_structure(self.to_fprop_dtype, (args, kwargs))
    with tf.name_scope(self.name):
      outputs = self.fprop(*args, **kwargs)
    for _, on_exit in _CALL_OBSERVERS:
      on_exit(self, outputs)
    return outputs

  def fprop(self, *args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError(f"{type(self).__name__} does not implement fprop")

  # -- statistics updated once per step (batch norm) ----------------------------------

  def report_stats(self, stats: Any) -> None:
    """Reports per-forward statistics (e.g. batch moments) for `update_from_stats`."""
    collected = current_context().layer_stats
    if collected is not None:
      collected.append((self, stats))

  def update_from_stats(self, stats_list: list[Any]) -> list[Any]:
    """Applies the statistics of one step (one entry per forward pass); returns ops."""
    return []


def call_with(layer: Callable[..., Any], inputs: Any) -> Any:
  """`layer` on `inputs`; a tuple is passed as positional arguments. The one rule by
  which layer stacks pass tuple outputs on (e.g. AmoebaNet's (previous,
  previous-previous)): Sequential, cells, the pipeline, tasks and the partitioner's
  cost probes all call their layers through it."""
  return layer(*inputs) if isinstance(inputs, tuple) else layer(inputs)


def apply_layer_stats(layer_stats: list[tuple[BaseLayer, Any]]) -> None:
  """Calls `update_from_stats` once per layer with everything it reported."""
  by_layer: dict[int, tuple[BaseLayer, list]] = {}
  for layer, stats in layer_stats:
    by_layer.setdefault(id(layer), (layer, []))[1].append(stats)
  for layer, stats_list in by_layer.values():
    layer.update_from_stats(stats_list)
