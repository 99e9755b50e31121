"""The suite's two tiers: `make test` (quick) and `make test-all` (every test).

A test marked `exhaustive` runs in the full tier only (`pytest -m "not exhaustive"` is
the quick tier). The full tier is what CI runs. The quick tier keeps at least one test of
every file and every feature (docs/library.md, "Testing", lists what it leaves to the
full one); where a covering grid is cut, it keeps a fixed sample of the grid's rows that
holds every value of every column at least once (`each_value_once`), not its first rows.

  @pytest.mark.parametrize("schedule, num_cells", quick_sample(GRID))
  def test_...(schedule, num_cells): ...

  @pytest.mark.exhaustive          # a whole test: the full tier only
  def test_...(): ...
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

EXHAUSTIVE = pytest.mark.exhaustive


def each_value_once(rows: Sequence[Sequence],
                    columns: Sequence[int] | None = None) -> list[tuple]:
  """A subset of `rows` in which every value of each of `columns` occurs at least once.

  Greedy and fixed: repeatedly takes the first row (in the grid's order) that adds the
  most (column, value) pairs not yet held, until every pair is held. The subset's size
  is at least the largest column's number of distinct values.

  Args:
    rows: the grid, each row a tuple of the same length (a single value counts as a
      one-column row).
    columns: the indices of the columns to cover (default: all). Leave out the columns
      of sizes that only repeat what others cover (a third micro-batch count), keep
      those that name a feature (schedule, recompute policy, dtype).
  Returns:
    The chosen rows, in the grid's order.
  """
  rows = [tuple(row) if isinstance(row, (tuple, list)) else (row,) for row in rows]
  covered = range(len(rows[0])) if columns is None else columns

  def pairs(row: tuple) -> set:
    return {(column, repr(row[column])) for column in covered}

  missing = set().union(*map(pairs, rows))
  chosen: set[int] = set()
  while missing:
    gains = [len(missing & pairs(row)) for row in rows]
    best = max(range(len(rows)), key=lambda i: (gains[i], -i))
    chosen.add(best)
    missing -= pairs(rows[best])
  return [rows[i] for i in sorted(chosen)]


def quick_sample(rows: Sequence, columns: Sequence[int] | None = None,
                 quick: Sequence | None = None) -> list:
  """`rows` as parametrize values, those outside the quick sample marked `exhaustive`.

  Args:
    rows: the full grid (tuples, or single values for a one-name parametrize).
    columns: the columns whose every value the quick sample holds
      (`each_value_once(rows, columns)`; default all).
    quick: the rows the quick tier runs instead, chosen by hand (each must be a row of
      `rows`); say why beside the grid.
  Returns:
    A list of `pytest.param`s, one per row, in the grid's order, each with the id
    pytest would give the bare row.
  """
  as_tuples = [_row(row) for row in rows]
  keep = [_row(row) for row in (each_value_once(as_tuples, columns) if quick is None
                                else quick)]
  unknown = [row for row in keep if row not in as_tuples]
  if unknown:
    raise ValueError(f"quick rows {unknown} are not rows of the grid")
  return [pytest.param(*row, marks=() if row in keep else EXHAUSTIVE)
          for row in as_tuples]


def _row(row) -> tuple:
  """A parametrize value as a tuple of its arguments (a bare value: one argument)."""
  return tuple(row) if isinstance(row, (tuple, list)) else (row,)
