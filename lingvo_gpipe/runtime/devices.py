"""Local devices for cells: logical CPUs, local GPUs, or one GPU split into several.

`configure_devices(spec)` must run before TensorFlow initializes its devices (before
the first op); it returns the device names in order, one per pipeline cell slot. They
become `default_devices()`, where pipelines without explicit devices go (joining a
cluster sets them too: `cluster.connect_to_cluster`).

Specs:
  cpu        the one CPU device
  cpu:N      N logical CPU devices sharing the host (placement and memory tests)
  gpu        every local GPU
  gpu:N      GPU 0 split into N logical GPUs
  gpu:N:MB   GPU 0 split into N logical GPUs of MB megabytes each
"""

from __future__ import annotations

import re

import tensorflow as tf

_SPEC = re.compile(r"^(cpu|gpu)(?::(\d+))?(?::(\d+))?$")
VALID_SPECS = "cpu, cpu:N, gpu, gpu:N or gpu:N:MEMORY_MB (N >= 1)"


class DeviceSpecError(ValueError):
  """A device spec that cannot be parsed or satisfied."""


def parse_device_spec(spec: str) -> tuple[str, int | None, int | None]:
  """'cpu:4' → ('cpu', 4, None); raises DeviceSpecError naming the bad spec."""
  match = _SPEC.match(spec.strip().lower())
  if not match:
    raise DeviceSpecError(f"bad device spec {spec!r}; valid: {VALID_SPECS}")
  kind, count, memory_mb = match.group(1), match.group(2), match.group(3)
  count = int(count) if count is not None else None
  memory_mb = int(memory_mb) if memory_mb is not None else None
  if count is not None and count < 1:
    raise DeviceSpecError(f"bad device spec {spec!r}: N must be >= 1; valid: {VALID_SPECS}")
  if kind == "cpu" and memory_mb is not None:
    raise DeviceSpecError(f"bad device spec {spec!r}: CPU devices take no memory limit")
  return kind, count, memory_mb

_configured: list[str] = []
# Full device name → its incarnation, for devices of other processes (set when joining a
# cluster): a Send to another process must name the sending device's real incarnation.
_incarnations: dict[str, int] = {}


def set_device_incarnations(incarnations: dict[str, int]) -> None:
  """Records the incarnations of remote devices (`runtime.cluster.connect_to_cluster`)."""
  _incarnations.update(incarnations)


def device_incarnation(full_name: str) -> int | None:
  """The recorded incarnation of a device named in full (/job:…/device:…), or None."""
  return _incarnations.get(full_name)


def set_default_devices(devices: list[str]) -> None:
  """Makes `devices` the default_devices() (one per cell slot, in order)."""
  _configured[:] = devices


def default_devices() -> list[str]:
  """The devices of the last `configure_devices`, else all logical GPUs, else CPUs."""
  if _configured:
    return list(_configured)
  gpus = tf.config.list_logical_devices("GPU")
  return [d.name for d in (gpus or tf.config.list_logical_devices("CPU"))]


def available_devices() -> list[str]:
  """Every logical device this process can place ops on (a cluster's remote ones too)."""
  return [d.name for d in tf.config.list_logical_devices()]


_DEVICE_FIELDS = ("job", "replica", "task", "device_type", "device_index")


def known_device(name: str) -> bool:
  """Whether `name` ('/cpu:1', '/job:worker/task:0/device:CPU:0', ...) matches a logical
  device of this process: every field it sets equals that device's."""
  try:
    wanted = tf.DeviceSpec.from_string(name)
  except ValueError:
    return False
  for device in available_devices():
    have = tf.DeviceSpec.from_string(device)
    if all(getattr(wanted, f) in (None, getattr(have, f)) for f in _DEVICE_FIELDS):
      return True
  return False


def configure_devices(spec: str) -> list[str]:
  """Sets up the devices `spec` asks for and returns their names, in order.

  They become `default_devices()`, where pipelines without explicit devices go.
  """
  _configured[:] = _configure(spec)
  return list(_configured)


def _configure(spec: str) -> list[str]:
  kind, count, memory_mb = parse_device_spec(spec)
  physical = tf.config.list_physical_devices(kind.upper())
  if not physical:
    raise DeviceSpecError(f"device spec {spec!r} asks for {kind.upper()} but none is present")
  if kind == "gpu" and count is None:
    return [d.name for d in tf.config.list_logical_devices("GPU")]
  wanted = count or 1
  if kind == "cpu":
    configs = [tf.config.LogicalDeviceConfiguration() for _ in range(wanted)]
  else:
    configs = [tf.config.LogicalDeviceConfiguration(memory_limit=memory_mb)
               for _ in range(wanted)]
  current = tf.config.get_logical_device_configuration(physical[0])
  if current is None or len(current) != wanted:
    try:
      tf.config.set_logical_device_configuration(physical[0], configs)
    except RuntimeError as e:
      have = len(tf.config.list_logical_devices(kind.upper()))
      raise DeviceSpecError(
          f"cannot set up {spec!r}: TensorFlow already initialized {have} {kind.upper()} "
          "device(s); configure devices before running any op") from e
  return [d.name for d in tf.config.list_logical_devices(kind.upper())][:wanted]



def host_of(device: str | None) -> str:
  """The CPU of the host that runs `device` ('/job:w/task:1/device:GPU:0' →
  '/job:w/task:1/device:CPU:0'; a local device or None → '/device:CPU:0')."""
  spec = tf.DeviceSpec.from_string(device or "")
  return spec.replace(device_type="CPU", device_index=0).to_string()
