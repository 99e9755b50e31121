"""Pipeline speedup with one worker process per stage, on loopback.

Starts `--max_workers` TensorFlow servers (tools/worker.py), each with one inter-op
and one intra-op thread so that each behaves like one sequential accelerator
(DESIGN.md), joins them as a client, and times training steps (forward, recomputed
forward, backward, SGD update) at a fixed global batch:

  K = 1: every cell on worker 0 (one "accelerator", re-materialized, M micro-batches);
  K = k: k cells on workers 0..k-1.

for M in --micro_batches, on (a) an 8-layer 1024-wide ReLU MLP at batch 256 and (b) a
stack of 8 Transformer feed-forward blocks (model dim 512, hidden 2048) at 16×64
tokens. K=1 and K=k steps alternate, so that machine noise hits both alike; the
figures are medians. The fill-drain bubble bounds the K=2 speedup by 2·M/(M+1).

  python bench/pipeline_speedup.py                 # K ∈ {1, 2}, M ∈ {1, 2, 4, 8, 16}
  python bench/pipeline_speedup.py --max_workers 4 # also K = 4 (needs ≥ 5 cores)

The last line printed is one JSON object; `speedup_k2_m8` is the MLP's K=1 ÷ K=2
median step time at M=8.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")



def model_layers(name: str):
  from lingvo_gpipe.core import layers

  if name == "mlp":
    return [layers.Linear.Params().set(name=f"fc{i}", input_dim=1024, output_dim=1024,
                                       activation="RELU") for i in range(8)], [256, 1024]
  return [layers.FeedForwardBlock.Params().set(name=f"block{i}", input_dim=512,
                                               hidden_dim=2048) for i in range(8)], [16, 64, 512]


def make_step(model_name: str, num_cells: int, num_micro_batches: int, devices: list[str]):
  import tensorflow as tf

  from lingvo_gpipe.core import base_layer, gpipe, optimizers

  stack, input_shape = model_layers(model_name)
  model = gpipe.PipeliningLayer.Params().set(
      name=model_name, layers=stack, num_cells=num_cells, num_micro_batches=num_micro_batches,
      devices=devices[:num_cells] if num_cells > 1 else devices[:1], recompute="always",
      random_seed=1).instantiate()
  variables = model.trainable_variables
  optimizer = optimizers.SGD.Params().set(learning_rate=1e-4, momentum=0.0).instantiate()
  optimizer.create_slots(variables)
  with tf.device(devices[0]):
    inputs = tf.random.stateless_normal(input_shape, seed=[1, 2])

  @tf.function
  def step(s):
    with base_layer.step_context(training=True, step=s, layer_stats=[]):
      loss = tf.reduce_mean(tf.square(model(inputs)))
    optimizer.apply_gradients(tf.gradients(loss, variables), variables, s)
    return loss

  counter = [0]

  def run() -> float:
    counter[0] += 1
    start = time.perf_counter()
    step(tf.constant(counter[0], tf.int64)).numpy()
    return time.perf_counter() - start

  run()  # trace and warm up
  return run


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--max_workers", type=int, default=2)
  parser.add_argument("--micro_batches", default="1,2,4,8,16")
  parser.add_argument("--steps", type=int, default=15, help="timed steps per configuration")
  parser.add_argument("--models", default="mlp,transformer")
  args = parser.parse_args()
  micro_batches = [int(m) for m in args.micro_batches.split(",")]
  worker_counts = [k for k in (2, 4, 8) if k <= args.max_workers]

  from lingvo_gpipe.core import cluster

  spec, procs = cluster.start_local_workers(args.max_workers)
  try:
    import tensorflow as tf

    workers_spec = cluster.parse_cluster_spec(spec)
    cluster.wait_for_servers(workers_spec["worker"])
    devices = cluster.connect_to_cluster(workers_spec)
    results: dict = {}
    for model_name in args.models.split(","):
      for m in micro_batches:
        runners = {1: make_step(model_name, 1, m, devices)}
        for k in worker_counts:
          runners[k] = make_step(model_name, k, m, devices)
        times: dict[int, list[float]] = {k: [] for k in runners}
        for _ in range(args.steps):
          for k, run in runners.items():
            times[k].append(run())
        medians = {k: statistics.median(v) for k, v in times.items()}
        for k in worker_counts:
          key = f"{model_name}_k{k}_m{m}"
          results[key] = {"step_seconds_k1": round(medians[1], 4),
                          f"step_seconds_k{k}": round(medians[k], 4),
                          "speedup": round(medians[1] / medians[k], 3),
                          "bubble_bound": round(k * m / (m + k - 1), 3)}
          print(f"{key:22s} K=1 {medians[1]:.4f} s  K={k} {medians[k]:.4f} s  "
                f"speedup {medians[1] / medians[k]:.2f}  (bound {k * m / (m + k - 1):.2f})",
                flush=True)
    summary = {
        "bench": "pipeline_speedup",
        "machine": f"{platform.machine()} {os.cpu_count()} cores, TF {tf.__version__}",
        "workers": args.max_workers, "steps_per_config": args.steps,
        "results": results,
    }
    if "mlp_k2_m8" in results:
      summary["speedup_k2_m8"] = results["mlp_k2_m8"]["speedup"]
      summary["bubble_bound_k2_m8"] = results["mlp_k2_m8"]["bubble_bound"]
    print(json.dumps(summary))
  finally:
    for proc in procs:
      proc.kill()


if __name__ == "__main__":
  main()
