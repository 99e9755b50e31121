"""Pipeline stages in two worker processes on loopback equal the single-process run."""

import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
from conftest import REPO, run_trainer, sigint_as_default
from numerics import HALF_REORDERED, REORDERED, assert_close
from tiers import EXHAUSTIVE

from lingvo_gpipe.runtime import cluster
from lingvo_gpipe.runtime.devices import DeviceSpecError
from lingvo_gpipe.runtime.local_workers import start_local_worker, start_local_workers


@EXHAUSTIVE
def test_two_worker_processes_give_the_unpartitioned_gradients():
  script = Path(__file__).resolve().parent / "loopback_pipeline.py"
  result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
  assert result.returncode == 0, result.stderr[-3000:]
  report = json.loads(result.stdout.strip().split("\n")[-1])
  # the last pipeline built, interleaved: cells 0 and 2 on worker 0, 1 and 3 on worker 1
  assert [d.split("/device")[0] for d in report["devices"]] == [
      "/job:worker/replica:0/task:0", "/job:worker/replica:0/task:1"] * 2
  assert {"/job:worker/replica:0/task:0/device:CPU:0",
          "/job:worker/replica:0/task:1/device:CPU:0"} == set(report["variable_devices"])
  # in units of each reference's largest element (tests/numerics.py)
  assert sorted(report["max_relative_difference"]) == sorted(
      ("gpipe", "1f1b", "zb_h1", "zbv", "interleaved_1f1b", "1f1b/bfloat16",
       "1f1b/token_slices"))
  for name, worst in report["max_relative_difference"].items():
    if name.endswith("/bfloat16"):  # bfloat16 hand-offs between the processes: against
      # the unpartitioned bfloat16 model, at its eps (tests/mixed_precision_test.py)
      assert worst <= HALF_REORDERED * 2.0 ** -7, name
    else:
      assert worst <= REORDERED * np.finfo(np.float32).eps, name
  before, after = report["memory_before"], report["memory_after"]
  assert before["device"] == "CPU:0"
  # The pipeline's step ran there, so the peak exceeds what stays allocated.
  assert before["peak_bytes_in_use"] > before["bytes_in_use"] > 0
  grown = after["bytes_in_use"] - before["bytes_in_use"]
  assert report["block_bytes"] <= grown <= report["block_bytes"] + 64 * 1024, grown


def test_free_ports_are_distinct_and_free():
  ports = cluster.free_ports(16)
  assert len(set(ports)) == 16, ports
  assert [cluster.port_in_use(p) for p in ports] == [None] * 16


def test_cluster_specs_parse_and_bad_ones_are_named(monkeypatch):
  assert cluster.parse_cluster_spec("worker=h1:2222,h2:2223;ps=h3:1") == {
      "worker": ["h1:2222", "h2:2223"], "ps": ["h3:1"]}
  for bad, message in [("worker", "bad cluster spec"), ("worker=h1", "bad address 'h1'"),
                       ("worker=h:1;worker=h:2", "appears twice"), ("", "empty cluster spec")]:
    with pytest.raises(DeviceSpecError, match=message):
      cluster.parse_cluster_spec(bad)
  monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": {"worker": ["a:1", "b:2"]},
                                              "task": {"type": "worker", "index": 1}}))
  spec = cluster.cluster_spec_from_tf_config()
  assert cluster.task_address(spec, "worker", 1) == "b:2"
  with pytest.raises(DeviceSpecError, match="task 2 is out of range"):
    cluster.task_address(spec, "worker", 2)


def test_an_absent_server_is_named_within_the_timeout():
  address = f"localhost:{cluster.free_port()}"
  said = []
  with pytest.raises(DeviceSpecError,
                     match=f"no TensorFlow server answers at {address} after 0 s "
                     r"\(it cannot be reached \(unavailable\)\)"):
    cluster.wait_for_servers([address], timeout_s=0.5, log=said.append)
  assert said == [f"Waiting up to 0 s for the workers at {address} ({address} cannot be "
                  "reached (unavailable)) ..."]


@EXHAUSTIVE
def test_a_worker_with_an_unwritable_memory_log_exits_2_naming_it(tmp_path):
  bad = tmp_path / "missing" / "memory.jsonl"
  result = subprocess.run(
      [sys.executable, str(REPO / "tools" / "worker.py"),
       f"--cluster_spec=worker=localhost:{cluster.free_port()}", "--task=0",
       f"--memory_log={bad}"], capture_output=True, text=True, timeout=120,
      env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
  assert result.returncode == 2, result.stderr[-2000:]
  assert f"--memory_log={bad} cannot be written" in result.stderr


@EXHAUSTIVE
def test_a_worker_warns_that_it_serves_every_interface_unauthenticated():
  port = cluster.free_port()
  worker = start_local_worker(f"worker=localhost:{port}", 0, capture_output=True)
  try:
    said = worker.stdout.readline()
    # TensorFlow's own start-up lines (oneDNN, absl) may come first.
    warned = next((line for line in iter(worker.stderr.readline, "")
                   if line.startswith("warning: port")), "")
  finally:
    worker.kill()
    worker.wait()
  assert f"serving on port {port} of every network interface" in said
  assert warned.startswith(f"warning: port {port} is open on all network interfaces with no "
                           "authentication"), warned
  assert "docs/distributed.md: Security" in warned


def _latest_checkpoint(logdir: Path) -> str | None:
  return tf.train.latest_checkpoint(str(logdir / "train"))


@EXHAUSTIVE
def test_a_dead_worker_stops_training_in_bounded_time_and_a_restart_resumes(tmp_path):
  spec, workers = start_local_workers(2, single_thread=False)
  try:
    cluster.wait_for_servers(cluster.parse_cluster_spec(spec)["worker"])
    logdir = tmp_path / "run"
    model = ["--model=demo.TinyConvNet", "--params_override=task.pipeline.num_cells=2;"
             "task.pipeline.num_micro_batches=2;task.train.save_interval_steps=5;"
             "task.train.log_interval_steps=1"]
    trainer = subprocess.Popen(
        [sys.executable, str(REPO / "tools" / "trainer.py"), *model, f"--logdir={logdir}",
         f"--cluster_spec={spec}", "--max_steps=1000000"], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, cwd=REPO, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    deadline = time.monotonic() + 180
    # Step 6's line: the save of step 5 has returned. (Its files appear before the save
    # is done: a worker killed then fails the save, which removes them.)
    for line in trainer.stdout:
      assert time.monotonic() < deadline, "no step after the first checkpoint within 180 s"
      if line.startswith("step 6/"):
        break
    assert _latest_checkpoint(logdir) is not None, "step 6 came without a checkpoint"
    workers[1].kill()
    killed = time.monotonic()
    _, stderr = trainer.communicate(timeout=120)
    noticed_after = time.monotonic() - killed
    assert trainer.returncode == 1, stderr[-3000:]
    assert "worker /job:worker/task:1 at " in stderr, stderr
    assert "cannot be reached (unavailable); stopped training" in stderr, stderr
    # Ours is the last line: none of TensorFlow's teardown lines about the lost worker.
    assert stderr.strip().splitlines()[-1].startswith("error: worker"), stderr[-2000:]
    assert noticed_after < 30, f"the dead worker was noticed only after {noticed_after:.0f} s"
    latest = _latest_checkpoint(logdir)
    assert f"the last checkpoint is {latest}" in stderr
    saved_step = int(latest.rsplit("-", 1)[1])

    workers[1] = start_local_worker(spec, 1, single_thread=False)
    cluster.wait_for_servers(cluster.parse_cluster_spec(spec)["worker"])
    final_step = saved_step + 5
    resumed = run_trainer(*model, f"--logdir={logdir}", f"--cluster_spec={spec}",
                          f"--max_steps={final_step}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"Resuming from checkpoint {latest} at step {saved_step}" in resumed.stdout
  finally:
    for worker in workers:
      worker.kill()
  # Nothing lost: the interrupted-and-resumed run ends where an uninterrupted one does.
  reference = run_trainer(*model, f"--logdir={tmp_path / 'reference'}", "--devices=cpu:2",
                          f"--max_steps={final_step}")
  assert reference.returncode == 0, reference.stderr[-3000:]
  got = tf.train.load_checkpoint(_latest_checkpoint(logdir))
  want = tf.train.load_checkpoint(_latest_checkpoint(tmp_path / "reference"))
  assert sorted(got.get_variable_to_dtype_map()) == sorted(want.get_variable_to_dtype_map())
  # Every numeric tensor: weights, optimizer slots, batch-norm statistics, global step
  # (the input position is a variant; that it was restored shows in the equal weights).
  names = [n for n, dtype in want.get_variable_to_dtype_map().items()
           if dtype.is_floating or dtype.is_integer]
  assert any("global_step" in n for n in names) and len(names) > 10
  for name in names:
    assert_close(got.get_tensor(name), want.get_tensor(name), err_msg=name)


def _start_trainer(logdir: Path, spec: str, model: list[str]) -> subprocess.Popen:
  # (-X faulthandler: a crash prints every thread's Python stack to the stderr a failure
  # reports; once on a loaded machine the trainer aborted before its first checkpoint)
  return subprocess.Popen(
      [sys.executable, "-X", "faulthandler", str(REPO / "tools" / "trainer.py"), *model,
       f"--logdir={logdir}", f"--cluster_spec={spec}", "--max_steps=1000000"],
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE, text=True, cwd=REPO, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"),
      preexec_fn=sigint_as_default)  # (a Ctrl-C test signals it)


def _wait_for_checkpoint_after(logdir: Path, step: int, trainer: subprocess.Popen) -> None:
  deadline = time.monotonic() + 180
  while trainer.poll() is None and time.monotonic() < deadline:
    latest = _latest_checkpoint(logdir)
    if latest is not None and int(latest.rsplit("-", 1)[1]) > step:
      return
    time.sleep(0.2)
  if trainer.poll() is None:
    raise AssertionError(f"no checkpoint after step {step} within 180 s")
  _, stderr = trainer.communicate()
  raise AssertionError(f"the trainer exited ({trainer.returncode}) before a checkpoint after "
                       f"step {step}:\n{stderr[-5000:]}")


@EXHAUSTIVE
def test_a_frozen_worker_is_named_within_30_s_and_ctrl_c_is_heard_while_it_hangs(tmp_path):
  """kill -STOP: the worker's port still accepts connections but nothing answers. A
  trainer waiting on it hears Ctrl-C (exit 130 within 5 s), and one left alone names the
  frozen worker within 30 s (exit 1); the checkpoints stay readable throughout."""
  spec, workers = start_local_workers(2, single_thread=False)
  logdir = tmp_path / "run"
  model = ["--model=demo.TinyConvNet", "--params_override=task.pipeline.num_cells=2;"
           "task.pipeline.num_micro_batches=2;task.train.save_interval_steps=5"]
  try:
    cluster.wait_for_servers(cluster.parse_cluster_spec(spec)["worker"])
    trainer = _start_trainer(logdir, spec, model)
    _wait_for_checkpoint_after(logdir, 0, trainer)
    workers[1].send_signal(signal.SIGSTOP)
    time.sleep(1.0)  # the step in flight now waits on the stopped worker
    trainer.send_signal(signal.SIGINT)
    interrupted = time.monotonic()
    _, stderr = trainer.communicate(timeout=60)
    assert time.monotonic() - interrupted < 5, stderr
    assert trainer.returncode == 130, stderr
    latest = _latest_checkpoint(logdir)
    assert f"interrupted (Ctrl-C); the last checkpoint is {latest}" in stderr, stderr
    assert "warning: port " in stderr and "no authentication" in stderr
    tf.train.load_checkpoint(latest)  # intact

    workers[1].send_signal(signal.SIGCONT)
    trainer = _start_trainer(logdir, spec, model)
    _wait_for_checkpoint_after(logdir, int(latest.rsplit("-", 1)[1]), trainer)
    workers[1].send_signal(signal.SIGSTOP)
    frozen = time.monotonic()
    _, stderr = trainer.communicate(timeout=120)
    noticed_after = time.monotonic() - frozen
    assert trainer.returncode == 1, stderr[-3000:]
    assert noticed_after < 30, f"the frozen worker was noticed only after {noticed_after:.0f} s"
    latest = _latest_checkpoint(logdir)
    assert (f"worker /job:worker/task:1 at {cluster.parse_cluster_spec(spec)['worker'][1]} "
            "does not reply within 2 s (frozen or overloaded); stopped training: the last "
            f"checkpoint is {latest}") in stderr, stderr
    tf.train.load_checkpoint(latest)
  finally:
    for worker in workers:
      worker.send_signal(signal.SIGCONT)
      worker.kill()


def _can_make_a_private_mount() -> str | None:
  """None if this process may give a child its own mount namespace (root, unshare);
  else why not."""
  if shutil.which("unshare") is None:
    return "no unshare binary"
  probe = subprocess.run(["unshare", "-m", "--propagation", "private", "true"],
                         capture_output=True, text=True)
  return None if probe.returncode == 0 else f"unshare -m fails: {probe.stderr.strip()}"


def _start_worker_on_its_own_disk(spec: str, task: int, private: Path) -> subprocess.Popen:
  """Task `task` of `spec` as a worker that sees an empty tmpfs at `private` (its own
  mount namespace): a host that does not share the trainer's disk there."""
  worker = (f"mount -t tmpfs tmpfs {shlex.quote(str(private))} && "
            f"exec {shlex.quote(sys.executable)} -m lingvo_gpipe.tools.worker "
            f"--cluster_spec={shlex.quote(spec)} --task={task}")
  return subprocess.Popen(["unshare", "-m", "--propagation", "private", "bash", "-c", worker],
                          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"),
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def train_then_resume(spec: str, logdir: Path, save_every: int) -> str:
  """TinyConvNet at K=2 with its cells on the workers of `spec`: trained to step
  `save_every` (saved), then resumed to twice that; returns the first run's stdout."""
  model = ["--model=demo.TinyConvNet", "--params_override=task.pipeline.num_cells=2;"
           f"task.pipeline.num_micro_batches=2;task.train.save_interval_steps={save_every}"]
  cluster.wait_for_servers(cluster.parse_cluster_spec(spec)["worker"])
  first = run_trainer(*model, f"--logdir={logdir}", f"--cluster_spec={spec}",
                      f"--max_steps={save_every}")
  assert first.returncode == 0, first.stderr[-3000:]
  resumed = run_trainer(*model, f"--logdir={logdir}", f"--cluster_spec={spec}",
                        f"--max_steps={2 * save_every}")
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert (f"Resuming from checkpoint {logdir / 'train' / f'ckpt-{save_every}'} at step "
          f"{save_every}") in resumed.stdout
  return first.stdout


def test_the_trainer_trains_and_resumes_with_its_cells_in_two_worker_processes(tmp_path):
  """TinyConvNet, K=2: each cell's variables on its own tools/worker.py process, 3 steps
  saved, then resumed to 6: the checkpoint holds both cells' variables. (The quick
  tier's loopback run: it needs no private mount, unlike the test below.)"""
  spec, workers = start_local_workers(2, single_thread=False)
  logdir = tmp_path / "run"
  try:
    stdout = train_then_resume(spec, logdir, save_every=3)
    assert "/job:worker/replica:0/task:1" in stdout  # "cells go to ..."
  finally:
    for worker in workers:
      worker.kill()
  saved = tf.train.load_checkpoint(str(logdir / "train" / "ckpt-6"))
  assert len([n for n in saved.get_variable_to_shape_map() if "layers/" in n
              and "OPTIMIZER_SLOT" not in n]) > 2


@EXHAUSTIVE
@pytest.mark.skipif(_can_make_a_private_mount() is not None,
                    reason=f"a private mount namespace is needed: {_can_make_a_private_mount()}")
def test_checkpoints_of_workers_without_the_trainers_disk_are_written_and_read_on_the_trainers_host(
    tmp_path):
  """Worker 1 holds cell 1's variables but sees its own empty disk where the logdir is.
  Every checkpoint read and write goes through the trainer's host: the run saves,
  resumes, and the worker's disk stays empty."""
  shared = tmp_path / "shared"
  shared.mkdir()
  spec = "worker=" + ",".join(f"localhost:{port}" for port in cluster.free_ports(2))
  workers = [start_local_worker(spec, 0, single_thread=False),
             _start_worker_on_its_own_disk(spec, 1, shared)]
  logdir = shared / "run"
  try:
    train_then_resume(spec, logdir, save_every=5)
    # What worker 1 sees at the logdir's path: its own tmpfs, still empty.
    assert list(Path(f"/proc/{workers[1].pid}/root{shared}").iterdir()) == []
  finally:
    for worker in workers:
      worker.kill()
  saved = tf.train.load_checkpoint(str(logdir / "train" / "ckpt-10"))
  cell_1 = [n for n in saved.get_variable_to_shape_map() if "OPTIMIZER_SLOT" not in n
            and "layers/" in n]
  assert len(cell_1) > 2  # every layer's variables, both cells'


def test_a_worker_whose_port_is_taken_exits_2_naming_it():
  with socket.socket() as taken:
    taken.bind(("localhost", 0))
    taken.listen()
    port = taken.getsockname()[1]
    result = subprocess.run(
        [sys.executable, str(REPO / "tools" / "worker.py"),
         f"--cluster_spec=worker=localhost:{port}", "--task=0"], capture_output=True,
        text=True, timeout=120, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
  assert result.returncode == 2, result.stderr[-2000:]
  errors = [line for line in result.stderr.splitlines()
            if not line.startswith(("I0000", "WARNING: All"))]  # TensorFlow's start-up lines
  assert errors == [f"error: port {port} of localhost:{port} (/job:worker/task:0 in the cluster "
                    "spec) cannot be served: in use by another process; stop what uses it or "
                    "give this task another port in the cluster spec"], result.stderr
