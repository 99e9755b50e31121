"""The measured pipeline schedule: statistics against hand-built schedules, and the
timestamps in a traced step (on every cell's device, not chained to one another)."""

import numpy as np
import pytest
import tensorflow as tf

from lingvo_gpipe import train_step
from lingvo_gpipe.core import base_layer, layers
from lingvo_gpipe.pipeline import layer as gpipe
from lingvo_gpipe.pipeline import timeline


def fill_drain(num_cells: int, num_micro: int, forward: float = 1.0, backward: float = 2.0):
  """GPipe's ideal schedule, written out by hand: (cell, m, phase, start, end) rows."""
  rows = []
  for m in range(num_micro):
    for k in range(num_cells):
      rows.append((k, m, timeline.FORWARD, (m + k) * forward, (m + k + 1) * forward))
  backward_start = (num_micro + num_cells - 1) * forward
  for m in range(num_micro):
    for k in reversed(range(num_cells)):
      slot = m + (num_cells - 1 - k)
      rows.append((k, m, timeline.BACKWARD, backward_start + slot * backward,
                   backward_start + (slot + 1) * backward))
  return rows


def schedule_of(rows, offset: float = 1000.0) -> timeline.Schedule:
  keys = [timeline.SpanKey(k, m, phase) for k, m, phase, _, _ in rows]
  times = np.array([[start + offset, end + offset] for *_, start, end in rows])
  return timeline.Schedule.from_fetched([times], [keys])


@pytest.mark.parametrize("num_cells, num_micro", [(1, 4), (2, 4), (4, 8), (3, 1)])
def test_an_ideal_fill_drain_schedule_measures_the_theoretical_bubble(num_cells, num_micro):
  measured = schedule_of(fill_drain(num_cells, num_micro))
  assert measured.num_cells == num_cells and measured.num_micro_batches == num_micro
  assert measured.duration == pytest.approx(3.0 * (num_micro + num_cells - 1))
  busy = num_micro / (num_micro + num_cells - 1)
  assert measured.busy_fractions() == pytest.approx([busy] * num_cells)
  assert measured.bubble() == pytest.approx(measured.theoretical_bubble())
  assert measured.theoretical_bubble() == pytest.approx(
      (num_cells - 1) / (num_micro + num_cells - 1))


def test_overlapping_calls_count_once_and_idle_time_shows_white():
  rows = [(0, 0, timeline.FORWARD, 0.0, 2.0), (0, 1, timeline.FORWARD, 1.0, 3.0),
          (1, 0, timeline.BACKWARD, 6.0, 8.0)]
  measured = schedule_of(rows)
  assert measured.busy_fractions() == pytest.approx([3 / 8, 2 / 8])
  image = measured.image(width=81, row_height=4, gap=2)
  assert image.shape == (2 * (4 + 2) + 2, 81, 3) and image.dtype == np.uint8
  top_row, bottom_row = image[2], image[8]
  white = np.array([255, 255, 255])
  assert (top_row[:30] != white).any(axis=1).all() and (top_row[31:] == white).all()
  assert (bottom_row[:60] == white).all() and (bottom_row[60:80] != white).any(axis=1).all()


def test_fetched_rows_must_match_the_keys():
  with pytest.raises(ValueError, match="3 fetched spans for 2 keys"):
    timeline.Schedule.from_fetched([np.zeros((3, 2))],
                                   [[timeline.SpanKey(0, 0, timeline.FORWARD)] * 2])


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_traced_step_stamps_every_cell_call_on_its_device_without_chaining(cpu_devices,
                                                                            schedule):
  num_cells, num_micro = 2, 3
  model = gpipe.PipeliningLayer.Params().set(
      name="stack", num_cells=num_cells, num_micro_batches=num_micro, devices=cpu_devices[:2],
      schedule=schedule,
      layers=[layers.Linear.Params().set(name=f"fc{i}", input_dim=4, output_dim=4)
              for i in range(4)]).instantiate()
  wrapped = train_step.StackWithLoss(
      model, lambda out, _: {"loss": (tf.reduce_sum(out), tf.constant(1.0))})
  keys = []

  @tf.function
  def step():
    with base_layer.step_context(training=True, step=tf.constant(1, tf.int64),
                                 schedule=[]) as ctx:
      _, grads = train_step.loss_and_gradients(wrapped, {"inputs": tf.ones([6, 4])},
                                               model.trainable_variables)
    fetched, keys[:] = timeline.fetches(ctx.schedule)
    return grads, fetched

  graph = step.get_concrete_function().graph
  stamps = [op for op in graph.get_operations() if op.type == "Timestamp"]
  # Two per call: forward and backward of every (cell, micro-batch).
  assert len(stamps) == 2 * 2 * num_cells * num_micro
  by_device = {tf.DeviceSpec.from_string(op.device).device_index for op in stamps}
  assert by_device == {0, 1}
  # tf.function chains stateful ops in program order; a chain of stamps would
  # serialize the pipeline, so no stamp may wait for another.
  for op in stamps:
    assert not [c for c in op.control_inputs if c.type == "Timestamp"], op.name

  _, fetched = step()
  measured = timeline.Schedule.from_fetched([t.numpy() for t in fetched], keys)
  assert sorted((k.cell, k.micro_batch, k.phase) for k in measured.keys) == sorted(
      (k, m, phase) for k in range(num_cells) for m in range(num_micro)
      for phase in (timeline.FORWARD, timeline.BACKWARD))
  assert (measured.times[:, 1] >= measured.times[:, 0]).all()
  # Each device ran its calls one at a time, in the order the schedule lists.
  assert measured.followed(model.plan()) == [True] * num_cells
  summary = measured.summary(model.plan())
  assert summary["pipeline/cells_following_plan"] == 1.0
  assert summary["pipeline/bubble_planned"] == pytest.approx(
      (num_cells - 1) / (num_micro + num_cells - 1))
  for k in range(num_cells):
    spans = sorted(tuple(t) for t, key in zip(measured.times, measured.keys) if key.cell == k)
    assert all(later[0] >= earlier[1] for earlier, later in zip(spans, spans[1:]))
