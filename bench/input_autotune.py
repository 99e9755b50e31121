"""tf.data's autotuning on and off for the shipped inputs: throughput, and the wait
when an iterator is freed.

The inputs run with autotuning off by default (`BaseInputGenerator`'s `autotune`):
in TensorFlow 2.21, freeing an iterator joins the autotuning model thread, which can
sleep out the rest of its optimization period, a period that doubles up to 60 s while
the iterator lives (docs/library.md, "Testing"). This measures what turning it off
costs and what it saves, for each model's training input:

- batches per second over --batches batches after a warm-up, autotuning on and off,
  in alternating rounds (the median of --rounds);
- the seconds `del` of an iterator takes after it has been read for --live_s seconds
  (one batch every 10 ms), on and off, in each round: the stall is a race, so it shows
  in some rounds and not in others.

  python bench/input_autotune.py --rounds 3 --batches 200 --live_s 40

The last line printed is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

from lingvo_gpipe import model_registry  # noqa: E402

MODELS = ("image.AmoebaNetTiny", "lm.TransformerTiny", "lm.TransformerTinyBuckets",
          "mt.MultilingualTiny")


def dataset(model: str, autotune: bool) -> tf.data.Dataset:
  params = model_registry.get_params(model).train_input.copy().set(autotune=autotune)
  return params.instantiate().dataset()


def batches_per_second(model: str, autotune: bool, batches: int) -> float:
  it = iter(dataset(model, autotune))
  for _ in range(20):
    next(it)
  start = time.perf_counter()
  for _ in range(batches):
    next(it)
  return batches / (time.perf_counter() - start)


def seconds_to_free(model: str, autotune: bool, live_s: float) -> float:
  """Reads an iterator for `live_s` seconds (a batch every 10 ms, as a trainer's
  steps would), then times its `del`."""
  it = iter(dataset(model, autotune))
  end = time.perf_counter() + live_s
  while time.perf_counter() < end:
    next(it)
    time.sleep(0.01)
  start = time.perf_counter()
  del it
  return time.perf_counter() - start


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--models", default=",".join(MODELS))
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--batches", type=int, default=200)
  parser.add_argument("--live_s", type=float, default=40.0)
  args = parser.parse_args()
  model_registry.load_param_files()
  result: dict = {}
  for model in args.models.split(","):
    rates: dict[bool, list[float]] = {True: [], False: []}
    frees: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(args.rounds):
      for autotune in (True, False):
        rates[autotune].append(batches_per_second(model, autotune, args.batches))
        if args.live_s > 0:
          frees[autotune].append(seconds_to_free(model, autotune, args.live_s))
    on, off = statistics.median(rates[True]), statistics.median(rates[False])
    print(f"{model}: {on:.0f} batches/s autotuned, {off:.0f} off ({off / on:.2f}x); "
          f"free after {args.live_s:.0f} s: on {[round(s, 2) for s in frees[True]]}, "
          f"off {[round(s, 2) for s in frees[False]]}", flush=True)
    result[model] = {"batches_per_s_autotune": round(on, 1), "batches_per_s_off": round(off, 1),
                     "off_vs_autotune": round(off / on, 3),
                     "free_s_autotune": [round(s, 3) for s in frees[True]],
                     "free_s_off": [round(s, 3) for s in frees[False]]}
  print(json.dumps(result))


if __name__ == "__main__":
  main()
