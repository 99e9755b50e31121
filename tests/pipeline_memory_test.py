"""1F1B's memory win, measured with the BFC allocator in a fresh process."""

import json
import os
import subprocess
import sys

from conftest import REPO


def test_1f1b_holds_far_less_activation_memory_than_gpipe():
  """K=4, M=16, no re-materialization: GPipe keeps every micro-batch's activations
  until the backward pass starts, 1F1B at most K−k on cell k (10 of 64 in all)."""
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", TF_CPU_ALLOCATOR_USE_BFC="true")
  done = subprocess.run(
      [sys.executable, str(REPO / "bench" / "remat_memory.py"), "--layers", "8", "--dim", "64",
       "--hidden", "256", "--batch", "64", "--seq", "64",
       "--configs", "gpipe_k4_m16_never,1f1b_k4_m16_never"],
      capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
  assert done.returncode == 0, done.stderr[-3000:]
  summary = json.loads(done.stdout.strip().splitlines()[-1])
  activations = summary["activation_bytes"]
  assert activations["1f1b_k4_m16_never"] <= 0.4 * activations["gpipe_k4_m16_never"], summary
