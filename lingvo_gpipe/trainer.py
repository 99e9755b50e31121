"""Train and eval loops: steps, TensorBoard summaries, checkpoints, resumption.

Layout of a logdir:
  <logdir>/params.txt           the full params text of the run (see logdirs.py)
  <logdir>/train/ckpt-<step>.*  checkpoints, found from the files (see checkpoints.py)
  <logdir>/train/events.*       loss, metrics, learning rate, gradient norm, examples/sec;
                                for a pipelined model, the measured schedule (an image
                                and per-cell busy fractions, measured vs theoretical bubble)
  <logdir>/train/plugins/profile/  TensorFlow profiles of the steps --profile_steps names
  <logdir>/eval/events.*        eval metrics at the step they were computed

One training step is `train_step.TrainStep` (traced once): the pipelined (or plain)
forward and backward → (with R replicas: gradients averaged across replicas) →
optimizer update on each variable's device → batch-norm moving statistics from the
whole batch → global step + 1. If the loss or the gradient norm is not finite,
nothing is updated and the Python loop stops with NonFiniteLossError, except where
the loss is scaled (float16, core/loss_scale.py) and only the gradient overflowed:
then the step is skipped (the global step stays), the scale halves and training goes
on, until the scale reaches its minimum; if they were
finite but the update made a variable non-finite (a learning rate far too large), the
loop stops with NonFiniteUpdateError before anything of that step is saved. Either
way the last checkpoint on disk is the last good state.

Nothing is written to the logdir before the run has been checked: the newest readable
checkpoint restored (or none found), the training step built; only then are damaged
checkpoints set aside, the index repaired and params.txt written.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import itertools
import os
import re
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import tensorflow as tf

from lingvo_gpipe import checkpoints, logdirs, train_step
from lingvo_gpipe.core import base_layer, loss_scale, stacked_variables, tf_internals
from lingvo_gpipe.core.from_keras import load_saved_keras_weights
from lingvo_gpipe.core.gc_pause import cyclic_gc_paused
from lingvo_gpipe.core.hyperparams import Params
from lingvo_gpipe.pipeline import hybrid, memory, schedule_chart, timeline
from lingvo_gpipe.pipeline.layer import requested_cells
from lingvo_gpipe.preflight import check_batch_splits, check_calls_against_buckets
from lingvo_gpipe.tasks import base_task

# The checkpoint key of the dynamic loss scale's variables (saved only where a layer
# computes in float16): the one difference a restore lets through.
LOSS_SCALE_KEY = "loss_scale/"


class TrainerError(RuntimeError):
  """A run that cannot go on; the message says why."""


class NonFiniteLossError(TrainerError):
  pass


class NonFiniteUpdateError(NonFiniteLossError):
  pass


class CheckpointMismatchError(TrainerError):
  pass


class SummaryWriteError(TrainerError):
  pass


class TrainingInterrupted(TrainerError):
  pass


class BadDataError(TrainerError):
  """A batch with an id or label the model cannot take (base_task.check_batch_ids)."""


def step_error_cause(error: Exception) -> str:
  """What a TensorFlow error raised by a step says of its cause, in one line: the
  node it was detected at and its message, without the Python stack that defined the
  node and the `[[node]]` frames. A step on several devices that failed on one may be
  reported by the cancelled hand-offs of the others ('[_Derived_]RecvAsync is
  cancelled'); the line then says that the cause was on another device."""
  text = getattr(error, "message", None) or str(error)
  node = re.search(r"Detected at node (\S+)", text)
  lines = [line.strip() for line in text.splitlines()]
  causes = [line for line in lines
            if line and not line.startswith(("File ", "[[", "Graph execution error",
                                             "Detected at node", "<stack traces"))]
  cause = re.sub(r"\s*\[Op:[^\]]*\]$", "", " ".join(causes)) or type(error).__name__
  if "_Derived_" in cause or isinstance(error, tf.errors.CancelledError):
    return (f"{cause.replace('[_Derived_]', '')} (a cancelled hand-off: the step failed "
            "on another device first, and TensorFlow did not report its cause; run it on "
            "one device, --devices=cpu, to see it)")
  return f"{cause} (at node {node.group(1)})" if node else cause


def _format_eta(seconds: float) -> str:
  return str(datetime.timedelta(seconds=int(max(seconds, 0))))


def parse_profile_steps(text: str) -> tuple[int, int] | None:
  """'A,B' → (A, B), the first and last global step to profile; '' → None."""
  if not text:
    return None
  parts = [p.strip() for p in text.split(",")]
  try:
    first, last = (int(p) for p in parts)
  except ValueError:
    raise ValueError(f"bad --profile_steps {text!r}; expected A,B: the first and last "
                     "global step to profile, 1 <= A <= B (e.g. 10,12)") from None
  if not 1 <= first <= last:
    raise ValueError(f"bad --profile_steps {text!r}: need 1 <= A <= B (e.g. 10,12)")
  return first, last


def _build_replicas(task_params: Params) -> hybrid.Replicas:
  """The task, once per replica of task.pipeline.num_replicas (replica r's cells on
  devices r·K … r·K+K−1); built from the same params, the replicas start equal.
  num_replicas >= 1 is check_batch_splits'."""
  pipeline = task_params.pipeline
  num_replicas = pipeline.num_replicas
  if num_replicas == 1:
    task = task_params.instantiate()
    return hybrid.Replicas([task], [task.input_device])
  num_cells = requested_cells(pipeline)
  if not num_cells:
    raise hybrid.HybridError(f"task.pipeline.num_replicas={num_replicas} needs pipelining: "
                             "set task.pipeline.num_cells (or splits)")
  try:  # (the device count is the only HybridError replicate raises)
    tasks = hybrid.replicate(task_params, num_replicas, pipeline_key="pipeline")
  except hybrid.HybridError as e:
    raise hybrid.HybridError(f"task.pipeline.num_replicas: {e}") from None
  return hybrid.Replicas(tasks, [task.input_device for task in tasks])


class Trainer:
  """Builds a task from frozen model params and trains / evaluates it in `logdir`."""

  def __init__(self, params: Params, logdir: str, log: Callable[[str], None] = print):
    self.params = params
    self.logdir = logdir
    self.train_dir = os.path.join(logdir, "train")
    self.eval_dir = os.path.join(logdir, "eval")
    self.log = log
    train_p = params.task.train
    check_batch_splits(params)  # before anything is built: a schedule is linear in M
    log("Building the input and the model ...")
    # The input first, so that missing data is reported before a large model is built.
    # Its position is checkpointed too, so a resumed run sees the batches the
    # uninterrupted run would have seen (no repeats, no skips).
    # The bytes it holds in the host's allocator are measured: where the devices are
    # logical CPUs they share it, and a plan's check counts them (planning.compare).
    self.train_input = params.train_input.instantiate()
    self.train_iterator, self.input_held_bytes = memory.held_by(
        lambda: iter(self.train_input.dataset()), memory.HOST_ALLOCATOR)
    # One task per data-parallel replica (task.pipeline.num_replicas); replica 0 is the
    # one checkpointed, evaluated and decoded. Each replica has its own optimizer (slots
    # live with their variables).
    with cyclic_gc_paused():  # a deep model's objects, nearly all of them kept
      self.replicas = _build_replicas(
          base_task.with_partition_costs(params.task, params.train_input, log))
      self.task = self.replicas.replicas[0]
      self.optimizers = [train_p.optimizer.instantiate() for _ in self.replicas.replicas]
      for optimizer, variables in zip(self.optimizers, self.replicas.trainable_variables):
        optimizer.create_slots(variables)
    # The ids and labels the model can take; every batch is checked on the host before
    # its step (an id past an embedding would fail inside a cell's loop, where the
    # other cells' cancelled hand-offs can hide the cause; a label past the softmax
    # would train silently on a zero target).
    self.id_bounds = type(self.task).id_bounds(params.task)
    self.global_step = tf.Variable(0, dtype=tf.int64, trainable=False, name="global_step")
    # The dynamic loss scale where a layer computes in float16 (None otherwise): saved
    # with the run only then, so float32 and bfloat16 checkpoints are as before.
    self.loss_scale = loss_scale.make(train_p.loss_scale, self.task)
    self.train_step = train_step.TrainStep(self.replicas, self.optimizers, self.global_step,
                                           scale=self.loss_scale)
    scaled = {"loss_scale": self.loss_scale} if self.loss_scale is not None else {}
    self.checkpoint = tf.train.Checkpoint(task=self.task, optimizer=self.optimizers[0],
                                          global_step=self.global_step,
                                          train_input_position=self.train_iterator,
                                          **scaled)
    self.checkpoint_options = checkpoints.io_options()  # files only on this host
    self.checkpoints = checkpoints.CheckpointStore(
        self.checkpoint, self.train_dir, train_p.max_checkpoints_to_keep, self.restore,
        CheckpointMismatchError, log, options=self.checkpoint_options)
    # Set from another thread (tools/trainer.py's Ctrl-C handler): the loop stops
    # after the step in flight.
    self.stop_requested = threading.Event()
    # Wall seconds of each step this trainer ran (the first includes building its
    # graph): what a plan's predicted step is compared with.
    self.step_seconds: list[float] = []
    self.last_timestamps: list[tf.Tensor] = []  # the last step's measured timeline

  # -- checkpoints -----------------------------------------------------------------

  def restore_latest(self) -> int | None:
    """Restores the newest readable checkpoint in <logdir>/train, if any, and returns
    its step; writes nothing (an unreadable newer one is only named in a warning)."""
    found = self.checkpoints.restore_newest()
    return None if found.step is None else int(self.global_step.numpy())

  def restore(self, path: str) -> None:
    """Restores `path`, raising CheckpointMismatchError if it is not this model's."""
    status = None
    try:
      with stacked_variables.whole_stack_io():  # one write per stack, not per row
        status = self.checkpoint.restore(path, options=self.checkpoint_options)
      status.assert_consumed()
    except (ValueError, AssertionError) as e:
      if status is not None:
        status.expect_partial()  # no warnings about it at exit: the error says it all
      differences = checkpoints.variable_mismatches(path, self.checkpoint)
      if not differences or not all(d.startswith(LOSS_SCALE_KEY) for d in differences):
        detail = "; ".join(differences) if differences else str(e).split("\n")[0]
        raise CheckpointMismatchError(
            f"checkpoint {path} does not match model: {detail}. Use a new --logdir, or "
            "restore the params the checkpoint was written with.") from None
      # float16 ↔ another dtype (docs/trainer.md, "Resuming"): everything else restored
      self.log(f"Restored {path} without its loss scale: "
               + ("the loss scale starts at its initial value" if self.loss_scale is not None
                  else "this run computes in no float16 and drops it"))
    self.replicas.copy_from_first(self.optimizers)

  def save(self) -> str:
    return self.checkpoints.save(int(self.global_step.numpy()))

  @contextlib.contextmanager
  def _summary_errors(self, directory: str):
    """Turns a failed summary write or flush (a full disk) into one SummaryWriteError
    line naming the directory, the cause and the last good checkpoint."""
    try:
      yield
    except tf.errors.OpError as e:
      raise SummaryWriteError(
          f"could not write summaries to {directory}: {checkpoints.first_line(e)}; the last "
          f"good checkpoint is {self.checkpoints.latest or 'none'}; rerun the same command "
          "to resume from it once the cause is fixed") from None

  # -- steps -------------------------------------------------------------------------

  def _eval_step(self, batch: dict[str, tf.Tensor]) -> dict[str, tuple[tf.Tensor, tf.Tensor]]:
    with base_layer.step_context(training=False, step=self.global_step.read_value()):
      return self.task(batch)

  def _decode_step(self, batch: dict[str, tf.Tensor],
                   full_spec: dict[str, tf.TensorSpec]) -> dict[str, tf.Tensor]:
    with base_layer.step_context(training=False, step=self.global_step.read_value()):
      return self.task.decode(batch, full_spec)

  # -- loops ---------------------------------------------------------------------------

  def train(self, max_steps: int, eval_fn: Callable[[], dict] | None = None,
            on_step: Callable[[int, dict], None] | None = None,
            profile_steps: tuple[int, int] | None = None) -> dict:
    """Trains until the global step reaches `max_steps`; returns the last step's values.

    Each step: run it and check it (a non-finite loss or update stops the run before
    anything of it is saved), then, each at its own interval of task.train and at
    max_steps, write summaries, log a progress line, save a checkpoint; evaluate at
    eval_interval_steps (not at max_steps: evaluating the final state is the caller's).

    Args:
      max_steps: the global step to train up to (a run restored at or past it trains
        nothing).
      eval_fn: called every task.train.eval_interval_steps steps (when that is set).
      on_step: `on_step(step, values)` is called after every step (values: numpy
        scalars, the loss among them).
      profile_steps: `(A, B)` captures a TensorFlow profile of global steps A..B into
        <logdir>/train (TensorBoard's profile tab).

    Returns:
      The last step's values ({} when there was nothing to train).

    Raises:
      NonFiniteLossError, NonFiniteUpdateError: a step's loss, gradient norm or update
        was not finite; the last checkpoint on disk is the last good state.
      TrainingInterrupted: `stop_requested` was set; raised after the step in flight.
      SummaryWriteError: summaries could not be written.
      CheckpointMismatchError: the newest checkpoint is not this model's.
      checkpoints.CheckpointError: no checkpoint on disk can be read, or a save failed.
    """
    train_p = self.params.task.train
    found = self.checkpoints.restore_newest()
    start = self._start_step(found)
    if found.step is None and train_p.init_from_keras:
      load_saved_keras_weights(train_p.init_from_keras, self.task.main_stack)
      self.replicas.copy_from_first(self.optimizers)
      self.log(f"Initialized from the Keras model {train_p.init_from_keras}")
    if start >= max_steps:
      self.log(f"Global step {start} >= max_steps {max_steps}; nothing to train")
      return {}
    step_fn = self._build_train_step(self._longest_call(max_steps - start, eval_fn))
    writer = self._start_writing(found, start)  # the run is checked: from here on it writes
    progress = _Progress(start, max_steps)
    profiler = _StepProfiler(profile_steps, self.train_dir, self.log, start, max_steps)
    values: dict = {}
    # Steps run but not yet looked at: a call runs up to task.train.steps_per_call.
    ran: collections.deque = collections.deque()
    try:
      while True:
        if not ran:
          if progress.step >= max_steps:
            break
          self._stop_if_requested(progress.step)
          call_start = time.perf_counter()
          results = self._run_call(step_fn, self._call_size(progress, eval_fn, profiler),
                                   progress.step + 1, profiler)
          # Each step of a call is taken as done at its share of the call's time (the
          # host sees them all at its end: counted then, a window ending inside a call
          # would read millions of examples/sec).
          call_end = time.perf_counter()
          ran.extend((*result, call_start + (call_end - call_start) * (i + 1) / len(results))
                     for i, result in enumerate(results))
          if not ran:  # the input has ended
            break
        batch, outputs, timestamps, done_at = ran.popleft()
        step = progress.step + 1  # the global step this update makes (as progress lines count)
        checked = self._checked_step(outputs, step)
        if checked is None:  # skipped (a loss-scaled gradient overflowed): same step again
          continue
        values = checked
        progress.step = step
        if step == start + 1:
          # The first call also builds the executable graph and warms the cells up.
          self.log(f"First step done in {progress.seconds_since_start():.1f} s")
        if on_step is not None:
          on_step(step, values)
        examples_per_sec = progress.count_step(_examples_in(batch), done_at)
        if progress.due(train_p.summary_interval_steps):
          self._write_summaries(writer, step, values, examples_per_sec, timestamps)
        if progress.due(train_p.log_interval_steps):
          self._log_progress(progress, values, examples_per_sec)
        if progress.due(train_p.save_interval_steps):
          self.save()
        if eval_fn is not None and progress.due_before_the_end(train_p.eval_interval_steps):
          eval_fn()
    except BaseException:
      # Summaries reach the disk if they can; the error in flight is the one to report.
      with contextlib.suppress(tf.errors.OpError):
        writer.flush()
      raise
    finally:
      profiler.stop()
    with self._summary_errors(self.train_dir):
      writer.flush()
    self.log(f"Saved {self.checkpoints.latest}")
    return values

  def _start_step(self, found: checkpoints.Restored) -> int:
    """The global step this run starts from (that of the restored checkpoint, or 0),
    said in a log line."""
    if found.step is None:
      self.log("No checkpoint found; starting from step 0")
      return 0
    start = int(self.global_step.numpy())
    self.log(f"Resuming from checkpoint {found.path} at step {start}")
    return start

  def _start_writing(self, found: checkpoints.Restored, start: int) -> tf.summary.SummaryWriter:
    """The first writes of a checked run: the checkpoint directory repaired (see
    CheckpointStore.repair), params.txt, and the params as a text summary at step
    `start`; returns the writer of <logdir>/train's summaries."""
    os.makedirs(self.train_dir, exist_ok=True)
    self.checkpoints.repair(found)
    logdirs.write_params(self.logdir, self.params, start)
    writer = tf.summary.create_file_writer(self.train_dir)
    with self._summary_errors(self.train_dir), writer.as_default():
      tf.summary.text("params", "```\n" + self.params.to_text() + "```", step=start)
    return writer

  def _call_size(self, progress: _Progress, eval_fn: Callable | None,
                 profiler: _StepProfiler) -> int:
    """How many steps the next call runs: task.train.steps_per_call, fewer where a
    checkpoint, an eval, a profile's start or end, or max_steps comes sooner (a call
    ends at each: what they read is the state after a whole call)."""
    step = progress.step
    size = min(self.params.task.train.steps_per_call, progress.max_steps - step)
    for interval in self._call_ending_intervals(eval_fn):
      size = min(size, interval - step % interval)
    for edge in profiler.edges():
      if edge > step:
        size = min(size, edge - step)
    return max(size, 1)

  def _run_call(self, step_fn: Callable, count: int, first_step: int,
                profiler: _StepProfiler) -> list[tuple[Any, dict, list[tf.Tensor]]]:
    """Runs up to `count` steps in one call, from global step `first_step` (profiled if
    asked for); each step's (batch, values as numpy, timestamps), in order. Fewer
    when the input ends; a batch with a bad id raises BadDataError before the call,
    nothing of that call applied."""
    batches = list(itertools.islice(self.train_iterator, count))
    for j, batch in enumerate(batches):
      self._check_batch(batch, "train_input", first_step + j)
    if not batches:
      return []
    profiler.before(first_step)
    start = time.perf_counter()
    results = [(batch, {k: v.numpy() for k, v in outputs.items()}, timestamps)
               for batch, (outputs, timestamps) in zip(batches, step_fn(batches))]
    seconds = time.perf_counter() - start
    self.step_seconds += [seconds / len(batches)] * len(batches)
    self.last_timestamps = results[-1][2]
    profiler.after(first_step + len(batches) - 1)
    return results

  def _checked_step(self, values: dict, step: int) -> dict | None:
    """The values of the step that made global step `step`; None when the step was
    skipped because its loss-scaled gradient overflowed (the scale has halved).

    Raises:
      NonFiniteLossError: the loss or gradient norm was not finite (nothing was updated).
      NonFiniteUpdateError: the update made a variable non-finite (nothing is saved).
    """
    if not values["finite"] and self._overflow_skipped(step, values):
      return None
    if not values["finite"]:
      last = self.checkpoints.latest or "none"
      raise NonFiniteLossError(
          f"non-finite loss ({values['loss']}) or gradient norm ({values['grad_norm']}) "
          f"at step {step}; stopped without applying it. Last good checkpoint: {last}")
    if not values["update_finite"]:
      self._stop_non_finite_update(step, values)
    return values

  def _check_batch(self, batch: dict, input_name: str, step: int | None = None) -> None:
    """Raises BadDataError for an id or label outside the model's sizes (id_bounds),
    before the step that would read it."""
    try:
      base_task.check_batch_ids(batch, self.id_bounds, input_name, step)
    except base_task.BadBatchError as e:
      raise BadDataError(f"{e}; nothing of this step was applied. Last good checkpoint: "
                         f"{self.checkpoints.latest or 'none'}") from None

  def _overflow_skipped(self, step: int, values: dict) -> bool:
    """Whether a non-finite step is one dynamic loss scaling skips (said in a log
    line): the loss finite, the gradient not, at a scale above its minimum."""
    if "loss_scale" not in values or not np.isfinite(values["loss"]):
      return False
    used = float(values["loss_scale"])
    if used <= self.loss_scale.params.min_scale:
      return False
    # (The step's own halving: with several steps per call, the variable is the call's.)
    halved = max(used * 0.5, self.loss_scale.params.min_scale)
    self.log(f"step {step}: gradient overflow at loss scale {used:g}; update skipped, "
             f"loss scale now {halved:g}")
    return True

  def _write_summaries(self, writer: tf.summary.SummaryWriter, step: int, values: dict,
                       examples_per_sec: float, timestamps: list[tf.Tensor]) -> None:
    """Writes the step's values (all but its finiteness flags), examples/sec and, for
    a pipelined model, its measured timeline."""
    with self._summary_errors(self.train_dir), writer.as_default():
      for name, value in values.items():
        if name not in ("finite", "update_finite"):
          tf.summary.scalar(name, value, step=step)
      tf.summary.scalar("examples_per_sec", examples_per_sec, step=step)
      if timestamps:
        self._write_timeline(timestamps, step)

  def _log_progress(self, progress: _Progress, values: dict, examples_per_sec: float) -> None:
    """Logs the progress line (step, loss, examples/sec, ETA) and starts a new window
    for examples/sec."""
    self.log(f"step {progress.step}/{progress.max_steps}  loss {values['loss']:.4f}  "
             f"examples/sec {examples_per_sec:.1f}  eta {_format_eta(progress.eta_seconds())}")
    progress.start_window()

  def _stop_if_requested(self, step: int) -> None:
    """Raises TrainingInterrupted if `stop_requested` is set (after step `step`)."""
    if self.stop_requested.is_set():
      raise TrainingInterrupted(
          f"interrupted at step {step}; the last checkpoint is "
          f"{self.checkpoints.latest or 'none'}: rerun the same command to resume from it")

  def _stop_non_finite_update(self, step: int, values: dict) -> None:
    """Raises NonFiniteUpdateError naming the variables the update of `step` broke;
    nothing of that step has been saved."""
    broken = train_step.non_finite_variables(self.train_step.checkpointed_variables())
    shown = ", ".join(broken[:5]) + (f" and {len(broken) - 5} more" if len(broken) > 5 else "")
    # (all_finite checks each variable's sum: weights of order 1e32 overflow it while
    # every one of them is still finite)
    what = (f"made {len(broken)} variable(s) non-finite ({shown})" if broken else
            "made a variable's weights so large (order 1e32) that their sum overflows")
    raise NonFiniteUpdateError(
        f"the update of step {step} {what} "
        f"although the loss ({values['loss']}) and gradient norm ({values['grad_norm']}) "
        f"were finite: the learning rate ({values['learning_rate']}) is likely too large; "
        f"nothing of this step was saved. Last good checkpoint: "
        f"{self.checkpoints.latest or 'none'}")

  def _call_ending_intervals(self, eval_fn: Callable | None) -> list[int]:
    """The intervals (in steps) at whose multiples every call ends: the checkpoint's,
    and the eval's where this run evaluates."""
    train_p = self.params.task.train
    intervals = [train_p.save_interval_steps]
    if eval_fn is not None and train_p.eval_interval_steps:
      intervals.append(train_p.eval_interval_steps)
    return intervals

  def _longest_call(self, steps_left: int, eval_fn: Callable | None) -> int:
    """The most steps one call of this run can take (`_call_size`'s bound): fewer than
    steps_per_call where max_steps or an interval that ends calls comes sooner."""
    return max(1, min(self.params.task.train.steps_per_call, steps_left,
                      *self._call_ending_intervals(eval_fn)))

  def _build_train_step(self, longest_call: int) -> Callable:
    """Traces the training step (for calls of up to `longest_call` steps: what
    `_longest_call` allows), saying what it builds and how long that took."""
    pipeline = self.task.pipeline
    if pipeline is not None:
      p = pipeline.params
      what = (f"{len(pipeline.cells)} cells × {p.num_micro_batches} micro-batches, "
              f"schedule {p.schedule}, recompute {p.recompute}")
      if self.replicas.num_replicas > 1:
        what += f", {self.replicas.num_replicas} replicas"
    else:
      what = "not pipelined"
    specs = self.train_input.batch_specs()
    check_calls_against_buckets(self.params.task.train, specs)
    if len(specs) > 1:
      what += f", {len(specs)} length buckets"
    self.log(f"Building the training step ({what}) ...")
    start = time.perf_counter()
    per_call = min(self.params.task.train.steps_per_call, longest_call)
    if per_call < self.params.task.train.steps_per_call:
      # (One unrolled step per step of a call: a call this run never makes, traced,
      # would cost time and memory in proportion, a billion steps never finishing.)
      self.log(f"task.train.steps_per_call={self.params.task.train.steps_per_call} is more "
               f"than a call of this run takes: at most {per_call}, up to the next "
               "checkpoint, eval or max_steps")
    if per_call > 1:  # (one batch shape: check_calls_against_buckets)
      return self._steps_per_call_fn(specs[0], per_call, start)
    # One traced step per batch shape: every length bucket's up front unless
    # task.train.trace_buckets says 'when_needed' (then a bucket's first batch traces
    # its step, mid-run). Either way a bucket's first run still pays the executor's
    # set-up (Grappler, kernels).
    traced = _StepPerShape(self.train_step, specs, on_trace=lambda shape, seconds: self.log(
        f"Built the training step for {'×'.join(map(str, shape[0]))} batches in "
        f"{seconds:.1f} s"))
    if len(specs) == 1 or self.params.task.train.trace_buckets == "up_front":
      with tf_internals.step_options(), cyclic_gc_paused():  # (its own Grappler settings)
        for spec in specs:
          traced.trace(spec)
      self.log(f"Built the training step in {time.perf_counter() - start:.1f} s"
               + (" (one per bucket)" if len(specs) > 1 else ""))
    else:
      self.log("Each bucket's training step is built at its first batch")

    def step_fn(batches: list[Any]) -> list[Any]:
      with tf_internals.step_options():
        return [traced(batch) for batch in batches]

    return step_fn

  def _steps_per_call_fn(self, spec: Any, per_call: int, start: float) -> Callable:
    """step_fn(batches) → each step's (outputs, timestamps): `TrainStep.steps`, one
    tf.function per number of batches, traced for `per_call` here and for fewer (a
    call cut short by a checkpoint, an eval or max_steps) when first needed."""
    traced: dict[int, Any] = {}

    def calls_of(count: int) -> Any:
      if count not in traced:
        traced[count] = tf.function(self.train_step.steps).get_concrete_function(
            [spec] * count)
      return traced[count]

    with tf_internals.step_options(), cyclic_gc_paused():
      calls_of(per_call)
    self.log(f"Built the training step in {time.perf_counter() - start:.1f} s "
             f"({per_call} steps per call)")

    def step_fn(batches: list[Any]) -> list[Any]:
      with tf_internals.step_options():
        return calls_of(len(batches))(batches)

    return step_fn

  def _write_timeline(self, fetched: list[tf.Tensor], step: int) -> None:
    """Writes the measured timeline of this step's pipeline: scalars and an image."""
    measured = timeline.MeasuredTimeline.from_fetched([t.numpy() for t in fetched])
    for name, value in measured.summary(self.train_step.plan).items():
      tf.summary.scalar(name, value, step=step)
    devices = self.task.pipeline.cell_devices if self.task.pipeline is not None else None
    image = schedule_chart.chart(measured, devices, self.train_step.plan)
    tf.summary.image("pipeline/schedule", image[None], step=step,
                     description="Replica 0's cells top to bottom (with their devices), "
                     "time in ms left to right; forward calls blue, backward (with "
                     "recompute) orange, deferred weight gradients green, darker for later "
                     "units and numbered with the unit (the micro-batch; m.j, slice j of "
                     "micro-batch m, with token slices) where a bar is wide enough; white "
                     "is idle (the bubble).")

  def evaluate(self) -> dict[str, float]:
    """Runs the eval input once; writes and returns the example-weighted mean metrics."""
    if self.params.eval_input is None:
      raise TrainerError("this model has no eval_input")
    self.log(f"Evaluating at step {int(self.global_step.numpy())} ...")
    input_gen = self.params.eval_input.copy().set(repeat=False).instantiate()
    step_fn = _StepPerShape(self._eval_step, input_gen.batch_specs())
    totals: dict[str, float] = {}
    weights: dict[str, float] = {}
    with tf_internals.step_options():
      for batch in input_gen.dataset():
        self._check_batch(batch, "eval_input")
        for name, (value, weight) in step_fn(batch).items():
          totals[name] = totals.get(name, 0.0) + float(value) * float(weight)
          weights[name] = weights.get(name, 0.0) + float(weight)
    if not weights:
      raise TrainerError("the eval input produced no full batch; lower its batch_size")
    results = {name: totals[name] / weights[name] for name in totals}
    if getattr(self.task, "has_decoder", False):
      # Metrics of decoded outputs (BLEU) are computed on the host over the whole set.
      full_spec = input_gen.full_batch_spec()
      decode_fn = _StepPerShape(lambda batch: self._decode_step(batch, full_spec),
                                input_gen.batch_specs())
      with tf_internals.step_options():
        decoded = [{k: v.numpy() for k, v in decode_fn(batch).items()}
                   for batch in input_gen.dataset()]
      results.update(self.task.decode_metrics(decoded, input_gen))
    step = int(self.global_step.numpy())
    writer = tf.summary.create_file_writer(self.eval_dir)
    with self._summary_errors(self.eval_dir), writer.as_default():
      for name, value in results.items():
        tf.summary.scalar(name, value, step=step)
      writer.flush()
    shown = "  ".join(f"{k} {v:.4f}" for k, v in sorted(results.items()))
    self.log(f"eval at step {step}: {shown}")
    return results


def _examples_in(batch: dict[str, tf.Tensor]) -> int:
  """A batch's examples (its rows: with length buckets, each bucket has its own)."""
  return int(tf.nest.flatten(batch)[0].shape[0])


def _shape_of(structure: Any) -> tuple:
  """The shapes of a batch's (or a batch spec's) tensors, in flattening order."""
  return tuple(tuple(t.shape) for t in tf.nest.flatten(structure))


class _StepPerShape:
  """`step` as a tf.function of one batch, traced once per batch shape: with one shape
  (no length buckets) for exactly that spec; with several, each when `trace` is
  called for it or, failing that, at the first batch of its shape (then `on_trace`
  hears the shape and the seconds it took). Traces go through get_concrete_function,
  so a bucket's first batch is never a 'retrace' TensorFlow warns of."""

  def __init__(self, step: Callable, specs: list[dict[str, tf.TensorSpec]],
               on_trace: Callable[[tuple, float], None] | None = None):
    self._traced = tf.function(step, input_signature=specs if len(specs) == 1 else None)
    self._shapes: set[tuple] = set()
    self._on_trace = on_trace

  def trace(self, spec: Any) -> None:
    self._traced.get_concrete_function(spec)
    self._shapes.add(_shape_of(spec))

  def __call__(self, batch: Any) -> Any:
    shape = _shape_of(batch)
    if shape not in self._shapes:
      start = time.perf_counter()
      self.trace(tf.nest.map_structure(tf.TensorSpec.from_tensor, batch))
      if self._on_trace is not None:
        self._on_trace(shape, time.perf_counter() - start)
    return self._traced(batch)


class _Progress:
  """Where one `Trainer.train` call is: the global step it has reached, the cadence of
  what is done at intervals, examples/sec over the steps since the last progress line
  (the window) and the ETA from the rate since the run started."""

  def __init__(self, start: int, max_steps: int):
    self.start, self.max_steps = start, max_steps
    self.step = start
    self.run_start = time.perf_counter()
    self.window_end = self.run_start  # (when the last step counted was done)
    self.start_window()

  def due(self, interval: int) -> bool:
    """Whether something done every `interval` steps is due now: at its interval and at
    max_steps."""
    return self.step % interval == 0 or self.step == self.max_steps

  def due_before_the_end(self, interval: int) -> bool:
    """Like `due`, but never at max_steps; an `interval` of 0 means never."""
    return bool(interval) and self.step % interval == 0 and self.step != self.max_steps

  def seconds_since_start(self) -> float:
    return time.perf_counter() - self.run_start

  def count_step(self, examples: int, done_at: float) -> float:
    """Counts a step of `examples` done (at perf_counter time `done_at`) in the window;
    returns examples/sec over the window up to then, which the next window starts
    from."""
    self.window_examples += examples
    self.window_end = done_at
    return self.window_examples / max(done_at - self.window_start, 1e-9)

  def start_window(self) -> None:
    """A new window from the last step counted (the run's start before any)."""
    self.window_start, self.window_examples = self.window_end, 0

  def eta_seconds(self) -> float:
    """Seconds to max_steps at the rate since the run started."""
    steps_per_sec = (self.step - self.start) / max(self.seconds_since_start(), 1e-9)
    return (self.max_steps - self.step) / steps_per_sec


class _StepProfiler:
  """Starts TensorFlow's profiler before global step steps[0] and stops it after
  steps[1] (None, or a range outside start+1..max_steps: nothing is profiled)."""

  def __init__(self, steps: tuple[int, int] | None, logdir: str,
               log: Callable[[str], None], start: int, max_steps: int):
    self.steps, self.logdir, self.log = steps, logdir, log
    self.active = False
    if steps is not None and (steps[1] <= start or steps[0] > max_steps):
      log(f"--profile_steps {steps[0]},{steps[1]} lie outside the steps this run trains "
          f"({start + 1}..{max_steps}); nothing is profiled")
      self.steps = None

  def edges(self) -> list[int]:
    """The global steps after which a call must end so that the profile holds steps
    steps[0]..steps[1] (task.train.steps_per_call): steps[0] − 1 and steps[1]."""
    return [] if self.steps is None else [self.steps[0] - 1, self.steps[1]]

  def before(self, step: int) -> None:
    if self.steps is not None and not self.active and self.steps[0] <= step <= self.steps[1]:
      tf.profiler.experimental.start(self.logdir)
      self.active = True

  def after(self, step: int) -> None:
    if self.active and step >= self.steps[1]:
      self.stop()

  def stop(self) -> None:
    if self.active:
      tf.profiler.experimental.stop()
      self.active = False
      self.log(f"Profiled steps {self.steps[0]}..{self.steps[1]} into "
               f"{self.logdir}/plugins/profile (TensorBoard's profile tab)")
      self.steps = None
