"""The code is ruff-clean (the style rules are in pyproject.toml)."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def test_ruff_is_clean():
  ruff = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
  if not Path(ruff).exists():
    pytest.fail("ruff is not installed; `pip install -e .[test]` installs it")
  result = subprocess.run([ruff, "check", str(REPO)], capture_output=True, text=True)
  assert result.returncode == 0, result.stdout + result.stderr
