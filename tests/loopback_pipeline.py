"""Run by loopback_test.py in its own process (joining a cluster changes TF's context).

Starts two tools/worker.py servers on loopback, places a pipeline on them with each
schedule (two cells; interleaved and zbv: four, two per worker) and a causal LM on token
slices, and prints one JSON line: the
largest relative difference between its loss and gradients and those of the same
layers run unpartitioned in this process (also with fprop_dtype='bfloat16': bfloat16
hand-offs between the processes), and worker 1's device memory
(tools/worker.py --memory_log) before and after a 4 MiB variable
is created there.
"""

import gc
import json
import os
import tempfile
import time

from numerics import relative_difference

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def main() -> None:
  from lingvo_gpipe.runtime.local_workers import local_cluster
  from lingvo_gpipe.runtime.memory_log import memory_log_path

  log_dir = tempfile.mkdtemp(prefix="loopback_memory_")
  with local_cluster(2, single_thread=False, memory_log_dir=log_dir) as (devices, _):
    import numpy as np
    import tensorflow as tf

    from lingvo_gpipe import train_step
    from lingvo_gpipe.core import base_layer, layers, stacked_variables
    from lingvo_gpipe.pipeline import layer as gpipe

    stack = [layers.Linear.Params().set(name=f"fc{i}", input_dim=16, output_dim=16,
                                        activation="TANH") for i in range(4)]
    stack.insert(2, layers.Dropout.Params().set(name="drop", keep_prob=0.7))
    x = tf.constant(np.random.RandomState(0).randn(10, 16), tf.float32)

    def head(outputs, _):
      per_example = tf.reduce_sum(tf.square(tf.cast(outputs, tf.float32)), axis=-1)
      return {"loss": (tf.reduce_mean(per_example), tf.cast(tf.size(per_example), tf.float32))}

    def unpartitioned(dtype):
      local = layers.Sequential.Params().set(name="s", layers=stack, random_seed=3,
                                             fprop_dtype=dtype).instantiate()
      with tf.GradientTape() as tape:
        with base_layer.step_context(training=True, step=tf.constant(4, tf.int64)):
          loss = head(local(x), None)["loss"][0]
      return [loss.numpy()] + [g.numpy() for g in tape.gradient(loss,
                                                                local.trainable_variables)]

    wants = {"float32": unpartitioned("float32"), "bfloat16": unpartitioned("bfloat16")}
    worst = {}
    # (interleaved last: the report names the devices of the last pipeline built)
    for schedule in ("gpipe", "1f1b", "1f1b/bfloat16", "zb_h1", "zbv", "interleaved_1f1b"):
      schedule, _, dtype = schedule.partition("/")
      interleaved = schedule in ("interleaved_1f1b", "zbv")  # 4 cells, 2 on each worker
      remote = gpipe.PipeliningLayer.Params().set(
          name="s", layers=stack, random_seed=3, num_cells=4 if interleaved else 2,
          virtual_stages=2 if interleaved else 1, num_micro_batches=4,
          devices=devices, schedule=schedule, fprop_dtype=dtype or "float32").instantiate()
      want = wants[dtype or "float32"]

      @tf.function
      def run(model=remote):
        with base_layer.step_context(training=True, step=tf.constant(4, tf.int64)):
          metrics, grads = train_step.loss_and_gradients(
              train_step.StackWithLoss(model, head), {"inputs": x},
              stacked_variables.trainable_weights(model))
        return metrics["loss"][0], grads

      loss, grads = run()
      got = [loss.numpy()] + [g.numpy() for g in grads]
      worst[f"{schedule}/{dtype}" if dtype else schedule] = max(
          relative_difference(g, w) for g, w in zip(got, want))
    worst["1f1b/token_slices"] = token_slices_difference(devices)
    # Worker 1's memory log sees a 4 MiB variable created there.
    log = memory_log_path(log_dir, 1)
    gc.collect()  # remote tensors of the models above, freed now rather than between reads
    before = settled_record(log, lambda _: True)
    with tf.device(devices[1]):
      block = tf.Variable(tf.zeros([1024, 1024]))
    block_bytes = int(tf.size(block)) * 4
    after = settled_record(
        log, lambda r: r["bytes_in_use"] - before["bytes_in_use"] >= block_bytes)
    print(json.dumps({"devices": remote.cell_devices, "variable_devices":
                      [v.device for v in stacked_variables.trainable_weights(remote)],
                      "max_relative_difference": worst,
                      "memory_before": before, "memory_after": after,
                      "block_bytes": block_bytes}))


def settled_record(log: str, wanted, stable_s: float = 1.5, deadline_s: float = 60.0) -> dict:
  """The memory log's last record once it is `wanted` and has not changed for `stable_s`
  (three of the worker's 0.5 s polls: what was being freed or allocated is done), or
  the last record at the deadline (the caller's bounds then fail, naming it). Polled, not
  slept for a fixed time: the worker's process may be starved on a loaded machine."""
  from lingvo_gpipe.runtime.memory_log import read_memory_log

  end = time.monotonic() + deadline_s
  record, since = read_memory_log(log), time.monotonic()
  while time.monotonic() < end:
    time.sleep(0.1)
    latest = read_memory_log(log)
    if latest != record:
      record, since = latest, time.monotonic()
    elif wanted(record) and time.monotonic() - since >= stable_s:
      break
  return record


def token_slices_difference(devices) -> float:
  """A causal LM (dropout on) on both workers, K=2, M=2, S=2 token slices (each worker
  keeps its cells' caches), against the same layers unpartitioned here: the largest
  relative difference of the loss and the gradients (the keys' bias, 0 analytically,
  at its weight's scale)."""
  import numpy as np
  import tensorflow as tf

  from lingvo_gpipe import train_step
  from lingvo_gpipe.core import base_layer, layers, stacked_variables
  from lingvo_gpipe.models import transformer
  from lingvo_gpipe.pipeline import layer as gpipe
  from lingvo_gpipe.tasks.language_model import token_metrics

  stack = transformer.lm_stack(11, 8, 16, 2, 2, residual_keep_prob=0.8, atten_keep_prob=0.9,
                               relu_keep_prob=0.9).layers
  rng = np.random.RandomState(1)
  data = {"labels": tf.constant(rng.randint(0, 11, [4, 8]), tf.int32),
          "paddings": tf.zeros([4, 8])}
  ids = tf.constant(rng.randint(0, 11, [4, 8]), tf.int32)

  def head(logits, head_inputs):
    return token_metrics(logits, head_inputs["labels"], head_inputs["paddings"])

  local = layers.Sequential.Params().set(name="lm", layers=stack, random_seed=3).instantiate()
  with tf.GradientTape() as tape:
    with base_layer.step_context(training=True, step=tf.constant(4, tf.int64)):
      loss = head(local(ids, data["paddings"]), data)["loss"][0]
  want = [loss.numpy()] + [tf.convert_to_tensor(g).numpy()
                           for g in tape.gradient(loss, local.trainable_variables)]
  names = ["loss"] + [v.name for v in local.trainable_variables]
  remote = gpipe.PipeliningLayer.Params().set(
      name="lm", layers=stack, random_seed=3, num_cells=2, num_micro_batches=2,
      num_token_slices=2, schedule="1f1b", devices=devices).instantiate()

  @tf.function
  def run():
    with base_layer.step_context(training=True, step=tf.constant(4, tf.int64)):
      metrics, grads = train_step.loss_and_gradients(
          train_step.StackWithLoss(remote, head),
          {"inputs": (ids, data["paddings"]), **data},
          stacked_variables.trainable_weights(remote))
    return metrics["loss"][0], grads

  loss, grads = run()
  got = [loss.numpy()] + [g.numpy() for g in grads]
  scale = {name: float(np.abs(w).max()) for name, w in zip(names, want)}
  worst = 0.0
  for name, g, w in zip(names, got, want):
    of = scale[name.replace("/key/b:0", "/key/w:0")] if name.endswith("/key/b:0") else scale[name]
    worst = max(worst, float(np.abs(g - w).max()) / (of or 1.0))
  return worst


if __name__ == "__main__":
  main()
