"""The machine's figures stay finite: a hand-off too fast to time is floored at the
timing's resolution, and the cost cache writes only numbers strict JSON has."""

import dataclasses
import json
import math
import sys
import time

import numpy as np
import pytest

from lingvo_gpipe import calibration
from lingvo_gpipe.pipeline import layer_profiler, planner
from lingvo_gpipe.pipeline.layer_profiler import LayerCost

SIZES = (2**16, 2**22)


def strict_json(text: str):
  """json.loads refusing Infinity, -Infinity and NaN (Python's json takes them)."""
  def refuse(constant):
    raise ValueError(f"{constant} is not JSON")
  return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize("larger_s", [1e-4, 0.9e-4, 0.5e-4])  # slope 0, and below 0
def test_a_slope_the_timing_cannot_resolve_is_floored_at_its_resolution(larger_s):
  fit = calibration.fit_link(SIZES, [1e-4, larger_s], resolution_s=2e-6)
  # 2 µs over the sizes' difference: the least slope the timing tells apart.
  assert fit.floored
  assert math.isfinite(fit.bytes_per_s) and fit.bytes_per_s > 0
  assert fit.bytes_per_s == pytest.approx((SIZES[1] - SIZES[0]) / 2e-6)
  assert fit.latency_s == pytest.approx(1e-4 - SIZES[0] * 2e-6 / (SIZES[1] - SIZES[0]))


def test_a_slope_the_timing_resolves_is_the_line_through_the_two_sizes():
  seconds = [1e-4, 1e-4 + 4e-3]  # ~1 GB/s
  fit = calibration.fit_link(SIZES, seconds, resolution_s=2e-6)
  slope, intercept = np.polyfit(SIZES, seconds, 1)
  assert not fit.floored
  assert fit.bytes_per_s == pytest.approx(1 / slope)
  assert fit.latency_s == pytest.approx(intercept)


def test_link_floors_a_hand_off_too_fast_to_time_and_says_so(monkeypatch):
  """Both ends' calls take the same time at both sizes (slope 0); their times stray by
  a median absolute deviation of 0.1 ms each: 0.2 ms is what the timing resolves."""
  times = [1e-3, 1.1e-3, 0.9e-3, 1e-3, 1e-3, 1.2e-3, 0.8e-3]
  monkeypatch.setattr(calibration, "_call_times_s", lambda fn, runs=7: list(times))
  notes = []
  latency, rate = calibration.link("/device:CPU:0", "/device:CPU:1", SIZES, log=notes.append)
  assert rate == pytest.approx((SIZES[1] - SIZES[0]) / 2e-4)
  assert latency == 0.0
  assert len(notes) == 1 and "floored" in notes[0] and "/device:CPU:1" in notes[0], notes

  # Calls timed alike to the nanosecond: the clock's resolution is the floor.
  monkeypatch.setattr(calibration, "_call_times_s", lambda fn, runs=7: [1e-3] * 7)
  _, rate = calibration.link("/device:CPU:0", "/device:CPU:1", SIZES, log=notes.append)
  clock = time.get_clock_info("perf_counter").resolution
  assert math.isfinite(rate) and rate == pytest.approx((SIZES[1] - SIZES[0]) / clock)


@pytest.mark.parametrize("num_devices", [1, 4])
def test_the_machine_figures_are_finite_and_predict_as_their_infinite_originals(
    monkeypatch, tmp_path, num_devices):
  """An accelerator's concurrency (inf: every device at full speed) and a lone device's
  link (nothing crosses it) are stored as finite stand-ins; plans predict the same
  with them as with inf."""
  monkeypatch.setattr(calibration, "_call_times_s", lambda fn, runs=7: [1e-3] * 7)
  monkeypatch.setattr(calibration, "action_overhead_s", lambda device: 1e-4)
  monkeypatch.setattr(calibration, "update_s_per_byte", lambda device, params: 1e-12)
  monkeypatch.setattr(calibration, "concurrency", lambda devices, work=None: math.inf)
  devices = [f"/device:CPU:{i}" for i in range(num_devices)]
  found = calibration.measure_machine(devices, 1e9, None, 2.0, log=lambda _: None)
  figures = dataclasses.asdict(found)
  path = tmp_path / "costs.json"
  layer_profiler.cached_record(str(path), ["machine"], lambda: figures, print,
                               decode=lambda e: e, encode=lambda r: r)
  (entry,) = strict_json(path.read_text()).values()
  assert entry == figures
  assert found.cores == num_devices
  if num_devices == 1:
    assert found.link_bytes_per_s == sys.float_info.max

  costs = [LayerCost(forward_s=1e-3 * (1 + i % 3), backward_s=2e-3, weight_bytes=10**6,
                     input_bytes=10**5, kept_bytes=10**5, batch=4) for i in range(8)]
  infinite = dataclasses.replace(found, cores=math.inf, link_bytes_per_s=(
      math.inf if num_devices == 1 else found.link_bytes_per_s))
  for replicas, splits, m, schedule in [(1, (8,), 4, "gpipe")] + (
      [(1, (2, 4, 6, 8), 8, "gpipe"), (2, (4, 8), 4, "1f1b"), (4, (8,), 2, "gpipe")]
      if num_devices == 4 else []):
    want = planner.predict(costs, infinite, replicas, splits, m, "never", schedule, 16)
    got = planner.predict(costs, found, replicas, splits, m, "never", schedule, 16)
    assert got.step_s == pytest.approx(want.step_s, rel=1e-12), (replicas, splits)


def test_the_cost_cache_refuses_to_write_a_number_json_does_not_have(tmp_path):
  path = tmp_path / "costs.json"
  record = {"link_bytes_per_s": 1e9, "cores": [2.0, math.inf]}
  with pytest.raises(ValueError, match=r"the record for key [0-9a-f]{16} \(machine\) holds "
                                       r"\['cores'\]\[1\]=inf, not a finite number"):
    layer_profiler.cached_record(str(path), ["machine"], lambda: record, print,
                                 decode=lambda e: e, encode=lambda r: r)
  assert not path.exists() and not (tmp_path / "costs.json.tmp").exists()


def test_entries_an_older_version_wrote_with_infinity_are_left_out_when_it_is_rewritten(
    tmp_path):
  path = tmp_path / "costs.json"
  path.write_text('{"0123456789abcdef": {"cores": Infinity}, "fedcba9876543210": {"a": 1}}')
  warnings = []
  layer_profiler.cached_record(str(path), ["machine"], lambda: {"cores": 4.0},
                               warnings.append, decode=lambda e: e, encode=lambda r: r)
  stored = strict_json(path.read_text())
  assert "0123456789abcdef" not in stored and stored["fedcba9876543210"] == {"a": 1}
  assert {"cores": 4.0} in stored.values() and len(stored) == 2
  assert len(warnings) == 1 and "0123456789abcdef" in warnings[0], warnings
