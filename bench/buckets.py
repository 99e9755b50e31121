"""Length buckets against fixed-length batches on long-tailed text: padding, training
tokens per second at K=2 on two workers, and what each extra bucket costs at start-up.

The text is the synthetic LM corpus with Zipf-like sentence lengths (P(n) ∝ 1/(n − 3)
for 4 ≤ n ≤ 126 words: mostly short sentences, a long tail), padded to 128 tokens.
Both configurations hold about the same tokens per step (2048 positions):

  fixed:    16 sentences × 128 tokens, every batch;
  bucketed: bucket j holds 2048 // u_j sentences of up to u_j tokens
            (u = 6, 8, 11, 15, 20, 27, 36, 48, 64, 96, 128).

The model is a 4-layer Transformer LM (d 256, hidden 1024, 4 heads), K=2 cells on two
loopback workers (one inter-op and one intra-op thread each), M=4, trained by the real
trainer (trainer.Trainer). Figures:

  padding_fraction_*: padded positions ÷ all positions over --padding_batches batches;
  tokens_per_s_*: real (non-padding) tokens trained per second, over the steps after
    each batch shape's first (which pays its trace and the executor's set-up);
  bucketed_vs_fixed_tokens_per_s: their ratio (target ≥ 1.5);
  trace_s_per_extra_bucket: (the bucketed step's build − the fixed one's) ÷ (n − 1),
    every bucket traced up front (task.train.trace_buckets='up_front');
  when_needed_trace_s: the median trace of a bucket at its first batch
    ('when_needed');
  first_run_extra_s: the median, over buckets, of a bucket's first step less its later
    steps' median (the set-up neither mode can do ahead of the first batch).

  python bench/buckets.py --steps 60

The last line printed is JSON with these figures.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")  # inherited by the worker processes

BOUNDS = [6, 8, 11, 15, 20, 27, 36, 48, 64, 96, 128]
TOKENS_PER_BATCH = 2048
LENGTH = 128


def make_params(bucketed: bool, trace_buckets: str = "up_front"):
  """The bench's LM params (task, train_input, eval_input): fixed-length or bucketed
  batches."""
  from lingvo_gpipe.base_model_params import SingleTaskModelParams
  from lingvo_gpipe.core import optimizers
  from lingvo_gpipe.inputs.synthetic_text import SyntheticLm
  from lingvo_gpipe.models import transformer
  from lingvo_gpipe.tasks.language_model import LanguageModelTask

  class ZipfLm(SingleTaskModelParams):
    def train_input(self):
      text = SyntheticLm.Params().set(
          name="zipf_lm", num_examples=20000, min_length=4, max_length=LENGTH - 2,
          sequence_length=LENGTH, length_distribution="zipf",
          batch_size=TOKENS_PER_BATCH // LENGTH)
      if bucketed:
        text.set(bucket_upper_bounds=BOUNDS,
                 bucket_batch_sizes=[TOKENS_PER_BATCH // u for u in BOUNDS])
      return text

    def task(self):
      vocab_size = self.train_input().instantiate().vocab.size
      task = LanguageModelTask.Params().set(name="zipf_lm")
      task.stack = transformer.lm_stack(vocab_size, model_dim=256, hidden_dim=1024,
                                        num_heads=4, num_layers=4)
      task.pipeline.set(num_cells=2, num_micro_batches=4)
      task.train.optimizer = optimizers.Adam.Params().set(learning_rate=1e-3)
      task.train.set(max_steps=10**6, save_interval_steps=10**6,
                     summary_interval_steps=10**6, log_interval_steps=10**6,
                     trace_buckets=trace_buckets)
      return task

  return ZipfLm().model_params()


def padding_fraction(params, batches: int) -> float:
  """Padded positions ÷ all positions over the input's first `batches` batches."""
  from lingvo_gpipe.inputs import buckets

  made = params.train_input.instantiate()
  groups = made.sequence_groups()
  padded = total = 0.0
  for batch, _ in zip(made.dataset(), range(batches)):
    size = sum(int(batch[g.paddings].shape.num_elements()) for g in groups)
    padded += buckets.padding_fraction(batch, groups) * size
    total += size
  return padded / total


def train(params, steps: int) -> dict:
  """Trains `steps` steps; returns the build's and each step's seconds, each step's
  batch shape and real tokens, and the traces made at a first batch."""
  import numpy as np

  from lingvo_gpipe import trainer

  lines: list[str] = []
  twin = iter(params.train_input.instantiate().dataset())  # the same batches, in order
  stamps: list[float] = []
  with tempfile.TemporaryDirectory() as logdir:
    run = trainer.Trainer(params.freeze(), logdir, log=lines.append)
    started = time.perf_counter()
    run.train(steps, on_step=lambda step, values: stamps.append(time.perf_counter()))
  seconds = np.diff([started] + stamps)
  shapes, tokens = [], []
  for _ in range(steps):
    batch = next(twin)
    shapes.append(tuple(batch["ids"].shape))
    tokens.append(int((batch["paddings"].numpy() < 0.5).sum()))
  built = [float(m.group(1)) for line in lines
           for m in [re.search(r"Built the training step in ([0-9.]+) s", line)] if m]
  mid_run = [float(m.group(1)) for line in lines
             for m in [re.search(r"Built the training step for .* in ([0-9.]+) s", line)] if m]
  build = built[0] if built else 0.0
  return {"build_s": build, "seconds": list(seconds), "shapes": shapes, "tokens": tokens,
          "mid_run_traces_s": mid_run}


def steady_rate(result: dict) -> tuple[float, float]:
  """(real tokens per second over the steps after each shape's first; the median over
  shapes of a shape's first step less its later steps' median)."""
  first_seen: set = set()
  kept_tokens = kept_seconds = 0.0
  later: dict = {}
  first: dict = {}
  for shape, tokens, seconds in zip(result["shapes"], result["tokens"], result["seconds"]):
    if shape not in first_seen:
      first_seen.add(shape)
      first[shape] = seconds
      continue
    kept_tokens += tokens
    kept_seconds += seconds
    later.setdefault(shape, []).append(seconds)
  extras = [first[s] - statistics.median(later[s]) for s in later]
  return kept_tokens / kept_seconds, statistics.median(extras) if extras else 0.0


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--steps", type=int, default=60)
  parser.add_argument("--padding_batches", type=int, default=400)
  args = parser.parse_args()

  from lingvo_gpipe.runtime import devices as device_config
  from lingvo_gpipe.runtime.local_workers import local_cluster

  fixed_params, bucketed_params = make_params(False), make_params(True)
  results = {"padding_fraction_fixed": round(padding_fraction(fixed_params,
                                                              args.padding_batches), 4),
             "padding_fraction_bucketed": round(padding_fraction(bucketed_params,
                                                                 args.padding_batches), 4)}
  print(results, flush=True)
  with local_cluster(2) as (devices, _):
    device_config.set_default_devices(devices)
    fixed = train(fixed_params, args.steps)
    bucketed = train(bucketed_params, args.steps)
    when_needed = train(make_params(True, "when_needed"), args.steps)
  fixed_rate, _ = steady_rate(fixed)
  bucketed_rate, first_run_extra = steady_rate(bucketed)
  buckets_seen = len(set(bucketed["shapes"]))
  results.update({
      "tokens_per_s_fixed": round(fixed_rate, 1),
      "tokens_per_s_bucketed": round(bucketed_rate, 1),
      "bucketed_vs_fixed_tokens_per_s": round(bucketed_rate / fixed_rate, 3),
      "real_tokens_per_step_fixed": round(statistics.mean(fixed["tokens"]), 1),
      "real_tokens_per_step_bucketed": round(statistics.mean(bucketed["tokens"]), 1),
      "build_s_fixed": round(fixed["build_s"], 2),
      "build_s_bucketed_up_front": round(bucketed["build_s"], 2),
      "trace_s_per_extra_bucket": round((bucketed["build_s"] - fixed["build_s"])
                                        / (len(BOUNDS) - 1), 3),
      "when_needed_trace_s": round(statistics.median(when_needed["mid_run_traces_s"]), 3)
      if when_needed["mid_run_traces_s"] else None,
      "first_run_extra_s": round(first_run_extra, 3),
      "buckets": len(BOUNDS), "buckets_seen": buckets_seen, "steps": args.steps,
  })
  print(json.dumps(results))


if __name__ == "__main__":
  sys.exit(main())
