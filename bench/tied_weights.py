"""Tied against untied embedding and softmax, and against Megatron's tie: the step time.

A tied softmax on another device than the embedding reads a copy of the table on its
own device, refreshed once per step, and hands the copy's gradient back
(pipeline/tied_weights.py): two transfers of V·D per step, one variable, one update.
Megatron's way keeps two trainable tables, one on each end, equal from the start: each
step their gradients are all-reduced (each end sends its gradient to the other and adds
the one it receives: also two transfers of V·D) and each end updates its own table and
its own optimizer slots with the sum. Here that is the untied model with its two
tables' gradients so summed (`megatron_all_reduce`, patched into the step for those
runs only).

This times the LM tied, untied and Megatron-tied at K=2 on two loopback workers (one
thread each), M=4, by the real trainer, and reports each step's median, the ratios, and
the parameters.

  python bench/tied_weights.py --steps 30 --vocab 8192

The model: a 4-layer Transformer LM (d 256, hidden 1024, 4 heads) over a vocabulary of
--vocab ids (the synthetic corpus's words, its table padded up to the size asked), 16
sentences of 64 tokens per step. The last line printed is JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")  # inherited by the worker processes

import tensorflow as tf  # noqa: E402

MODEL_DIM = 256


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
      task.stack = transformer.lm_stack(vocab, model_dim=MODEL_DIM, hidden_dim=1024, num_heads=4,
                                        num_layers=4, tie_embedding_softmax=tied)
      task.pipeline.set(num_cells=2, num_micro_batches=4)
      task.train.optimizer = optimizers.Adam.Params().set(learning_rate=1e-3)
      task.train.set(max_steps=10**6, save_interval_steps=10**6,
                     summary_interval_steps=10**6, log_interval_steps=10**6)
      return task

  return Lm().model_params()


def two_tables(variables, vocab: int) -> tuple[int, int]:
  """The indices of the untied model's embedding table [1, V, D] (the first variable of
  that shape: its first cell's) and softmax weight [1, D, V] (the last of that shape:
  its last cell's) among `variables`."""
  shapes = [tuple(v.shape[-2:]) for v in variables]
  embedding = shapes.index((vocab, MODEL_DIM))
  softmax = len(shapes) - 1 - shapes[::-1].index((MODEL_DIM, vocab))
  return embedding, softmax


@contextlib.contextmanager
def megatron_all_reduce(vocab: int):
  """While open, the training step (built in it) all-reduces the gradients of the
  untied model's two tables as Megatron does between its first and last stage: each
  end receives the other's gradient [V, D] and adds it, on its own device; each end's
  optimizer then updates its own table with the sum."""
  from lingvo_gpipe.pipeline import hybrid

  plain = hybrid.Replicas.all_reduce_gradients

  def all_reduce(self, grads, loss_weights):
    grads = [list(g) for g in plain(self, grads, loss_weights)]
    variables = self.trainable_variables[0]
    i, j = two_tables(variables, vocab)
    g = grads[0]
    with tf.device(variables[i].device):
      to_embedding = g[i] + tf.transpose(g[j], [0, 2, 1])
    with tf.device(variables[j].device):
      to_softmax = g[j] + tf.transpose(g[i], [0, 2, 1])
    g[i], g[j] = to_embedding, to_softmax
    return grads

  hybrid.Replicas.all_reduce_gradients = all_reduce
  try:
    yield
  finally:
    hybrid.Replicas.all_reduce_gradients = plain


def step_seconds(params, steps: int, megatron_vocab: int | None = None
                 ) -> tuple[list[float], int, float]:
  """Each step's seconds after the first, the trainable parameter count, and how far
  apart the two tables ended (max |E − Wᵀ|; 0 when not Megatron's).
  `megatron_vocab`: the untied model's tables are tied Megatron's way (equal at the
  start, their gradients all-reduced)."""
  from lingvo_gpipe import trainer

  stamps: list[float] = []
  with tempfile.TemporaryDirectory() as logdir, (
      megatron_all_reduce(megatron_vocab) if megatron_vocab else contextlib.nullcontext()):
    run = trainer.Trainer(params.freeze(), logdir, log=lambda _: None)
    if megatron_vocab:
      variables = run.task.trainable_variables
      i, j = two_tables(variables, megatron_vocab)
      variables[j].assign(tf.transpose(variables[i], [0, 2, 1]))
    run.train(steps, on_step=lambda step, values: stamps.append(time.perf_counter()))
    count = sum(int(v.shape.num_elements())
                for v in run.task.trainable_variables)
    apart = 0.0
    if megatron_vocab:
      i, j = two_tables(run.task.trainable_variables, megatron_vocab)
      apart = float(tf.reduce_max(tf.abs(variables[i] - tf.transpose(variables[j], [0, 2, 1]))))
  return [b - a for a, b in zip(stamps, stamps[1:])], count, apart


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
    times: dict[str, list[float]] = {"tied": [], "untied": [], "megatron": []}
    counts: dict[str, int] = {}
    apart = 0.0
    for _ in range(2):
      for name in ("untied", "megatron", "tied"):
        seconds, counts[name], tables_apart = step_seconds(
            make_params(name == "tied", args.vocab), args.steps // 2,
            megatron_vocab=args.vocab if name == "megatron" else None)
        times[name] += seconds
        apart = max(apart, tables_apart)
  tied, untied, megatron = (statistics.median(times[k])
                            for k in ("tied", "untied", "megatron"))
  print(json.dumps({
      "step_s_tied": round(tied, 4), "step_s_untied": round(untied, 4),
      "step_s_megatron": round(megatron, 4),
      "tied_vs_untied_step": round(tied / untied, 3),
      "tied_vs_megatron_step": round(tied / megatron, 3),
      "megatron_vs_untied_step": round(megatron / untied, 3),
      "megatron_tables_apart": apart,
      "params_tied": counts["tied"], "params_untied": counts["untied"],
      "params_saved": counts["untied"] - counts["tied"], "vocab": args.vocab,
      "table_bytes": args.vocab * MODEL_DIM * 4, "steps": args.steps}))


if __name__ == "__main__":
  sys.exit(main())
