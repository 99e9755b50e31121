"""A logdir's checkpoint → a SavedModel of the task's serving functions.

  <logdir>/export/<step>/           tf.saved_model.save's layout, one signature per
                                    serving function (tasks/serving.py)
  <logdir>/export/<step>/assets/    params.txt (the run's params), version.json (the
                                    library and TensorFlow versions, model, checkpoint,
                                    step, dtype, devices, signatures)

The task is built for inference (`inference_params`): by default unpipelined, its
whole stack on one device; with `devices`, cut into the cells of its params on those
devices, its serving functions a forward-only pipeline over micro-batches. Its
weights come from the newest checkpoint of <logdir>/train that can be read (a damaged
newer one is passed over with a warning, as training does), or from `checkpoint`.

Nothing is written before the checkpoint is restored and the functions are traced;
the SavedModel is written to a hidden folder beside its place (`.<step>.partial-<pid>-
<random>@<host>`) and renamed into it, so <logdir>/export/<step> is whole or absent;
the next export on the host removes the hidden folders of exports that were killed
(and puts back an overwritten export that was moved aside).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import socket
import tempfile
from collections.abc import Callable
from typing import Any

import tensorflow as tf

from lingvo_gpipe import checkpoints, logdirs
from lingvo_gpipe.core import stacked_variables
from lingvo_gpipe.core.hyperparams import Params
from lingvo_gpipe.tasks import serving

EXPORT_DIR = "export"


class ExportError(Exception):
  """Bad input to export or decode (no checkpoint, another model's, an export that
  exists): the user's to fix; nothing was written."""


class _Mismatch(Exception):
  """A checkpoint of another model (not a damaged one: no older one is tried)."""


def version() -> str:
  """This library's installed version ('unknown' when it runs from a source tree)."""
  from importlib import metadata

  try:
    return metadata.version("lingvo_gpipe")
  except metadata.PackageNotFoundError:
    return "unknown"


def inference_params(task_params: Params, devices: list[str] | None, dtype: str) -> Params:
  """The task's params for serving: unpipelined (num_cells 0) without `devices`, else
  its cells on `devices`; one replica, one token slice; computing in `dtype`."""
  p = task_params.copy()
  if devices is None:
    # The training devices go too: a model trained on GPUs exports on a host without.
    p.pipeline.set(num_cells=0, splits=[], devices=[])
  else:
    p.pipeline.devices = list(devices)
  p.pipeline.set(num_replicas=1, num_token_slices=1, token_slice_lengths=None)
  # What the flag says, whatever the run trained in (a layer's own fprop_dtype stays).
  p.fprop_dtype = serving.serving_dtype(dtype)
  return p


def restore_for_inference(params: Params, logdir: str, checkpoint: str | None,
                          devices: list[str] | None, dtype: str,
                          log: Callable[[str], None] = print) -> tuple[Any, int, str]:
  """(task built by `inference_params`, the step restored, the checkpoint's path).

  Raises ExportError for a logdir without a readable checkpoint, a checkpoint of
  another model, or a `checkpoint` that cannot be read.
  """
  from lingvo_gpipe.tasks import base_task

  task_params = inference_params(params.task, devices, dtype)
  if devices is not None:
    task_params = base_task.with_partition_costs(task_params, params.train_input, log)
  task = task_params.instantiate()
  step = tf.Variable(0, dtype=tf.int64, trainable=False, name="global_step")
  restorable = tf.train.Checkpoint(task=task, global_step=step)

  def restore(prefix: str) -> None:
    # Read from the checkpoint's variable list first: another model's is refused by name.
    differences = [line for line in checkpoints.variable_mismatches(prefix, restorable)
                   if line.startswith(("task/", "global_step"))]
    if differences:
      raise _Mismatch(f"checkpoint {prefix} does not match model: {'; '.join(differences[:3])}"
                      + (f" (and {len(differences) - 3} more)" if len(differences) > 3 else ""))
    with stacked_variables.whole_stack_io():  # one write per stack, not per row
      status = restorable.restore(prefix)
    status.expect_partial().assert_existing_objects_matched()

  train_dir = os.path.join(logdir, "train")
  try:
    if checkpoint:
      try:
        restore(checkpoint)
      except _Mismatch:
        raise
      except Exception as e:  # noqa: BLE001 - every other failure means "cannot be read"
        raise ExportError(f"--checkpoint {checkpoint} cannot be read: "
                          f"{checkpoints.first_line(e)}") from None
      return task, int(step.numpy()), checkpoint
    store = checkpoints.CheckpointStore(restorable, train_dir, 1, restore, _Mismatch, log)
    found = store.restore_newest(writer=logdirs.lock_holder(logdir))
  except _Mismatch as e:
    raise ExportError(f"{e}. Pass the --model (and --params_override) this logdir was "
                      "trained with") from None
  except checkpoints.NoReadableCheckpointError as e:
    raise ExportError(str(e)) from None
  if found.path is None:
    raise ExportError(f"no checkpoint in {train_dir}: train first, or pass --checkpoint")
  return task, int(step.numpy()), found.path


def export(params: Params, logdir: str, *, model_name: str = "", checkpoint: str | None = None,
           devices: list[str] | None = None, options: serving.ServingOptions | None = None,
           overwrite: bool = False, params_changed: list[dict] | None = None,
           log: Callable[[str], None] = print) -> str:
  """Writes <logdir>/export/<step>/ (see the module's docstring) and returns its path.

  Args:
    params: the model's frozen params (the eval input says the serving shapes).
    logdir: the run's logdir; its train/ has the checkpoints.
    model_name: the registered model key, recorded in version.json.
    checkpoint: a checkpoint prefix to export instead of the newest good one.
    devices: None: the whole task on one device; else the devices its cells go to.
    options: dtype and generate's cache length.
    overwrite: replace an export of the same step (else ExportError).
    params_changed: what serving changed of the trained params ([{key, trained,
      served}], run_params.apply_serving_overrides), recorded in version.json.
    log: hears what is done.
  """
  options = options or serving.ServingOptions()
  try:
    serving.serving_dtype(options.dtype)
  except ValueError as e:
    raise ExportError(f"--export_dtype: {e}") from None
  if params.eval_input is None:
    raise ExportError("the model has no eval_input: its serving shapes and vocabulary come "
                      "from it")
  task, step, path = restore_for_inference(params, logdir, checkpoint, devices, options.dtype,
                                           log)
  target = os.path.join(logdir, EXPORT_DIR, str(step))
  if os.path.exists(target) and not overwrite:
    raise ExportError(f"{target} exists (an export of step {step}); pass --overwrite to "
                      "replace it")
  log(f"Restored {path}; tracing the serving functions ...")
  model = serving.ServingModel(task, params.eval_input.instantiate(), options)
  facts = {"lingvo_gpipe": version(), "tensorflow": tf.__version__, "model": model_name,
           "checkpoint": path, "step": step, "dtype": options.dtype,
           "devices": list(devices) if devices else None,
           "max_decode_length": options.max_decode_length,
           "signatures": sorted(model.functions),
           "params_changed_from_training": list(params_changed or [])}
  os.makedirs(os.path.dirname(target), exist_ok=True)
  clean_up_killed_exports(os.path.dirname(target), log)
  staging = _staging_dir(os.path.dirname(target), step)
  try:
    _save(model, staging, params.to_text(), facts, devices is not None)
    _move_into_place(staging, target)
  except BaseException:
    shutil.rmtree(staging, ignore_errors=True)
    raise
  log(f"Exported step {step} to {target}: signatures {', '.join(sorted(model.functions))}")
  return target


def _save(model: serving.ServingModel, directory: str, params_text: str, facts: dict,
          keep_devices: bool) -> None:
  """tf.saved_model.save of `model` into `directory`, its assets params.txt and
  version.json; a pipelined model keeps its variables' devices."""
  with tempfile.TemporaryDirectory() as scratch:
    assets = {}
    for name, text in (("params.txt", params_text),
                       ("version.json", json.dumps(facts, indent=1) + "\n")):
      with open(os.path.join(scratch, name), "w") as f:
        f.write(text)
      assets[name.replace(".", "_")] = tf.saved_model.Asset(os.path.join(scratch, name))
    model.assets = assets
    policy = (tf.saved_model.experimental.VariablePolicy.SAVE_VARIABLE_DEVICES if keep_devices
              else None)
    tf.saved_model.save(model, directory, signatures=dict(model.functions),
                        options=tf.saved_model.SaveOptions(experimental_variable_policy=policy))


# Hidden folders of an export in progress: `.<step>.partial-<pid>-<random>@<host>` (the
# SavedModel being written) and `.<step>.old-<pid>-<random>@<host>` (an export it
# overwrites, moved aside). Older names carry no host: they are this host's.
_HIDDEN = re.compile(r"\.(\d+)\.(partial|old)-(\d+)-[0-9a-f]+(?:@(.+))?")


def _host() -> str:
  return re.sub(r"[^A-Za-z0-9.-]", "_", socket.gethostname())


def _hidden_name(step: str | int, kind: str) -> str:
  return f".{step}.{kind}-{os.getpid()}-{secrets.token_hex(4)}@{_host()}"


def clean_up_killed_exports(parent: str, log: Callable[[str], None] = print) -> None:
  """Cleans up after exports into `parent` that were killed (their process gone; only
  this host's processes can be judged, another host's folders stay): a half-written
  `.<step>.partial-*` is removed; an overwritten export moved aside (`.<step>.old-*`)
  goes back to <step> if the kill came before the new one took its place, and is
  removed otherwise."""
  for name in sorted(os.listdir(parent)):
    match = _HIDDEN.fullmatch(name)
    if not match or (match.group(4) or _host()) != _host() or _process_alive(
        int(match.group(3))):
      continue
    path, target = os.path.join(parent, name), os.path.join(parent, match.group(1))
    if match.group(2) == "old" and not os.path.exists(target):
      os.rename(path, target)
      log(f"Restored {target}, moved aside by an export that did not finish")
      continue
    shutil.rmtree(path, ignore_errors=True)
    log(f"Removed {path}, left by an export that did not finish")


def _process_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True  # another user's process
  return True


def _staging_dir(parent: str, step: int) -> str:
  """A new hidden folder `.<step>.partial-<pid>-<random>@<host>` in `parent`, its mode what a
  plain makedirs gives (0777 less the umask, which mkdir applies itself: reading the
  umask means setting it, and that races with other threads)."""
  while True:
    path = os.path.join(parent, _hidden_name(step, "partial"))
    try:
      os.mkdir(path, 0o777)
      return path
    except FileExistsError:
      continue


def _move_into_place(staging: str, target: str) -> None:
  """Renames `staging` to `target`; an existing `target` (overwrite) is renamed aside
  first and removed after, so that one of the two is always whole."""
  if not os.path.exists(target):
    os.rename(staging, target)
    return
  old = os.path.join(os.path.dirname(target), _hidden_name(os.path.basename(target), "old"))
  os.rename(target, old)  # (killed from here to the next rename: the next export restores it)
  os.rename(staging, target)
  shutil.rmtree(old, ignore_errors=True)
