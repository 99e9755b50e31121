"""Op-type census of traced pipeline steps: a refactoring of the engine that should not
change the step shows it did not.

Traces the trainer's step (`pipeline_speedup.make_step`) of four configurations on
four logical CPUs and counts every node of the step's graph and of every function in
its library, by op type; times 5 steps of each (median; one process, logical CPUs:
a rough figure, not the loopback benchmark's). Run it on two checkouts and compare the
JSON lines:

  PYTHONPATH=/path/to/checkout python /path/to/checkout/bench/graph_census.py

Prints one JSON line: per configuration {ops: {type: count}, nodes, functions,
median_s}.
"""

import collections
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

CONFIGS = (("transformer", 2, 4, "zbv", "never"),
           ("transformer", 2, 2, "interleaved_zb", "never"),
           ("mlp", 2, 4, "1f1b", "always"),
           ("mlp", 2, 4, "zb_h1", "never"))


def census(graph_def) -> collections.Counter:
  """Op type → how many nodes of that type the graph and its functions hold."""
  counts = collections.Counter(node.op for node in graph_def.node)
  for function in graph_def.library.function:
    counts.update(node.op for node in function.node_def)
  return counts


def main() -> None:
  from lingvo_gpipe.runtime.devices import configure_devices

  devices = configure_devices("cpu:4")
  import pipeline_speedup

  out = {}
  for model, k, m, schedule, recompute in CONFIGS:
    run = pipeline_speedup.make_step(model, k, m, devices, schedule=schedule,
                                     recompute=recompute)
    counts = census(run.graph_def)
    seconds = sorted(run()[0] for _ in range(5))
    out[f"{model}_k{k}_m{m}_{schedule}_{recompute}"] = {
        "ops": dict(sorted(counts.items())), "nodes": sum(counts.values()),
        "functions": len(run.graph_def.library.function), "median_s": seconds[2]}
  print(json.dumps(out))


if __name__ == "__main__":
  main()
