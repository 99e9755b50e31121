"""`import lingvo_gpipe` gives the public API, in a fresh interpreter (no import cycle),
and the library table (docs/library.md) names every module there is."""

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

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


def test_the_readme_library_table_matches_the_tree():
  repo = Path(__file__).resolve().parent.parent
  section = (repo / "docs" / "library.md").read_text().split("# The library")[1].split("\n## ")[0]
  named = re.findall(r"^\| `(lingvo_gpipe/[^`]+)`(?:, `([^`]+)`)?(?:, `([^`]+)`)?",
                     section, flags=re.MULTILINE)
  paths = set()
  for row in named:
    first = row[0]
    paths.add(first)
    # Further names in a row are short ("core/gpipe.py"), relative to the package.
    paths.update(f"lingvo_gpipe/{name}" for name in row[1:] if name)
  for path in paths:
    assert (repo / path).exists(), f"README names {path}, which does not exist"
  folders = {p for p in paths if p.endswith("/")}
  modules = {str(p.relative_to(repo)) for p in (repo / "lingvo_gpipe").rglob("*.py")
             if p.name != "__init__.py" and "tools" not in p.parts}
  missing = sorted(m for m in modules
                   if m not in paths and not any(m.startswith(f) for f in folders))
  assert missing == [], f"modules the README's library table does not name: {missing}"


def test_each_subpackage_module_map_names_exactly_its_modules():
  """A subpackage's __init__ docstring that lists modules ("  name.py  what it is")
  lists every module of the package and no other."""
  repo = Path(__file__).resolve().parent.parent
  for init in sorted((repo / "lingvo_gpipe").glob("*/__init__.py")):
    docstring = ast.get_docstring(ast.parse(init.read_text()), clean=False) or ""
    listed = set(re.findall(r"^ +(\w+\.py) ", docstring, flags=re.MULTILINE))
    if not listed:
      continue
    modules = {p.name for p in init.parent.glob("*.py") if p.name != "__init__.py"}
    assert listed == modules, (f"{init.relative_to(repo)}: missing {sorted(modules - listed)}, "
                               f"not there {sorted(listed - modules)}")


def test_readme_and_docs_cite_no_internal_work_items():
  """A reader outside the project cannot look up "issue 51": README and docs say what
  was measured and why, not which work item asked for it."""
  repo = Path(__file__).resolve().parent.parent
  pattern = re.compile(r"\b(issue|work item|task) #?\d+\b", re.IGNORECASE)
  cited = [f"{path.relative_to(repo)}:{number}: {line.strip()}"
           for path in [repo / "README.md", *sorted((repo / "docs").glob("*.md"))]
           for number, line in enumerate(path.read_text().splitlines(), 1)
           if pattern.search(line)]
  assert not cited, cited
