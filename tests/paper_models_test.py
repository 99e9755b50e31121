"""The registered paper models: parameter counts from shapes against the GPipe paper's
numbers and exactly as the table of docs/models.md shows them, partition counts, and
`--mode=inspect_model` end to end."""

import json
import re
from pathlib import Path

import pytest
from conftest import run_trainer
from tiers import EXHAUSTIVE, quick_sample

from lingvo_gpipe import model_registry
from lingvo_gpipe.core import base_layer
from lingvo_gpipe.tasks import base_task

# key: (the paper's parameter count, tolerance, the paper's number of cells K)
PAPER_MODELS = {
    "image.AmoebaNetD_18_208": (82e6, 0.05, 1),
    "image.AmoebaNetD_18_416": (318e6, 0.05, 1),
    "image.AmoebaNetD_18_544": (542e6, 0.05, 2),
    "image.AmoebaNetD_36_544": (1.05e9, 0.05, 4),
    "image.AmoebaNetD_72_512": (1.8e9, 0.05, 8),
    "image.AmoebaNetB_18_512": (557e6, 0.05, 4),
    "lm.TransformerL3": (282.2e6, 0.01, 1),
    "lm.TransformerL13": (785.8e6, 0.01, 1),
    "lm.TransformerL103": (5.3e9, 0.01, 8),
    "lm.TransformerL415": (21.0e9, 0.01, 32),
    "lm.TransformerL1663": (83.9e9, 0.01, 128),
    "mt.Multilingual400M": (400e6, 0.08, 1),
    "mt.MultilingualDeep1p3B": (1.3e9, 0.08, 4),
    "mt.MultilingualWide1p3B": (1.3e9, 0.08, 2),
    "mt.Multilingual3B": (3e9, 0.08, 8),
    "mt.Multilingual128L6B": (6e9, 0.08, 16),
}
# GPipe's Table 2 configurations (no parameter count in the paper) and the tiny members.
TABLE2_MODELS = ["image.AmoebaNetD_18_256", "lm.Transformer48"]
TINY_MODELS = ["image.AmoebaNetTiny", "lm.TransformerTiny", "mt.MultilingualTiny"]


model_registry.load_param_files()

MODELS_PAGE = Path(__file__).resolve().parent.parent / "docs" / "models.md"
_UNITS = {"k": 1e3, "M": 1e6, "B": 1e9}


def readme_counts() -> dict[str, str]:
  """{key: the params column} of the table of docs/models.md of registered models."""
  rows = re.findall(r"^\| `([\w.]+)` \| [^|]+ \| \d+ \| \d+ \| ([\d.]+[kMB]) \|",
                    MODELS_PAGE.read_text(), flags=re.MULTILINE)
  return dict(rows)


def assert_readme_count(key: str, count: int) -> None:
  """The figure of docs/models.md is `count` rounded to the digits it shows."""
  shown = readme_counts()[key]
  number, unit = shown[:-1], _UNITS[shown[-1]]
  decimals = len(number.partition(".")[2])
  assert f"{count / unit:.{decimals}f}" == number, \
      f"{key}: docs/models.md says {shown}, counted {count:,}"


def test_the_readme_table_lists_every_registered_paper_and_tiny_model():
  listed = set(readme_counts())
  assert set(PAPER_MODELS) | set(TABLE2_MODELS) | set(TINY_MODELS) == listed


def task_params(key):
  """The task params of `key` as the trainer builds them (a FLOP-balanced pipeline gets
  its input_specs from the training input), but balanced by FLOPs where `key` measures
  its layers' times (AmoebaNetTiny): which layers a cell holds changes no count, and
  the measurement takes seconds per build."""
  params = model_registry.get_params(key)
  if params.task.pipeline.partition_cost == "measured":
    params.task.pipeline.partition_cost = "flops"
  params = params.freeze()
  return params, base_task.with_partition_costs(params.task, params.train_input)


def build_shapes_only(key):
  params, task = task_params(key)
  with base_layer.shapes_only():
    return params, task.instantiate()


# The quick tier leaves out the three deepest (seconds each to build, even as shapes).
@pytest.mark.parametrize("key", quick_sample(sorted(PAPER_MODELS), quick=sorted(
    set(PAPER_MODELS) - {"lm.TransformerL1663", "image.AmoebaNetD_72_512",
                         "image.AmoebaNetD_36_544"})))
def test_paper_model_parameter_count_and_cells(key):
  target, tolerance, num_cells = PAPER_MODELS[key]
  params, task = build_shapes_only(key)
  total = task.num_params()
  assert abs(total / target - 1) <= tolerance, f"{key}: {total:,} vs the paper's {target:,.0f}"
  assert_readme_count(key, total)
  stack = task.children()[0]
  assert len(stack.cells) == num_cells
  assert params.task.pipeline.num_micro_batches >= 4 * num_cells  # GPipe's M >= 4K


@pytest.mark.parametrize("key", TABLE2_MODELS)
def test_table2_models_have_the_counts_the_readme_shows(key):
  _, task = build_shapes_only(key)
  assert_readme_count(key, task.num_params())


@pytest.mark.parametrize("key", quick_sample(TINY_MODELS, quick=TINY_MODELS[1:]))
def test_tiny_models_count_params_like_their_variables(key):
  _, shapes_task = build_shapes_only(key)
  task = task_params(key)[1].instantiate()
  assert sum(int(v.shape.num_elements()) for v in task.trainable_variables) == \
      shapes_task.num_params()
  assert_readme_count(key, shapes_task.num_params())


@EXHAUSTIVE
def test_inspect_model_reports_paper_count_and_cells():
  result = run_trainer("--mode=inspect_model", "--model=image.AmoebaNetD_18_544",
                       "--inspect_depth=1", timeout=600)
  assert result.returncode == 0, result.stderr
  summary = json.loads(result.stdout.strip().splitlines()[-1])
  assert_readme_count("image.AmoebaNetD_18_544", summary["total_params"])
  assert len(summary["cells"]) == 2
