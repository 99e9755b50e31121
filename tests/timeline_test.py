"""The measured pipeline schedule: statistics against hand-built schedules, the
timestamps of a step (every action of every cell, in its loop), and the chart of a
schedule."""

import numpy as np
import pytest
import tensorflow as tf
from tiers import quick_sample

from lingvo_gpipe import train_step
from lingvo_gpipe.core import base_layer, layers
from lingvo_gpipe.pipeline import layer as gpipe
from lingvo_gpipe.pipeline import schedule, schedule_chart, timeline
from lingvo_gpipe.pipeline.schedule import BACKWARD, FORWARD


def fill_drain(num_cells: int, num_micro: int, forward: float = 1.0, backward: float = 2.0):
  """GPipe's ideal schedule, written out by hand: (cell, m, phase, start, end) rows."""
  rows = []
  for m in range(num_micro):
    for k in range(num_cells):
      rows.append((k, m, FORWARD, (m + k) * forward, (m + k + 1) * forward))
  backward_start = (num_micro + num_cells - 1) * forward
  for m in range(num_micro):
    for k in reversed(range(num_cells)):
      slot = m + (num_cells - 1 - k)
      rows.append((k, m, BACKWARD, backward_start + slot * backward,
                   backward_start + (slot + 1) * backward))
  return rows


def schedule_of(rows, offset: float = 1000.0) -> timeline.MeasuredTimeline:
  keys = [timeline.SpanKey(k, m, phase) for k, m, phase, _, _ in rows]
  times = np.array([[start + offset, end + offset] for *_, start, end in rows])
  return timeline.MeasuredTimeline.from_spans(times, keys)


@pytest.mark.parametrize("num_cells, num_micro", [(1, 4), (2, 4), (4, 8), (3, 1)])
def test_an_ideal_fill_drain_schedule_measures_the_theoretical_bubble(num_cells, num_micro):
  measured = schedule_of(fill_drain(num_cells, num_micro))
  assert measured.num_cells == num_cells and measured.num_units == num_micro
  assert measured.duration == pytest.approx(3.0 * (num_micro + num_cells - 1))
  busy = num_micro / (num_micro + num_cells - 1)
  assert measured.busy_fractions() == pytest.approx([busy] * num_cells)
  assert measured.bubble() == pytest.approx(measured.theoretical_bubble())
  assert measured.theoretical_bubble() == pytest.approx(
      (num_cells - 1) / (num_micro + num_cells - 1))


def test_overlapping_calls_count_once():
  rows = [(0, 0, FORWARD, 0.0, 2.0), (0, 1, FORWARD, 1.0, 3.0),
          (1, 0, BACKWARD, 6.0, 8.0)]
  measured = schedule_of(rows)
  assert measured.busy_fractions() == pytest.approx([3 / 8, 2 / 8])


def test_the_chart_labels_cells_devices_time_and_bubbles_and_leaves_idle_white():
  rows = fill_drain(2, 4)  # seconds: F 1 s, B 2 s; 15 s in all; bubble 1/5
  measured = schedule_of(rows)
  devices = ["/job:worker/replica:0/task:0/device:CPU:0",
             "/job:worker/replica:0/task:1/device:GPU:0"]
  plan = schedule.gpipe(2, 4)
  fig = schedule_chart.figure(measured, devices, plan)
  axes = fig.axes[0]
  assert [t.get_text() for t in axes.get_yticklabels()] == ["cell 0\ntask:0 CPU:0",
                                                           "cell 1\ntask:1 GPU:0"]
  assert axes.get_xlabel() == "time in the step (ms)" and axes.get_xlim() == (0, 15000)
  assert axes.get_title() == ("K=2 cells, M=4 micro-batches\nbubble: measured 20%, GPipe "
                              f"theory 20%, gpipe plan {plan.bubble():.0%}")
  # Sized for TensorBoard's card (about 330-400 px): no shrinking makes the text illegible.
  assert fig.get_figwidth() * fig.dpi <= 410
  # Every bar carries its micro-batch number (all are wide enough here).
  assert sorted(t.get_text() for t in axes.texts) == sorted(str(m) for _, m, _, _, _ in rows)
  assert [t.get_text() for t in axes.get_legend().get_texts()] == [
      "forward", "backward (with recompute)", "idle (bubble)",
      "thin: the plan, measured call times"]
  # Every call is one bar spanning its own milliseconds on its cell's row, and the
  # plan (simulated with the measured 1 s forwards and 2 s backwards: this very
  # fill-drain) one thin bar under it at the same place.
  bars = [path.get_extents() for bar in axes.collections for path in bar.get_paths()]
  measured_bars = [b for b in bars if b.height > 0.5]
  planned_bars = [b for b in bars if b.height < 0.2]
  assert sorted((round(b.x0), round(b.x1), round(b.y0 + 0.4)) for b in measured_bars) == sorted(
      (round(start * 1e3), round(end * 1e3), k) for k, _, _, start, end in rows)
  assert sorted((round(b.x0), round(b.x1), round(b.y0 - 0.24)) for b in planned_bars) == sorted(
      (round(start * 1e3), round(end * 1e3), k) for k, _, _, start, end in rows)

  pixels = schedule_chart.render(fig)
  assert pixels.dtype == np.uint8 and pixels.ndim == 3 and pixels.shape[2] == 3
  height = pixels.shape[0]

  def pixel(ms: float, cell: int) -> np.ndarray:
    x, y = axes.transData.transform((ms, cell))
    return pixels[int(height - y), int(x)]

  white = [255, 255, 255]
  assert list(pixel(500, 1)) == white      # cell 1 waits for micro-batch 0: the bubble
  assert list(pixel(500, 0)) != white      # cell 0 runs F0
  assert list(pixel(1500, 1)) != white     # cell 1 runs F0
  assert list(pixel(14500, 1)) == white    # cell 1 is done; cell 0 runs B3
  assert list(pixel(14500, 0)) != white


def test_rows_must_match_the_keys():
  with pytest.raises(ValueError, match="3 spans for 2 keys"):
    timeline.MeasuredTimeline.from_spans(np.zeros((3, 2)), [timeline.SpanKey(0, 0, FORWARD)] * 2)


def stamped_step(batch_size: int, **pipeline):
  """A pipeline of four 4-wide Linear layers and its traced training step → (grads,
  the timestamps to fetch)."""
  model = gpipe.PipeliningLayer.Params().set(
      name="stack", layers=[layers.Linear.Params().set(name=f"fc{i}", input_dim=4,
                                                        output_dim=4) for i in range(4)],
      **pipeline).instantiate()
  wrapped = train_step.StackWithLoss(
      model, lambda out, _: {"loss": (tf.reduce_sum(out), tf.constant(1.0))})

  @tf.function
  def step():
    with base_layer.step_context(training=True, step=tf.constant(1, tf.int64),
                                 spans=[]) as ctx:
      _, grads = train_step.loss_and_gradients(wrapped, {"inputs": tf.ones([batch_size, 4])},
                                               model.trainable_variables)
    return grads, timeline.fetches(ctx.spans)

  return model, step


@pytest.mark.parametrize("schedule", quick_sample(["gpipe", "1f1b"], quick=["1f1b"]))
def test_a_step_stamps_every_action_in_the_loop_of_its_device(cpu_devices, schedule):
  num_cells, num_micro = 2, 3
  model, step = stamped_step(6, num_cells=num_cells, num_micro_batches=num_micro,
                             devices=cpu_devices[:2], schedule=schedule)

  graph = step.get_concrete_function().graph
  # The stamps are taken inside the loops: one loop per device (here one cell each).
  loops = [op for op in graph.get_operations() if op.type == "While"]
  assert sorted(tf.DeviceSpec.from_string(op.device).device_index for op in loops) == [0, 1]
  assert not [op for op in graph.get_operations() if op.type == "Timestamp"]

  _, fetched = step()
  measured = timeline.MeasuredTimeline.from_fetched([t.numpy() for t in fetched])
  assert sorted((k.cell, k.unit, k.phase) for k in measured.keys) == sorted(
      (k, m, phase) for k in range(num_cells) for m in range(num_micro)
      for phase in (FORWARD, BACKWARD))
  # The stamps follow the hand-offs. A span starts once its input is in the inbox, and a
  # cell sends its output inside its Case, after its own start: so cell 1 starts F_m only
  # after cell 0 started it, and cell 0 starts B_m only after cell 1 started B_m (its
  # output gradient). The ends have no such order: the receiver can finish a small action
  # before the sender's Case returns and its end is stamped (seen on CI: 0.3 ms earlier).
  span = {(k.cell, k.unit, k.phase): t for t, k in zip(measured.times, measured.keys)}
  for m in range(num_micro):
    assert span[1, m, FORWARD][0] >= span[0, m, FORWARD][0]
    assert span[0, m, BACKWARD][0] >= span[1, m, BACKWARD][0]
  # Each device ran its calls one at a time, in the order the schedule lists.
  assert measured.followed(model.plan()) == [True] * num_cells
  summary = measured.summary(model.plan())
  assert summary["pipeline/cells_following_plan"] == 1.0
  assert summary["pipeline/bubble_planned_equal_cells"] == pytest.approx(
      (num_cells - 1) / (num_micro + num_cells - 1))
  # The plan with this step's own call times: each cell's mean forward and backward.
  def mean(k, phase):
    return np.mean([t[1] - t[0] for t, key in zip(measured.times, measured.keys)
                    if key.cell == k and key.phase == phase])
  forwards = [mean(k, FORWARD) for k in range(num_cells)]
  backwards = [mean(k, BACKWARD) for k in range(num_cells)]
  assert summary["pipeline/bubble_planned"] == pytest.approx(
      model.plan().bubble(forwards, backwards, 0.0))
  # Its step, simulated with those means. (Not bounded by the measured step: a slow action
  # where a cell had slack moves the real end little but every action of its mean.)
  planned = summary["pipeline/schedule_seconds_planned"]
  if schedule == "gpipe":  # K=2, M=3: (M−1)·max + the sum over cells, per phase
    expected = sum(sum(t) + 2 * max(t) for t in (forwards, backwards))
  else:
    expected = max(end for _, end in model.plan().simulate(forwards, backwards, 0.0).values())
  assert planned == pytest.approx(expected, rel=1e-9)
  busy = [sum(t[1] - t[0] for t, key in zip(measured.times, measured.keys) if key.cell == k)
          for k in range(num_cells)]
  assert max(busy) * (1 - 1e-9) <= planned <= sum(busy) * (1 + 1e-9)
  for k in range(num_cells):
    spans = sorted(tuple(t) for t, key in zip(measured.times, measured.keys) if key.cell == k)
    assert all(later[0] >= earlier[1] for earlier, later in zip(spans, spans[1:]))


@pytest.mark.parametrize("schedule_name, num_cells, virtual_stages", quick_sample([
    ("interleaved_1f1b", 4, 2), ("zb_h1", 2, 1), ("zbv", 4, 2)], quick=[("zbv", 4, 2)]))
def test_each_device_runs_its_cells_in_one_loop_one_call_at_a_time(cpu_devices, schedule_name,
                                                                   num_cells, virtual_stages):
  num_micro, num_devices = 4, num_cells // virtual_stages
  model, step = stamped_step(8, num_cells=num_cells, num_micro_batches=num_micro,
                             devices=cpu_devices[:num_devices], schedule=schedule_name,
                             virtual_stages=virtual_stages)

  graph = step.get_concrete_function().graph
  assert len([op for op in graph.get_operations() if op.type == "While"]) == num_devices
  measured = timeline.MeasuredTimeline.from_fetched([t.numpy() for t in step()[1]])
  plan = model.plan()
  assert measured.num_devices == num_devices
  assert measured.followed(plan) == [True] * num_cells
  want = sorted((k, a.unit, a.phase) for k in range(num_cells) for a in plan.actions[k])
  assert sorted((k.cell, k.unit, k.phase) for k in measured.keys) == want
  for d in range(num_devices):
    spans = sorted(tuple(t) for t, device in zip(measured.times, measured.devices) if device == d)
    assert all(later[0] >= earlier[1] for earlier, later in zip(spans, spans[1:]))
  assert len(measured.device_busy_fractions()) == num_devices
