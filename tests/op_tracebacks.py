"""The suite traces without recording each op's Python stack, except where a test reads it.

TensorFlow records the Python stack at every op it creates (`ops._create_c_op`:
`tf_stack.extract_stack`, kept as the op's `traceback` for error messages and
`Operation.traceback`). Under pytest and xdist, inside nested tf.function, While and
Case traces, a stack is a few hundred frames deep, and the record is a tenth of a
pipeline test's time (py-spy over `tests/gpipe_test.py`: 11.5% of the samples in
`extract_stack`). The tests compare values, which the record does not touch; the suite
turns it off (`off()`, from conftest) and a module that reads ops' frames (the
placement audit names the frame that made an op) marks itself
`pytestmark = pytest.mark.op_tracebacks` to trace with them. Trainer processes the
tests start are not affected: they never import this module.
"""

import contextlib
import functools
import inspect
from collections.abc import Iterator

from tensorflow.python.framework import ops  # private: the one place ops are created

_RECORDING = ops._create_c_op


def _check() -> None:
  """Fails loudly where TensorFlow's op creation no longer takes the switch."""
  if "extract_traceback" not in inspect.signature(_RECORDING).parameters:
    raise RuntimeError("tensorflow.python.framework.ops._create_c_op takes no "
                       "extract_traceback: update tests/op_tracebacks.py")


@functools.wraps(_RECORDING)
def _not_recording(*args, **kwargs):
  kwargs["extract_traceback"] = False
  return _RECORDING(*args, **kwargs)


def off() -> None:
  """Ops created from now on keep no Python stack."""
  _check()
  ops._create_c_op = _not_recording


@contextlib.contextmanager
def recorded() -> Iterator[None]:
  """Ops created inside keep their Python stack (TensorFlow's default)."""
  previous, ops._create_c_op = ops._create_c_op, _RECORDING
  try:
    yield
  finally:
    ops._create_c_op = previous
