"""Moved to `lingvo_gpipe/runtime/` (devices, cluster, watchdog, local_workers,
memory_log); this module re-exports their names so that existing imports keep working."""

from lingvo_gpipe.runtime.cluster import (
                                          VALID_CLUSTER_SPEC,
                                          cluster_spec_from_tf_config,
                                          connect_to_cluster,
                                          exposure_warning,
                                          free_port,
                                          parse_cluster_spec,
                                          task_address,
                                          wait_for_servers,
                                          worker_status,
)
from lingvo_gpipe.runtime.devices import (
                                          VALID_SPECS,
                                          DeviceSpecError,
                                          configure_devices,
                                          default_devices,
                                          parse_device_spec,
                                          set_default_devices,
)
from lingvo_gpipe.runtime.local_workers import (
                                          local_cluster,
                                          start_local_worker,
                                          start_local_workers,
)
from lingvo_gpipe.runtime.memory_log import log_device_memory, memory_log_path, read_memory_log
from lingvo_gpipe.runtime.watchdog import WorkerWatchdog

__all__ = [
    "VALID_CLUSTER_SPEC", "VALID_SPECS", "DeviceSpecError", "WorkerWatchdog",
    "cluster_spec_from_tf_config", "configure_devices", "connect_to_cluster",
    "default_devices", "exposure_warning", "free_port", "local_cluster", "log_device_memory",
    "memory_log_path", "parse_cluster_spec", "parse_device_spec", "read_memory_log",
    "set_default_devices", "start_local_worker", "start_local_workers", "task_address",
    "wait_for_servers", "worker_status",
]
