"""Python's cyclic garbage collector paused over a block, for two reasons.

- Speed: building a deep model and tracing its step make millions of objects that all
  live on, and each collection walks them again (5% of a 512-layer model's start;
  docs/benchmarks_history.md, "A cell's weights stacked per shape (2026-11-25)"). The
  trainer pauses it there.
- Measurement: TensorFlow's allocator counts are the process's, and a collection between
  two reads frees what others left (tensors in reference cycles) and counts it against
  what is measured. The layer profiler and the tests that read the counts collect once
  first, then pause it.

Reference counting still frees what is dropped within the block.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def cyclic_gc_paused(collect_first: bool = False) -> Iterator[None]:
  """The cyclic collector off within (then on as it was); with `collect_first`, one
  collection before (what is measured within starts from no garbage)."""
  if collect_first:
    gc.collect()
  was_enabled = gc.isenabled()
  gc.disable()
  try:
    yield
  finally:
    if was_enabled:
      gc.enable()
