"""Peak activation memory of one training step: naive vs GPipe re-materialization.

A stack of L Transformer feed-forward blocks (pre-norm, residual) is trained one
step at a fixed batch with Adam, as:

  naive        the same layers as one Sequential: no micro-batches, no recompute;
  gpipe_k1_m8  one cell, M micro-batches, recompute;
  gpipe_k2_m8  two cells on two logical CPU devices, M micro-batches, recompute;
  gpipe_k4_m8  four cells on four logical CPU devices.

Memory comes from tf.config.experimental.get_memory_info('CPU:0') with TensorFlow's
BFC allocator (the one GPUs use); all logical CPU devices share that one allocator,
so K>1 figures are the total over the K devices.
Activation bytes = peak during the step − bytes in use just before it (weights,
optimizer slots and the input batch), measured on the second step so tracing and
slot creation are not counted.

The paper's bound for the same L, K, M: naive activations grow as N·L, GPipe's as
N + (L/K)·(N/M) per device, so the ratio is L / (1 + L/(K·M)) for one device's share.

  python bench/remat_memory.py            # L=32, d=256, hidden 1024, 32×128 tokens, M=8

The last line printed is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# TensorFlow's default CPU allocator keeps no counts on some CPUs (measured 2026-11-22 on
# an AVX2-only EPYC: get_memory_info raises); its BFC allocator, the one GPUs use, does.
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")

import tensorflow as tf  # noqa: E402

from lingvo_gpipe.core import base_layer, cluster, gpipe, layers, optimizers  # noqa: E402


def build(args, num_cells: int | None, devices: list[str]):
  blocks = [layers.FeedForwardBlock.Params().set(
      name=f"block{i}", input_dim=args.dim, hidden_dim=args.hidden) for i in range(args.layers)]
  if num_cells is None:
    return layers.Sequential.Params().set(name="stack", layers=blocks,
                                          random_seed=1).instantiate()
  return gpipe.PipeliningLayer.Params().set(
      name="stack", layers=blocks, random_seed=1, num_cells=num_cells,
      num_micro_batches=args.micro_batches, devices=devices[:num_cells],
      recompute="always").instantiate()


def measure(args, num_cells: int | None, devices: list[str]) -> dict:
  model = build(args, num_cells, devices)
  variables = model.trainable_variables
  optimizer = optimizers.Adam.Params().set(learning_rate=1e-4).instantiate()
  optimizer.create_slots(variables)
  inputs = tf.random.stateless_normal([args.batch, args.seq, args.dim], seed=[1, 2])

  @tf.function
  def train_step(x, step):
    with base_layer.step_context(training=True, step=step, layer_stats=[]):
      loss = tf.reduce_mean(tf.square(model(x)))
    grads = tf.gradients(loss, variables)
    optimizer.apply_gradients(grads, variables, step)
    return loss

  train_step(inputs, tf.constant(0, tf.int64)).numpy()  # trace, warm up
  gc.collect()
  tf.config.experimental.reset_memory_stats("CPU:0")
  before = tf.config.experimental.get_memory_info("CPU:0")["current"]
  start = time.perf_counter()
  train_step(inputs, tf.constant(1, tf.int64)).numpy()
  seconds = time.perf_counter() - start
  peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
  weight_bytes = sum(v.shape.num_elements() * v.dtype.size for v in variables)
  result = {"peak_bytes": peak, "baseline_bytes": before, "activation_bytes": peak - before,
            "weight_bytes": weight_bytes, "step_seconds": round(seconds, 3)}
  return result


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--layers", type=int, default=32)
  parser.add_argument("--dim", type=int, default=256)
  parser.add_argument("--hidden", type=int, default=1024)
  parser.add_argument("--batch", type=int, default=32)
  parser.add_argument("--seq", type=int, default=128)
  parser.add_argument("--micro_batches", type=int, default=8)
  args = parser.parse_args()
  devices = cluster.configure_devices("cpu:4")

  configs = {"naive": None, "gpipe_k1_m8": 1, "gpipe_k2_m8": 2, "gpipe_k4_m8": 4}
  results = {}
  for name, num_cells in configs.items():
    results[name] = measure(args, num_cells, devices)
    r = results[name]
    print(f"{name:12s} activations {r['activation_bytes'] / 2**20:9.1f} MiB   "
          f"peak {r['peak_bytes'] / 2**20:9.1f} MiB   step {r['step_seconds']:.2f} s", flush=True)

  num_layers, m = args.layers, args.micro_batches
  naive = results["naive"]["activation_bytes"]
  summary = {
      "bench": "remat_memory",
      "machine": f"{platform.machine()} {os.cpu_count()} cores, TF {tf.__version__}",
      "layers": num_layers, "dim": args.dim, "hidden": args.hidden,
      "tokens_per_batch": args.batch * args.seq, "micro_batches": m,
      "weight_bytes": results["naive"]["weight_bytes"],
      "activation_bytes_naive": naive,
      "activation_bytes_gpipe_k1_m8": results["gpipe_k1_m8"]["activation_bytes"],
      "activation_bytes_gpipe_k2_m8_total": results["gpipe_k2_m8"]["activation_bytes"],
      "activation_bytes_gpipe_k4_m8_total": results["gpipe_k4_m8"]["activation_bytes"],
      "activation_memory_ratio": round(naive / results["gpipe_k1_m8"]["activation_bytes"], 3),
      "theoretical_ratio_k1_m8": round(num_layers / (1 + num_layers / m), 3),
      "step_seconds": {k: v["step_seconds"] for k, v in results.items()},
  }
  print(json.dumps(summary))


if __name__ == "__main__":
  main()
