"""The largest AmoebaNet-D that trains within a memory budget per device (GPipe Table 1).

GPipe's Table 1 trains AmoebaNet-D (L normal cells, D filters) on 8 GB accelerators:
naive-1 fits (18, 208) = 82M parameters, pipeline-1 (18, 416) = 318M, pipeline-2
(18, 544) = 542M, pipeline-4 (36, 544) = 1.05B, pipeline-8 (72, 512) = 1.8B. Here
each mode tries those sizes in order, each in a fresh process (one build and two
training steps on synthetic images, Adam-free RMSProp as the paper), until one does
not fit:

  naive         one device, no micro-batches, no re-materialization
  pipeline-K    K cells on K devices, --micro_batches, re-materialization

Devices come from --devices with {k} the mode's device count: logical GPUs of one GPU
with a memory limit each (gpu:{k}:8192, each with its own allocator: a logical GPU
that runs out fails the step) or, to rehearse the script without a GPU, logical CPUs
(cpu:{k}, no limit: every size fits).

  python bench/amoeba_size.py --devices gpu:{k}:8192
  python bench/amoeba_size.py --devices cpu:{k} --sizes 3x8,3x16 --image_size 32 \
      --batch 8 --modes naive,pipeline-2                    # rehearsal (tools/gpu_check.sh)

The last line printed is one JSON object: per mode the largest size that trained,
its parameters and each device's allocator peak, and the first size that did not.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

PAPER_SIZES = "18x208,18x416,18x544,36x544,72x512"  # (L normal cells) x (D filters)
OUT_OF_MEMORY = 3  # a probe's exit status when a device ran out of memory


def probe(args: argparse.Namespace) -> int:
  """One size in one mode, in this process: build, two training steps; prints a JSON
  line (parameters, each device's allocator peak) or exits OUT_OF_MEMORY."""
  import tempfile

  import tensorflow as tf

  from lingvo_gpipe.core import optimizers
  from lingvo_gpipe.inputs.synthetic_images import SyntheticImages
  from lingvo_gpipe.runtime import devices as devices_lib
  from lingvo_gpipe.trainer import Trainer
  from params.image import AmoebaNetImageNet

  cells = 0 if args.mode == "naive" else int(args.mode.split("-")[1])
  device_names = devices_lib.configure_devices(args.devices.format(k=max(cells, 1)))
  layers, filters = (int(x) for x in args.size.split("x"))

  class Probe(AmoebaNetImageNet):
    NUM_NORMAL_CELLS, FILTERS, IMAGE_SIZE, BATCH_SIZE = layers, filters, args.image_size, \
        args.batch

    def task(self):
      p = super().task()
      if cells:
        p.pipeline.set(num_cells=cells, num_micro_batches=args.micro_batches,
                       recompute="always", partition_cost="params")
      else:
        p.pipeline.set(num_cells=0, recompute="never")
      p.train.optimizer = optimizers.RMSProp.Params().set(
          learning_rate=0.01, decay=0.9, momentum=0.9, epsilon=1.0)
      return p

    def train_input(self):
      return SyntheticImages.Params().set(
          name="synthetic", split="train", batch_size=args.batch, num_examples=4 * args.batch,
          image_size=args.image_size, num_classes=self.NUM_CLASSES)

    def eval_input(self):
      return None

  params = Probe().model_params()
  try:
    with tempfile.TemporaryDirectory() as logdir:
      trainer = Trainer(params, logdir, log=lambda line: None)
      step = trainer._build_train_step()  # noqa: SLF001 (two steps, no checkpoint)
      for _ in range(2):
        values, _ = step(next(trainer.train_iterator))
      loss = float(values["loss"].numpy())
  except tf.errors.ResourceExhaustedError as e:
    print(f"out of memory: {str(e).splitlines()[0][:200]}", file=sys.stderr)
    return OUT_OF_MEMORY
  weights = sum(int(v.shape.num_elements()) for v in trainer.replicas.trainable_variables[0])
  peaks = []
  for name in dict.fromkeys(device_names):
    kind = tf.DeviceSpec.from_string(name)
    allocator = f"{kind.device_type}:{kind.device_index}" if kind.device_type == "GPU" \
        else "CPU:0"
    try:
      peaks.append(tf.config.experimental.get_memory_info(allocator)["peak"])
    except ValueError:
      peaks.append(None)
  print(json.dumps({"size": args.size, "mode": args.mode, "params": weights, "loss": loss,
                    "peak_bytes": peaks}))
  return 0


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--devices", default="gpu:{k}:8192",
                      help="--devices of the trainer, {k} the mode's device count")
  parser.add_argument("--modes", default="naive,pipeline-1,pipeline-2,pipeline-4,pipeline-8")
  parser.add_argument("--sizes", default=PAPER_SIZES, help="LxD, smallest first")
  parser.add_argument("--image_size", type=int, default=224)
  parser.add_argument("--batch", type=int, default=64)
  parser.add_argument("--micro_batches", type=int, default=8)
  parser.add_argument("--timeout", type=int, default=900, help="seconds per probe")
  parser.add_argument("--mode", help=argparse.SUPPRESS)  # a probe's (internal)
  parser.add_argument("--size", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.mode:
    return probe(args)
  results = {"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d"), "modes": {}}
  for mode in args.modes.split(","):
    fitted, first_failed = None, None
    for size in args.sizes.split(","):
      command = [sys.executable, __file__, f"--mode={mode}", f"--size={size}",
                 f"--devices={args.devices}", f"--image_size={args.image_size}",
                 f"--batch={args.batch}", f"--micro_batches={args.micro_batches}"]
      start = time.perf_counter()
      try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
        status = done.returncode
      except subprocess.TimeoutExpired:
        status, done = None, None
      seconds = time.perf_counter() - start
      if status == 0:
        fitted = json.loads(done.stdout.strip().splitlines()[-1]) | {"seconds": seconds}
        print(f"{mode} {size}: trains ({fitted['params'] / 1e6:.1f}M params, "
              f"{seconds:.0f} s)", flush=True)
        continue
      why = ("out of memory" if status == OUT_OF_MEMORY else
             "timed out" if status is None else
             f"failed (exit {status}): {done.stderr.strip().splitlines()[-1:]}")
      first_failed = {"size": size, "why": why}
      print(f"{mode} {size}: {why}", flush=True)
      break
    results["modes"][mode] = {"largest": fitted, "first_not": first_failed}
  print(json.dumps(results))
  return 0


if __name__ == "__main__":
  sys.exit(main())
