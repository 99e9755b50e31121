"""What the engine wrote before the compiled-cells rewrite still loads.

tests/data holds a params text dumped by the old `lingvo_gpipe.core.gpipe` module and
a `demo.TinyConvNet` logdir (K=2, M=2, 3 steps) trained by the old engine.
"""

import shutil
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
from numerics import assert_close
from tiers import quick_sample

from lingvo_gpipe import model_registry, trainer
from lingvo_gpipe.core import hyperparams
from lingvo_gpipe.pipeline import PipeliningLayer

DATA = Path(__file__).resolve().parent / "data"
model_registry.load_param_files()


def test_a_params_text_naming_the_old_module_loads():
  text = (DATA / "legacy_pipelining_layer_params.txt").read_text()
  assert "cls : lingvo_gpipe.core.gpipe.PipeliningLayer" in text
  # The pipeline's own keys (its layers' lines need the list built first).
  top_level = "\n".join(line for line in text.splitlines() if not line.startswith("layers["))
  p = PipeliningLayer.Params().from_text(top_level)
  assert p.cls is PipeliningLayer
  assert (p.num_cells, p.num_micro_batches, p.recompute) == (2, 4, "always")
  assert p.schedule == "gpipe"  # not in the old text: the default, today's fill-drain


def legacy_params(schedule: str, num_cells: int = 2):
  params = model_registry.get_params("demo.TinyConvNet")
  overrides = (f"task.pipeline.num_cells={num_cells};task.pipeline.num_micro_batches=2;"
               f"task.pipeline.schedule={schedule};task.train.save_interval_steps=100")
  for name, value in hyperparams.parse_overrides(overrides):
    params.set_from_text(name, value)
  return params.freeze()


@pytest.mark.parametrize("schedule", quick_sample(["gpipe", "1f1b"], quick=["1f1b"]))
def test_a_checkpoint_of_the_old_engine_restores_and_training_goes_on(tmp_path, schedule):
  logdir = tmp_path / "run"
  shutil.copytree(DATA / "legacy_tiny_conv_net_k2", logdir)
  run = trainer.Trainer(legacy_params(schedule), str(logdir), log=lambda _: None)
  assert run.restore_latest() == 3
  reader = tf.train.load_checkpoint(str(logdir / "train" / "ckpt-3"))
  checked = 0
  for i, layer in enumerate(run.task.body.layers):
    for var in layer.own_variables():
      name = var.name.split("/")[-1].split(":")[0]
      want = reader.get_tensor(f"task/body/layers/{i}/{name}/.ATTRIBUTES/VARIABLE_VALUE")
      np.testing.assert_array_equal(var.numpy(), want)
      checked += 1
  assert checked == 10  # two convolutions, two batch norms (4 each)
  losses = []
  run.train(5, on_step=lambda step, values: losses.append(float(values["loss"])))
  assert tf.train.latest_checkpoint(str(logdir / "train")).endswith("ckpt-5")
  # Reference: the same checkpoint (weights, momentum slots, input position) restored
  # into the model as one cell (the same two micro-batches: batch norm's statistics
  # are per micro-batch), trained the same two steps.
  reference_dir = tmp_path / "one_cell"
  shutil.copytree(DATA / "legacy_tiny_conv_net_k2", reference_dir)
  reference = trainer.Trainer(legacy_params(schedule, num_cells=1), str(reference_dir),
                              log=lambda _: None)
  assert len(reference.task.pipeline.cells) == 1 and reference.restore_latest() == 3
  want = []
  reference.train(5, on_step=lambda step, values: want.append(float(values["loss"])))
  assert len(losses) == len(want) == 2
  assert_close(losses, want, dtype=np.float32)
