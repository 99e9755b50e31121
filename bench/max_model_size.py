"""Largest Transformer LM whose measured peak memory per device fits a budget (GPipe Table 1).

The family is the paper's Transformer-L: an embedding, L Transformer layers (pre-norm,
causal self-attention, feed-forward) and a softmax, trained with Adam. Each device is
one tools/worker.py process on loopback with one inter-op and one intra-op thread
(a sequential device: the environment variables govern a server's eager executor,
a ConfigProto passed to it does not; see tools/worker.py), and three ways of running
the same model compete for the same per-device budget:

  naive        every layer on worker 0, one Sequential: no micro-batches, no
               re-materialization (the activations of every layer for the whole
               mini-batch are alive at the start of the backward pass);
  pipeline-1   one GPipe cell on worker 0, M micro-batches, re-materialization;
  pipeline-K   K cells on workers 0..K-1 (the partitioner balances parameters).

A device's memory is what its worker process holds above its idle state: the peak
resident set (VmHWM, reset through /proc/PID/clear_refs once the worker is idle and
joined) minus the resident set at that moment, over building the model (weights),
creating Adam's slots, and one training step (gradients, activations). A worker is
a fresh process for every probe, so nothing one probe allocated is seen by the
next. Each probe runs in its own client process (joining a cluster changes
TensorFlow's context for good).

The search for each mode measures two depths, fits memory ≈ a + b·L, and then walks
from the estimate until depth L* fits and L*+1 does not, both measured. Parameters
count every trainable variable of the model at L*.

  python bench/max_model_size.py                        # naive, pipeline-1, -2, -4
  python bench/max_model_size.py --budget_mib 512 --modes naive,pipeline-1

The last line printed is one JSON object; `pipeline1_over_naive_params` is the ratio
of the parameters pipeline-1 fits to those naive fits (the paper: 2.8× for the
Transformer, 3.9× for AmoebaNet).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

MODES = ("naive", "pipeline-1", "pipeline-2", "pipeline-4", "pipeline-8")


def num_cells(mode: str) -> int:
  """0 for naive, K for pipeline-K."""
  if mode == "naive":
    return 0
  if mode.startswith("pipeline-") and mode[len("pipeline-"):].isdigit():
    return int(mode[len("pipeline-"):])
  raise ValueError(f"unknown mode {mode!r}; valid: naive or pipeline-K (K >= 1)")


def probe(args, mode: str, num_layers: int) -> dict:
  """Builds the model at depth `num_layers` in fresh workers, trains one step, and
  returns each worker's memory above idle (bytes)."""
  import tensorflow as tf

  from lingvo_gpipe import train_step
  from lingvo_gpipe.core import layers, optimizers
  from lingvo_gpipe.models import transformer
  from lingvo_gpipe.pipeline import layer as gpipe
  from lingvo_gpipe.runtime.local_workers import local_cluster
  from lingvo_gpipe.runtime.memory_log import memory_log_path, read_memory_log

  cells = num_cells(mode)
  log_dir = tempfile.mkdtemp(prefix="max_model_size_")
  with local_cluster(max(cells, 1), memory_log_dir=log_dir) as (devices, procs):
    stack = transformer.lm_stack(vocab_size=args.vocab, model_dim=args.dim,
                                 hidden_dim=args.hidden, num_heads=args.heads,
                                 num_layers=num_layers)
    if cells == 0:
      with tf.device(devices[0]):
        model = stack.set(random_seed=1).instantiate()
    else:
      model = gpipe.PipeliningLayer.Params().set(
          name="stack", layers=stack.layers, num_cells=cells,
          num_micro_batches=args.micro_batches, devices=devices[:cells],
          recompute="always", random_seed=1).instantiate()
    def next_token_loss(logits, head_inputs):
      ids = head_inputs["labels"]
      return {"loss": (tf.reduce_mean(layers.softmax_cross_entropy(logits, ids)),
                       tf.cast(tf.size(ids), tf.float32))}

    wrapped = train_step.StackWithLoss(model, next_token_loss)
    variables = wrapped.trainable_variables
    optimizer = optimizers.Adam.Params().set(learning_rate=1e-4).instantiate()
    optimizer.create_slots(variables)
    step = train_step.TrainStep(wrapped, optimizer, tf.Variable(1, dtype=tf.int64),
                                input_device=devices[0])

    @tf.function
    def run(batch):
      # Naive: every op on worker 0 (the pipeline places its cells itself).
      with tf.device(devices[0]) if cells == 0 else contextlib.nullcontext():
        return step(batch)[0]["loss"]

    with tf.device(devices[0]):
      ids = tf.random.stateless_uniform([args.batch, args.seq], seed=[1, 2],
                                        maxval=args.vocab, dtype=tf.int32)
      batch = {"inputs": (ids, tf.zeros([args.batch, args.seq])), "labels": ids}
    start = time.perf_counter()
    loss = float(run(batch).numpy())
    seconds = time.perf_counter() - start
    time.sleep(2.0)  # the workers log their memory every 0.5 s
    per_device = [read_memory_log(memory_log_path(log_dir, task))
                  ["peak_bytes_in_use"] for task in range(len(procs))]
  shutil.rmtree(log_dir)
  return {"mode": mode, "layers": num_layers,
          "params": sum(v.shape.num_elements() for v in variables),
          "bytes_per_device": per_device, "max_bytes": max(per_device),
          "loss": round(loss, 4), "seconds": round(seconds, 1)}


def run_probe(args, mode: str, num_layers: int) -> dict:
  """`probe` in a child process (a fresh TensorFlow context); its last line is JSON."""
  command = [sys.executable, __file__, f"--probe={mode}:{num_layers}"] + [
      f"--{name}={getattr(args, name)}" for name in SHAPE_FLAGS]
  result = subprocess.run(command, capture_output=True, text=True, check=False)
  if result.returncode != 0:
    raise RuntimeError(f"probe {mode} L={num_layers} failed:\n{result.stderr[-3000:]}")
  record = json.loads(result.stdout.strip().splitlines()[-1])
  print(f"  {mode:11s} L={num_layers:4d}  params {record['params'] / 1e6:7.2f} M  "
        f"peak/device {record['max_bytes'] / 2**20:8.1f} MiB  "
        f"({', '.join(f'{b / 2**20:.0f}' for b in record['bytes_per_device'])})  "
        f"first step {record['seconds']} s (tracing included)", flush=True)
  return record


def largest_fitting(args, mode: str) -> dict:
  """Measured L* (fits the budget) and L*+1 (does not).

  Memory grows about linearly with depth, so each next depth to measure comes from
  the line through the last two measurements (the first two are cheap shallow ones);
  once that line points at a depth already measured, single steps settle L*.
  """
  budget = args.budget_mib * 2**20
  cells = max(num_cells(mode), 1)
  probes: dict[int, dict] = {}

  def peak(num_layers: int) -> int:
    if num_layers not in probes:
      probes[num_layers] = run_probe(args, mode, num_layers)
    return probes[num_layers]["max_bytes"]

  if peak(cells) > budget:
    return {"mode": mode, "layers": 0, "params": 0,
            "probes": {str(k): v["max_bytes"] for k, v in probes.items()}}
  a, b = cells, 3 * cells
  for _ in range(8):  # the line settles within a few steps
    slope = (peak(b) - peak(a)) / (b - a)
    if slope <= 0:
      raise RuntimeError(f"{mode}: memory does not grow with depth: "
                         f"{a} layers {peak(a)} B, {b} layers {peak(b)} B")
    estimate = max(cells, b + int((budget - peak(b)) // slope))
    if estimate in probes:
      break
    a, b = b, estimate
  depth = estimate
  while depth > cells and peak(depth) > budget:
    depth -= 1
  while peak(depth + 1) <= budget:
    depth += 1
  return {"mode": mode, "layers": depth, "params": probes[depth]["params"],
          "peak_bytes": peak(depth), "peak_bytes_next": peak(depth + 1),
          "bytes_per_layer": round(slope),
          "probes": {str(k): v["max_bytes"] for k, v in sorted(probes.items())}}


SHAPE_FLAGS = ("vocab", "dim", "hidden", "heads", "batch", "seq", "micro_batches")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--modes", default="naive,pipeline-1,pipeline-2")
  parser.add_argument("--budget_mib", type=int, default=192,
                      help="memory each device may hold above its idle state")
  parser.add_argument("--vocab", type=int, default=256)
  parser.add_argument("--dim", type=int, default=128)
  parser.add_argument("--hidden", type=int, default=512)
  parser.add_argument("--heads", type=int, default=4)
  parser.add_argument("--batch", type=int, default=32)
  parser.add_argument("--seq", type=int, default=128)
  parser.add_argument("--micro_batches", type=int, default=8)
  parser.add_argument("--probe", default=None, help=argparse.SUPPRESS)  # MODE:L, internal
  args = parser.parse_args()

  if args.probe:
    mode, num_layers = args.probe.rsplit(":", 1)
    print(json.dumps(probe(args, mode, int(num_layers))))
    return

  modes = args.modes.split(",")
  for mode in modes:
    num_cells(mode)  # rejects an unknown mode before any probe runs
  results = {}
  for mode in modes:
    print(f"{mode}: searching for the deepest model within {args.budget_mib} MiB per device",
          flush=True)
    results[mode] = largest_fitting(args, mode)
    r = results[mode]
    print(f"{mode}: L* = {r['layers']}, {r['params'] / 1e6:.2f} M parameters", flush=True)

  import tensorflow as tf

  summary = {
      "bench": "max_model_size",
      "machine": f"{platform.machine()} {os.cpu_count()} cores, TF {tf.__version__}",
      "budget_mib": args.budget_mib,
      "model": {name: getattr(args, name) for name in SHAPE_FLAGS},
      "results": results,
  }
  naive = results.get("naive", {}).get("params")
  for mode in modes:
    if mode != "naive" and naive:
      summary[f"{mode.replace('-', '')}_over_naive_params"] = round(
          results[mode]["params"] / naive, 2)
  print(json.dumps(summary))


if __name__ == "__main__":
  main()
