"""tests/tiers.py: a grid's quick sample marks the rest, and the quick tier keeps a test
of every test file."""

from pathlib import Path

import pytest
from conftest import DESELECTED
from tiers import quick_sample

TESTS = Path(__file__).resolve().parent


def test_quick_sample_marks_every_row_outside_the_sample():
  rows = [("gpipe", 1), ("1f1b", 2), ("zbv", 4)]
  params = quick_sample(rows, quick=[("1f1b", 2)])
  assert [p.values for p in params] == rows
  assert [[m.name for m in p.marks] for p in params] == [["exhaustive"], [], ["exhaustive"]]
  assert [p.values for p in quick_sample(["a", "b"], quick=["b"])] == [("a",), ("b",)]
  # A one-name grid of lists keeps each list whole.
  assert [p.values for p in quick_sample([[12], [3, 4]], quick=[[12]])] == [([12],), ([3, 4],)]
  with pytest.raises(ValueError, match=r"\('ddp', 1\)"):
    quick_sample(rows, quick=[("ddp", 1)])


def test_every_test_file_keeps_a_test_in_the_quick_tier(request):
  """Of the tests this session collected (those it runs and those `-m` or `-k`
  deselected), the ones not marked `exhaustive` include a test of every tests/*_test.py
  that has tests. Skipped unless the session was asked for the whole folder."""
  asked = {Path(request.config.rootpath, arg.split("::")[0]).resolve()
           for arg in request.config.args}
  if asked != {TESTS}:
    pytest.skip(f"the session was asked for {sorted(map(str, asked))}, not all of tests/")
  items = [*request.session.items, *DESELECTED]
  with_tests = {item.path.name for item in items}
  quick = {item.path.name for item in items if item.get_closest_marker("exhaustive") is None}
  assert sorted(with_tests - quick) == []
