"""Checkpoint save and restore of a deep stacked model: each row by an eager op of its own
against each stack by one (`stacked_variables.whole_stack_io`, what the trainer uses).

Builds the trainer for the start-up depth sweep's LM (64 wide, hidden 256, 4 heads, L
layers, K=4 cells, Adam: every weight and its two slots are rows of stacks, each saved
under its own key) and times, alternating the two ways in one process, `Checkpoint.write`
and `Checkpoint.read` + `assert_consumed` of the trainer's checkpoint (the model, Adam's
slots, the step). Medians of --repeats; the restored weights are checked equal to the
saved ones each time.

  python bench/checkpoint_io.py --depths 128,512 --repeats 3

The last line printed is one JSON object: save_s_rows_L, save_s_stacks_L, restore_s_rows_L,
restore_s_stacks_L, rows_L (how many rows the checkpoint holds) for each depth.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))


def build_trainer(layers: int, logdir: str):
  """The depth sweep's model (bench/startup_time.py's depth<L>) in a Trainer."""
  import startup_time

  from lingvo_gpipe import model_registry
  from lingvo_gpipe import trainer as trainer_lib

  param_dir = Path(tempfile.mkdtemp(prefix="checkpoint_io_params_"))
  (param_dir / "startup_shapes.py").write_text(
      startup_time.PARAM_FILE
      + f"\n_register('depth{layers}', LAYERS={layers}, CELLS=4, MICRO_BATCHES=8, BATCH=32)\n")
  model_registry.load_param_files([str(param_dir)])
  params = model_registry.get_params(f"startup_shapes.depth{layers}")
  return trainer_lib.Trainer(params, logdir, log=lambda line: None)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--depths", default="128,512")
  parser.add_argument("--repeats", type=int, default=3)
  args = parser.parse_args()
  from lingvo_gpipe.runtime.devices import configure_devices
  configure_devices("cpu:4")
  import numpy as np
  import tensorflow as tf

  from lingvo_gpipe.core import stacked_variables

  summary: dict[str, object] = {"machine": platform.processor() or platform.machine(),
                                "date": time.strftime("%Y-%m-%d")}
  for layers in [int(d) for d in args.depths.split(",")]:
    folder = tempfile.mkdtemp(prefix=f"checkpoint_io_{layers}_")
    trainer = build_trainer(layers, os.path.join(folder, "logdir"))
    checkpoint = trainer.checkpoint
    weights = stacked_variables.trainable_weights(trainer.task)
    want = [w.numpy() for w in weights]
    times: dict[str, list[float]] = {k: [] for k in
                                     ("save_rows", "save_stacks", "restore_rows",
                                      "restore_stacks")}
    for repeat in range(args.repeats + 1):  # the first round warms both ways up
      for way in ("rows", "stacks"):
        scope = stacked_variables.whole_stack_io if way == "stacks" else contextlib.nullcontext
        path = os.path.join(folder, f"{way}_{repeat}")
        start = time.perf_counter()
        with scope():
          path = checkpoint.write(path)
        saved = time.perf_counter() - start
        for w in weights:
          w.assign(tf.zeros_like(w))
        start = time.perf_counter()
        with scope():
          checkpoint.read(path).assert_consumed()
        restored = time.perf_counter() - start
        for w, value in zip(weights, want):
          np.testing.assert_array_equal(w.numpy(), value)
        if repeat:
          times[f"save_{way}"].append(saved)
          times[f"restore_{way}"].append(restored)
    rows = len(tf.train.list_variables(path))
    medians = {k: round(statistics.median(v), 3) for k, v in times.items()}
    print(f"L={layers}: {rows} keys, medians (s) {medians}", flush=True)
    summary[f"rows_{layers}"] = rows
    for key, value in medians.items():  # save_rows → save_s_rows_<L>
      summary[f"{key.replace('_', '_s_', 1)}_{layers}"] = value
  print(json.dumps(summary))


if __name__ == "__main__":
  main()
