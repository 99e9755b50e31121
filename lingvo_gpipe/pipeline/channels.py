"""Hand-offs between neighbouring cells: Send/Recv pairs inside the cells' loops.

Each pipeline link (cell k → cell k+1) has two directions: `forward` carries cell k's
outputs of one micro-batch, `backward` carries cell k+1's gradients of its inputs.
A direction is a `Channel`: one rendezvous name per flat tensor of a hand-off, full
device names on both ends. Sends and receives of one name are matched first in, first
out within a step (`tf_internals.send` / `recv`), so both ends must list a link's
transfers in the same order; `schedule.PipelineSchedule` refuses a schedule where they
do not, naming the link.

Names are unique per pipeline (`channel_prefix`), so several pipelines (hybrid
replicas) can share devices and a step.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import tensorflow as tf

from lingvo_gpipe.core import tf_internals
from lingvo_gpipe.runtime.devices import DeviceSpecError, device_incarnation

_PIPELINE_IDS = itertools.count()


def channel_prefix(path: str) -> str:
  """A name prefix no other pipeline of this process has."""
  return f"{path}#{next(_PIPELINE_IDS)}"


def full_device_name(device: str) -> str:
  """/job:J/replica:R/task:T/device:TYPE:N for `device` (a local device's job, replica
  and task are this process's own): the form a rendezvous key needs."""
  spec = tf.DeviceSpec.from_string(device)
  if spec.device_type is None:
    raise DeviceSpecError(f"a pipeline cell's device must name a device type and index, "
                          f"got {device!r}")
  local = tf.DeviceSpec.from_string(tf_internals.host_address_space())
  spec = spec.make_merged_spec(local) if spec.job is None else spec
  return tf.DeviceSpec(job=spec.job, replica=spec.replica or 0, task=spec.task or 0,
                       device_type=spec.device_type,
                       device_index=spec.device_index or 0).to_string()


def incarnation(full_name: str) -> int:
  """The sending device's incarnation: 0 for this process's devices; a remote device's
  is recorded when the cluster is joined (a wrong one fails every receive)."""
  local = tf_internals.host_address_space()
  if full_name.startswith(local + "/"):
    return 0
  known = device_incarnation(full_name)
  if known is None:
    raise DeviceSpecError(f"no incarnation known for {full_name}: a remote device's is "
                          "recorded by runtime.cluster.connect_to_cluster")
  return known


@dataclasses.dataclass(frozen=True)
class Channel:
  """One direction of one link: `sender` hands tensors to `receiver` (full names)."""
  name: str
  sender: str
  receiver: str

  def send(self, tensors: Sequence[tf.Tensor]) -> list[tf.Operation]:
    """Send ops for one hand-off (run on the sender's device)."""
    sender_incarnation = incarnation(self.sender)
    return [tf_internals.send(t, f"{self.name}/{i}", self.sender, sender_incarnation,
                              self.receiver) for i, t in enumerate(tensors)]

  def receive(self, specs: Sequence[tf.TensorSpec]) -> list[tf.Tensor]:
    """The tensors of one hand-off, shaped as `specs` (run on the receiver's device)."""
    sender_incarnation = incarnation(self.sender)
    return [tf_internals.recv(spec, f"{self.name}/{i}", self.sender, sender_incarnation,
                              self.receiver) for i, spec in enumerate(specs)]


@dataclasses.dataclass(frozen=True)
class Link:
  """Cells k and k+1 of one pipeline: activations forward, their gradients back."""
  forward: Channel
  backward: Channel


def links(prefix: str, devices: Sequence[str]) -> list[Link]:
  """links[k] joins cell k (on devices[k]) and cell k+1."""
  full = [full_device_name(d) for d in devices]
  return [Link(Channel(f"{prefix}/{k}to{k + 1}/forward", full[k], full[k + 1]),
               Channel(f"{prefix}/{k + 1}to{k}/backward", full[k + 1], full[k]))
          for k in range(len(devices) - 1)]
