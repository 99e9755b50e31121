"""An upgrade tripwire: the TensorFlow behaviours the engine relies on beyond the
documented API (lingvo_gpipe/pipeline/tf_internals.py) were checked on this version."""

import tensorflow as tf

from lingvo_gpipe.pipeline import tf_internals


def test_the_tensorflow_internals_were_checked_on_this_version():
  assert tf.__version__ == tf_internals.TENSORFLOW_CHECKED, (
      f"TensorFlow is {tf.__version__}; the tricks in tf_internals.py were checked on "
      f"{tf_internals.TENSORFLOW_CHECKED}: re-check each with the test named beside it, "
      "then update TENSORFLOW_CHECKED")


def test_the_private_method_the_timestamps_need_still_exists():
  graph = tf.Graph()
  with graph.as_default():
    stamp = tf.timestamp()
  tf_internals.exempt_from_program_order(stamp.op)
  assert stamp.op._get_control_flow_context().IsWhileContext() is False  # noqa: SLF001
