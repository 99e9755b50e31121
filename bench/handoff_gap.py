"""Where the loop's time between two actions goes: after a hand-off against after none.

Each device's loop stamps every action's start (once its hand-off is in the inbox) and
end (timeline.py). From the measured timelines of `--steps` training steps this splits
each action's gap since its device's previous action, the device's idle time, into

  wait: the time its hand-off was not yet made: the producer's end (F of cell k−1 for a
        forward, B of cell k+1 for a backward, on another device) after the device's
        previous end; and
  cost: the rest, start − max(previous end, producer's end): what the loop, the receive
        and the executor take once both the device and the data are ready.

and reports the medians of each, by kind of action: `handoff` (its input crossed devices),
`local` (a hand-off between two cells of one device, zbv's turn) and `none` (the first
cell's forward, the last cell's backward, W). Two settings, chosen by --where:

  process:  K logical CPU devices of this process, K inter-op threads and one intra-op
            thread (one rendezvous in memory, no RPC);
  loopback: K worker processes with one inter-op and one intra-op thread each (the
            bench's setting; a receive is a RecvTensor call over gRPC).

  python bench/handoff_gap.py --where=loopback,process --models=mlp,tiny \
      --schedules=1f1b,zbv --micro_batches=8 --steps=15

The last line printed is JSON: {"<where>_<model>_<schedule>_m<M>": {"<kind>_cost_ms": ...,
"<kind>_wait_ms": ..., "<kind>_count": ...}}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

KINDS = ("handoff", "local", "none")


def gaps(measured) -> dict[str, list[tuple[float, float]]]:
  """Per kind, (wait, cost) seconds of every action of `measured` (a MeasuredTimeline)
  that follows another on its device."""
  from lingvo_gpipe.pipeline.schedule import BACKWARD, FORWARD

  span = {(k.cell, k.unit, k.phase): (tuple(t), int(d))
          for t, k, d in zip(measured.times, measured.keys, measured.devices)}
  last_cell = measured.num_cells - 1
  out: dict[str, list[tuple[float, float]]] = {kind: [] for kind in KINDS}
  for device in sorted(set(measured.devices.tolist())):
    rows = sorted((t[0], t[1], k) for t, k, d in zip(measured.times, measured.keys,
                                                      measured.devices) if d == device)
    for (_, previous_end, _), (start, _, key) in zip(rows, rows[1:]):
      producer = None
      if key.phase == FORWARD and key.cell > 0:
        producer = span[(key.cell - 1, key.unit, FORWARD)]
      elif key.phase == BACKWARD and key.cell < last_cell:
        producer = span[(key.cell + 1, key.unit, BACKWARD)]
      if producer is None:
        out["none"].append((0.0, start - previous_end))
        continue
      (_, producer_end), producer_device = producer
      ready = max(previous_end, producer_end)
      kind = "handoff" if producer_device != device else "local"
      out[kind].append((max(0.0, producer_end - previous_end), start - ready))
  return out


def measure(where: str, models: list[str], schedules: list[str], micro_batches: list[int],
            steps: int, k: int) -> dict:
  """This process's figures for `where` (it must be the first TensorFlow use here)."""
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  import pipeline_speedup

  def run_all(devices: list[str]) -> dict:
    results = {}
    for model_name in models:
      for schedule in schedules:
        for m in micro_batches:
          run = pipeline_speedup.make_step(model_name, k, m, devices, schedule,
                                           recompute="never")
          per_kind: dict[str, list[tuple[float, float]]] = {kind: [] for kind in KINDS}
          for _ in range(steps):
            _, measured = run()
            for kind, values in gaps(measured).items():
              per_kind[kind].extend(values)
          figures = {}
          for kind, values in per_kind.items():
            if values:
              for part, index in (("wait", 0), ("cost", 1)):
                median = statistics.median(v[index] for v in values)
                figures[f"{kind}_{part}_ms"] = round(1e3 * float(median), 3)
              figures[f"{kind}_count"] = len(values) // steps
          name = f"{where}_{model_name}_{schedule}_m{m}"
          print(name, figures, flush=True)
          results[name] = figures
    return results

  if where == "loopback":
    from lingvo_gpipe.runtime.local_workers import local_cluster
    with local_cluster(k) as (devices, _):
      return run_all(devices)
  os.environ.setdefault("TF_NUM_INTEROP_THREADS", str(k))  # K sequential devices
  os.environ.setdefault("TF_NUM_INTRAOP_THREADS", "1")
  from lingvo_gpipe.runtime import devices as device_config
  return run_all(device_config.configure_devices(f"cpu:{k}"))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--where", default="loopback,process")
  parser.add_argument("--models", default="mlp,tiny")
  parser.add_argument("--schedules", default="1f1b,zbv")
  parser.add_argument("--micro_batches", default="8")
  parser.add_argument("--steps", type=int, default=15)
  parser.add_argument("--k", type=int, default=2)
  parser.add_argument("--one", help=argparse.SUPPRESS)  # run one --where here
  args = parser.parse_args()
  models, schedules = args.models.split(","), args.schedules.split(",")
  micro_batches = [int(m) for m in args.micro_batches.split(",")]
  if args.one:
    print(json.dumps(measure(args.one, models, schedules, micro_batches, args.steps, args.k)))
    return
  results = {}
  for where in args.where.split(","):  # one process each: joining a cluster is for good
    command = [sys.executable, os.path.abspath(__file__), "--one", where, "--models",
               args.models, "--schedules", args.schedules, "--micro_batches",
               args.micro_batches, "--steps", str(args.steps), "--k", str(args.k)]
    done = subprocess.run(command, stdout=subprocess.PIPE, text=True, check=True)
    lines = done.stdout.strip().splitlines()
    print("\n".join(lines[:-1]), flush=True)
    results.update(json.loads(lines[-1]))
  print(json.dumps(results))


if __name__ == "__main__":
  main()
