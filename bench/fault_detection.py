"""How fast the trainer notices a lost worker, and hears Ctrl-C, on loopback.

For each fault, a fresh pair of loopback workers (tools/worker.py) and a trainer
(tools/trainer.py --cluster_spec, demo.TinyConvNet pipelined over 2 cells) run until
the first checkpoint; then the fault is injected and the time until the trainer's
process ends is taken:

  killed     worker 1 gets SIGKILL (its port closes)            → exit 1 naming it
  frozen     worker 1 gets SIGSTOP (its port still accepts)     → exit 1 naming it
  ctrl_c     worker 1 gets SIGSTOP, then the trainer SIGINT     → exit 130

  python bench/fault_detection.py            # 3 trials of each (about 4 minutes here)
  python bench/fault_detection.py --trials 1

The last line printed is one JSON object: detect_s_<fault> (median over trials),
max_detect_s_<fault>, and the exit codes seen.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from lingvo_gpipe.runtime import cluster  # noqa: E402
from lingvo_gpipe.runtime.local_workers import start_local_workers  # noqa: E402

FAULTS = ("killed", "frozen", "ctrl_c")
MODEL = ["--model=demo.TinyConvNet", "--params_override=task.pipeline.num_cells=2;"
         "task.pipeline.num_micro_batches=2;task.train.save_interval_steps=5"]


def one_trial(fault: str, logdir: str) -> tuple[float, int, str]:
  """(seconds from the fault to the trainer's exit, exit code, its error line)."""
  spec, workers = start_local_workers(2, single_thread=False)
  try:
    cluster.wait_for_servers(cluster.parse_cluster_spec(spec)["worker"])
    trainer = subprocess.Popen(
        [sys.executable, str(REPO / "tools" / "trainer.py"), *MODEL, f"--logdir={logdir}",
         f"--cluster_spec={spec}", "--max_steps=1000000"], stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    index = Path(logdir) / "train" / "checkpoint"
    deadline = time.monotonic() + 300
    while not index.exists():
      if trainer.poll() is not None or time.monotonic() > deadline:
        raise RuntimeError(f"no checkpoint: {trainer.stderr.read()[-2000:]}")
      time.sleep(0.2)
    if fault == "killed":
      workers[1].kill()
    else:
      workers[1].send_signal(signal.SIGSTOP)
    if fault == "ctrl_c":
      time.sleep(1.0)  # the step in flight now waits on the stopped worker
      trainer.send_signal(signal.SIGINT)
    start = time.monotonic()
    _, stderr = trainer.communicate(timeout=300)
    errors = [line for line in stderr.split("\n") if line.startswith("error:")]
    return time.monotonic() - start, trainer.returncode, (errors or ["(no error line)"])[-1]
  finally:
    for worker in workers:
      if worker.poll() is None:
        worker.send_signal(signal.SIGCONT)
        worker.kill()
      worker.wait()


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--trials", type=int, default=3)
  parser.add_argument("--faults", default=",".join(FAULTS))
  args = parser.parse_args()
  faults = [f for f in args.faults.split(",") if f]
  unknown = sorted(set(faults) - set(FAULTS))
  if unknown or args.trials < 1:
    parser.error(f"--faults takes {', '.join(FAULTS)} (got {unknown}); --trials >= 1")
  result: dict = {"machine": platform.processor() or platform.machine(),
                  "cpus": os.cpu_count(), "trials": args.trials}
  for fault in faults:
    times, codes = [], []
    for trial in range(args.trials):
      with tempfile.TemporaryDirectory(prefix=f"fault_{fault}_") as tmp:
        seconds, code, last_line = one_trial(fault, os.path.join(tmp, "run"))
      times.append(seconds)
      codes.append(code)
      print(f"{fault} trial {trial}: exit {code} after {seconds:.1f} s: {last_line[:160]}",
            flush=True)
    result[f"detect_s_{fault}"] = round(statistics.median(times), 2)
    result[f"max_detect_s_{fault}"] = round(max(times), 2)
    result[f"exit_codes_{fault}"] = sorted(set(codes))
  print(json.dumps(result))


if __name__ == "__main__":
  main()
