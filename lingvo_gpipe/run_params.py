"""The params a logdir's checkpoints were trained with, for export and decode.

An export serves the params the run trained with. The registered model is only the
skeleton: every leaf of the run's params text (`<logdir>/params.txt`, or the
`params.before_step_<N>.txt` a later resume set aside) that differs from it is set
from that text, so `--params_override` given to the training run (`num_heads=8`) is
served too, and a param file edited since the run changes nothing.

Which text belongs to a checkpoint at step S: a resume that changed params at step N
kept the old text as `params.before_step_<N>.txt`; the checkpoints up to N were written
with it. So S takes the file of the smallest N >= S, else params.txt.

`--params_override` at export may change only what serving chooses and no trained
computation (SERVING_RULES): how the stack runs (task.pipeline.*), the compute dtype,
which eval examples decode reads (not the keys that make its vocabulary) and the
training input
(which serving does not read). Any other key (a layer's width, heads, vocabulary, ...)
is refused: serving it would serve another model than the one trained.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable

import tensorflow as tf

from lingvo_gpipe import checkpoints, logdirs
from lingvo_gpipe.core.hyperparams import Params, ParamsError

# The eval input's keys an export may change: which examples decode reads, and how. Not
# the keys that make the vocabulary (vocab_file, target_vocab_size, num_words,
# language_seed, ...): the serving functions' token tables come from the eval input.
SERVABLE_EVAL_INPUT_KEYS = ("batch_size", "num_examples", "split", "repeat", "prefetch",
                            "shuffle_buffer", "seed", "data_dir", "name", "bucket_upper_bounds",
                            "bucket_batch_sizes", "length_distribution", "autotune")
# (key pattern, why an export may change it): the first match decides; no match refuses.
SERVING_RULES = (
    (r"task\.pipeline\..*", "how the stack runs (devices, cells, micro-batches)"),
    (r"task(\..*)?\.fprop_dtype", "the compute dtype"),
    (r"task\.train\..*", "the training loop's settings, which serving does not read"),
    (r"eval_input\.(" + "|".join(SERVABLE_EVAL_INPUT_KEYS) + ")",
     "which eval examples decode reads, and how"),
    (r"train_input\..*", "the training input, which serving does not read"),
)
_GLOBAL_STEP_KEY = "global_step/.ATTRIBUTES/VARIABLE_VALUE"
_BEFORE_STEP = re.compile(r"params\.before_step_(\d+)\.txt")


class RunParamsError(ParamsError):
  """A logdir whose params cannot be served (no params.txt, another model's, an
  override that changes the trained model): the user's to fix, exit 2."""


def params_file_for_step(logdir: str, step: int | None) -> str:
  """The params text the checkpoint of `step` was written with (module docstring);
  params.txt for None (the newest run's)."""
  if step is not None:
    names = os.listdir(logdir) if os.path.isdir(logdir) else []
    kept = sorted(int(m.group(1)) for m in map(_BEFORE_STEP.fullmatch, names) if m)
    later = [n for n in kept if n >= step]
    if later:
      return os.path.join(logdir, f"params.before_step_{later[0]}.txt")
  return os.path.join(logdir, logdirs.PARAMS_FILE)


def checkpoint_step(prefix: str) -> int | None:
  """The global step the checkpoint at `prefix` holds; where it cannot be read, N of a
  prefix '.../ckpt-N'; else None. The step held first: a copy renamed by hand
  ('best-1' of ckpt-4) would take another checkpoint's params text by its name."""
  try:
    return int(tf.train.load_checkpoint(prefix).get_tensor(_GLOBAL_STEP_KEY))
  except Exception:  # noqa: BLE001 (not a checkpoint, or cut short: the exporter says so)
    match = re.search(r"-(\d+)$", prefix)
    return int(match.group(1)) if match else None


def _newest_readable_step(train_dir: str) -> int | None:
  """The step of the newest checkpoint in `train_dir` every tensor of which can be
  read, the one the export's restore will take (it passes over one it cannot read:
  being written, truncated); else that of the newest, or None without any. Every
  tensor, as the restore reads them: a checkpoint cut short still gives the global
  step at the start of its data. (The cost: the chosen checkpoint is read twice.)"""
  found = checkpoints.find(train_dir)
  for step, prefix in found:
    try:
      reader = tf.train.load_checkpoint(prefix)
      for key, dtype in reader.get_variable_to_dtype_map().items():
        if dtype != tf.variant:  # (the input's iterator state: numpy cannot hold it)
          reader.get_tensor(key)
    except Exception:  # noqa: BLE001 (truncated data: IndexError; others: OpError, ...)
      continue
    return step
  return found[0][0] if found else None


def trained_params(registered: Params, path: str,
                   log: Callable[[str], None] = lambda _: None) -> Params:
  """`registered` (unfrozen, changed in place and returned) with every leaf of the
  params text at `path` that differs from it set from that text, and every param added
  since that text was written set to what the code did before it existed
  (logdirs.take_params_added_since; `log` names them).

  Raises:
    RunParamsError: `path` cannot be read as params text, or names a key `registered`
      lacks, or holds a differing value that cannot be read back (the logdir was
      trained with another model, or a param file that no longer loads so).
  """
  try:
    with open(path, encoding="utf-8") as f:
      text = f.read()
    logdirs.check_written_whole(text, path)
    trained = logdirs.params_leaves(text, path)
  except (OSError, UnicodeDecodeError, logdirs.LogdirError) as e:
    why = e.strerror if isinstance(e, OSError) else str(e)
    raise RunParamsError(f"{path} cannot be read as params text: {why}") from None
  own = dict(logdirs.params_leaves(registered.to_text()))
  for key, value in trained.items():
    if key not in own:
      raise RunParamsError(
          f"{path} has '{key}', which this model lacks: the logdir was trained with "
          "another --model (or a param file that defined it otherwise)")
    if own[key] == value:
      continue
    try:
      registered.set_from_text(key, value)
    except (ParamsError, AttributeError, KeyError) as e:
      raise RunParamsError(f"{path}: '{key} : {value[:80]}' cannot be set on this "
                           f"model ({str(e).splitlines()[0]}): the logdir was trained "
                           "with another --model") from None
  added = logdirs.take_params_added_since(registered, text, path)
  if added:
    log(f"{path} was written before these params existed; served as the run trained, "
        f"with each as it was then: {'; '.join(added)}")
  return registered


def serving_rule(key: str) -> str | None:
  """Why an export may override `key` (SERVING_RULES), or None: it may not."""
  return next((why for pattern, why in SERVING_RULES if re.fullmatch(pattern, key)), None)


def apply_serving_overrides(params: Params, overrides: list[tuple[str, str]]
                            ) -> list[dict[str, str]]:
  """Sets each (key, value text) of `overrides` on `params` (unfrozen) and returns what
  changed, [{key, trained, served}] (the export records it).

  Raises:
    RunParamsError: a changed value of a key no SERVING_RULES row admits (it would
      serve another model); the trained value given again is taken.
    ParamsError: an unknown key or a value of the wrong type (set_from_text's).
  """
  changed = []
  for key, value in overrides:
    before = params.get(key)
    params.set_from_text(key, value)
    after = params.get(key)
    if repr(before) == repr(after):
      continue  # the trained value given again (a training command reused): no change
    if serving_rule(key) is None:
      raise RunParamsError(
          f"--params_override {key}={value}: an export serves the params the run "
          f"trained with ({key}={before!r}), and {key} is part of the trained model; "
          "only these may change at export: task.pipeline.*, fprop_dtype, task.train.*, "
          f"train_input.*, and eval_input's {', '.join(SERVABLE_EVAL_INPUT_KEYS)}")
    changed.append({"key": key, "trained": repr(before), "served": repr(after)})
  return changed


def served_params(registered: Params, logdir: str, checkpoint: str | None,
                  overrides: list[tuple[str, str]], model_name: str,
                  log: Callable[[str], None] = print) -> tuple[Params, list[dict[str, str]]]:
  """The params to export or decode the checkpoint of `logdir` with, and what
  `overrides` changed of the trained ones ([{key, trained, served}]).

  The checkpoint is `checkpoint` or the newest of <logdir>/train; its params text
  (`params_file_for_step`) is applied over `registered` (unfrozen; `trained_params`),
  then `overrides` (only SERVING_RULES' keys). A logdir without that text is served
  only with an explicit `checkpoint`: `registered` with `overrides` as given (so is one
  without any checkpoint, which the exporter then refuses as such).

  Raises:
    RunParamsError: no params text and no `checkpoint`; a params text of another
      model; an override of a trained param.
    ParamsError: an override of an unknown key or of the wrong type.
  """
  if checkpoint:
    step = checkpoint_step(checkpoint)
  else:
    step = _newest_readable_step(os.path.join(logdir, "train"))
  path = params_file_for_step(logdir, step)
  if not os.path.exists(path):
    if not checkpoint and step is not None:
      raise RunParamsError(
          f"{path} is missing: an export serves the params the run trained with, and "
          "this logdir does not record them; pass --checkpoint=<prefix> to serve it with "
          f"the registered --model={model_name} (and --params_override) as given")
    for key, value in overrides:
      registered.set_from_text(key, value)
    return registered, [{"key": key, "served": value} for key, value in overrides]
  log(f"Serving the params the checkpoint was trained with: {path}")
  params = trained_params(registered, path, log)
  return params, apply_serving_overrides(params, overrides)
