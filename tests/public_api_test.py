"""`import lingvo_gpipe` gives the public API, in a fresh interpreter (no import cycle)."""

import os
import subprocess
import sys

import lingvo_gpipe
from lingvo_gpipe.pipeline.layer import PipeliningLayer


def test_every_public_name_resolves():
  missing = [name for name in lingvo_gpipe.__all__ if not hasattr(lingvo_gpipe, name)]
  assert missing == []
  assert lingvo_gpipe.PipeliningLayer is PipeliningLayer


def test_a_fresh_interpreter_imports_the_package_alone():
  result = subprocess.run(
      [sys.executable, "-c", "import lingvo_gpipe as g; print(g.PipeliningLayer.__name__, "
       "g.layers.Linear.__name__, g.register.__name__)"],
      capture_output=True, text=True, timeout=120, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
  assert result.returncode == 0, result.stderr[-2000:]
  assert result.stdout.split() == ["PipeliningLayer", "Linear", "register"]
