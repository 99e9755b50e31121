"""The pre-flight check refuses every bad value before anything is written.

A generated sweep: each leaf of the three tiny paper models' params that holds a
number, a bool or a str gets a value of another type, and `preflight` (what the trainer
binary runs before it creates the logdir) must refuse it in one line naming the key.
The binary's own path (exit 2, one line, nothing written) is tested in trainer_test.py.
"""

import pytest

from lingvo_gpipe import model_registry
from lingvo_gpipe.core.hyperparams import ParamsError
from lingvo_gpipe.preflight import preflight

MODELS = ("lm.TransformerTiny", "mt.MultilingualTiny", "image.AmoebaNetTiny")


def wrong_typed(value):
  """A value of another type than `value` (a bool, number or str), or None."""
  if isinstance(value, bool):
    return "yes"
  if isinstance(value, (int, float)):
    return "seven"
  if isinstance(value, str):
    return 7
  return None


def test_the_shipped_tiny_models_pass(cpu_devices):
  model_registry.load_param_files()
  for model in MODELS:
    preflight(model_registry.get_params(model).freeze(), "train_and_eval", cpu_devices[:2])


@pytest.mark.parametrize("model", MODELS)
def test_every_wrong_typed_value_is_refused_in_one_line_naming_its_key(model, cpu_devices):
  model_registry.load_param_files()
  baseline = model_registry.get_params(model)
  covered, missed = 0, []
  for key, value in baseline.flatten():
    wrong = wrong_typed(value)
    if wrong is None:
      continue
    covered += 1
    params = baseline.copy().set(**{key: wrong})
    try:
      preflight(params.freeze(), "train_and_eval", cpu_devices[:2])
      missed.append(key)
    except ParamsError as e:
      assert key in str(e) and "\n" not in str(e), (key, str(e))
  print(f"{model}: {covered} keys covered, {covered - len(missed)} caught")
  assert covered > 50 and not missed, missed


def test_a_number_is_not_taken_for_a_dtype(cpu_devices):
  model_registry.load_param_files()
  for value in (14, 1, True):
    params = model_registry.get_params("lm.TransformerTiny").set(**{"task.fprop_dtype": value})
    with pytest.raises(ParamsError,
                       match=r"task: fprop_dtype .* is not a compute dtype; valid: \['float32'"):
      preflight(params.freeze(), "train", cpu_devices[:2])


def test_an_export_checks_its_own_devices_not_the_training_ones(cpu_devices):
  """A run trained with its 2 cells on 2 named devices, exported on 1: pre-flight places
  the cells on --export_devices, as the export builds them (it checked the training
  devices and passed), and refuses naming the flag; on 2 it passes."""
  model_registry.load_param_files()
  params = model_registry.get_params("demo.TinyConvNet")
  params.task.pipeline.set(num_cells=2, devices=list(cpu_devices[:2]),
                           round_robin_devices=False)
  params = params.freeze()
  with pytest.raises(ParamsError, match=r"2 cells but only 1 device.*an export's "
                     r"--export_devices"):
    preflight(params, "export", cpu_devices[:1])
  preflight(params, "export", cpu_devices[2:4])
