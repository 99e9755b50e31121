"""The lingvo_gpipe trainer binary.

  python tools/trainer.py --model=demo.TinyConvNet --logdir=/tmp/run --max_steps=200

Modes: train, eval, train_and_eval, inspect_params, inspect_model, list_models, plan,
export, decode. export writes the newest good checkpoint of --logdir (or --checkpoint)
as a SavedModel with the task's serving signatures to <logdir>/export/<step>/ (one
device, or --export_devices: the cells on those devices, a forward-only pipeline);
decode runs the eval input through the same serving functions and writes
<logdir>/decode_<step>.jsonl and the task's metrics to TensorBoard (docs/trainer.md).
plan measures (or reads from --cost_cache) the per-layer costs and the machine's figures,
prints the best plans for --devices and --device_memory and what the model's own
configuration would take (and whether it fits), last a JSON line with the best plan's
--params_override. In train modes, --plan=auto trains with the best plan, --plan=check
with the params as given; both predict the step and per-device peak, and write them
beside the measured ones when training ends (log, TensorBoard, train/plan_check.json).
export and decode serve the params the run trained with (<logdir>/params.txt;
lingvo_gpipe/run_params.py). Exit codes: 0 success; 2 bad input (a bad flag, unknown
model, a param file that does not load, bad override, unwritable logdir, bad device or
cluster spec, missing TFDS data, a model smaller than its data's vocabulary or classes,
a checkpoint of another model, params its checkpoints cannot follow, an export override
of a trained param, an export that exists without --overwrite), reported before
anything is written; 1 a run that failed (a non-finite loss, an id the model cannot
take, a step that failed, a worker that died, froze or became unreachable, a
checkpoint that could not be saved; the last good checkpoint is kept and a rerun with
the same logdir resumes); 130 interrupted (Ctrl-C); 143 terminated (SIGTERM).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import TYPE_CHECKING

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags, logging  # noqa: E402

if TYPE_CHECKING:
  from lingvo_gpipe.core.hyperparams import Params
  from lingvo_gpipe.planning import Planned
  from lingvo_gpipe.runtime.watchdog import WorkerWatchdog
  from lingvo_gpipe.trainer import Trainer

MODES = ("train", "eval", "train_and_eval", "inspect_params", "inspect_model", "list_models",
         "plan", "export", "decode")

FLAGS = flags.FLAGS
# The modes that run the logdir's own model on (and write to it).
_TRAIN_MODES = ("train", "eval", "train_and_eval")
flags.DEFINE_string("model", None, "Registered model key, e.g. demo.TinyConvNet.")
flags.DEFINE_string("logdir", None, "Directory for checkpoints, summaries and params.txt.")
flags.DEFINE_integer("max_steps", None, "Train until this global step (default: the "
                     "model's task.train.max_steps).")
flags.DEFINE_string("params_override", "", "Semicolon-separated key=value overrides, "
                    "e.g. 'task.train.max_steps=10;train_input.batch_size=16'.")
flags.DEFINE_enum("mode", "train", MODES, "What to do.")
flags.DEFINE_string("devices", "cpu", "Devices: cpu, cpu:N (N logical CPUs), gpu, gpu:N or "
                    "gpu:N:MEMORY_MB (GPU 0 split into N logical GPUs).")
flags.DEFINE_string("cluster_spec", None, "Run pipeline cells on TensorFlow servers "
                    "(tools/worker.py): JOB=HOST:PORT,...[;JOB=...], cell k on /job:worker/task:k. "
                    "'tf_config' reads the cluster from $TF_CONFIG. Replaces --devices.")
flags.DEFINE_list("params_path", [], "Extra param files or directories to register models "
                  "from (also $LINGVO_GPIPE_PARAMS_PATH, ':'-separated).")
flags.DEFINE_integer("inspect_depth", 3, "Layer depth shown by --mode=inspect_model.")
flags.DEFINE_string("profile_steps", "", "A,B: capture a TensorFlow profile of global steps "
                    "A..B into <logdir>/train/plugins/profile (TensorBoard's profile tab), "
                    "e.g. 10,12.")
flags.DEFINE_enum("plan", "", ["", "auto", "check"], "Train modes: 'auto' trains with the "
                  "best plan for the devices and --device_memory (replacing task.pipeline's "
                  "num_cells, splits, num_micro_batches, recompute, schedule, "
                  "virtual_stages, weight_gradient_group, num_token_slices, "
                  "token_slice_lengths (near-equal), num_replicas; and, under "
                  "partition_cost='measured', layer_costs: the planner's); 'check' with "
                  "the params as given (their split written into them). Both log the "
                  "predicted step "
                  "and per-device peak and, when training ends, the measured ones beside "
                  "them.")
flags.DEFINE_string("device_memory", "16GB", "--mode=plan and --plan: each device's memory "
                    "budget (e.g. 16GB, 512MiB); plans keep 10% of it free.")
flags.DEFINE_string("cost_cache", "~/.cache/lingvo_gpipe/layer_costs.json", "--mode=plan and "
                    "--plan: the file measured per-layer costs and machine figures are kept "
                    "in (a plan is redone quickly once they are there); empty: measure "
                    "every time.")
flags.DEFINE_bool("reset_params", False, "Train modes: set <logdir>/params.txt aside "
                  "(renamed, kept) before the run, e.g. a damaged one that cannot be read; "
                  "the restore still checks the model against the checkpoint.")
flags.DEFINE_string("checkpoint", None, "--mode=export and decode: the checkpoint prefix "
                    "to use (e.g. <logdir>/train/ckpt-300) instead of the newest good one.")
flags.DEFINE_string("export_devices", None, "--mode=export and decode: the devices the "
                    "cells go to (cpu:N, gpu:N, as --devices): the task's cells stay on them "
                    "and inference is a forward-only pipeline over its micro-batches. "
                    "Default: the whole model on one device.")
flags.DEFINE_string("export_dtype", "float32", "--mode=export and decode: the weights' "
                    "dtype (cast once) and the compute dtype: float32, bfloat16 or float16.")
flags.DEFINE_integer("max_decode_length", 128, "--mode=export and decode, language models: "
                     "the longest prefix + new tokens generate handles (its key/value cache "
                     "holds this many positions).")
flags.DEFINE_bool("overwrite", False, "--mode=export: replace an export of the same step.")
flags.DEFINE_string("data_dir", None, "Prepared TFDS data for the model's TFDS inputs "
                    "(sets train_input.data_dir and eval_input.data_dir).")


class UsageFailure(Exception):
  """Bad input: reported on stderr with exit code 2."""


@dataclasses.dataclass
class RunState:
  """What the Ctrl-C handler (in the main thread) needs of the run in the trainer thread.

  `_run_interruptibly` makes one and hands it down to `_run`; `_train_or_eval` sets
  `trainer` once it is built.
  """
  trainer: Trainer | None = None
  planned: Planned | None = None  # --plan: the prediction to compare the run with
  devices: tuple[str, ...] = ()
  measuring: subprocess.Popen | None = None  # --plan: the child measuring the costs
  measuring_folder: str | None = None  # its temporary cache's (--cost_cache=''), if any
  stopping: bool = False  # request_stop was called
  # --plan with evals between steps: the allocators' peaks of the training before each
  # eval (an eval's own peak is not the plan's), their most per allocator
  peaks_between_evals: tuple[list[str], list[float]] | None = None

  def request_stop(self) -> None:
    """Asks the training loop, if one is built, to stop after the call in flight (one
    step, or steps_per_call of them), and stops the child measuring costs, if any."""
    if self.trainer is not None:
      self.trainer.stop_requested.set()
    self.stopping = True
    if self.measuring is not None and self.measuring.poll() is None:
      self.measuring.terminate()  # (its cache is written whole or not at all)
      try:
        self.measuring.wait(timeout=5)
      except subprocess.TimeoutExpired:
        self.measuring.kill()
        self.measuring.wait()
    self.discard_measuring_folder()

  def discard_measuring_folder(self) -> None:
    """Removes the child's temporary cache folder, if there is one (the process may be
    about to end without the trainer thread's cleanup)."""
    if self.measuring_folder is not None:
      shutil.rmtree(self.measuring_folder, ignore_errors=True)
      self.measuring_folder = None


@contextlib.contextmanager
def _bad_params_are_usage_errors():
  """A bad params value (hyperparams.ParamsError, which the pipeline's errors extend)
  or missing data is the user's to fix: exit code 2. Any other exception is a bug of
  the library and keeps its traceback."""
  from lingvo_gpipe import model_registry
  from lingvo_gpipe.core import hyperparams
  from lingvo_gpipe.inputs.tfds_inputs import MissingDataError

  try:
    yield
  except MissingDataError as e:
    raise UsageFailure(str(e)) from None
  except hyperparams.ParamsError as e:
    where = model_registry.where_in_param_files(e)
    raise UsageFailure(f"bad model params: {e}" + (f" (at {where})" if where else "")) from None


def _model_params(serving_changes: list[dict[str, str]] | None = None):
  """The frozen params of --model with --params_override, --data_dir and --max_steps.

  With `serving_changes` (export, decode): the params the logdir's checkpoint was
  trained with (run_params.served_params of --logdir and --checkpoint), the override
  limited to what serving may change; what it changed is appended to the list, for the
  export to record.
  """
  from lingvo_gpipe import model_registry, run_params
  from lingvo_gpipe.core import hyperparams

  if not FLAGS.model:
    raise UsageFailure("--model is required (see --mode=list_models)")
  try:
    with _bad_params_are_usage_errors():  # raised inside the model's own params methods
      params = model_registry.get_params(FLAGS.model)
  except (model_registry.ModelNotFoundError, model_registry.ParamFileError) as e:
    raise UsageFailure(str(e)) from None
  try:
    overrides = hyperparams.parse_overrides(FLAGS.params_override)
    if serving_changes is not None:
      params, changes = run_params.served_params(
          params, FLAGS.logdir, FLAGS.checkpoint, overrides, FLAGS.model,
          log=lambda line: print(line, flush=True))
      serving_changes.extend(changes)
    else:
      for key, value in overrides:
        params.set_from_text(key, value)
      if FLAGS.mode in _TRAIN_MODES and FLAGS.logdir and not FLAGS.reset_params:
        _take_params_added_since_the_logdir(params, frozenset(k for k, _ in overrides))
  except run_params.RunParamsError as e:
    raise UsageFailure(str(e)) from None
  except hyperparams.ParamsError as e:
    raise UsageFailure(f"--params_override: {e}") from None
  if FLAGS.data_dir is not None:
    inputs = [params.train_input, params.eval_input]
    with_data_dir = [p for p in inputs if p is not None and "data_dir" in p]
    if not with_data_dir:
      raise UsageFailure(f"--data_dir: model {FLAGS.model} has no TFDS input (its inputs "
                         "are offline sets)")
    for p in with_data_dir:
      p.data_dir = FLAGS.data_dir
  if FLAGS.max_steps is not None:
    if FLAGS.max_steps < 0:
      raise UsageFailure(f"--max_steps must be >= 0, got {FLAGS.max_steps}")
    params.task.train.max_steps = FLAGS.max_steps
  return params.freeze()


def _take_params_added_since_the_logdir(params, overridden: frozenset[str]) -> None:
  """A logdir written by an older version: each param added since takes what the code
  did before it existed (logdirs.take_params_added_since), unless --params_override
  set it, so that the run goes on as it trained; noted. A damaged params.txt is left to
  the resume check, which names it."""
  from lingvo_gpipe import logdirs

  try:
    text = logdirs.read_params_text(FLAGS.logdir)
    path = os.path.join(FLAGS.logdir, logdirs.PARAMS_FILE)
    added = [] if text is None else logdirs.take_params_added_since(
        params, text, path, keep=overridden)
  except logdirs.LogdirError:
    return
  if added:
    print(f"{path} was written before these params existed; the run goes on as it "
          f"trained, with each as it was then: {'; '.join(added)}", flush=True)


def _inspect_model(params) -> None:
  from lingvo_gpipe.core import model_stats
  from lingvo_gpipe.pipeline import PipeliningLayer
  from lingvo_gpipe.tasks.base_task import unpipelined, with_partition_costs

  batch_spec = params.train_input.instantiate().batch_spec()
  task_params = with_partition_costs(params.task, params.train_input)
  stats = model_stats.analyze(task_params, batch_spec, max_depth=FLAGS.inspect_depth)
  if any(isinstance(s.layer, PipeliningLayer) for s in stats):
    # A pipeline's cells run inside its device loops' functions, whose ops the graph's
    # op list does not show: FLOPs and shapes come from the same layers run unpipelined.
    plain = {s.path: s for s in model_stats.analyze(unpipelined(task_params), batch_spec,
                                                     max_depth=FLAGS.inspect_depth)}
    for s in stats:
      if s.path in plain:
        s.flops = plain[s.path].flops
        s.output_shapes = s.output_shapes or plain[s.path].output_shapes
  print(model_stats.format_table(stats))
  cells = []
  for s in stats:
    if isinstance(s.layer, PipeliningLayer):
      described = s.layer.describe_cells()
      print(f"\nPipeline {s.path}: {len(described)} cells, "
            f"{s.layer.params.num_micro_batches} micro-batches, "
            f"recompute={s.layer.params.recompute}, schedule={s.layer.params.schedule}")
      print(model_stats.format_cells(described))
      cells.extend({k: c[k] for k in ("device", "params", "cost_share", "cost_by")}
                   for c in described)
  root = stats[0]
  summary = {"model": FLAGS.model, "total_params": root.num_params,
             "total_flops_per_batch": root.flops,
             "batch_size": params.train_input.batch_size}
  if cells:
    summary["cells"] = cells
  print(json.dumps(summary))


def _plan_setting(devices: list[str]):
  """planning.Setting of --device_memory (less a 10% margin), --cost_cache and the
  devices (UsageFailure on a bad budget or cache path)."""
  from lingvo_gpipe import planning
  from lingvo_gpipe.pipeline import layer_profiler, planner

  try:
    budget = planner.parse_bytes(FLAGS.device_memory) * 0.9
  except ValueError as e:
    raise UsageFailure(f"--device_memory: {e}") from None
  cache_path = os.path.expanduser(FLAGS.cost_cache)
  if cache_path:
    try:
      layer_profiler.check_cache_path(cache_path)  # before the model is probed
    except layer_profiler.CostCacheError as e:
      raise UsageFailure(f"--cost_cache: {e}") from None
  return planning.Setting(tuple(devices), budget, cache_path,
                          log=lambda text: print(text, flush=True))


def _plan(params, devices: list[str]) -> int:
  """--mode=plan: measures (or reads from --cost_cache) each layer's costs and the
  machine's figures, prints the best plans for the devices and --device_memory and
  what the params as given would take, and last one JSON line with the best plan's
  --params_override."""
  from lingvo_gpipe import planning
  from lingvo_gpipe.core.hyperparams import ParamsError
  from lingvo_gpipe.pipeline import layer_profiler, planner

  setting = _plan_setting(devices)
  planning.warn_where_allocations_go_uncounted(setting)
  try:
    stack, costs, machine = planning.measured(params, setting)
    batch_size = stack.batch_size
  except layer_profiler.CostCacheError as e:
    raise UsageFailure(f"--cost_cache: {e}") from None
  start = time.perf_counter()
  try:
    plans = planner.plan(costs, machine, batch_size)
  except planner.PlanError as e:
    plans, no_plan = [], str(e)
  print(f"Planned in {time.perf_counter() - start:.1f} s: {len(devices)} device(s), "
        f"{setting.memory_bytes / 2**30:.3g} GiB each after a 10% margin, "
        f"{planning.planned_batch(params)}")
  if plans:
    print(planner.format_plans(plans))
  own = None
  try:
    shape, own = planning.predict_own(planning.with_measured_costs(params, costs), costs,
                                      machine, devices, batch_size)
  except (ParamsError, ValueError) as e:  # a configuration these devices cannot build
    print(f"The params as given cannot be predicted here: {e}")
  if own is not None:
    print(f"The params as given (K={shape.num_cells}, M={shape.num_micro_batches}, "
          f"{shape.recompute}, {shape.schedule}): step {own.step_s * 1e3:.1f} ms, peak per "
          f"device {planning.format_peaks(own.peak_bytes)}; "
          f"{planning.verdict(own, setting)}")
  if not plans:
    raise UsageFailure(no_plan)
  best = plans[0]
  print(json.dumps({"model": FLAGS.model, "devices": len(devices),
                    "device_memory_bytes": setting.memory_bytes / 0.9,
                    "step_s": best.step_s, "bubble": best.bubble,
                    "peak_bytes": list(best.peak_bytes),
                    "params_override": best.shape.params_override(),
                    "fit": planner.fit_word(max(best.peak_bytes), setting.memory_bytes),
                    "plans": [{"step_s": p.step_s, "peak_bytes": list(p.peak_bytes),
                               "params_override": p.shape.params_override()}
                              for p in plans],
                    "own": None if own is None else {
                        "step_s": own.step_s, "peak_bytes": list(own.peak_bytes),
                        "fits": max(own.peak_bytes) <= setting.memory_bytes,
                        "fit": planner.fit_word(max(own.peak_bytes),
                                                setting.memory_bytes)}}))
  return 0


def _planned_params(params, devices: list[str], state: RunState):
  """--plan: the params to train (auto: the best plan's), their prediction kept in
  `state` for the comparison at the end."""
  from lingvo_gpipe import planning
  from lingvo_gpipe.pipeline import layer_profiler, planner

  setting = _plan_setting(devices)
  with _bad_params_are_usage_errors():
    try:
      if FLAGS.plan == "check":  # (before a child measures what this cannot use)
        planning.check_one_device_per_cell(params.task.pipeline, devices)
      try:
        measured, found = _measured_apart(params, setting, state)
        state.planned = planning.plan_run(params, measured, auto=FLAGS.plan == "auto",
                                          found_in_cache=found)
      finally:
        state.discard_measuring_folder()
    except (planner.PlanError, layer_profiler.CostCacheError) as e:  # (ParamsErrors too)
      raise UsageFailure(f"--plan={FLAGS.plan}: {e}") from None
  state.devices = tuple(devices)
  planning.reset_allocator_peaks(devices)  # the run's peak, not the measuring's
  return state.planned.params


def _measured_apart(params, setting, state: RunState):
  """(the setting, what its cost cache holds for the plan: planning.from_cache, or
  None where the run must measure). What the cache lacks is
  measured by this command run as --mode=plan in a child process, so that the run's
  allocator holds nothing the measuring left (run in the trainer's own process, it
  left the run's peak 2-15% higher: docs/benchmarks.md, "The bound at small sizes").
  Without a cache (--cost_cache=''), the child writes to a temporary one this run
  reads. In-process as before where a child cannot help: remote devices (their
  workers keep the measuring's allocations either way), or a cache file that is not
  one (a child could not save to it)."""
  import tempfile

  from lingvo_gpipe import planning
  from lingvo_gpipe.pipeline import layer_profiler

  if FLAGS.cluster_spec or (setting.cost_cache and
                            layer_profiler.cache_problem(setting.cost_cache)):
    return setting, None
  found = planning.from_cache(params, setting)
  if found is not None:
    return setting, found
  if not setting.cost_cache:
    state.measuring_folder = tempfile.mkdtemp(prefix="lingvo_gpipe_costs_")
  cache = setting.cost_cache or os.path.join(state.measuring_folder, "layer_costs.json")
  given = {id(FLAGS[name]): FLAGS[name] for name in FLAGS
           if FLAGS[name].present and name not in ("mode", "plan", "cost_cache", "flagfile")}
  command = [sys.executable, os.path.abspath(__file__), "--mode=plan", "--plan=",
             f"--cost_cache={cache}"] + [flag.serialize() for flag in given.values()]
  print("Measuring in a child process (--mode=plan), so that this run holds nothing of "
        "it ...", flush=True)
  child = state.measuring = subprocess.Popen(command, stdout=subprocess.PIPE,
                                             stderr=subprocess.STDOUT, text=True)
  lines = []
  for line in child.stdout:
    lines.append(line)
    if line.startswith(("Measuring", "Measured", "warning")):
      print("  " + line, end="", flush=True)
  child.wait()
  if state.stopping:  # (the child was stopped with the run, which ends now)
    raise UsageFailure("interrupted while the costs were measured")
  setting = dataclasses.replace(setting, cost_cache=cache)
  found = planning.from_cache(params, setting)
  if found is None:  # (then the run measures, as it did before)
    print(f"warning: the child process (exit {child.returncode}) did not measure the costs; "
          f"measuring here. Its last lines:\n{''.join(lines[-5:])}", flush=True)
  return setting, found


def _evaluate_apart_from_the_plan(state: RunState, trainer) -> None:
  """--plan with evals between steps: an eval, its peak kept out of the training's
  (what the plan predicts): the peaks so far are kept, and reset after it."""
  from lingvo_gpipe import planning

  state.peaks_between_evals = planning.most_of(state.peaks_between_evals,
                                               planning.allocator_peaks(state.devices))
  trainer.evaluate()
  planning.reset_allocator_peaks(state.devices)


def _compare_with_plan(state: RunState, trainer) -> None:
  """--plan: the prediction beside what the run measured (log, TensorBoard, JSON)."""
  from lingvo_gpipe import planning

  peaks = planning.most_of(state.peaks_between_evals, planning.allocator_peaks(state.devices))
  found = planning.compare(state.planned, trainer.step_seconds, peaks,
                           trainer.last_timestamps, host_bytes=trainer.input_held_bytes)
  print(planning.format_comparison(found), flush=True)
  path = planning.write_comparison(trainer.train_dir, found,
                                   int(trainer.global_step.numpy()))
  print(f"Wrote {path}")


def _latest_checkpoint() -> str | None:
  from lingvo_gpipe import checkpoints

  return checkpoints.latest(os.path.join(FLAGS.logdir, "train")) if FLAGS.logdir else None


def _lost_worker_message(task: int, address: str, why: str) -> str:
  latest = _latest_checkpoint()
  resume = (f"the last checkpoint is {latest}; restart the worker and rerun this command "
            "(same --logdir) to resume from it" if latest else "no checkpoint was written yet")
  return f"worker /job:worker/task:{task} at {address} {why}; stopped training: {resume}"


def _exit_now(message: str, code: int) -> None:
  """Prints `message` and ends the process at once, whatever its threads are doing (a
  step waiting on a dead or frozen worker never returns)."""
  sys.stdout.flush()
  print(f"error: {message}", file=sys.stderr, flush=True)
  os._exit(code)


def _watch_workers(addresses: list[str]):
  """Exits the process (code 1) soon after a worker dies, freezes or becomes
  unreachable: the step waiting on it cannot be waited for."""
  from lingvo_gpipe.runtime.watchdog import WorkerWatchdog

  def on_failure(task: int, address: str, why: str) -> None:
    _exit_now(_lost_worker_message(task, address, why), 1)

  return WorkerWatchdog(addresses, on_failure).start()


def _run(state: RunState) -> int:
  """Does what --mode asks: the steps below in order, each mode ending at its own.

  Args:
    state: where the trainer, once built, is left for the Ctrl-C handler.

  Returns:
    The exit code (0).

  Raises:
    UsageFailure: bad input, reported before anything is written (exit code 2).
    trainer.TrainerError: a run that failed (exit code 1).
  """
  _set_up_local_devices_first()
  _load_param_files()
  if FLAGS.mode == "list_models":
    _list_models()
    return 0
  if FLAGS.mode in ("export", "decode"):
    _check_serving_flags()
    changes: list[dict[str, str]] = []
    return _export_or_decode(_model_params(serving_changes=changes), changes)
  params = _model_params()
  if FLAGS.mode == "inspect_params":
    print(params.to_text(), end="")
    return 0
  devices, watchdog = _devices()
  if FLAGS.mode == "inspect_model":
    with _bad_params_are_usage_errors():
      _inspect_model(params)
    return 0
  from lingvo_gpipe.preflight import preflight

  with _bad_params_are_usage_errors():  # before anything is written or built
    preflight(params, FLAGS.mode, devices, resuming=_has_checkpoint(FLAGS.logdir))
  if FLAGS.mode == "plan":
    with _bad_params_are_usage_errors():
      return _plan(params, devices)
  if FLAGS.plan and FLAGS.mode != "eval":
    params = _planned_params(params, devices, state)
  return _run_in_logdir(params, watchdog, state)


def _has_checkpoint(logdir: str | None) -> bool:
  """Whether `logdir` holds a checkpoint index its run would resume from."""
  import tensorflow as tf

  return bool(logdir) and tf.train.latest_checkpoint(os.path.join(logdir, "train")) is not None


def _export_or_decode(params: Params, changes: list[dict[str, str]]) -> int:
  """--mode=export or decode: writes the SavedModel (export; `changes`: what
  --params_override changed of the trained params, recorded in it) or the decode
  records and metrics (decode) from the newest good checkpoint."""
  import tensorflow as tf

  from lingvo_gpipe import checkpoints, decoder, exporter
  from lingvo_gpipe import trainer as trainer_lib
  from lingvo_gpipe.preflight import preflight
  from lingvo_gpipe.runtime.devices import DeviceSpecError, configure_devices
  from lingvo_gpipe.tasks import serving

  devices = None
  if FLAGS.export_devices:
    try:
      devices = configure_devices(FLAGS.export_devices)
    except DeviceSpecError as e:
      raise UsageFailure(f"--export_devices: {e}") from None
  options = serving.ServingOptions(dtype=FLAGS.export_dtype,
                                   max_decode_length=FLAGS.max_decode_length)
  try:
    with _bad_params_are_usage_errors():
      preflight(params, FLAGS.mode, devices or ())
      if FLAGS.mode == "export":
        exporter.export(params, FLAGS.logdir, model_name=FLAGS.model,
                        checkpoint=FLAGS.checkpoint, devices=devices, options=options,
                        overwrite=FLAGS.overwrite, params_changed=changes)
      else:
        decoder.decode(params, FLAGS.logdir, checkpoint=FLAGS.checkpoint, devices=devices,
                       options=options)
  except exporter.ExportError as e:
    raise UsageFailure(str(e)) from None
  except (OSError, tf.errors.OpError) as e:  # e.g. a full disk: nothing half-written stays
    if isinstance(e, tf.errors.OpError) and not isinstance(
        e, (tf.errors.ResourceExhaustedError, tf.errors.PermissionDeniedError,
            tf.errors.FailedPreconditionError, tf.errors.NotFoundError)):
      # The model failed (e.g. a shape it cannot take), not the writing.
      raise trainer_lib.TrainerError(f"--mode={FLAGS.mode} failed: "
                                     f"{trainer_lib.step_error_cause(e)}") from None
    raise trainer_lib.TrainerError(f"--mode={FLAGS.mode} could not write into "
                                   f"{FLAGS.logdir}: {checkpoints.first_line(e)}") from None
  return 0


# generate's key/value cache holds this many positions per layer and example: beyond it
# the cache (and an int32 position) is not what any shipped model needs.
MAX_DECODE_LENGTH = 65536


def _check_serving_flags() -> None:
  """Refuses (UsageFailure) export or decode flags no run accepts, before the params
  are read: no --logdir, a bad --export_dtype or --max_decode_length."""
  from lingvo_gpipe.tasks import serving

  if not FLAGS.logdir:
    raise UsageFailure(f"--logdir is required for --mode={FLAGS.mode}")
  if not os.path.isdir(FLAGS.logdir):
    raise UsageFailure(f"--logdir {FLAGS.logdir} does not exist: nothing to {FLAGS.mode}")
  try:
    serving.serving_dtype(FLAGS.export_dtype)
  except ValueError as e:
    raise UsageFailure(f"--export_dtype: {e}") from None
  if not 2 <= FLAGS.max_decode_length <= MAX_DECODE_LENGTH:
    raise UsageFailure(f"--max_decode_length must be in 2..{MAX_DECODE_LENGTH} (generate's "
                       f"cache positions), got {FLAGS.max_decode_length}")


def _set_up_local_devices_first() -> None:
  """Sets up the local devices the mode will use (--devices, or --export_devices for
  export and decode) before any param file runs: a param file may start TensorFlow's
  runtime (building a Keras LSTM or GRU lists the GPUs), after which no logical device
  can be added. A bad spec is left for the mode to report, naming its flag."""
  from lingvo_gpipe.runtime.devices import DeviceSpecError, configure_devices

  if FLAGS.mode in ("export", "decode"):
    spec = FLAGS.export_devices
  elif FLAGS.mode in ("list_models", "inspect_params") or FLAGS.cluster_spec:
    spec = None
  else:
    spec = FLAGS.devices
  if spec:
    with contextlib.suppress(DeviceSpecError):
      configure_devices(spec)


def _load_param_files() -> None:
  """Registers the built-in models and those of --params_path and $LINGVO_GPIPE_PARAMS_PATH."""
  from lingvo_gpipe import model_registry

  try:
    model_registry.load_param_files(FLAGS.params_path)
  except (FileNotFoundError, model_registry.ParamFileError) as e:
    raise UsageFailure(f"--params_path: {e}") from None


def _list_models() -> None:
  from lingvo_gpipe import model_registry

  listed = model_registry.keys()
  width = max(map(len, listed))
  print("\n".join(f"{key.ljust(width)}  {model_registry.describe(key)}" for key in listed))


def _devices() -> tuple[list[str], WorkerWatchdog | None]:
  """The devices the cells go to, from --cluster_spec or else --devices, and the
  watchdog of the cluster's workers (None without a cluster)."""
  from lingvo_gpipe.runtime.devices import DeviceSpecError, configure_devices

  try:
    if FLAGS.cluster_spec:
      return _join_cluster()
    return configure_devices(FLAGS.devices), None
  except DeviceSpecError as e:
    flag = "--cluster_spec" if FLAGS.cluster_spec else "--devices"
    raise UsageFailure(f"{flag}: {e}") from None


def _join_cluster() -> tuple[list[str], WorkerWatchdog]:
  """Waits for --cluster_spec's servers, joins them as the client and starts watching
  the workers; returns the cells' devices and the watchdog."""
  from lingvo_gpipe.runtime import cluster

  spec = (cluster.cluster_spec_from_tf_config() if FLAGS.cluster_spec == "tf_config"
          else cluster.parse_cluster_spec(FLAGS.cluster_spec))
  cluster.wait_for_servers(spec.get("worker", []), timeout_s=60.0,
                           log=lambda line: print(line, flush=True))
  spec.setdefault("client", [f"localhost:{cluster.free_port()}"])
  devices = cluster.connect_to_cluster(spec)
  print(f"Joined cluster; cells go to {', '.join(devices)}")
  print(cluster.exposure_warning(spec["client"][0].rpartition(":")[2]), file=sys.stderr,
        flush=True)
  return devices, _watch_workers(spec.get("worker", []))


def _run_in_logdir(params: Params, watchdog: WorkerWatchdog | None, state: RunState) -> int:
  """--mode train, eval or train_and_eval: checks the flags and the logdir, then runs
  the mode holding the logdir's lock; refused before the run wrote, it lets the lock go."""
  from lingvo_gpipe import logdirs

  profile_steps = _check_logdir_flags(params)
  # One trainer per logdir; eval only reads checkpoints and may run beside it.
  lock = logdirs.LogdirLock(FLAGS.logdir) if FLAGS.mode != "eval" else None
  aside = None
  try:
    if lock is not None:
      lock.acquire()
      aside = _note_changed_params(params)
    return _train_or_eval(params, profile_steps, watchdog, state)
  except (logdirs.LogdirError, UsageFailure) as e:  # refused before the run wrote
    if aside is not None:
      # (--reset_params set params.txt aside, and the run was refused before writing
      # its own: the logdir keeps the one its checkpoints were written with.)
      path = os.path.join(FLAGS.logdir, logdirs.PARAMS_FILE)
      if not os.path.lexists(path):
        os.rename(aside, path)
        print(f"Put {aside} back as {path}: the run was refused", flush=True)
    if lock is not None:
      lock.release(remove_if_unused=True)
    raise e if isinstance(e, UsageFailure) else UsageFailure(str(e)) from None


def _check_logdir_flags(params: Params) -> tuple[int, int] | None:
  """Refuses (UsageFailure) a run without --logdir or one it cannot write, eval of a
  model without eval_input, and a bad --profile_steps, which it returns parsed."""
  from lingvo_gpipe import logdirs
  from lingvo_gpipe import trainer as trainer_lib

  if not FLAGS.logdir:
    raise UsageFailure(f"--logdir is required for --mode={FLAGS.mode}")
  if FLAGS.mode != "train" and params.eval_input is None:
    raise UsageFailure(f"model {FLAGS.model} has no eval_input; use --mode=train")
  try:
    profile_steps = trainer_lib.parse_profile_steps(FLAGS.profile_steps)
  except ValueError as e:
    raise UsageFailure(str(e)) from None
  try:
    logdirs.check_writable(FLAGS.logdir, with_eval=FLAGS.mode != "train")
  except logdirs.LogdirError as e:
    raise UsageFailure(str(e)) from None
  return profile_steps


def _note_changed_params(params: Params) -> str | None:
  """Refuses (logdirs.LogdirError) params the logdir's checkpoints cannot follow, and
  notes how the others differ from its params.txt, each with its row of the resume
  rules (logdirs.RESUME_RULES). --reset_params first sets params.txt aside; returns
  where (None: it did not)."""
  from lingvo_gpipe import logdirs

  aside = None
  if FLAGS.reset_params:
    aside = logdirs.set_params_aside(FLAGS.logdir)
    if aside:
      print(f"Set {os.path.join(FLAGS.logdir, 'params.txt')} aside as {aside} "
            "(--reset_params); the restore still checks the model against the checkpoint")
  change = logdirs.check_resumable(FLAGS.logdir, params)
  if change is not None and change.changes:
    path = os.path.join(FLAGS.logdir, "params.txt")
    if not change.has_checkpoints:
      print(f"Note: params that differ from {path} (no checkpoint yet to follow):"
            + change.describe())
    else:
      print(f"Resuming with params that differ from {path}:" + change.describe())
  return aside


def _tensorboard_command() -> str:
  """`tensorboard` as this interpreter's environment has it (.venv/bin/tensorboard when
  run as .venv/bin/python), so that the line works as pasted."""
  beside = os.path.join(os.path.dirname(sys.executable), "tensorboard")
  return beside if os.path.exists(beside) else "tensorboard"


def _train_or_eval(params: Params, profile_steps: tuple[int, int] | None,
                   watchdog: WorkerWatchdog | None, state: RunState) -> int:
  """Builds the trainer (left in `state` for the Ctrl-C handler) and runs --mode
  (train, eval or train_and_eval) in the logdir; returns the exit code (0)."""
  import tensorflow as tf

  from lingvo_gpipe import checkpoints, logdirs
  from lingvo_gpipe import trainer as trainer_lib

  with _bad_params_are_usage_errors():
    trainer = trainer_lib.Trainer(params, FLAGS.logdir)
  state.trainer = trainer
  try:
    if FLAGS.mode == "eval":
      if trainer.restore_latest() is None:
        raise UsageFailure(f"no checkpoint in {trainer.train_dir} to evaluate")
      trainer.evaluate()
      return 0
    eval_fn = trainer.evaluate if FLAGS.mode == "train_and_eval" else None
    if eval_fn is not None and state.planned is not None:
      eval_fn = functools.partial(_evaluate_apart_from_the_plan, state, trainer)
    trainer.train(params.task.train.max_steps, eval_fn=eval_fn, profile_steps=profile_steps)
    if state.planned is not None and trainer.step_seconds:
      _compare_with_plan(state, trainer)
    if eval_fn is not None:
      trainer.evaluate()
    print(f"Logs and checkpoints are in {FLAGS.logdir}; look at them with: "
          f"{_tensorboard_command()} --logdir={FLAGS.logdir}")
  except trainer_lib.CheckpointMismatchError as e:
    differing = logdirs.compare_params(FLAGS.logdir, params) or logdirs.ParamsChange([])
    keys = [key for key, _, _, _ in differing.changes]
    shown = f" (params that differ from params.txt: {', '.join(keys)})" if keys else ""
    raise UsageFailure(f"{e}{shown}") from None
  except (checkpoints.CheckpointError, tf.errors.OpError) as e:
    # A save or a step that failed because a worker went away: name the worker.
    lost = watchdog.unreachable() if watchdog is not None else []
    if lost:
      raise trainer_lib.TrainerError(_lost_worker_message(*lost[0])) from None
    if isinstance(e, checkpoints.CheckpointError):
      raise trainer_lib.TrainerError(str(e)) from None
    raise trainer_lib.TrainerError(
        f"--mode={FLAGS.mode} failed: {trainer_lib.step_error_cause(e)}; the last good "
        f"checkpoint is {_latest_checkpoint() or 'none'}") from None
  except OSError as e:  # e.g. params.txt on a full disk
    raise trainer_lib.TrainerError(
        f"{e.strerror or e}: {e.filename}; the last good checkpoint is "
        f"{_latest_checkpoint() or 'none'}") from None
  return 0


class _Terminated(Exception):
  """SIGTERM arrived (a scheduler or `kill` stopping the run): handled as Ctrl-C is."""


def _raise_terminated(signum: int, frame) -> None:
  del signum, frame
  raise _Terminated()


def _run_interruptibly() -> int:
  """Runs _run in a thread so that Ctrl-C is heard at once (a main thread blocked in a
  TensorFlow call does not run Python's signal handler until the call returns: never,
  for a step waiting on a frozen worker). Ctrl-C asks the loop to stop after the call in
  flight (it flushes its summaries), waits up to 2 s for it, then exits with code 130
  (SIGTERM likewise, with code 143; an export or decode that has not finished by then
  exits so without writing its result);
  an interrupted save leaves only a ckpt-N_temp/ directory, removed at the next start.
  The handler finds the trainer in the RunState this hands down to _run.

  Returns:
    _run's exit code.

  Raises:
    Whatever _run raised (UsageFailure, trainer.TrainerError, a bug's exception),
    re-raised in the main thread.
  """
  outcome: dict = {}
  state = RunState()
  # An Event, not Thread.join: a join interrupted by KeyboardInterrupt leaves the thread
  # looking finished (Python 3.11), and the second wait would not wait.
  done = threading.Event()

  def target() -> None:
    try:
      outcome["code"] = _run(state)
    except BaseException as e:  # noqa: BLE001 - re-raised in the main thread
      outcome["error"] = e
    finally:
      done.set()

  threading.Thread(target=target, name="trainer", daemon=True).start()
  # (Python sets handlers in the main thread only; a handler installed outside Python
  # reads back as None and is left as it is.)
  in_main = threading.current_thread() is threading.main_thread()
  previous_sigterm = signal.signal(signal.SIGTERM, _raise_terminated) if in_main else None
  try:
    while not done.wait(0.2):
      pass
  except (KeyboardInterrupt, _Terminated) as e:
    if in_main:
      signal.signal(signal.SIGTERM, signal.SIG_IGN)  # (a second one while stopping)
    how, code = ("SIGTERM", 143) if isinstance(e, _Terminated) else ("Ctrl-C", 130)
    state.request_stop()
    with contextlib.suppress(KeyboardInterrupt):
      done.wait(2.0)
    if FLAGS.mode in ("export", "decode"):
      if done.is_set() and "code" in outcome:  # it had finished: its lines say what
        print(f"interrupted ({how}) as the {FLAGS.mode} finished: it was written whole",
              file=sys.stderr, flush=True)
        return outcome["code"]
      leftover = ("a hidden partial folder is removed by the next export"
                  if FLAGS.mode == "export" else
                  "a decode_<step>.jsonl.partial is removed by the next decode")
      _exit_now(f"interrupted ({how}) before the {FLAGS.mode} was written: nothing of it "
                f"was written ({leftover}); rerun the same command", code)
    latest = _latest_checkpoint()
    _exit_now(f"interrupted ({how}); the last checkpoint is {latest}: rerun the same "
              "command to resume from it" if latest else
              f"interrupted ({how}) before the first checkpoint was written", code)
  finally:
    if previous_sigterm is not None:
      signal.signal(signal.SIGTERM, previous_sigterm)
  if "error" in outcome:
    raise outcome["error"]
  return outcome["code"]


# TensorFlow 2.21 prints INFO lines while it loads (oneDNN, CPU features), before absl's
# log is initialized; those ignore TF_CPP_MIN_LOG_LEVEL. These are their first words.
_START_UP_NOISE = ("I0000 ", "WARNING: All log messages before absl::InitializeLog()")


def _import_tensorflow_quietly() -> None:
  """Imports tensorflow (through lingvo_gpipe, which imports it) with its start-up INFO
  lines held back; anything else it writes to stderr meanwhile is passed on."""
  import tempfile

  sys.stderr.flush()
  saved = os.dup(2)
  with tempfile.TemporaryFile() as captured:
    os.dup2(captured.fileno(), 2)
    try:
      import tensorflow  # noqa: F401
    finally:
      os.dup2(saved, 2)
      os.close(saved)
      captured.seek(0)
      for line in captured.read().decode(errors="replace").splitlines(keepends=True):
        if not line.startswith(_START_UP_NOISE):
          sys.stderr.write(line)


def _count_every_allocation_for_plans() -> None:
  """--mode=plan and --plan measure memory with TensorFlow's BFC allocator on CPUs
  (TF_CPU_ALLOCATOR_USE_BFC=true, unless set otherwise): the default CPU allocator's
  counts leave out allocations under 256 KiB on some CPUs, which at small sizes are
  half a layer's working set (docs/benchmarks.md, "The bound at small sizes"). Runs
  before TensorFlow is first imported, which reads the variable."""
  if FLAGS.mode == "plan" or (FLAGS.plan and FLAGS.mode != "eval"):
    os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")


def _set_log_levels() -> None:
  """Quiet by default: TensorFlow's C++ log at errors only (TF_CPP_MIN_LOG_LEVEL=2) and
  Python logging at warnings. absl's --verbosity, when given, is obeyed: at 0 (INFO)
  or more TensorFlow's C++ info lines (oneDNN, CPU features) are shown too. Runs
  before TensorFlow is first imported, which reads the environment variable."""
  verbose = FLAGS["verbosity"].present
  if verbose and FLAGS.verbosity >= logging.INFO:  # absl: INFO is 0, DEBUG 1
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "0"
  else:
    _import_tensorflow_quietly()
  import tensorflow as tf

  if not verbose:
    tf.get_logger().setLevel("WARNING")
    logging.set_verbosity(logging.WARNING)


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    print(f"error: unexpected arguments {argv[1:]}", file=sys.stderr)
    sys.exit(2)
  _count_every_allocation_for_plans()
  try:  # (importing TensorFlow takes seconds)
    _set_log_levels()
    from lingvo_gpipe import trainer as trainer_lib
  except KeyboardInterrupt:  # (before _run_interruptibly hears Ctrl-C itself)
    _exit_now("interrupted (Ctrl-C) while starting: nothing was written", 130)
  try:
    code = _run_interruptibly()
  except UsageFailure as e:
    # At once, as below: TensorFlow's teardown may log after ours (a failed restore's
    # "object being deleted with unrestored values").
    _exit_now(str(e), 2)
  except trainer_lib.TrainerError as e:
    # At once: the run has flushed its summaries, and TensorFlow's teardown would print
    # its own lines after ours (after a lost worker: "Failed to remove function
    # remotely ... Socket closed", once per function).
    _exit_now(str(e), 1)
  sys.exit(code)


def _parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing, a bad flag exiting 2 (bad input) with one line, not 1."""
  try:
    return FLAGS(argv)
  except flags.Error as e:
    print(f"error: {e}; see --help", file=sys.stderr)
    sys.exit(2)


def run() -> None:
  """Console-script entry point (lingvo_gpipe_trainer)."""
  app.run(main, flags_parser=_parse_flags)


if __name__ == "__main__":
  run()
