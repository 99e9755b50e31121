"""BUILD declares every module, param file, binary and test of the repository.

Bazel is not run here (see README: Debian's bazel-bootstrap cannot fetch what the
Python rules need offline), so this test keeps BUILD honest instead: a module or
test file missing from BUILD, or a BUILD entry without its file, fails it.
"""

from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def load_build() -> dict[str, dict]:
  """Evaluates BUILD (its Starlark subset is valid Python) into {name: attributes}."""
  targets: dict[str, dict] = {}

  def rule(kind):
    def declare(name, **attrs):
      assert name not in targets, f"target {name} declared twice"
      targets[name] = dict(attrs, kind=kind)
    return declare

  scope = {k: rule(k) for k in ("py_library", "py_binary", "py_test")}
  scope["package"] = lambda **_: None
  exec(compile((REPO / "BUILD").read_text(), "BUILD", "exec"), scope)  # noqa: S102
  return targets


def test_every_python_file_is_in_build_and_every_entry_exists():
  targets = load_build()
  declared = {src for t in targets.values() for src in t.get("srcs", [])}
  on_disk = {str(p.relative_to(REPO)) for folder in ("lingvo_gpipe", "params", "tools", "tests",
                                                     "bench")
             for p in (REPO / folder).rglob("*.py")}
  assert sorted(on_disk - declared) == [], "files missing from BUILD"
  assert sorted(declared - on_disk) == [], "BUILD names files that do not exist"


def test_every_test_file_has_a_py_test_and_deps_resolve():
  targets = load_build()
  test_files = {str(p.relative_to(REPO)) for p in (REPO / "tests").glob("*_test.py")}
  tested = {src for t in targets.values() if t["kind"] == "py_test" for src in t["srcs"]
            if src.endswith("_test.py")}
  assert test_files == tested
  for name, target in targets.items():
    for dep in target.get("deps", []):
      assert dep.startswith(":") and dep[1:] in targets, f"{name}: unknown dep {dep}"
