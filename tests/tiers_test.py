"""tests/tiers.py: the quick sample of a grid against a brute-force search, and the quick
tier keeps a test of every test file."""

import itertools
import random
from pathlib import Path

import pytest
from conftest import DESELECTED
from tiers import each_value_once, quick_sample

TESTS = Path(__file__).resolve().parent


def held(rows, columns):
  return {(c, row[c]) for row in rows for c in columns}


def smallest_cover(rows, columns) -> int:
  """The fewest rows holding every value of `columns`, by trying every subset."""
  want = held(rows, columns)
  for size in range(1, len(rows) + 1):
    if any(held(subset, columns) == want for subset in itertools.combinations(rows, size)):
      return size
  raise AssertionError("unreachable")


@pytest.mark.parametrize("seed", range(8))
def test_each_value_once_holds_every_value_and_is_near_the_fewest_rows(seed):
  rng = random.Random(seed)
  sizes = [rng.randint(1, 4) for _ in range(3)]
  rows = [row for row in itertools.product(*map(range, sizes)) if rng.random() < 0.6] or [
      (0, 0, 0)]
  for columns in ([0, 1, 2], [0, 2], [1]):
    chosen = each_value_once(rows, columns)
    assert held(chosen, columns) == held(rows, columns)
    assert set(chosen) <= set(rows) and len(set(chosen)) == len(chosen)
    assert chosen == sorted(chosen, key=rows.index)  # in the grid's order
    # Greedy set cover: within the harmonic bound of the fewest (H(3) < 2 here).
    assert len(chosen) <= 2 * smallest_cover(rows, columns)
    assert each_value_once(list(rows), columns) == chosen  # fixed


def test_a_full_product_is_covered_by_its_largest_column():
  rows = list(itertools.product(["gpipe", "1f1b", "zbv"], [1, 2], ["always", "never"]))
  chosen = each_value_once(rows)
  assert len(chosen) == 3 == smallest_cover(rows, [0, 1, 2])


def test_quick_sample_marks_every_row_outside_the_sample_and_keeps_its_id():
  rows = [("gpipe", 1), ("1f1b", 2), ("zbv", 4)]
  params = quick_sample(rows, quick=[("1f1b", 2)])
  assert [p.values for p in params] == rows
  assert [[m.name for m in p.marks] for p in params] == [["exhaustive"], [], ["exhaustive"]]
  assert [p.values for p in quick_sample(["a", "b"], quick=["b"])] == [("a",), ("b",)]
  with pytest.raises(ValueError, match=r"\('ddp', 1\)"):
    quick_sample(rows, quick=[("ddp", 1)])


def test_every_test_file_keeps_a_test_in_the_quick_tier(request):
  """Of the tests this session collected (those it runs and those `-m` deselected), the
  ones not marked `exhaustive` include a test of every tests/*_test.py. Skipped when
  the session did not collect the whole folder."""
  items = [*request.session.items, *DESELECTED]
  files = {path.name for path in TESTS.glob("*_test.py")}
  if {item.path.name for item in items} != files:
    pytest.skip("the session collected only part of tests/")
  quick = {item.path.name for item in items if item.get_closest_marker("exhaustive") is None}
  assert sorted(files - quick) == []
