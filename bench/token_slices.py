"""Token slices (TeraPipe): step time and bubble of a causal LM with few sequences.

A pipeline whose mini-batch holds few sequences has few micro-batches: at 4 sequences
on K cells, M ≤ 4 and the fill-drain bubble is (K−1)/(M+K−1). Cutting every
micro-batch into S token slices (`num_token_slices`, core/token_slices.py) makes the
schedule's units M·S slices of 1/S the work each. This benchmark trains the
Transformer LM stack of `bench/pipeline_speedup.py` (8 causal layers, model 512,
hidden 2048, 8 heads) on --batch sequences of --length tokens with M = --micro_batches,
on K one-thread loopback workers (tools/worker.py; one process per worker, like one
sequential accelerator each), for each S of --slices:

  step_seconds            median wall time of a training step (forward, recomputed
                          forward, backward, SGD)
  speedup_vs_s1           S=1's step ÷ this one's, measured side by side (the
                          configurations alternate step by step)
  speedup_vs_plain_single what a user whose model fits one device runs instead (the
                          same layers in plain TensorFlow on worker 0: no pipeline,
                          no micro-batches, no re-materialization; in the same
                          alternation) ÷ this step
  bubble_measured         idle share of the workers in the measured schedule
  bubble_planned          the schedule simulated with the step's own measured call
                          times (what it would give with free hand-offs)
  bubble_theoretical      (K−1)/(M·S+K−1), equal cells and units
  worker_cpu_seconds      median CPU time of a step summed over the K worker processes
                          (user + system, from /proc): the work a step does, whatever
                          the cores it ran on
  cores_busy              median of worker_cpu_seconds ÷ step_seconds: how many cores
                          the workers kept busy (at most the machine's cores; when it is
                          there, a smaller bubble cannot shorten the step, only less
                          work can)
  work_vs_s1              worker_cpu_seconds ÷ S=1's: the work slicing adds
  peak_gb_per_worker      each worker's peak bytes in use (TensorFlow's BFC allocator:
                          weights, slots, stash, cache, activations, transfer
                          buffers) over two steps, in a cluster of fresh workers
                          that run only this configuration

Each cluster runs in a process of its own (a client joins one cluster per process):
the timed one per K, and one per (K, S) for the memory.

  python bench/token_slices.py                      # K ∈ {2, 4}, S ∈ {1, 2, 4, 8}
  python bench/token_slices.py --workers 2 --length 256 --steps 5

K one-thread workers need K cores to behave like K devices: on a machine with fewer
cores (this project's have 2), K=4's workers share them, so its step times are not
those of 4 devices; the measured bubble still counts when a worker waits on another.

Where slicing costs time: `--profile` runs each S on one device in this process (one
inter-op and one intra-op thread, the workers' settings) and attributes the
profiled op time to phases and op types (bench/micro_batch_profile.py's), one column
per S:

  python bench/token_slices.py --profile --slices 1,8
The last line printed is one JSON object: `results` per configuration, and for each
K `k<K>_s<S>_speedup_vs_s1` and `k<K>_s<S>_bubble_over_s1` (measured bubble ÷ S=1's).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")  # inherited by the worker processes
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # pipeline_speedup


def make_step(args, num_slices: int, devices: list[str]):
  """A traced, warmed-up training step at S = num_slices: run() → (seconds, measured
  schedule); run.plan is its schedule."""
  import pipeline_speedup
  import tensorflow as tf

  from lingvo_gpipe.pipeline import layer as gpipe

  with tf.device(devices[0]):
    stack, inputs = pipeline_speedup.model_layers("transformer", args.batch, args.length,
                                                  args.keep_prob)
  model = gpipe.PipeliningLayer.Params().set(
      name="lm", layers=stack, num_cells=len(devices), num_micro_batches=args.micro_batches,
      num_token_slices=num_slices, devices=devices, schedule=args.schedule,
      weight_gradient_group=num_slices if args.weight_gradient_group == "S" else 1,
      random_seed=1).instantiate()

  def mean_square(outputs, _):
    """Mean square of the outputs over a unit's tokens, weighted by its tokens (so the
    units' weighted mean is the whole batch's mean)."""
    out = tf.nest.flatten(outputs)[0]
    tokens = tf.cast(tf.shape(out)[0] * tf.shape(out)[1], tf.float32)
    return {"loss": (tf.reduce_mean(tf.square(out)), tokens)}

  return pipeline_speedup.train_step_runner(model, mean_square, inputs, devices[0])


def measure_memory(args) -> list[float]:
  """Each worker's peak GB in use over two steps at K = args.workers, S = args.slices
  (one value), fresh workers counting with the BFC allocator."""
  import tempfile

  from lingvo_gpipe.runtime.local_workers import local_cluster
  from lingvo_gpipe.runtime.memory_log import memory_log_path, read_memory_log

  os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"  # the workers inherit it
  with tempfile.TemporaryDirectory() as logs:
    with local_cluster(args.workers, memory_log_dir=logs) as (devices, _):
      run = make_step(args, int(args.slices), devices)
      run()
      time.sleep(2.0)  # the workers log every 0.5 s
      return [round(read_memory_log(memory_log_path(logs, k))["peak_bytes_in_use"] / 1e9, 3)
              for k in range(args.workers)]


def profile(args) -> dict:
  """K=1, M = --micro_batches, each S of --slices on this process's CPU: step time and
  op time by phase and op type (bench/micro_batch_profile.py)."""
  import collections

  import micro_batch_profile

  columns = {}
  for s in (int(s) for s in args.slices.split(",")):
    run = make_step(args, s, ["/device:CPU:0"])
    wall_ms = 1e3 * statistics.median(run()[0] for _ in range(args.steps))
    times, profiled_wall_ms = micro_batch_profile.op_times(run, 3)
    phases = dict.fromkeys(micro_batch_profile.PHASES, 0.0)
    by_type: dict = collections.defaultdict(float)
    for (name, op_type), ms in times.items():
      phases[micro_batch_profile.phase_of(name, op_type, set())] += ms
      by_type[op_type] += ms
    phases["executor overhead"] = profiled_wall_ms - sum(times.values())
    columns[f"S={s}"] = {"step_ms": wall_ms, "phases_ms": phases, "op_types_ms": dict(by_type)}
  micro_batch_profile._print_table("token slices, K=1", columns)  # noqa: SLF001
  return {name: {"step_ms": round(c["step_ms"], 1),
                 "phases_ms": {k: round(v, 1) for k, v in c["phases_ms"].items()},
                 "op_types_ms": {k: round(v, 1) for k, v in sorted(
                     c["op_types_ms"].items(), key=lambda kv: -kv[1])[:15]}}
          for name, c in columns.items()}


def cpu_seconds(pids: list[int]) -> float:
  """User + system CPU seconds the processes `pids` have used so far (Linux /proc)."""
  ticks = os.sysconf("SC_CLK_TCK")
  total = 0
  for pid in pids:
    with open(f"/proc/{pid}/stat") as stat:
      fields = stat.read().rsplit(")", 1)[1].split()  # after "pid (comm)"
    total += int(fields[11]) + int(fields[12])  # utime, stime: fields 14 and 15
  return total / ticks


def run_one_cluster(args) -> dict:
  """All S at K = args.workers, in this process's cluster: {config: figures}."""
  from lingvo_gpipe.runtime.local_workers import local_cluster

  k, m = args.workers, args.micro_batches
  slices = [int(s) for s in args.slices.split(",")]
  with local_cluster(k) as (devices, workers):
    import pipeline_speedup

    runners = {s: make_step(args, s, devices) for s in slices}
    runners["plain"] = pipeline_speedup.make_plain_step(
        "transformer", devices[0], batch=args.batch, length=args.length,
        keep_prob=args.keep_prob)
    pids = [w.pid for w in workers]
    times: dict = {s: [] for s in runners}
    cpu: dict = {s: [] for s in runners}
    measured: dict = {s: [] for s in runners}
    for _ in range(args.steps):
      for s, run in runners.items():
        cpu_before = cpu_seconds(pids)
        seconds, schedule = run()
        cpu[s].append(cpu_seconds(pids) - cpu_before)
        times[s].append(seconds)
        measured[s].append(schedule)
    results = {}
    plain = statistics.median(times.pop("plain"))
    results[f"k{k}_plain"] = {"step_seconds": round(plain, 4),
                              "worker_cpu_seconds": round(statistics.median(cpu["plain"]), 3)}
    base = statistics.median(times[slices[0]])
    base_cpu = statistics.median(cpu[slices[0]])
    for s in slices:
      run, step = runners[s], statistics.median(times[s])
      runs = measured[s]
      results[f"k{k}_m{m}_s{s}"] = {
          "step_seconds": round(step, 4),
          "speedup_vs_s1": round(base / step, 3) if slices[0] == 1 else None,
          "speedup_vs_plain_single": round(plain / step, 3),
          "bubble_measured": round(statistics.median(r.bubble() for r in runs), 3),
          "bubble_planned": round(statistics.median(
              r.summary(run.plan)["pipeline/bubble_planned"] for r in runs), 3),
          "bubble_theoretical": round((k - 1) / (m * s + k - 1), 3),
          "worker_cpu_seconds": round(statistics.median(cpu[s]), 3),
          "cores_busy": round(statistics.median(c / t for c, t in zip(cpu[s], times[s])), 2),
          "work_vs_s1": (round(statistics.median(cpu[s]) / base_cpu, 3)
                         if slices[0] == 1 else None),
          "first_step_seconds": round(run.first_step_seconds, 1),
      }
      print(f"K={k} M={m} S={s}: {results[f'k{k}_m{m}_s{s}']}", file=sys.stderr, flush=True)
  return results


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--workers", default="2,4", help="K values, one cluster each")
  parser.add_argument("--slices", default="1,2,4,8", help="S values (the first the base)")
  parser.add_argument("--micro_batches", type=int, default=4)
  parser.add_argument("--batch", type=int, default=4, help="sequences per step")
  parser.add_argument("--length", type=int, default=512, help="tokens per sequence")
  parser.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b"])
  parser.add_argument("--keep_prob", type=float, default=1.0,
                      help="dropout keep probability of every layer (1: no dropout)")
  parser.add_argument("--steps", type=int, default=7, help="timed steps per configuration")
  parser.add_argument("--weight_gradient_group", default="1", choices=["1", "S"],
                      help="G: 1, or S (the projections' weight gradients of a "
                      "micro-batch's S slices in one product: PipeliningLayer's "
                      "weight_gradient_group)")
  parser.add_argument("--one_cluster", choices=["time", "memory"],
                      help="(internal) run --workers' single K here (memory: at the single "
                      "S of --slices), print its JSON")
  parser.add_argument("--profile", action="store_true",
                      help="profile each S at K=1 in this process instead (see above)")
  args = parser.parse_args()
  if args.profile:
    os.environ.update(TF_NUM_INTEROP_THREADS="1", TF_NUM_INTRAOP_THREADS="1")
    print(json.dumps({"bench": "token_slices --profile", "length": args.length,
                      "keep_prob": args.keep_prob,
                      "batch": args.batch, "micro_batches": args.micro_batches,
                      "profile": profile(args)}))
    return
  if args.one_cluster:
    args.workers = int(args.workers)
    print(json.dumps(run_one_cluster(args) if args.one_cluster == "time"
                     else measure_memory(args)))
    return

  def in_a_process(mode: str, k: int, slices: str) -> object:
    command = [sys.executable, __file__, f"--one_cluster={mode}", f"--workers={k}",
               f"--slices={slices}"] + [f"--{name}={getattr(args, name)}" for name in
                                        ("micro_batches", "batch", "length", "schedule",
                                         "steps", "weight_gradient_group", "keep_prob")]
    out = subprocess.run(command, check=True, stdout=subprocess.PIPE, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])

  results: dict = {}
  for k in [int(k) for k in args.workers.split(",")]:
    timed = in_a_process("time", k, args.slices)
    for s in args.slices.split(","):
      timed[f"k{k}_m{args.micro_batches}_s{s}"]["peak_gb_per_worker"] = in_a_process(
          "memory", k, s)
    results.update(timed)
  summary = {"bench": "token_slices", "weight_gradient_group": args.weight_gradient_group,
             "keep_prob": args.keep_prob,
             "machine": f"{platform.machine()} {os.cpu_count()} cores",
             "onednn": os.environ["TF_ENABLE_ONEDNN_OPTS"],
             "batch": args.batch, "length": args.length, "schedule": args.schedule,
             "steps_per_config": args.steps, "results": results}
  for name, r in results.items():
    if not name.endswith(("_s1", "_plain")):
      k_m, s = name.rsplit("_s", 1)
      base = results.get(f"{k_m}_s1")
      k = k_m.split("_")[0]
      summary[f"{k}_s{s}_speedup_vs_s1"] = r["speedup_vs_s1"]
      if base:
        summary[f"{k}_s{s}_bubble_over_s1"] = round(
            r["bubble_measured"] / max(base["bubble_measured"], 1e-9), 3)
  print(json.dumps(summary))


if __name__ == "__main__":
  main()
