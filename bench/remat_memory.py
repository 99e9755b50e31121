"""Peak activation memory of one training step: naive vs GPipe vs 1F1B, recompute on/off.

A stack of L Transformer feed-forward blocks (pre-norm, residual) is trained one
step at a fixed batch with Adam through the library's training step
(`train_step.TrainStep`, the trainer's), as:

  naive                 the same layers as one Sequential: no micro-batches, no recompute;
  gpipe_k1_m8           one cell, M micro-batches, recompute;
  gpipe_k2_m8 / _k4_m8  two / four cells on logical CPU devices, recompute;
  {gpipe,1f1b}_k4_m16_{recompute,never}
                        four cells, 16 micro-batches, each schedule with and without
                        re-materialization: 1F1B keeps at most K−k micro-batches in
                        flight on cell k instead of M.

Memory comes from the BFC allocator's counts (`pipeline/memory.py`); all logical CPU
devices share that one allocator, so K>1 figures are the total over the K devices.
Measured on the second step so tracing and slot creation are not counted.

The paper's bound for the same L, K, M: naive activations grow as N·L, GPipe's as
N + (L/K)·(N/M) per device, so the ratio is L / (1 + L/(K·M)) for one device's share.

  python bench/remat_memory.py            # L=32, d=256, hidden 1024, 32×128 tokens
  python bench/remat_memory.py --layers 8 --seq 32 --configs gpipe_k4_m16_never,1f1b_k4_m16_never

The last line printed is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# TensorFlow's default CPU allocator keeps no counts on some CPUs (measured 2026-11-22 on
# an AVX2-only EPYC: get_memory_info raises); its BFC allocator, the one GPUs use, does.
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")

import tensorflow as tf  # noqa: E402

from lingvo_gpipe import train_step  # noqa: E402
from lingvo_gpipe.core import layers, optimizers  # noqa: E402
from lingvo_gpipe.pipeline import memory  # noqa: E402
from lingvo_gpipe.pipeline.layer import PipeliningLayer  # noqa: E402
from lingvo_gpipe.runtime.devices import configure_devices

# name → (cells or None for naive, micro-batches, schedule, recompute,
#          weight_gradient_group)
CONFIGS = {
    "naive": (None, 1, "gpipe", "never", 1),
    "gpipe_k1_m8": (1, 8, "gpipe", "always", 1),
    "gpipe_k1_m8_g8": (1, 8, "gpipe", "always", 8),  # what deferring all 8 costs
    "gpipe_k2_m8": (2, 8, "gpipe", "always", 1),
    "gpipe_k4_m8": (4, 8, "gpipe", "always", 1),
    "gpipe_k4_m16_recompute": (4, 16, "gpipe", "always", 1),
    "1f1b_k4_m16_recompute": (4, 16, "1f1b", "always", 1),
    "gpipe_k4_m16_never": (4, 16, "gpipe", "never", 1),
    "1f1b_k4_m16_never": (4, 16, "1f1b", "never", 1),
}


def build(args, config: tuple, devices: list[str]):
  num_cells, micro_batches, schedule, recompute, weight_gradient_group = config
  blocks = [layers.FeedForwardBlock.Params().set(
      name=f"block{i}", input_dim=args.dim, hidden_dim=args.hidden) for i in range(args.layers)]
  if num_cells is None:
    return layers.Sequential.Params().set(name="stack", layers=blocks,
                                          random_seed=1).instantiate()
  return PipeliningLayer.Params().set(
      name="stack", layers=blocks, random_seed=1, num_cells=num_cells,
      num_micro_batches=micro_batches, devices=devices[:num_cells], schedule=schedule,
      recompute=recompute, weight_gradient_group=weight_gradient_group).instantiate()


def mean_square(outputs, _):
  """Loss: the mean square of the outputs, per example weighted by the examples."""
  return {"loss": (tf.reduce_mean(tf.square(outputs)),
                   tf.cast(tf.shape(outputs)[0], tf.float32))}


def measure(args, config: tuple, devices: list[str]) -> dict:
  model = train_step.StackWithLoss(build(args, config, devices), mean_square)
  variables = model.trainable_variables
  optimizer = optimizers.Adam.Params().set(learning_rate=1e-4).instantiate()
  optimizer.create_slots(variables)
  step = tf.function(train_step.TrainStep(model, optimizer, tf.Variable(0, dtype=tf.int64),
                                          input_device=devices[0]))
  batch = {"inputs": tf.random.stateless_normal([args.batch, args.seq, args.dim], seed=[1, 2])}
  step(batch)[0]["loss"].numpy()  # trace, warm up
  start = time.perf_counter()
  result = memory.step_activation_bytes(lambda: step(batch)[0]["loss"].numpy())
  result["step_seconds"] = round(time.perf_counter() - start, 3)
  result["weight_bytes"] = sum(v.shape.num_elements() * v.dtype.size for v in variables)
  return result


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--layers", type=int, default=32)
  parser.add_argument("--dim", type=int, default=256)
  parser.add_argument("--hidden", type=int, default=1024)
  parser.add_argument("--batch", type=int, default=32)
  parser.add_argument("--seq", type=int, default=128)
  parser.add_argument("--configs", default=",".join(CONFIGS),
                      help=f"comma-separated subset of {list(CONFIGS)}")
  args = parser.parse_args()
  devices = configure_devices("cpu:4")
  names = args.configs.split(",")
  unknown = [n for n in names if n not in CONFIGS]
  if unknown:
    parser.error(f"unknown --configs {unknown}; valid: {list(CONFIGS)}")

  results = {}
  for name in names:
    results[name] = measure(args, CONFIGS[name], devices)
    r = results[name]
    print(f"{name:24s} activations {r['activation_bytes'] / 2**20:9.1f} MiB   "
          f"peak {r['peak_bytes'] / 2**20:9.1f} MiB   step {r['step_seconds']:.2f} s", flush=True)

  summary = {
      "bench": "remat_memory",
      "machine": f"{platform.machine()} {os.cpu_count()} cores, TF {tf.__version__}",
      "layers": args.layers, "dim": args.dim, "hidden": args.hidden,
      "tokens_per_batch": args.batch * args.seq,
      "activation_bytes": {n: r["activation_bytes"] for n, r in results.items()},
      "step_seconds": {n: r["step_seconds"] for n, r in results.items()},
  }
  if "naive" in results and "gpipe_k1_m8" in results:
    summary["activation_memory_ratio"] = round(
        results["naive"]["activation_bytes"] / results["gpipe_k1_m8"]["activation_bytes"], 3)
    summary["theoretical_ratio_k1_m8"] = round(args.layers / (1 + args.layers / 8), 3)
  for recompute in ("recompute", "never"):
    gpipe_name, one_f_name = f"gpipe_k4_m16_{recompute}", f"1f1b_k4_m16_{recompute}"
    if gpipe_name in results and one_f_name in results:
      summary[f"1f1b_over_gpipe_k4_m16_{recompute}"] = round(
          results[one_f_name]["activation_bytes"] / results[gpipe_name]["activation_bytes"], 3)
  print(json.dumps(summary))


if __name__ == "__main__":
  main()
