"""Does mixed precision train as well? The same model and batches, float32 against
bfloat16 (and float16 with dynamic loss scaling), through the trainer.

Each model trains for --steps steps from the same initial weights (float32 master
weights are drawn the same whatever the compute dtype) on the same synthetic batches,
pipelined as its param file says, then is evaluated on its eval set. Reported per
dtype: the mean training loss of the last 10% of steps, the eval metrics, the step
time (median of the steps after the first), and each half dtype's last loss ÷
float32's.

  python bench/mixed_precision_accuracy.py                       # both models, 300 steps
  python bench/mixed_precision_accuracy.py --models lm.TransformerTiny --steps 100

The last line printed is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

from lingvo_gpipe import model_registry, trainer  # noqa: E402
from lingvo_gpipe.core import hyperparams  # noqa: E402
from lingvo_gpipe.runtime.devices import configure_devices  # noqa: E402

DTYPES = ("float32", "bfloat16", "float16")


def train_and_eval(model: str, dtype: str, steps: int, logdir: str) -> dict:
  params = model_registry.get_params(model)
  overrides = (f"task.fprop_dtype='{dtype}';task.train.max_steps={steps};"
               f"task.train.save_interval_steps={steps};task.train.summary_interval_steps={steps}")
  for key, value in hyperparams.parse_overrides(overrides):
    params.set_from_text(key, value)
  overflows: list[str] = []  # the trainer's lines for steps skipped by loss scaling
  run = trainer.Trainer(params.freeze(), logdir,
                        log=lambda line: "gradient overflow" in line and overflows.append(line))
  losses, times = [], []
  last = [time.perf_counter()]

  def on_step(_, values):
    now = time.perf_counter()
    times.append(now - last[0])
    last[0] = now
    losses.append(float(values["loss"]))

  run.train(steps, on_step=on_step)
  metrics = {k: round(float(v), 4) for k, v in run.evaluate().items()}
  tail = losses[-max(1, steps // 10):]
  return {"final_loss": round(statistics.mean(tail), 4), "eval": metrics,
          "median_step_seconds": round(statistics.median(times[1:]), 4),
          "skipped_steps": len(overflows)}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--models", default="lm.TransformerTiny,image.AmoebaNetTiny")
  parser.add_argument("--dtypes", default="float32,bfloat16,float16")
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--devices", default="cpu:2")
  args = parser.parse_args()
  dtypes = args.dtypes.split(",")
  if dtypes[0] != "float32" or any(d not in DTYPES for d in dtypes):
    parser.error(f"--dtypes must start with float32 and name only {DTYPES}")
  configure_devices(args.devices)
  model_registry.load_param_files()
  results: dict = {}
  for model in args.models.split(","):
    results[model] = {}
    for dtype in dtypes:
      with tempfile.TemporaryDirectory() as logdir:
        r = results[model][dtype] = train_and_eval(model, dtype, args.steps, logdir)
      print(f"{model:22s} {dtype:9s} loss {r['final_loss']:.4f}  eval {r['eval']}  "
            f"step {r['median_step_seconds']:.3f} s", flush=True)
  summary = {"bench": "mixed_precision_accuracy", "steps": args.steps,
             "machine": f"{platform.machine()} {os.cpu_count()} cores, TF {tf.__version__}",
             "python": sys.version.split()[0], "results": results}
  for model, by_dtype in results.items():
    name = model.split(".")[-1]
    for dtype in dtypes[1:]:
      summary[f"{name}_{dtype}_over_float32_loss"] = round(
          by_dtype[dtype]["final_loss"] / by_dtype["float32"]["final_loss"], 4)
      summary[f"{name}_{dtype}_over_float32_step"] = round(
          by_dtype[dtype]["median_step_seconds"] / by_dtype["float32"]["median_step_seconds"], 3)
  print(json.dumps(summary))


if __name__ == "__main__":
  main()
