"""The suite's two tiers: `make test` (quick) and `make test-all` (every test).

A test marked `exhaustive` runs in the full tier only (`pytest -m "not exhaustive"` is
the quick tier). The full tier is what CI runs. The quick tier keeps at least one test of
every file (tests/tiers_test.py checks it) and of every feature (docs/library.md,
"Testing", lists what it leaves to the full one). Where a covering grid is cut, the
quick tier runs a fixed sample of its rows, named beside the grid (a hard case of the
grid: uneven micro-batches, K=4 on two devices), never its first rows:

  @pytest.mark.parametrize("schedule, num_cells", quick_sample(GRID, quick=[("zbv", 4)]))
  def test_...(schedule, num_cells): ...

  @EXHAUSTIVE                      # a whole test: the full tier only
  def test_...(): ...
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

EXHAUSTIVE = pytest.mark.exhaustive


def quick_sample(rows: Sequence, quick: Sequence) -> list:
  """`rows` as parametrize values, those outside `quick` marked `exhaustive`.

  Args:
    rows: the full grid: tuples for a parametrize of several names, any other value
      (a list too) for a one-name parametrize.
    quick: the rows the quick tier runs, each a row of `rows`.
  Returns:
    A list of `pytest.param`s, one per row, in the grid's order, each with the id
    pytest gives the bare row.
  Raises:
    ValueError: a row of `quick` is not in `rows`.
  """
  as_tuples = [_row(row) for row in rows]
  keep = [_row(row) for row in quick]
  unknown = [row for row in keep if row not in as_tuples]
  if unknown:
    raise ValueError(f"quick rows {unknown} are not rows of the grid")
  return [pytest.param(*row, marks=() if row in keep else EXHAUSTIVE) for row in as_tuples]


def _row(row) -> tuple:
  """A parametrize row as a tuple of its arguments: a tuple is one per name, any other
  value (a list too) is the one name's value."""
  return row if isinstance(row, tuple) else (row,)
