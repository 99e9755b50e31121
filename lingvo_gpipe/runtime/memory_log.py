"""A worker's device memory as JSON lines (tools/worker.py --memory_log), and reading it."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import tensorflow as tf


def memory_log_path(directory: str, task: int) -> str:
  return str(Path(directory) / f"worker_{task}_memory.jsonl")


def log_device_memory(path: str, device: str, interval_s: float = 0.5,
                      stop: threading.Event | None = None) -> None:
  """Appends `device`'s allocator counts to `path`, one JSON line per change:
  {"time": unix seconds, "device": ..., "bytes_in_use": ..., "peak_bytes_in_use": ...}.

  The peak is since the process started: every tensor this worker ever held at once
  (weights, optimizer slots, activations, gradients, transfer buffers), not the
  program or runtime. CPU devices keep these counts only with TensorFlow's BFC
  allocator (TF_CPU_ALLOCATOR_USE_BFC=true before TensorFlow starts; the allocator
  GPUs use); GPUs always do. Runs until `stop` is set.
  """
  stop = stop or threading.Event()
  last = None
  while True:
    info = tf.config.experimental.get_memory_info(device)
    counts = (info["current"], info["peak"])
    if counts != last:
      record = {"time": round(time.time(), 3), "device": device,
                "bytes_in_use": counts[0], "peak_bytes_in_use": counts[1]}
      with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
      last = counts
    if stop.wait(interval_s):
      return


def read_memory_log(path: str) -> dict:
  """The last record `log_device_memory` wrote to `path`."""
  lines = Path(path).read_text().splitlines()
  if not lines:
    raise ValueError(f"{path} holds no memory record yet")
  return json.loads(lines[-1])
