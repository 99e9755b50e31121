"""Hybrid data + pipeline parallelism: R replicas of one pipeline, gradients all-reduced.

Replica r is a PipeliningLayer over the same layer params, with its K cells on
devices[r·K:(r+1)·K]; built from the same params, every replica starts with the same
weights (initializers are seeded by layer path, not by build order). A training step:

  batch [R·B, ...] → R shards [B, ...], shard r through replica r (M micro-batches,
  examples offset by r·B so dropout draws what one pipeline on the whole batch would)
  → per-replica loss and gradients → each variable's gradient, weighted by its
  replica's loss weight (examples, or an LM's non-padding tokens), averaged over the R
  copies of that variable with TensorFlow's collective all-reduce (one group per cell
  position k: the R devices holding cell k) → every replica applies the same update.

The weighted mean is the gradient of the whole batch's weighted mean loss, so R
replicas of (K cells, M micro-batches) train exactly like one pipeline of K cells over
R·M micro-batches of the R-times larger batch (tested).

Batch statistics (batch norm) are shared the same way: each replica's layer is
updated with the statistics every replica reported (`apply_layer_stats`).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from lingvo_gpipe.core import base_layer
from lingvo_gpipe.core.hyperparams import Params, ParamsError
from lingvo_gpipe.pipeline.layer import PipeliningLayer, requested_cells
from lingvo_gpipe.runtime.devices import default_devices


class HybridError(ParamsError):
  pass


# A group key names one set of devices for the whole process.
_GROUP_KEYS = itertools.count(1)


class CollectiveMean:
  """Mean of one tensor per device over a fixed group of devices (an all-reduce).

  Each device's all-reduce op takes an ordering token: a resource on that device.
  Without one, tf.function's automatic control dependencies chain the group's
  stateful collective ops in program order across devices, so the op on the second
  device waits for the first one to finish, which waits for its peer: a deadlock.
  With the token they are ordered per device only, and every device issues them in
  the same order (`tests/hybrid_test.py` runs them on logical CPU devices;
  `tf_internals.py` item 7 lists the op and the ordering behaviour, with their pins).
  """

  def __init__(self, devices: Sequence[str], group_key: int):
    self.devices = list(devices)
    self.group_key = group_key
    self._tokens = []
    for device in self.devices:
      with tf.init_scope(), tf.device(device):
        self._tokens.append(tf.Variable(0.0, trainable=False, name="ordering_token"))

  def __call__(self, tensors: Sequence[tf.Tensor], instance_key: int) -> list[tf.Tensor]:
    """tensors[i] on devices[i], all of one shape → their mean, once on each device.

    `instance_key` names this all-reduce within the group; it must differ between the
    all-reduces of one step.
    """
    if len(tensors) != len(self.devices):
      raise HybridError(f"{len(tensors)} tensors for a group of {len(self.devices)} devices")
    if len(self.devices) == 1:
      return list(tensors)
    results = []
    for tensor, device, token in zip(tensors, self.devices, self._tokens):
      with tf.device(device):
        results.append(tf.raw_ops.CollectiveReduceV2(
            input=tf.convert_to_tensor(tensor), group_size=len(self.devices),
            group_key=self.group_key, instance_key=instance_key,
            ordering_token=[token.handle], merge_op="Add", final_op="Div"))
    return results


class GradientAllReduce:
  """Averages the gradients of R copies of the same variables, each on its own device.

  variables[r][i] is replica r's copy of variable i. The copies of variable i form an
  all-reduce group with the devices they live on; variables on the same devices share
  one group (for a pipeline: one group per cell position, the R devices of cell k).
  """

  def __init__(self, variables: Sequence[Sequence[tf.Variable]]):
    self.num_replicas = len(variables)
    counts = {len(v) for v in variables}
    if len(counts) != 1:
      raise HybridError(f"replicas hold different numbers of variables: {sorted(counts)}")
    groups: dict[tuple[str, ...], CollectiveMean] = {}
    self._group_of_variable = []
    self._calls = itertools.count()
    for copies in zip(*variables):
      devices = tuple(v.device for v in copies)
      if len(set(devices)) != len(devices):
        raise HybridError(f"the copies of {copies[0].name} share a device: {devices}")
      if devices not in groups:
        groups[devices] = CollectiveMean(devices, group_key=next(_GROUP_KEYS))
      self._group_of_variable.append(groups[devices])

  def __call__(self, grads: Sequence[Sequence[tf.Tensor]]) -> list[list[tf.Tensor]]:
    """grads[r][i]: the gradient of variables[r][i] → the mean over r, on each device."""
    if len(grads) != self.num_replicas:
      raise HybridError(f"gradients of {len(grads)} replicas for {self.num_replicas}")
    reduced: list[list[tf.Tensor]] = [[] for _ in grads]
    # Keys no other all-reduce of this process's traces uses: two steps traced into one
    # function (task.train.steps_per_call) must not share one.
    first_key = next(self._calls) * len(self._group_of_variable) + 1
    for i, group in enumerate(self._group_of_variable):
      for r, mean in enumerate(group([tf.convert_to_tensor(g[i]) for g in grads],
                                     instance_key=first_key + i)):
        reduced[r].append(mean)
    return reduced


class Replicas:
  """R copies of one layer (a pipeline, or a whole task around one), trained as one.

  The copies must be built from the same params (so they start equal) with their
  variables on disjoint devices; replica r's inputs go to `input_devices[r]`. Use one
  optimizer per replica (slots are keyed by variable name, the same in every copy).
  A checkpoint needs replica 0 only: `copy_from_first` makes the others equal again.
  """

  def __init__(self, replicas: Sequence[base_layer.BaseLayer],
               input_devices: Sequence[str | None]):
    if not replicas:
      raise HybridError("no replicas")
    self.replicas = list(replicas)
    self.input_devices = list(input_devices)
    self.num_replicas = len(self.replicas)
    # Listed once: a layer makes its variables when built, and tf.Module's walk of a
    # deep model takes seconds.
    self._trainable = [list(rep.trainable_variables) for rep in self.replicas]
    self._all_reduce = GradientAllReduce(self.trainable_variables) \
        if self.num_replicas > 1 else None

  @property
  def trainable_variables(self) -> list[list[tf.Variable]]:
    """Per replica, its trainable variables (the same order in every replica)."""
    return [list(variables) for variables in self._trainable]

  def shard(self, batch: Any) -> list[Any]:
    """Splits every tensor of a nested batch [R·B, ...] into R shards [B, ...], shard r
    on replica r's input device."""
    if self.num_replicas == 1:
      return [batch]
    flat = tf.nest.flatten(batch)
    size = flat[0].shape[0]
    if size is None or size % self.num_replicas:
      raise HybridError(f"the batch size ({size}) must be static and divisible by "
                        f"num_replicas ({self.num_replicas})")
    part = size // self.num_replicas
    shards = []
    for r, device in enumerate(self.input_devices):
      with tf.device(device):
        shards.append(tf.nest.pack_sequence_as(
            batch, [t[r * part:(r + 1) * part] for t in flat]))
    return shards

  def replica_context(self, replica: int, shard: Any):
    """The StepContext of replica `replica` on `shard`: its examples are numbered from
    replica·B on, as in the whole batch (dropout masks are drawn by example position)."""
    ctx = base_layer.current_context()
    shard_size = tf.nest.flatten(shard)[0].shape[0]
    return base_layer.step_context(example_offset=ctx.example_offset + replica * shard_size)

  def call(self, replica: int, *inputs: Any) -> Any:
    """Replica `replica` on its shard (see replica_context)."""
    with self.replica_context(replica, inputs):
      return self.replicas[replica](*inputs)

  def all_reduce_gradients(self, grads: Sequence[Sequence[tf.Tensor]],
                           loss_weights: Sequence[tf.Tensor] | None = None
                           ) -> list[list[tf.Tensor]]:
    """grads[r][i]: replica r's gradient of its variable i → the whole batch's, on each
    replica's device (same structure). Each replica's gradient is of its own weighted
    mean loss; the whole batch's weights them by `loss_weights` (one scalar per
    replica: the weight of its loss, e.g. its non-padding tokens): Σ w_r g_r / Σ w_r,
    made as the all-reduce's mean of (R · w_r / Σ w) g_r. Without weights, or where
    they are equal (as examples are), the plain mean."""
    if self._all_reduce is None:
      return [list(g) for g in grads]
    if loss_weights is not None:
      weights = [tf.cast(w, tf.float32) for w in loss_weights]
      total = tf.add_n(weights)
      scaled = []
      for g_r, w_r in zip(grads, weights):
        factor = tf.math.divide_no_nan(self.num_replicas * w_r, total)
        row = []
        for g in g_r:
          with tf.device(g.device):  # where the gradient is: only the scalar travels
            row.append(g * tf.cast(factor, g.dtype))
        scaled.append(row)
      grads = scaled
    return self._all_reduce(grads)

  def apply_layer_stats(self, layer_stats: list[tuple[base_layer.BaseLayer, Any]]) -> None:
    """Updates each replica's layers with the statistics all replicas reported, so that
    batch-norm moving averages stay equal across replicas (and equal one pipeline's)."""
    position = {id(layer): n for rep in self.replicas for n, layer in enumerate(rep.walk())}
    by_position: dict[int, list[Any]] = {}
    for layer, stats in layer_stats:
      by_position.setdefault(position[id(layer)], []).append(stats)
    for rep in self.replicas:
      for n, layer in enumerate(rep.walk()):
        if n in by_position:
          layer.update_from_stats(by_position[n])

  def copy_from_first(self, optimizers: Sequence[Any] = ()) -> None:
    """Makes every replica's variables, and the slots of `optimizers[r]` (one per
    replica, if given), equal replica 0's (after restoring replica 0)."""
    first = self.replicas[0]
    for r in range(1, self.num_replicas):
      for src, dst in zip(first.variables, self.replicas[r].variables):
        dst.assign(src)
      if optimizers:
        for src, dst in zip(first.trainable_variables, self.replicas[r].trainable_variables):
          for name, slot in optimizers[r].slots_of(dst).items():
            slot.assign(optimizers[0].slots_of(src)[name])


def replica_device_slices(num_replicas: int, num_cells: int,
                          devices: Sequence[str]) -> list[list[str]]:
  """devices[r·K:(r+1)·K] for each replica r; a clear error when there are too few."""
  if num_replicas < 1:
    raise HybridError(f"num_replicas must be >= 1, got {num_replicas}")
  devices = list(devices)
  if num_replicas * num_cells > len(devices):
    raise HybridError(
        f"{num_replicas} replicas × {num_cells} cells need {num_replicas * num_cells} "
        f"devices; {len(devices)} given ({devices})")
  return [devices[r * num_cells:(r + 1) * num_cells] for r in range(num_replicas)]


def replica_devices(pipeline: Params, num_replicas: int, devices: Sequence[str]
                    ) -> list[list[str]]:
  """Each replica's devices for pipeline params `pipeline`: one per cell, or per V
  cells (interleaved virtual stages); HybridError when there are too few."""
  per_replica = max(1, (requested_cells(pipeline) or 1) // pipeline.virtual_stages)
  return replica_device_slices(num_replicas, per_replica, devices)


def replicate(params: Params, num_replicas: int, pipeline_key: str = "",
              devices: Sequence[str] | None = None) -> list[Any]:
  """R instances of `params`, replica r's K cells on devices[r·K:(r+1)·K] (on
  devices[r·D:(r+1)·D], D = K/V, with V virtual stages).

  pipeline_key: where the pipeline's params sit in `params` ('' when `params` are
  PipeliningLayer's own, 'pipeline' for a task's); devices: all R·K devices (default:
  the pipeline params' devices, else the ones set up by --devices). Built from the same
  params, the replicas start with the same weights.
  """
  pipeline = getattr(params, pipeline_key) if pipeline_key else params
  slices = replica_devices(pipeline, num_replicas,
                           devices or pipeline.devices or default_devices())
  key = f"{pipeline_key}.devices" if pipeline_key else "devices"
  return [params.copy().set(**{key: d}).freeze().instantiate() for d in slices]


class ReplicatedPipeline(Replicas):
  """R replicas × K cells of one PipeliningLayer (see the module docstring)."""

  def __init__(self, pipeline_params: Params, num_replicas: int,
               devices: Sequence[str] | None = None):
    replicas: list[PipeliningLayer] = replicate(pipeline_params, num_replicas,
                                                devices=devices)
    super().__init__(replicas, [rep.cell_devices[0] for rep in replicas])

  def fprop(self, replica: int, *inputs: Any) -> Any:
    return self.call(replica, *inputs)
