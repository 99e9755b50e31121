"""Serving: generate with and without the key/value cache, export cost, pipelined inference.

Three measurements, each reported in the last line's JSON:

1. `generate` tokens/s with the cache ÷ without, for lm.TransformerTiny's model (its
   initial weights: speed does not depend on them) at each batch of --batches, a
   --prefix-token prefix and --new_tokens new tokens: the task's own
   `generate_tokens` with use_cache on (one token per step through the stack, the
   keys and values of the positions before kept per layer) and off (each step the
   whole prefix + new-token buffer through the stack, what a user without a cache
   runs), each as a graph and XLA-compiled (`compiled`, what an export runs),
   alternated, medians; first calls (trace, compile) reported apart. All four must give
   the same tokens (greedy), which the JSON records. `generate_cache_speedup` is the
   lowest over the batches of no cache ÷ cache, both compiled.
2. Export: seconds (restore, trace, write) and SavedModel bytes of the three tiny
   models (image.AmoebaNetTiny, lm.TransformerTiny, mt.MultilingualTiny), exported
   from a checkpoint of their initial weights.
3. Pipelined inference (`pipelined_inference_speedup`): the LM `score` function of an
   8-layer Transformer LM 512 wide (hidden 2048, 8 heads: bench/pipeline_speedup.py's
   Transformer, with an embedding and softmax over a 1,000-word vocabulary) at batch
   --score_batch × 64 tokens, as a forward-only pipeline of K=2 cells on two loopback
   workers (tools/worker.py, one thread each: two sequential "accelerators") with M
   micro-batches, ÷ the same function on one worker. The forward fill-drain bound is
   2M/(M+1).

  python bench/serving.py                      # all three
  python bench/serving.py --parts generate     # one of generate,export,pipelined
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
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

TINY_MODELS = ("image.AmoebaNetTiny", "lm.TransformerTiny", "mt.MultilingualTiny")


def _median_seconds(runs: dict, repeats: int) -> dict:
  """{name: median seconds of run()} with the runs alternated `repeats` times."""
  times: dict = {name: [] for name in runs}
  for _ in range(repeats):
    for name, run in runs.items():
      start = time.perf_counter()
      run()
      times[name].append(time.perf_counter() - start)
  return {name: statistics.median(t) for name, t in times.items()}


def bench_generate(args) -> dict:
  import numpy as np
  import tensorflow as tf

  from lingvo_gpipe import model_registry

  model_registry.load_param_files([])
  params = model_registry.get_params("lm.TransformerTiny")
  params.task.pipeline.set(num_cells=0, splits=[])
  task = params.task.instantiate()
  max_length = args.prefix + args.new_tokens
  vocab_size = task.params.stack.layers[0].vocab_size
  result: dict = {"generate_shape": {"batches": args.batches, "prefix": args.prefix,
                                     "new_tokens": args.new_tokens}}

  def generator(prefix, use_cache: bool, compiled: bool):
    @tf.function(autograph=False)
    def generate():
      return task.generate_tokens(prefix, tf.constant(args.new_tokens), tf.constant(0.0),
                                  tf.constant(1, tf.int64), max_length, use_cache=use_cache,
                                  compiled=compiled)
    return generate

  for batch in args.batches:
    prefix = tf.constant(np.random.RandomState(1).randint(3, vocab_size,
                                                          size=[batch, args.prefix]), tf.int32)
    runs = {f"{'cache' if cache else 'no_cache'}_{'xla' if xla else 'graph'}":
            generator(prefix, cache, xla) for cache in (True, False) for xla in (True, False)}
    first, tokens = {}, {}
    for name, run in runs.items():  # the first call traces (and compiles)
      start = time.perf_counter()
      tokens[name] = run().numpy()
      first[name] = time.perf_counter() - start
    medians = _median_seconds(runs, args.repeats)
    new = batch * args.new_tokens
    for name, seconds in medians.items():
      result[f"generate_tokens_per_s_{name}_b{batch}"] = round(new / seconds, 1)
      result[f"generate_first_call_s_{name}_b{batch}"] = round(first[name], 2)
    for xla in ("xla", "graph"):
      result[f"generate_cache_speedup_{xla}_b{batch}"] = round(
          medians[f"no_cache_{xla}"] / medians[f"cache_{xla}"], 2)
    result[f"generate_same_tokens_b{batch}"] = all(
        np.array_equal(t, tokens["no_cache_graph"]) for t in tokens.values())
    print(f"generate, batch {batch}: " + ", ".join(
        f"{name} {new / seconds:.0f} tokens/s" for name, seconds in medians.items())
        + f"; same tokens: {result[f'generate_same_tokens_b{batch}']}", flush=True)
  # The headline: what the export runs (the cache, XLA) ÷ the same without the cache.
  result["generate_cache_speedup"] = min(result[f"generate_cache_speedup_xla_b{b}"]
                                         for b in args.batches)
  return result


def bench_export() -> dict:
  import tensorflow as tf  # noqa: F401

  from lingvo_gpipe import exporter, model_registry
  from lingvo_gpipe.trainer import Trainer

  model_registry.load_param_files([])
  result = {}
  for key in TINY_MODELS:
    params = model_registry.get_params(key)
    params.task.pipeline.partition_cost = "params"
    params = params.freeze()
    with tempfile.TemporaryDirectory() as logdir:
      trainer = Trainer(params, logdir, log=lambda _: None)
      trainer.checkpoints.repair(trainer.checkpoints.restore_newest())
      trainer.save()
      start = time.perf_counter()
      path = exporter.export(params, logdir, model_name=key, log=lambda _: None)
      seconds = time.perf_counter() - start
      size = sum(os.path.getsize(os.path.join(folder, name))
                 for folder, _, names in os.walk(path) for name in names)
    name = key.split(".")[1]
    result[f"export_seconds_{name}"] = round(seconds, 2)
    result[f"export_bytes_{name}"] = size
    print(f"export {key}: {seconds:.2f} s, {size / 2**20:.2f} MiB", flush=True)
  return result


def bench_pipelined(args) -> dict:
  from lingvo_gpipe.runtime.local_workers import local_cluster

  with local_cluster(2) as (devices, _):
    import numpy as np
    import tensorflow as tf

    from lingvo_gpipe.models import transformer
    from lingvo_gpipe.tasks import serving
    from lingvo_gpipe.tasks.language_model import LanguageModelTask

    def score_function(num_cells: int, micro_batches: int):
      p = LanguageModelTask.Params().set(name="lm512")
      p.stack = transformer.lm_stack(1000, model_dim=512, hidden_dim=2048, num_heads=8,
                                     num_layers=8)
      if num_cells > 1:
        p.pipeline.set(num_cells=num_cells, num_micro_batches=micro_batches,
                       devices=devices[:num_cells])
      with tf.device(devices[0]):
        task = p.instantiate()
        model = serving.ServingModel(task, None, serving.ServingOptions())
      return model.functions["score"]

    rng = np.random.RandomState(2)
    ids = tf.constant(rng.randint(3, 1000, size=[args.score_batch, 64]), tf.int32)
    paddings = tf.zeros([args.score_batch, 64], tf.float32)
    runs = {"single": score_function(1, 1)}
    for m in args.micro_batches:
      runs[f"k2_m{m}"] = score_function(2, m)
    def call(function):
      # On worker 0: the unpipelined function's ops carry no device and would otherwise
      # run on this client, which is not limited to one thread.
      with tf.device(devices[0]):
        return function(ids=ids, paddings=paddings)["log_prob"].numpy()

    calls = {name: (lambda f=f: call(f)) for name, f in runs.items()}
    reference = calls["single"]()
    agree = {name: float(np.max(np.abs(call() - reference))) for name, call in calls.items()}
    medians = _median_seconds(calls, args.repeats)
    result = {"pipelined_inference_seconds": {k: round(v, 4) for k, v in medians.items()},
              "pipelined_inference_max_abs_diff": agree}
    for m in args.micro_batches:
      result[f"pipelined_inference_speedup_m{m}"] = round(
          medians["single"] / medians[f"k2_m{m}"], 3)
    result["pipelined_inference_speedup"] = max(
        result[f"pipelined_inference_speedup_m{m}"] for m in args.micro_batches)
    for name, seconds in medians.items():
      print(f"score {name}: {seconds * 1e3:.1f} ms", flush=True)
    return result


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--parts", default="generate,export,pipelined")
  parser.add_argument("--batches", type=lambda s: [int(b) for b in s.split(",")],
                      default=[1, 8], help="generate's batch sizes")
  parser.add_argument("--prefix", type=int, default=4, help="generate's prefix tokens")
  parser.add_argument("--new_tokens", type=int, default=64)
  parser.add_argument("--score_batch", type=int, default=64)
  parser.add_argument("--micro_batches", type=lambda s: [int(m) for m in s.split(",")],
                      default=[2, 4, 8])
  parser.add_argument("--repeats", type=int, default=7)
  args = parser.parse_args()
  parts = args.parts.split(",")
  summary: dict = {}
  if "generate" in parts:
    summary.update(bench_generate(args))
  if "export" in parts:
    summary.update(bench_export())
  if "pipelined" in parts and len(parts) > 1:
    # In a process of its own: it joins a cluster, and functions of the other parts
    # would be "removed remotely" from it at exit, one error line each.
    import subprocess

    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--parts=pipelined",
                           f"--score_batch={args.score_batch}", f"--repeats={args.repeats}",
                           "--micro_batches=" + ",".join(map(str, args.micro_batches))],
                          stdout=subprocess.PIPE, text=True, check=True)
    print(done.stdout.rstrip("\n").rpartition("\n")[0], flush=True)
    summary.update(json.loads(done.stdout.strip().splitlines()[-1]))
  elif "pipelined" in parts:
    summary.update(bench_pipelined(args))
  print(json.dumps(summary))


if __name__ == "__main__":
  main()
