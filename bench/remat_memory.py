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
  zb_h1_k4_m16_*, interleaved_k4v2_m16_recompute
                        the zero-bubble schedule (its W actions keep each deferred
                        backward's projection inputs and output gradients until
                        they run), and 4 cells interleaved on 2 devices.

`--per_worker` runs each configuration in a child process on loopback worker
processes, one device each (tools/worker.py --memory_log), and reports every worker's
own peak: the per-device figure that logical devices, sharing one allocator, cannot
give. The *_k2_m8_* and interleaved_k4v2_m8_* configurations are meant for it:

  python bench/remat_memory.py --per_worker --configs \
      1f1b_k2_m8_recompute,zb_h1_k2_m8_recompute,1f1b_k2_m8_never,zb_h1_k2_m8_never

Memory comes from the BFC allocator's counts (`pipeline/memory.py`); all logical CPU
devices share that one allocator, so K>1 figures are the total over the K devices.
Measured on the second step so tracing and slot creation are not counted.

`--dtypes float32,bfloat16` runs every configuration in each compute dtype
(`fprop_dtype`: float32 master weights, activations, hand-offs and stash in the
dtype) and reports bfloat16 ÷ float32 for the activation bytes, the bytes handed off
between cells per step (from the traced cells' output specs: M micro-batches, each
forward hand-off and its gradient back) and the step time.

The paper's bound for the same L, K, M: naive activations grow as N·L, GPipe's as
N + (L/K)·(N/M) per device, so the ratio is L / (1 + L/(K·M)) for one device's share.

  python bench/remat_memory.py            # L=32, d=256, hidden 1024, 32×128 tokens
  python bench/remat_memory.py --layers 8 --seq 32 --configs gpipe_k4_m16_never,1f1b_k4_m16_never
  python bench/remat_memory.py --dtypes float32,bfloat16 --configs naive,gpipe_k4_m8

The last line printed is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
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
#          weight_gradient_group[, virtual_stages])
CONFIGS = {
    "naive": (None, 1, "gpipe", "never", 1),
    "gpipe_k1_m8": (1, 8, "gpipe", "always", 1),
    "gpipe_k1_m8_g8": (1, 8, "gpipe", "always", 8),  # what deferring all 8 costs
    "gpipe_k2_m8": (2, 8, "gpipe", "always", 1),
    "gpipe_k4_m8": (4, 8, "gpipe", "always", 1),
    "gpipe_k4_m16_recompute": (4, 16, "gpipe", "always", 1),
    "1f1b_k4_m16_recompute": (4, 16, "1f1b", "always", 1),
    "zb_h1_k4_m16_recompute": (4, 16, "zb_h1", "always", 1),
    "interleaved_k4v2_m16_recompute": (4, 16, "interleaved_1f1b", "always", 1, 2),
    "gpipe_k4_m16_never": (4, 16, "gpipe", "never", 1),
    "1f1b_k4_m16_never": (4, 16, "1f1b", "never", 1),
    "zb_h1_k4_m16_never": (4, 16, "zb_h1", "never", 1),
    # --per_worker: one device per worker process
    "gpipe_k2_m8_recompute": (2, 8, "gpipe", "always", 1),
    "1f1b_k2_m8_recompute": (2, 8, "1f1b", "always", 1),
    "zb_h1_k2_m8_recompute": (2, 8, "zb_h1", "always", 1),
    "interleaved_k4v2_m8_recompute": (4, 8, "interleaved_1f1b", "always", 1, 2),
    "1f1b_k2_m8_never": (2, 8, "1f1b", "never", 1),
    "zb_h1_k2_m8_never": (2, 8, "zb_h1", "never", 1),
}


def build(args, config: tuple, devices: list[str]):
  num_cells, micro_batches, schedule, recompute, weight_gradient_group = config[:5]
  virtual_stages = config[5] if len(config) > 5 else 1
  blocks = [layers.FeedForwardBlock.Params().set(
      name=f"block{i}", input_dim=args.dim, hidden_dim=args.hidden) for i in range(args.layers)]
  if num_cells is None:
    return layers.Sequential.Params().set(name="stack", layers=blocks, random_seed=1,
                                          fprop_dtype=args.dtype).instantiate()
  return PipeliningLayer.Params().set(
      name="stack", layers=blocks, random_seed=1, num_cells=num_cells, fprop_dtype=args.dtype,
      num_micro_batches=micro_batches, devices=devices[:num_cells // virtual_stages],
      schedule=schedule, virtual_stages=virtual_stages, recompute=recompute,
      weight_gradient_group=weight_gradient_group).instantiate()


def mean_square(outputs, _):
  """Loss: the mean square of the outputs (in float32), per example weighted by the
  examples."""
  return {"loss": (tf.reduce_mean(tf.square(tf.cast(outputs, tf.float32))),
                   tf.cast(tf.shape(outputs)[0], tf.float32))}


def _trained_step(args, config: tuple, devices: list[str]):
  """The traced training step of `config` and its batch."""
  model = train_step.StackWithLoss(build(args, config, devices), mean_square)
  variables = model.trainable_variables
  optimizer = optimizers.Adam.Params().set(learning_rate=1e-4).instantiate()
  optimizer.create_slots(variables)
  step = tf.function(train_step.TrainStep(model, optimizer, tf.Variable(0, dtype=tf.int64),
                                          input_device=devices[0]))
  with tf.device(devices[0]):
    batch = {"inputs": tf.random.stateless_normal([args.batch, args.seq, args.dim],
                                                  seed=[1, 2])}
  return step, batch, variables, model


def handoff_bytes(model) -> int:
  """Bytes a training step hands from cell to cell: per micro-batch, each cell but the
  last sends its floating outputs forward and receives their gradients back (from
  the traced cells' signatures: one per micro-batch shape)."""
  pipeline = model.pipeline
  if pipeline is None:
    return 0
  sizes = pipeline.params.num_micro_batches
  total = 0
  for cell in pipeline.cell_functions(model.head)[:-1]:
    signature = next(iter(cell._signatures.values()))  # noqa: SLF001 (equal micro-batches)
    total += 2 * sum(spec.shape.num_elements() * spec.dtype.size
                     for spec in signature.outputs if spec.dtype.is_floating)
  return total * sizes


def measure_on_workers(args, name: str) -> dict:
  """Config `name` on loopback workers (one device each), in this child process:
  every worker's peak bytes since it started (weights, slots, the steps)."""
  from lingvo_gpipe.runtime.local_workers import local_cluster
  from lingvo_gpipe.runtime.memory_log import memory_log_path, read_memory_log

  config = CONFIGS[name]
  num_workers = config[0] // (config[5] if len(config) > 5 else 1)
  with tempfile.TemporaryDirectory() as log_dir:
    with local_cluster(num_workers, memory_log_dir=log_dir) as (devices, _):
      step, batch, variables, _ = _trained_step(args, config, devices)
      step(batch)[0]["loss"].numpy()  # trace, warm up
      start = time.perf_counter()
      step(batch)[0]["loss"].numpy()
      seconds = time.perf_counter() - start
      time.sleep(1.5)  # the logs poll every 0.5 s
      peaks = [read_memory_log(memory_log_path(log_dir, t))["peak_bytes_in_use"]
               for t in range(num_workers)]
  return {"peak_bytes_per_worker": peaks, "step_seconds": round(seconds, 3),
          "weight_bytes": sum(v.shape.num_elements() * v.dtype.size for v in variables)}


def measure_in_child(args, name: str) -> dict:
  """measure_on_workers in a child process (joining a cluster is once per process)."""
  command = [sys.executable, os.path.abspath(__file__), "--child", name,
             f"--layers={args.layers}", f"--dim={args.dim}", f"--hidden={args.hidden}",
             f"--batch={args.batch}", f"--seq={args.seq}", f"--dtypes={args.dtype}"]
  result = subprocess.run(command, capture_output=True, text=True, timeout=1800)
  if result.returncode != 0:
    raise RuntimeError(f"{name} failed:\n{result.stderr[-3000:]}")
  return json.loads(result.stdout.strip().splitlines()[-1])


def measure(args, config: tuple, devices: list[str]) -> dict:
  step, batch, variables, model = _trained_step(args, config, devices)
  step(batch)[0]["loss"].numpy()  # trace, warm up
  start = time.perf_counter()
  result = memory.step_activation_bytes(lambda: step(batch)[0]["loss"].numpy())
  result["step_seconds"] = round(time.perf_counter() - start, 3)
  # The step time again, as the median of 3 (the first includes the memory probe's).
  times = []
  for _ in range(3):
    start = time.perf_counter()
    step(batch)[0]["loss"].numpy()
    times.append(time.perf_counter() - start)
  result["median_step_seconds"] = round(sorted(times)[1], 3)
  result["weight_bytes"] = sum(v.shape.num_elements() * v.dtype.size for v in variables)
  result["handoff_bytes"] = handoff_bytes(model)
  return result


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--layers", type=int, default=32)
  parser.add_argument("--dim", type=int, default=256)
  parser.add_argument("--hidden", type=int, default=1024)
  parser.add_argument("--batch", type=int, default=32)
  parser.add_argument("--seq", type=int, default=128)
  parser.add_argument("--configs", default=",".join(list(CONFIGS)[:12]),
                      help=f"comma-separated subset of {list(CONFIGS)}")
  parser.add_argument("--dtypes", default="float32",
                      help="comma-separated compute dtypes (fprop_dtype) to run each "
                      "configuration in: float32, bfloat16, float16")
  parser.add_argument("--per_worker", action="store_true",
                      help="each configuration on loopback workers, one peak per worker")
  parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
  args = parser.parse_args()
  dtypes = args.dtypes.split(",")
  bad = [d for d in dtypes if d not in ("float32", "bfloat16", "float16")]
  if bad:
    parser.error(f"unknown --dtypes {bad}; valid: float32, bfloat16, float16")
  args.dtype = dtypes[0]
  names = args.configs.split(",")
  unknown = [n for n in names + ([args.child] if args.child else []) if n not in CONFIGS]
  if unknown:
    parser.error(f"unknown --configs {unknown}; valid: {list(CONFIGS)}")
  if args.child:
    print(json.dumps(measure_on_workers(args, args.child)))
    return
  if args.per_worker:
    if len(dtypes) > 1:
      parser.error("--per_worker runs one --dtypes at a time")
    per_worker = {}
    for name in names:
      per_worker[name] = measure_in_child(args, name)
      peaks = per_worker[name]["peak_bytes_per_worker"]
      print(f"{name:32s} peak per worker " + " ".join(f"{p / 2**20:8.1f} MiB" for p in peaks)
            + f"   step {per_worker[name]['step_seconds']:.2f} s", flush=True)
    summary = {"bench": "remat_memory", "mode": "per_worker", "dtype": args.dtype,
               "machine": f"{platform.machine()} {os.cpu_count()} cores, TF {tf.__version__}",
               "layers": args.layers, "dim": args.dim, "hidden": args.hidden,
               "tokens_per_batch": args.batch * args.seq,
               "peak_bytes_per_worker": {n: r["peak_bytes_per_worker"]
                                         for n, r in per_worker.items()}}
    for recompute in ("recompute", "never"):
      one_f, zb = per_worker.get(f"1f1b_k2_m8_{recompute}"), per_worker.get(
          f"zb_h1_k2_m8_{recompute}")
      if one_f and zb:
        summary[f"zb_h1_over_1f1b_peak_k2_m8_{recompute}"] = round(
            max(zb["peak_bytes_per_worker"]) / max(one_f["peak_bytes_per_worker"]), 3)
    print(json.dumps(summary))
    return
  devices = configure_devices("cpu:4")

  by_dtype = {}
  for dtype in dtypes:
    args.dtype = dtype
    by_dtype[dtype] = {}
    for name in names:
      by_dtype[dtype][name] = r = measure(args, CONFIGS[name], devices)
      print(f"{dtype:9s} {name:32s} activations {r['activation_bytes'] / 2**20:9.1f} MiB   "
            f"peak {r['peak_bytes'] / 2**20:9.1f} MiB   hand-offs "
            f"{r['handoff_bytes'] / 2**20:7.1f} MiB   step {r['median_step_seconds']:.2f} s",
            flush=True)
  results = by_dtype[dtypes[0]]

  summary = {
      "bench": "remat_memory",
      "machine": f"{platform.machine()} {os.cpu_count()} cores, TF {tf.__version__}",
      "layers": args.layers, "dim": args.dim, "hidden": args.hidden,
      "tokens_per_batch": args.batch * args.seq,
      "dtype": dtypes[0],
      "activation_bytes": {n: r["activation_bytes"] for n, r in results.items()},
      "step_seconds": {n: r["step_seconds"] for n, r in results.items()},
  }
  for dtype in dtypes[1:]:  # each other dtype against the first (float32)
    other = by_dtype[dtype]
    summary[f"{dtype}_activation_bytes"] = {n: r["activation_bytes"] for n, r in other.items()}
    for r in list(other.values()) + list(results.values()):
      # What the step allocates besides its float32 gradient buffers (the sums, weight-
      # sized in every dtype by design): the part mixed precision can halve.
      r["activations_less_gradients"] = r["activation_bytes"] - r["weight_bytes"]
    for figure, key in (("activations", "activation_bytes"),
                        ("activations_less_gradients", "activations_less_gradients"),
                        ("handoff", "handoff_bytes"), ("step", "median_step_seconds")):
      summary[f"{dtype}_over_{dtypes[0]}_{figure}"] = {
          n: round(other[n][key] / results[n][key], 3) for n in names if results[n][key]}
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
