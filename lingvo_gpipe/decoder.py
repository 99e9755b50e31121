"""decode mode: the eval input through a task's serving functions.

  <logdir>/decode_<step>.jsonl   one JSON record per eval example: its inputs, the
                                 serving function's outputs and the reference (the
                                 task's `serving_examples`)
  <logdir>/decode/events.*       the task's metrics at <step> (`serving_metrics`:
                                 accuracy, log_pplx, BLEU) and the first examples as
                                 TensorBoard text

The functions are those an export writes (tasks/serving.py), built here from the
checkpoint (exporter.restore_for_inference), so what decode reports is what a served
model computes.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Callable

import tensorflow as tf

from lingvo_gpipe import exporter
from lingvo_gpipe.core.hyperparams import Params
from lingvo_gpipe.tasks import serving

DECODE_DIR = "decode"
TEXT_EXAMPLES = 5  # records shown as TensorBoard text


def decode(params: Params, logdir: str, *, checkpoint: str | None = None,
           devices: list[str] | None = None, options: serving.ServingOptions | None = None,
           log: Callable[[str], None] = print) -> tuple[str, dict[str, float]]:
  """Decodes the eval input with the newest good checkpoint (or `checkpoint`); returns
  (the .jsonl path, the metrics). ExportError as export's, before anything is written."""
  options = options or serving.ServingOptions()
  if params.eval_input is None:
    raise exporter.ExportError("the model has no eval_input to decode")
  task, step, path = exporter.restore_for_inference(params, logdir, checkpoint, devices,
                                                    options.dtype, log)
  eval_input = params.eval_input.instantiate()
  model = serving.ServingModel(task, eval_input, options)
  log(f"Decoding the eval input with {path} through {', '.join(sorted(model.functions))} ...")
  for name in os.listdir(logdir):  # left by a decode killed while writing
    if re.fullmatch(r"decode_\d+\.jsonl\.partial", name):
      os.remove(os.path.join(logdir, name))
  records = []
  for batch in eval_input.dataset():
    records += task.serving_examples(model, batch, eval_input)
  metrics = task.serving_metrics(records, eval_input)
  out_path = os.path.join(logdir, f"decode_{step}.jsonl")
  partial = out_path + ".partial"
  try:
    with open(partial, "w") as f:
      for record in records:
        f.write(json.dumps(record) + "\n")
    os.replace(partial, out_path)  # whole or absent
  except BaseException:  # (a full disk, an interrupt): nothing half-written is left
    with contextlib.suppress(OSError):
      os.remove(partial)
    raise
  writer = tf.summary.create_file_writer(os.path.join(logdir, DECODE_DIR))
  with writer.as_default(step=step):
    for name, value in metrics.items():
      tf.summary.scalar(name, value)
    shown = "\n\n".join(f"    {json.dumps(r)}" for r in records[:TEXT_EXAMPLES])
    tf.summary.text("examples", shown)
  writer.close()
  log(f"decode at step {step}: " + " ".join(f"{k} {v:.4g}" for k, v in metrics.items())
      + f" ({len(records)} examples; {out_path})")
  return out_path, metrics
