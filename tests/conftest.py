"""Test set-up: four logical devices, configured before TensorFlow initializes.

Logical CPUs by default; LINGVO_GPIPE_TEST_DEVICES=gpu:4:MEMORY_MB runs the tests that
take `cpu_devices` on four logical GPUs instead (tools/gpu_check.sh).

Clocks and memory counts in tests (CI is a loaded 2-core machine; float tolerances are
tests/numerics.py's): assert only the orders causality fixes (a receiver starts an
action after its sender started it; one device's spans never overlap), never one
between two devices' ends or between a measured and a simulated time; wait for an event
by polling under a generous deadline, not by a fixed sleep; read the process-wide
allocator counts with no garbage collection between the reads (`cpu_allocator_stats`).
"""

import atexit
import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import op_tracebacks  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402
from trainer_forkserver import TrainerServer  # noqa: E402

from lingvo_gpipe.core.gc_pause import cyclic_gc_paused
from lingvo_gpipe.core.tf_internals import step_function
from lingvo_gpipe.runtime.devices import configure_devices

REPO = Path(__file__).resolve().parent.parent
NUM_TEST_DEVICES = 4
TEST_DEVICES = os.environ.get("LINGVO_GPIPE_TEST_DEVICES", f"cpu:{NUM_TEST_DEVICES}")
if TEST_DEVICES.startswith("gpu"):
  # float32 products in float32, not TF32 (TensorFlow's default on Ampere and later: a
  # 10-bit mantissa, 3e-4 relative error measured on an H200): the tolerances of
  # tests/numerics.py are float32's. The variable reaches cuBLAS and cuDNN in the trainer
  # processes tests start too; the call below covers this one.
  os.environ.setdefault("NVIDIA_TF32_OVERRIDE", "0")
  tf.config.experimental.enable_tensor_float_32_execution(False)

TEST_DEVICE_NAMES = configure_devices(TEST_DEVICES)
if len(TEST_DEVICE_NAMES) != NUM_TEST_DEVICES:
  raise RuntimeError(f"LINGVO_GPIPE_TEST_DEVICES={TEST_DEVICES!r} gives {len(TEST_DEVICE_NAMES)} "
                     f"devices; the tests take {NUM_TEST_DEVICES}")
tf.get_logger().setLevel("ERROR")
op_tracebacks.off()  # (tests/op_tracebacks.py; a module marked op_tracebacks keeps them)


# The tests `-m` (or `-k`) left out of this session (tests/tiers_test.py reads them).
DESELECTED: list = []


def pytest_deselected(items) -> None:
  DESELECTED.extend(items)


@pytest.fixture(scope="module", autouse=True)
def _op_tracebacks_where_marked(request) -> Iterator[None]:
  """A module marked `op_tracebacks` traces with each op's Python stack recorded."""
  marked = request.node.get_closest_marker("op_tracebacks") is not None
  with op_tracebacks.recorded() if marked else contextlib.nullcontext():
    yield


def sigint_as_default() -> None:
  """A subprocess's preexec_fn: SIGINT back to its default, so that the Python it runs
  installs its KeyboardInterrupt handler. A suite started as a background job (`make
  test &`, no terminal) inherits SIGINT ignored, and so would every trainer a Ctrl-C
  test starts: the SIGINT it sends would never arrive."""
  import signal

  signal.signal(signal.SIGINT, signal.SIG_DFL)


def engine_step(model, wrapped, batch: dict, step: int, loss_scale=None, variables=None):
  """One training step as the trainer computes it, traced: train_step.loss_and_gradients
  of `wrapped` (a train_step.StackWithLoss of `model`: the pipeline's schedule, or
  TensorFlow's gradient of the whole batch) on `batch` at global step `step` (it seeds
  dropout), with the loss scale `loss_scale` → a callable returning (loss, one
  gradient per variable of `variables` (default: stacked_variables.trainable_weights
  of `model`, a stack's rows apart), each reporting layer's batch statistics as
  (layer path, statistics)). Traced and called under the trainer's Grappler settings
  for its step (tf_internals.step_options), as the trainer traces and calls it."""
  from lingvo_gpipe import train_step
  from lingvo_gpipe.core import base_layer, stacked_variables

  @tf.function(autograph=False)  # (no Python control flow on tensors in it)
  def traced():
    stats: list = []
    with base_layer.step_context(training=True, step=tf.constant(step, tf.int64),
                                 loss_scale=loss_scale, layer_stats=stats):
      metrics, grads = train_step.loss_and_gradients(
          wrapped, batch,
          stacked_variables.trainable_weights(model) if variables is None else variables)
    return metrics["loss"][0], grads, [(layer.path, s) for layer, s in stats]

  return step_function(traced)


def engine_loss_and_grads(model, wrapped, batch: dict, step: int, loss_scale=None):
  """`engine_step`'s loss and gradients, numpy."""
  loss, grads, _ = engine_step(model, wrapped, batch, step, loss_scale)()
  return loss.numpy(), [g.numpy() for g in grads]


def summary_values(event_dir: Path) -> dict[str, list[Any]]:
  """{tag: [value per event, in order]} of the summaries under `event_dir`: a scalar's
  float, any other summary's numpy value (an image's encoded bytes, a text's string)."""
  values: dict[str, list[Any]] = {}
  for path in sorted(event_dir.glob("events.out.tfevents.*")):
    for event in tf.compat.v1.train.summary_iterator(str(path)):
      for value in event.summary.value:
        array = tf.make_ndarray(value.tensor)
        values.setdefault(value.tag, []).append(float(array) if array.ndim == 0
                                                and array.dtype.kind == "f" else array)
  return values


@pytest.fixture
def cpu_devices() -> list[str]:
  """The four test devices: logical CPUs (or GPUs, LINGVO_GPIPE_TEST_DEVICES)."""
  return list(TEST_DEVICE_NAMES)


_TRAINER_SERVER = TrainerServer()
atexit.register(_TRAINER_SERVER.close)


def pytest_configure(config) -> None:
  """LINGVO_GPIPE_TEST_CLOCKS=DIR: each test's wall and CPU seconds to DIR (tests/clocks.py)."""
  folder = os.environ.get("LINGVO_GPIPE_TEST_CLOCKS")
  if folder:
    from clocks import TestClocks

    try:
      Path(folder).mkdir(parents=True, exist_ok=True)
      clocks = TestClocks(Path(folder), _TRAINER_SERVER.pid)
    except OSError as e:
      raise pytest.UsageError(f"LINGVO_GPIPE_TEST_CLOCKS={folder!r}: {e.strerror}; give a "
                              "folder this user can write") from None
    config.pluginmanager.register(clocks, "test_clocks")


def run_trainer(*args: str, env: dict | None = None, timeout: int = 300,
                file_size_limit: int | None = None, fresh_process: bool = False):
  """Runs tools/trainer.py ARGS in a process of its own; returns the CompletedProcess.
  The process is forked from a server that imported TensorFlow once
  (tests/trainer_forkserver.py); `fresh_process`, or an `env` of its own: a new
  interpreter instead (what the trainer does while it imports TensorFlow, and the
  variables TensorFlow reads then). `file_size_limit`: no file may grow past this many
  bytes (RLIMIT_FSIZE): a write past it fails with EFBIG, as a write to a full disk
  fails with ENOSPC."""
  import resource
  import subprocess

  full_env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", **(env or {}))
  if not fresh_process and env is None:
    return _TRAINER_SERVER.run(list(args), full_env, timeout, file_size_limit)

  def limit():
    resource.setrlimit(resource.RLIMIT_FSIZE, (file_size_limit, file_size_limit))

  return subprocess.run([sys.executable, str(REPO / "tools" / "trainer.py"), *args],
                        capture_output=True, text=True, timeout=timeout, env=full_env,
                        cwd=REPO, preexec_fn=limit if file_size_limit else None)


@pytest.fixture(scope="session")
def tiny_lm_cost_cache(tmp_path_factory) -> Path:
  """A cost cache (layers and machine) of lm.TransformerTiny on cpu:2, measured once
  per run by `--mode=plan` (about 50 s of profiling), for the tests that plan that
  model: each copies it rather than profiling again. Under xdist the workers share one
  (the first to ask measures it while the others wait on a lock)."""
  import fcntl

  shared = tmp_path_factory.getbasetemp()
  if os.environ.get("PYTEST_XDIST_WORKER"):
    shared = shared.parent  # this run's folder, above the workers' own
  cache = shared / "tiny_lm_costs.json"
  with open(shared / "tiny_lm_costs.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if not cache.exists():
      measured = run_trainer("--model=lm.TransformerTiny", "--devices=cpu:2", "--mode=plan",
                             f"--cost_cache={cache}")
      assert measured.returncode == 0, measured.stderr[-3000:]
  return cache


@pytest.fixture
def cpu_allocator_stats() -> Iterator[None]:
  """Skips a test that reads the CPU allocator's statistics where this TensorFlow keeps
  none (oneDNN off, TF_ENABLE_ONEDNN_OPTS=0, without TF_CPU_ALLOCATOR_USE_BFC=true):
  there the planner falls back to its formula (layer_profiler.measure_layer_memory
  returns None). Runs the test without automatic garbage collection (after one): the
  counts are process-wide, and a collection of what earlier tests left, between two
  reads, would move them by what this test did not do."""
  try:
    tf.config.experimental.get_memory_info("CPU:0")
  except ValueError as e:
    pytest.skip(f"the CPU allocator keeps no statistics here ({e}); set "
                "TF_CPU_ALLOCATOR_USE_BFC=true to run this test")
  with cyclic_gc_paused(collect_first=True):
    yield
