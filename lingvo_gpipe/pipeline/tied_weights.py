"""A weight read by cells on two devices (a softmax tied to the embedding table).

The variable lives with the layer that made it (the embedding, on the first cell's
device). A cell on another device cannot capture it in its loop: the loop runs on
that device, and TensorFlow places an op taking a variable's handle with the
variable ("a reference or resource edge connects colocation groups with
incompatible assigned devices"). So each such cell reads a copy on its own device:

  before the devices' loops, once per step: copy ← variable  (one transfer of V·D);
  in the loop: the cell reads the copy, and its backward adds the copy's gradient
    into the cell's running sums, as for any weight it reads;
  after the loops: the copy's summed gradient is added to the variable's, on the
    variable's device (one transfer of V·D), and the optimizer updates the variable.

The copy is not checkpointed, not in the optimizer nor in any module's variables (it
is trainable only so that the reading cell's tape watches it): one variable,
one checkpoint key, one update. It holds V·D values on its device for the run, what a
Megatron-style copy holds; instead of all-reducing two copies' gradients and updating
both, the variable's value travels to the copy and the copy's gradient back, once per
step each. Only the training step's device loops read the copies: eval, serving,
decoding and the fprop differentiated by TensorFlow read the variable itself (their
ops, loops included, are placed with it).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import tensorflow as tf

from lingvo_gpipe.core.base_layer import BaseLayer, VariableShape
from lingvo_gpipe.pipeline import device_loop


@dataclasses.dataclass(frozen=True)
class TiedCopy:
  """`layer.<name>` is tied to `variable` (on another device); `copy` is its copy on
  `device`, where the layer's cell runs."""
  layer: BaseLayer
  name: str
  variable: tf.Variable
  copy: tf.Variable
  device: str


def _same_device(a: str, b: str) -> bool:
  """Whether device names `a` and `b` name one device: every field both give agrees
  (a cell's '/device:CPU:0' is a variable's '/job:localhost/.../device:CPU:0')."""
  sa, sb = tf.DeviceSpec.from_string(a or ""), tf.DeviceSpec.from_string(b or "")
  return all(x is None or y is None or x == y
             for x, y in ((sa.job, sb.job), (sa.replica, sb.replica), (sa.task, sb.task),
                          (sa.device_type, sb.device_type),
                          (sa.device_index, sb.device_index)))


def make_copies(cells: Sequence[Sequence[BaseLayer]], devices: Sequence[str]
                ) -> list[TiedCopy]:
  """A copy on cell k's device of each weight cell k's layers tie to that lives on
  another device (one copy per variable and device)."""
  copies: list[TiedCopy] = []
  made: dict[tuple, tf.Variable] = {}
  for layers, device in zip(cells, devices):
    for layer in (sub for top in layers for sub in top.walk()):
      for name, variable in layer.ties():
        if isinstance(variable, VariableShape) or _same_device(variable.device, device):
          continue  # (a shapes-only build has nothing to copy)
        if not isinstance(variable, tf.Variable):
          raise ValueError(
              f"{layer.path}.{name} ties to {variable.name}, a row of another cell's "
              "stacked variable, which only that cell's bodies read; tie through a "
              "`tie_to` param (the pipeline keeps those targets whole) or set "
              "stack_variables=False")
        key = (variable.ref(), device)
        if key not in made:
          with tf.device(device):
            # Trainable as its variable (so that the cell's tape watches it, or, frozen,
            # does not); no optimizer, checkpoint or module's variable list sees it (it
            # is held here only).
            made[key] = tf.Variable(variable.read_value(), trainable=variable.trainable,
                                    name=f"{variable.name.split(':')[0]}/copy")
        copies.append(TiedCopy(layer, name, variable, made[key], device))
  return copies


def refresh(copies: Sequence[TiedCopy]) -> list[Any]:
  """Assigns each copy its variable's value, on the copy's device: the ops, run before
  the loops read the copies (automatic control dependencies order them)."""
  done: set = set()
  ops = []
  for c in copies:
    if c.copy.ref() in done:
      continue
    done.add(c.copy.ref())
    with tf.device(c.device):
      ops.append(c.copy.assign(c.variable.read_value()))
  return ops


@contextlib.contextmanager
def read_as_copies(copies: Sequence[TiedCopy]) -> Iterator[None]:
  """Within, each tying layer reads its copy (the cell bodies traced inside capture the
  copy, on their own device); restored on exit. Set past tf.Module's tracking."""
  originals = [(c.layer, c.name, getattr(c.layer, c.name)) for c in copies]
  for c in copies:
    object.__setattr__(c.layer, c.name, c.copy)
  try:
    yield
  finally:
    for layer, name, original in originals:
      object.__setattr__(layer, name, original)


def onto_variables(variables: Sequence[Any], gradients: Sequence[tf.Tensor],
                   copies: Sequence[TiedCopy]) -> tuple[list[Any], list[tf.Tensor]]:
  """A step's (variables, gradients) with each copy's gradient added to its variable's,
  on the variable's device (the copy itself leaves the list)."""
  master = {c.copy.ref(): c.variable for c in copies}
  return device_loop.summed_per_variable(
      (master.get(v.ref(), v), g) for v, g in zip(variables, gradients))
