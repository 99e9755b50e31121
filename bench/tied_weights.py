"""Tied against untied embedding and softmax: the step time and what the tie moves.

A tied softmax on another device than the embedding reads a copy of the table on its
own device, refreshed once per step, and hands the copy's gradient back
(pipeline/tied_weights.py): two transfers of V·D per step. This times the same LM
tied and untied at K=2 on two loopback workers (one thread each), M=4, by the real
trainer, and reports each step's median, their ratio, and the parameters.

  python bench/tied_weights.py --steps 30 --vocab 8192

The model: a 4-layer Transformer LM (d 256, hidden 1024, 4 heads) over a vocabulary of
--vocab ids (the synthetic corpus's words, its table padded up to the size asked), 16
sentences of 64 tokens per step. The last line printed is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")  # inherited by the worker processes


def make_params(tied: bool, vocab: int):
  """The bench's LM params (task, train_input, eval_input)."""
  from lingvo_gpipe.base_model_params import SingleTaskModelParams
  from lingvo_gpipe.core import optimizers
  from lingvo_gpipe.inputs.synthetic_text import SyntheticLm
  from lingvo_gpipe.models import transformer
  from lingvo_gpipe.tasks.language_model import LanguageModelTask

  class Lm(SingleTaskModelParams):
    def train_input(self):
      return SyntheticLm.Params().set(name="lm", num_examples=4000, min_length=20,
                                      max_length=62, sequence_length=64, batch_size=16)

    def task(self):
      task = LanguageModelTask.Params().set(name="lm")
      task.stack = transformer.lm_stack(vocab, model_dim=256, hidden_dim=1024, num_heads=4,
                                        num_layers=4, tie_embedding_softmax=tied)
      task.pipeline.set(num_cells=2, num_micro_batches=4)
      task.train.optimizer = optimizers.Adam.Params().set(learning_rate=1e-3)
      task.train.set(max_steps=10**6, save_interval_steps=10**6,
                     summary_interval_steps=10**6, log_interval_steps=10**6)
      return task

  return Lm().model_params()


def step_seconds(params, steps: int) -> tuple[list[float], int]:
  """Each step's seconds after the first, and the trainable parameter count."""
  from lingvo_gpipe import trainer

  stamps: list[float] = []
  with tempfile.TemporaryDirectory() as logdir:
    run = trainer.Trainer(params.freeze(), logdir, log=lambda _: None)
    run.train(steps, on_step=lambda step, values: stamps.append(time.perf_counter()))
    count = sum(int(v.shape.num_elements())
                for v in run.task.trainable_variables)
  return [b - a for a, b in zip(stamps, stamps[1:])], count


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--steps", type=int, default=30)
  parser.add_argument("--vocab", type=int, default=8192)
  args = parser.parse_args()

  from lingvo_gpipe.runtime import devices as device_config
  from lingvo_gpipe.runtime.local_workers import local_cluster

  with local_cluster(2) as (devices, _):
    device_config.set_default_devices(devices)
    # Alternating rounds: the machine drifts; each figure is a median over both rounds.
    times: dict[str, list[float]] = {"tied": [], "untied": []}
    counts: dict[str, int] = {}
    for _ in range(2):
      for name in ("untied", "tied"):
        seconds, counts[name] = step_seconds(make_params(name == "tied", args.vocab),
                                             args.steps // 2)
        times[name] += seconds
  tied, untied = (statistics.median(times[k]) for k in ("tied", "untied"))
  print(json.dumps({
      "step_s_tied": round(tied, 4), "step_s_untied": round(untied, 4),
      "tied_vs_untied_step": round(tied / untied, 3),
      "params_tied": counts["tied"], "params_untied": counts["untied"],
      "params_saved": counts["untied"] - counts["tied"], "vocab": args.vocab,
      "table_bytes": args.vocab * 256 * 4, "steps": args.steps}))


if __name__ == "__main__":
  sys.exit(main())
