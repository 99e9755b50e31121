"""The registry: built-in keys, external param files, unknown keys."""

import re
import textwrap
from pathlib import Path

import pytest

from lingvo_gpipe import model_registry


def test_builtin_keys_and_params():
  model_registry.load_param_files()
  assert "demo.TinyConvNet" in model_registry.keys()
  p = model_registry.get_params("demo.TinyConvNet")
  assert {name for name, _ in p.iter_params()} == {"task", "train_input", "eval_input"}


def test_unknown_key_lists_closest():
  model_registry.load_param_files()
  with pytest.raises(model_registry.ModelNotFoundError, match="closest: demo.TinyConvNet"):
    model_registry.get_class("demo.TinyConvnet")


def test_external_param_file_registers_under_its_file_name(tmp_path, monkeypatch):
  (tmp_path / "my_models.py").write_text(textwrap.dedent("""
      from lingvo_gpipe import model_registry
      from lingvo_gpipe_params import demo

      @model_registry.register
      class Wider(demo.TinyConvNet):
        pass
      """))
  model_registry.load_param_files([str(tmp_path / "my_models.py")])
  assert "my_models.Wider" in model_registry.keys()
  other = tmp_path / "envdir"
  other.mkdir()
  (other / "env_models.py").write_text(
      "from lingvo_gpipe import model_registry\n"
      "from lingvo_gpipe_params import demo\n"
      "@model_registry.register\nclass FromEnv(demo.TinyConvNet):\n  pass\n")
  monkeypatch.setenv(model_registry.PATH_ENV, str(other))
  model_registry.load_param_files()
  assert "env_models.FromEnv" in model_registry.keys()
  with pytest.raises(FileNotFoundError, match="nope.py"):
    model_registry.load_param_files([str(tmp_path / "nope.py")])


def test_a_param_file_that_fails_to_load_is_named_with_its_line(tmp_path):
  """(The trainer turns ParamFileError into exit 2: tests/trainer_test.py.)"""
  broken = tmp_path / "needs_a_module.py"
  broken.write_text("import os\nimport no_such_module_here\n")
  with pytest.raises(model_registry.ParamFileError,
                     match=f"param file {re.escape(str(broken))}, line 2 does not load: "
                     "ModuleNotFoundError: No module named 'no_such_module_here'"):
    model_registry.load_param_files([str(broken)])


def test_a_user_file_cannot_shadow_a_builtin_key(tmp_path):
  shadow = tmp_path / "demo.py"
  shadow.write_text(textwrap.dedent("""
      from lingvo_gpipe import model_registry
      from lingvo_gpipe_params import demo

      @model_registry.register
      class TinyConvNet(demo.TinyConvNet):
        pass
      """))
  model_registry.load_param_files()
  builtin = model_registry.get_class("demo.TinyConvNet")
  with pytest.raises(model_registry.ParamFileError,
                     match=r"demo\.py, line 5 does not load: ValueError: model key "
                     r"'demo\.TinyConvNet' is already defined by .*params/demo\.py; rename "
                     "this file or this class"):
    model_registry.load_param_files([str(shadow)])
  assert model_registry.get_class("demo.TinyConvNet") is builtin


def test_readme_param_file_example_registers_and_runs(tmp_path):
  readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
  code = re.search(r"```python\n# my_models.py\n(.*?)```", readme, re.S).group(1)
  (tmp_path / "my_models.py").write_text(code)
  model_registry.load_param_files([str(tmp_path)])
  params = model_registry.get_params("my_models.SmallMlp")
  task = params.task.instantiate()
  assert len(task.pipeline.cells) == 2 and task.pipeline.params.num_micro_batches == 4
  batch = next(iter(params.train_input.instantiate().dataset()))
  loss, weight = task(batch)["loss"]
  assert loss.shape == [] and float(weight) == 64


def test_readme_keras_example_registers_and_runs(tmp_path):
  """The README's Keras param file, its model built when the file is imported (in the
  registry's scratch graph): the pipelined task runs a batch."""
  readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
  code = re.search(r"```python\n# my_keras_models.py\n(.*?)```", readme, re.S).group(1)
  (tmp_path / "my_keras_models.py").write_text(code)
  model_registry.load_param_files([str(tmp_path)])
  params = model_registry.get_params("my_keras_models.MyKerasNet")
  task = params.task.instantiate()
  assert len(task.pipeline.cells) == 2
  batch = next(iter(params.train_input.instantiate().dataset()))
  loss, weight = task(batch)["loss"]
  assert loss.shape == [] and float(weight) == 64


def test_a_listing_marks_a_model_whose_params_fail_and_lists_the_others(tmp_path):
  """--mode=list_models with one model whose params raise: that model's line says
  so (it was a traceback, and nothing listed); the others are described as ever."""
  from conftest import run_trainer

  (tmp_path / "half_broken.py").write_text(textwrap.dedent("""
      from lingvo_gpipe import model_registry
      from lingvo_gpipe_params import demo

      @model_registry.register
      class Broken(demo.TinyConvNet):
        '''A model whose params raise.'''
        def train_input(self):
          raise ValueError("no such corpus: /nowhere")

      @model_registry.register
      class Fine(demo.TinyConvNet):
        '''A model that builds.'''
      """))
  listed = run_trainer("--mode=list_models", f"--params_path={tmp_path / 'half_broken.py'}")
  assert listed.returncode == 0, listed.stderr[-2000:]
  lines = dict(line.split(maxsplit=1) for line in listed.stdout.strip().split("\n"))
  assert lines["half_broken.Broken"] == ("A model whose params raise. (its params fail to "
                                          "build: ValueError: no such corpus: /nowhere)")
  assert lines["half_broken.Fine"] == "A model that builds."
  assert lines["demo.TinyConvNet"].startswith("Two conv-BN-ReLU blocks")
