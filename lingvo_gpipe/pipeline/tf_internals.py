"""Every place the engine relies on TensorFlow behaviour beyond its documented API.

Checked on TensorFlow `TENSORFLOW_CHECKED`. On an upgrade, `tests/tf_internals_test.py`
fails until each item below has been re-checked with the test named beside it, then
`TENSORFLOW_CHECKED` is updated.

1. `NOT_INLINED`, the function attribute `_noinline` on the cells' forward and
   backward functions (`tf.function(..., experimental_attributes=NOT_INLINED)`).
   Grappler inlines function calls by default and re-optimizes the flattened step:
   the first step then cost 13 s instead of 1.9 s (32 layers × 32 micro-batches), and
   common-subexpression elimination could merge the recomputed forward into the
   forward, undoing re-materialization. Pinned by `tests/pipeline_graph_test.py`
   (calls carry the attribute; bodies do not grow with M) and the re-materialization
   memory test `tests/pipeline_memory_test.py`.
2. `disable_function_specialization()`: Grappler's function optimizer off,
   process-wide (`tf.config.optimizer.set_experimental_options`; there is no
   per-function switch). It specializes a body copy per call with a constant input and
   examines every call site, so the first step's cost grew with layers × micro-batches
   (8 layers, 2 cells: 19.3 s at M=32 against 11.5 s with it off). Pinned by
   `bench/startup_time.py` only (a timing, not a test).
3. `exempt_from_program_order(op)`: sets a minimal control-flow context on a
   `tf.timestamp` op (`op._set_control_flow_context`, a private method). tf.function's
   automatic control dependencies chain every stateful op that touches no resource in
   program order, across devices; chained, the timestamps serialized the whole
   pipeline (no overlap at all). The chain skips ops inside a control-flow context.
   Pinned by `tests/timeline_test.py` (stamps are not chained to one another) and
   `tests/pipeline_graph_test.py`.
4. Ordering tokens on collective all-reduces (`hybrid.CollectiveMean`): the
   `ordering_token` input of `tf.raw_ops.CollectiveReduceV2` (a raw op, outside the
   `tf.distribute` API). Given a resource on its own device, tf.function's automatic
   control dependencies order the collectives per device instead of chaining them in
   program order across devices, which deadlocked the group. Pinned by
   `tests/hybrid_test.py` (the all-reduce test and the two-replica equivalence).
"""

from __future__ import annotations

import tensorflow as tf

TENSORFLOW_CHECKED = "2.21.0"

NOT_INLINED = {"_noinline": True}


def disable_function_specialization() -> None:
  """Turns Grappler's function optimizer off for the process (item 2 above)."""
  tf.config.optimizer.set_experimental_options({"function_optimization": False})


class _OutsideProgramOrder:
  """The minimal control-flow context tf.function's ordering checks for (not a loop,
  no outer context); it changes nothing in the GraphDef."""

  outer_context = None

  @staticmethod
  def IsWhileContext() -> bool:  # noqa: N802 (TensorFlow's control-flow context API)
    return False


def exempt_from_program_order(op: tf.Operation) -> None:
  """Keeps a stateful op that touches no resource out of tf.function's program-order
  chain (item 3 above)."""
  op._set_control_flow_context(_OutsideProgramOrder())  # noqa: SLF001
