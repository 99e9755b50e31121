"""Run by loopback_test.py in its own process (joining a cluster changes TF's context).

Starts two tools/worker.py servers on loopback, places a two-cell pipeline on them,
and prints one JSON line: the largest relative difference between its loss and
gradients and those of the same layers run unpartitioned in this process.
"""

import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def main() -> None:
  from lingvo_gpipe.core import cluster

  spec, workers = cluster.start_local_workers(2, single_thread=False)
  try:
    import numpy as np
    import tensorflow as tf

    from lingvo_gpipe.core import base_layer, gpipe, layers

    workers_spec = cluster.parse_cluster_spec(spec)
    cluster.wait_for_servers(workers_spec["worker"])
    devices = cluster.connect_to_cluster(workers_spec)
    stack = [layers.Linear.Params().set(name=f"fc{i}", input_dim=16, output_dim=16,
                                        activation="TANH") for i in range(4)]
    stack.insert(2, layers.Dropout.Params().set(name="drop", keep_prob=0.7))
    x = tf.constant(np.random.RandomState(0).randn(10, 16), tf.float32)

    def loss_and_grads(model, function):
      def run():
        with tf.GradientTape() as tape:
          with base_layer.step_context(training=True, step=tf.constant(4, tf.int64)):
            loss = tf.reduce_sum(tf.square(model(x)))
        return loss, tape.gradient(loss, model.trainable_variables)
      loss, grads = (tf.function(run) if function else run)()
      return [loss.numpy()] + [g.numpy() for g in grads]

    local = layers.Sequential.Params().set(name="s", layers=stack, random_seed=3).instantiate()
    remote = gpipe.PipeliningLayer.Params().set(
        name="s", layers=stack, random_seed=3, num_cells=2, num_micro_batches=4,
        devices=devices).instantiate()
    want = loss_and_grads(local, function=False)
    got = loss_and_grads(remote, function=True)
    worst = max(float(np.max(np.abs(g - w)) / max(np.max(np.abs(w)), 1e-12))
                for g, w in zip(got, want))
    print(json.dumps({"devices": remote.cell_devices, "variable_devices":
                      [v.device for v in remote.trainable_variables],
                      "max_relative_difference": worst}))
  finally:
    for worker in workers:
      worker.kill()


if __name__ == "__main__":
  main()
