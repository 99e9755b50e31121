"""How close two float results computed two ways must be: tolerances from their scale.

Two computations of the same sums in another order (another micro-batch split, a cell
boundary elsewhere, a kernel that blocks differently on a CPU with other vector widths,
another thread count, oneDNN on or off) round differently. What they differ by is a few
units in the last place (ulps) of the *largest* magnitudes that went into the sums, not
of each element: an element that is small because large terms cancelled carries the
absolute rounding error of those terms. (Seen: a gradient element -0.0012702 against
-0.0012701, one ulp of the vector's largest elements, on a CPU without AVX-512; a
fixed `atol=1e-7` only held on the machine the test was written on.) So every
comparison of float sums here is absolute and scaled by the reference:

    |got - want| <= ulps · eps(dtype) · max|want|

`ulps` (k) says how many units of the largest element the two orders may differ by:

- REORDERED (64): the same arithmetic in another order, through the few layers and
  micro-batch sums of the tests' tiny models (float32: 7.6e-6 of the largest element;
  the suite's old relative bound of 1e-5 was 84 ulps). The most seen on this
  project's machines (AVX2 without AVX-512, oneDNN on and off, one intra-op thread;
  docs/benchmarks.md) is 7.7 ulps, so 64 leaves a margin of 8; a wrong micro-batch
  weight (1/M of a micro-batch's share, M <= 13) or a missing gradient term moves a
  gradient by 1e-2 of its scale or more, a thousand times the bound
  (`tests/numerics_test.py` shows such breakages fail).
- TRAINED (1024): loss curves over tens of optimizer steps, where each step's
  rounding is carried into the next and Adam divides by small second moments (1.2e-4
  of scale, the old rtol of those tests). A few steps (two Adam steps, a resumed
  run) stay within REORDERED: seen at most 5 ulps.
- HALF_REORDERED (16), in units of a half compute dtype's eps (bfloat16 2^-7, float16
  2^-10; docs/mixed_precision.md): a model computing in it against the same model
  unpartitioned in it. The unpartitioned model rounds each product over the whole
  batch to the dtype once, the pipeline once per micro-batch and sums them in float32.
  Seen: at most 3.9 units of the largest gradient element, both dtypes, so 16 leaves
  a margin of 4; a micro-batch left out moves gradients by ~1/M of their scale (30
  units of bfloat16's eps at M = 4, 250 of float16's).
- A numpy reference (float64, or a direct convolution against TensorFlow's) is
  another order too; it is compared at the coarser dtype's eps (float32's for a
  float32 result), or at the `dtype` a call names with its reason (bfloat16's eps is
  2^-7, float16's 2^-10: a mixed-precision result is compared at its compute dtype's).
"""

from __future__ import annotations

import os
from typing import Any

import ml_dtypes  # bfloat16 for numpy (installed with TensorFlow)
import numpy as np

REORDERED = 64
TRAINED = 1024
HALF_REORDERED = 16


def tolerance(want: Any, ulps: float = REORDERED, dtype: Any = None) -> float:
  """The absolute tolerance for results shaped like `want`: ulps · eps · max|want|.

  dtype: whose eps (default: want's float dtype; float32 for integers). A reference
  of all zeros gets the scale 1 (so a result must be within ulps·eps of 0).
  """
  values = np.asarray(want)
  return ulps * _eps(dtype, values) * _scale(values)


def relative_difference(got: Any, want: Any) -> float:
  """max|got - want| / max|want|: what `tolerance` bounds, in units of want's scale."""
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.max(np.abs(got - want), initial=0.0)) / _scale(want)


def assert_close(got: Any, want: Any, ulps: float = REORDERED, dtype: Any = None,
                 err_msg: str = "") -> None:
  """Asserts every element of got is within ulps · eps · max|want| of want's, eps of
  dtype or else of the coarser of got's and want's dtypes (a float64 numpy reference
  of a float32 result is compared at float32's eps)."""
  got, want = np.asarray(got), np.asarray(want)
  eps = _eps(dtype, got, want)
  _log_observed(relative_difference(got, want) / eps)
  np.testing.assert_allclose(got, want, rtol=0, atol=ulps * eps * _scale(want),
                             err_msg=err_msg)


def assert_all_close(got: Any, want: Any, ulps: float = REORDERED, dtype: Any = None) -> None:
  """assert_close for two equally long sequences of arrays (e.g. gradients), each
  against its own scale."""
  got, want = list(got), list(want)
  assert len(got) == len(want), (len(got), len(want))
  for i, (g, w) in enumerate(zip(got, want)):
    assert_close(g, w, ulps, dtype, err_msg=f"item {i}")


def _scale(want: np.ndarray) -> float:
  """max|want|, or 1 for an empty or all-zero reference."""
  scale = float(np.max(np.abs(want), initial=0.0))
  return scale if scale > 0 else 1.0


def _eps(dtype: Any, *arrays: np.ndarray) -> float:
  """eps of dtype (a numpy dtype, or a name such as 'bfloat16'), else the largest eps
  of the arrays' float dtypes (float32's when none is a float)."""
  if dtype is not None:
    return float(ml_dtypes.finfo(np.dtype(getattr(ml_dtypes, str(dtype), dtype))).eps)
  floats = [ml_dtypes.finfo(a.dtype).eps for a in arrays if _is_float(a.dtype)]
  return float(max(floats)) if floats else float(np.finfo(np.float32).eps)


def _is_float(dtype: np.dtype) -> bool:
  """numpy's floats and ml_dtypes' (bfloat16: TensorFlow's .numpy() of a bfloat16
  tensor), which numpy counts as kind 'V'."""
  return dtype.kind == "f" or dtype == ml_dtypes.bfloat16


def _log_observed(ulps: float) -> None:
  """With $NUMERICS_ULPS_LOG set, appends the test's name and the ulps of want's scale
  this comparison used (max|got - want| / (eps · max|want|)) to that file: how the
  k above were chosen, and how to check them again on a new machine."""
  path = os.environ.get("NUMERICS_ULPS_LOG")
  if path:
    with open(path, "a") as f:
      f.write(f"{os.environ.get('PYTEST_CURRENT_TEST', '?')}\t{ulps:.2f}\n")
