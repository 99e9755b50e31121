"""Token slices (TeraPipe): a causal LM pipelined over slices of its sequences against
the same layers run unpartitioned on the whole batch and whole sequences."""

import itertools
import os

import numpy as np
import pytest
import tensorflow as tf
from conftest import engine_loss_and_grads
from numerics import TRAINED, assert_all_close, assert_close, tolerance
from tiers import EXHAUSTIVE, quick_sample

from lingvo_gpipe import train_step
from lingvo_gpipe.core import base_layer, layers, optimizers, stacked_variables, token_slices
from lingvo_gpipe.core.tf_internals import step_function
from lingvo_gpipe.models import amoeba_net, transformer
from lingvo_gpipe.pipeline import layer as gpipe
from lingvo_gpipe.pipeline import layer_profiler, planner, schedule, schedule_chart, timeline
from lingvo_gpipe.pipeline.layer_profiler import LayerCost
from lingvo_gpipe.pipeline.step_model import Machine
from lingvo_gpipe.tasks.language_model import token_metrics

VOCAB, DIM, STEP = 11, 8, 3


def lm_params(cls, **pipeline):
  """Embedding, two causal Transformer layers, softmax: four layers, dropout on all."""
  stack = transformer.lm_stack(VOCAB, DIM, 16, 2, 2, residual_keep_prob=0.8,
                               atten_keep_prob=0.7, relu_keep_prob=0.9)
  return cls.Params().set(name="stack", layers=stack.layers, random_seed=5, **pipeline)


def batch(batch_size: int, length: int) -> dict:
  """ids, labels [B, T] and paddings with a padded tail on all but the first sequence."""
  rng = np.random.default_rng(0)
  pads = np.zeros([batch_size, length], np.float32)
  for i in range(1, batch_size):
    pads[i, length - 1 - (3 * i) % (length - 1):] = 1.0
  return {"ids": tf.constant(rng.integers(0, VOCAB, [batch_size, length]), tf.int32),
          "labels": tf.constant(rng.integers(0, VOCAB, [batch_size, length]), tf.int32),
          "paddings": tf.constant(pads)}


def head(logits, head_inputs):
  return token_metrics(logits, head_inputs["labels"], head_inputs["paddings"])


def reference(data: dict, step: int = STEP):
  """Unpartitioned, whole sequences, GradientTape: (loss, gradients, variable names)."""
  model = lm_params(layers.Sequential).instantiate()
  with tf.GradientTape() as tape:
    with base_layer.step_context(training=True, step=tf.constant(step, tf.int64)):
      loss = head(model(data["ids"], data["paddings"]), data)["loss"][0]
  return (loss.numpy(), [tf.convert_to_tensor(g).numpy()
                         for g in tape.gradient(loss, model.trainable_variables)],
          [v.name for v in model.trainable_variables])


def assert_per_variable_close(got, want, names):
  """Per variable (gradients, or weights), got within REORDERED of the reference, at
  the reference's scale; but the keys' bias, whose gradient is 0 analytically (a
  softmax does not change when a constant is added to every logit of a row), holds
  rounding noise on both sides: it is compared at the scale of its projection
  weight's."""
  weight_of = {name: i for i, name in enumerate(names)}
  for i, name in enumerate(names):
    if name.endswith("/key/b:0"):
      atol = tolerance(want[weight_of[name.replace("/key/b:0", "/key/w:0")]])
      np.testing.assert_allclose(got[i], want[i], rtol=0, atol=atol, err_msg=name)
    else:
      assert_close(got[i], want[i], err_msg=name)


def sliced(data: dict, devices, **pipeline):
  """The pipeline's scheduled step: (loss, gradients)."""
  model = lm_params(gpipe.PipeliningLayer, devices=devices, **pipeline).instantiate()
  return engine_loss_and_grads(
      model, train_step.StackWithLoss(model, head),
      {"inputs": (data["ids"], data["paddings"]), "labels": data["labels"],
       "paddings": data["paddings"]}, STEP)


# schedule × K ∈ {1, 2, 4} × M ∈ {1, 2} × S ∈ {2, 4, 8} × recompute: every pair of
# values of any two once at least (test_the_grid_covers_every_pair); dropout on.
GRID = [
    ("gpipe", 1, 1, 2, "always"), ("1f1b", 1, 2, 4, "never"), ("gpipe", 1, 2, 8, "never"),
    ("1f1b", 2, 1, 2, "never"), ("gpipe", 2, 2, 4, "always"), ("1f1b", 2, 1, 8, "always"),
    ("1f1b", 4, 2, 2, "always"), ("gpipe", 4, 1, 4, "never"), ("1f1b", 4, 2, 8, "never"),
    ("gpipe", 4, 2, 2, "never"),
]
FULL_GRID = list(itertools.product(["gpipe", "1f1b"], [1, 2, 4], [1, 2], [2, 4, 8],
                                   ["always", "never"]))
# LINGVO_GPIPE_FULL_GRID=1 runs all 72 (about 4 minutes on 2 cores).
RUN_GRID = FULL_GRID if os.environ.get("LINGVO_GPIPE_FULL_GRID") == "1" else GRID


def test_the_grid_covers_every_pair():
  def pairs(rows):
    return {(i, j, row[i], row[j]) for row in rows for i, j in itertools.combinations(range(5), 2)}
  assert pairs(GRID) == pairs(FULL_GRID)


@pytest.fixture(scope="module")
def even():
  data = batch(4, 16)
  return data, reference(data)


@pytest.mark.parametrize("schedule_name, num_cells, num_micro_batches, num_slices, recompute",
                         quick_sample(RUN_GRID, quick=[("1f1b", 4, 2, 2, "always")]))
def test_loss_and_gradients_equal_the_unsliced_model(even, cpu_devices, schedule_name, num_cells,
                                                     num_micro_batches, num_slices, recompute):
  data, (want_loss, want_grads, names) = even
  loss, grads = sliced(data, cpu_devices[:num_cells], num_cells=num_cells,
                       num_micro_batches=num_micro_batches, num_token_slices=num_slices,
                       schedule=schedule_name, recompute=recompute)
  assert_close(loss, want_loss)
  assert_per_variable_close(grads, want_grads, names)


@EXHAUSTIVE
def test_uneven_slices_and_micro_batches_with_grouped_weight_gradients(cpu_devices):
  """T = 14 into 4 slices (4, 4, 3, 3), 3 sequences into 2 micro-batches (2, 1): four
  unit shapes; weight gradients over groups of 3 backwards (deferred products)."""
  data = batch(3, 14)
  want_loss, want_grads, names = reference(data)
  loss, grads = sliced(data, cpu_devices[:2], num_cells=2, num_micro_batches=2,
                       num_token_slices=4, schedule="1f1b", weight_gradient_group=3)
  assert_close(loss, want_loss)
  assert_per_variable_close(grads, want_grads, names)


@pytest.mark.parametrize("lengths, schedule_name, recompute",
                         [([7, 5, 3, 1], "1f1b", "always"), ([2, 9, 5], "gpipe", "never")])
@EXHAUSTIVE
def test_given_slice_lengths_equal_the_unsliced_model(even, cpu_devices, lengths,
                                                      schedule_name, recompute):
  """T = 16 cut where `token_slice_lengths` says (TeraPipe's uneven slices), K=2, M=2,
  dropout on: a shape class per distinct length."""
  data, (want_loss, want_grads, names) = even
  loss, grads = sliced(data, cpu_devices[:2], num_cells=2, num_micro_batches=2,
                       num_token_slices=len(lengths), token_slice_lengths=lengths,
                       schedule=schedule_name, recompute=recompute)
  assert_close(loss, want_loss)
  assert_per_variable_close(grads, want_grads, names)


def test_slice_lengths_that_miss_the_sequence_are_named(cpu_devices):
  model = lm_params(gpipe.PipeliningLayer, num_cells=2, num_token_slices=2,
                    token_slice_lengths=[3, 4], devices=cpu_devices[:2]).instantiate()
  data = batch(2, 8)
  with pytest.raises(gpipe.PipelineError,
                     match=r"token_slice_lengths=\[3, 4\] must sum to the sequence length 8"):
    with base_layer.step_context(training=True, layer_stats=[]):
      train_step.loss_and_gradients(
          train_step.StackWithLoss(model, head),
          {"inputs": (data["ids"], data["paddings"]), "labels": data["labels"],
           "paddings": data["paddings"]}, stacked_variables.trainable_weights(model))


@pytest.mark.parametrize("max_draws", [layers.MAX_WINDOW_DRAWS, 0])  # 0: whole, then cut
@pytest.mark.parametrize("whole_shape, settings, dtype", [
    ([2, 3, 8, 8], dict(token_axis=2, key_axis=3), tf.float32),  # attention [B, N, T, T]
    ([2, 3, 8, 8], dict(token_axis=-2, key_axis=-1, noise_shape_broadcast_dims=[-3]),
     tf.float64),  # heads share a mask; negative axes
    ([3, 8, 5], dict(noise_shape_broadcast_dims=[2]), tf.float32),  # [B, T, D], D shared
])
def test_dropout_on_a_slice_is_the_window_of_the_whole_sequences_mask(
    monkeypatch, max_draws, whole_shape, settings, dtype):
  """Dropout on the slice of n tokens at `offset` (along key_axis, if any, the
  sequence's first offset + n positions, a length known only at run time): that window
  of the whole sequences' mask, drawn as a window or as the whole mask cut."""
  monkeypatch.setattr(layers, "MAX_WINDOW_DRAWS", max_draws)
  dropout = layers.Dropout.Params().set(name="dropout", keep_prob=0.5, **settings).instantiate()
  rank = len(whole_shape)
  token_axis = settings.get("token_axis", 1) % rank
  key_axis = settings["key_axis"] % rank if "key_axis" in settings else None
  with base_layer.step_context(training=True, step=7, example_offset=3):
    whole = dropout(tf.ones(whole_shape, dtype)).numpy()
  for offset, n in [(0, 3), (3, 3), (6, 2)]:
    shape, spec, window = list(whole_shape), list(whole_shape), [slice(None)] * rank
    shape[token_axis], spec[token_axis], window[token_axis] = n, n, slice(offset, offset + n)
    if key_axis is not None:
      shape[key_axis], spec[key_axis], window[key_axis] = offset + n, None, slice(0, offset + n)
    token_slice = token_slices.TokenSlice(tf.constant(offset, tf.int64), 8,
                                          token_slices.SliceCache())
    with base_layer.step_context(training=True, step=7, example_offset=3,
                                 token_slice=token_slice):
      got = tf.function(dropout, input_signature=[tf.TensorSpec(spec, dtype)])(
          tf.ones(shape, dtype)).numpy()
    np.testing.assert_array_equal(got, whole[tuple(window)])


@EXHAUSTIVE
def test_two_trainer_steps_give_the_unsliced_weights(cpu_devices):
  """TrainStep (the trainer's step) at K=2, M=2, S=4 against SGD on the unpartitioned
  model by hand: the same losses and weights after two steps. (SGD: Adam would turn
  the keys' bias's rounding noise into ±learning-rate steps of random sign.)"""
  data = batch(4, 16)
  want_model = lm_params(layers.Sequential).instantiate()
  opt = optimizers.SGD.Params().set(learning_rate=0.5).instantiate()
  variables = want_model.trainable_variables
  opt.create_slots(variables)
  want_losses = []
  for i in range(2):
    with tf.GradientTape() as tape:
      with base_layer.step_context(training=True, step=tf.constant(i, tf.int64)):
        loss = head(want_model(data["ids"], data["paddings"]), data)["loss"][0]
    want_losses.append(loss.numpy())
    opt.apply_gradients(tape.gradient(loss, variables), variables, tf.constant(i, tf.int64))

  model = lm_params(gpipe.PipeliningLayer, num_cells=2, num_micro_batches=2,
                    num_token_slices=4, schedule="1f1b", devices=cpu_devices[:2]).instantiate()
  pipeline_opt = optimizers.SGD.Params().set(learning_rate=0.5).instantiate()
  pipeline_opt.create_slots(model.trainable_variables)
  global_step = tf.Variable(0, dtype=tf.int64)
  run = step_function(train_step.TrainStep(train_step.StackWithLoss(model, head), pipeline_opt,
                                           global_step))
  losses = []
  for _ in range(2):
    values, _ = run({"inputs": (data["ids"], data["paddings"]), "labels": data["labels"],
                     "paddings": data["paddings"]})
    losses.append(values["loss"].numpy())
  assert_all_close(losses, want_losses)
  assert_per_variable_close([v.numpy() for v in stacked_variables.trainable_weights(model)],
                            [v.numpy() for v in variables], [v.name for v in variables])


def test_a_layer_on_slices_with_its_cache_equals_the_whole_sequence():
  """A causal Transformer layer (dropout on) run slice by slice, each slice given the
  cache entries the previous one extended, against the whole sequence."""
  layer = transformer.TransformerLmLayer.Params().set(
      name="layer", input_dim=DIM, hidden_dim=16, num_heads=2, residual_keep_prob=0.8,
      atten_keep_prob=0.7, relu_keep_prob=0.9).instantiate()
  data = batch(3, 12)
  x = tf.random.stateless_normal([3, 12, DIM], [1, 2])
  with base_layer.step_context(training=True, step=STEP, example_offset=5):
    want, _ = layer.fprop(x, data["paddings"])
  parts, entries, start = [], None, 0
  for length in token_slices.slice_lengths(12, 3):
    cache = token_slices.SliceCache(entries)
    part = token_slices.TokenSlice(tf.constant(start, tf.int64), 12, cache)
    with base_layer.step_context(training=True, step=STEP, example_offset=5, token_slice=part):
      y, _ = layer.fprop(x[:, start:start + length], data["paddings"][:, start:start + length])
    parts.append(y.numpy())
    entries, start = cache.outgoing, start + length
  # key paddings [B, T], keys [B, N, H, T] and values [B, N, T, H]
  assert [e.shape.as_list() for e in cache.outgoing] == [[3, 12], [3, 2, 4, 12], [3, 2, 12, 4]]
  assert_close(np.concatenate(parts, axis=1), want.numpy())


def test_schedules_over_slices_and_their_bubble():
  """gpipe and 1f1b over units (m, j); with F = B the bubble is that of M·S
  micro-batches, (K−1)/(M·S+K−1)."""
  for name in schedule.SLICED_SCHEDULES:
    plan = schedule.make(name, 4, 4, num_token_slices=4)
    assert (plan.num_units, plan.micro_batches, plan.slices) == (16, 4, 4)
    assert plan.bubble(1.0, 1.0, 0.0) == pytest.approx(3 / 19)
  one_f_one_b = schedule.make("1f1b", 3, 2, num_token_slices=2)
  assert str(one_f_one_b).splitlines()[2] == \
      "cell 2: F0.0 F0.1 B0.1 F1.0 B0.0 F1.1 B1.1 B1.0"


@pytest.mark.parametrize("actions, message", [
    (("F1", "F0", "B1", "B0"), "runs F0.1 before F0.0"),
    (("F0", "F1", "B0", "B1"), "runs B0.0 before B0.1"),
])
def test_a_schedule_running_slices_out_of_order_is_refused(actions, message):
  parsed = tuple(schedule.from_lists("bad", [actions]).actions)
  with pytest.raises(schedule.ScheduleError, match=message):
    schedule.PipelineSchedule("bad", 1, 2, parsed, slices=2)


@pytest.mark.parametrize("actions, message", [
    ([("F0", "F1", "B1", "B0"), ("F1", "F0", "B1", "B0")], "cell 1 runs F0.1 before F0.0"),
    ([("F0", "F1", "B0", "B1"), ("F0", "F1", "B1", "B0")], "cell 0 runs B0.0 before B0.1"),
])
def test_a_later_cell_running_slices_out_of_order_is_refused(actions, message):
  with pytest.raises(schedule.ScheduleError, match=message):
    schedule.from_lists("bad", actions, num_token_slices=2)


@pytest.mark.parametrize("name, slices", [
    ("1f1b", -1), ("gpipe", 0), ("gpipe", 2.0), ("gpipe", True), ("zb_h1", 0),
    ("interleaved_1f1b", 0)])
def test_make_names_a_bad_slice_count(name, slices):
  with pytest.raises(schedule.ScheduleError,
                     match=f"num_token_slices must be an int >= 1, got {slices!r}"):
    schedule.make(name, 2, 2, num_token_slices=slices)


def test_make_refuses_slices_on_schedules_that_do_not_run_them():
  for name in ("zb_h1", "interleaved_1f1b"):
    with pytest.raises(schedule.ScheduleError, match=f"schedule '{name}' does not run"):
      schedule.make(name, 2, 2, num_token_slices=2)


@pytest.mark.parametrize("settings, message", [
    (dict(num_token_slices=0), "num_token_slices must be an int >= 1"),
    (dict(num_token_slices=-2), "num_token_slices must be an int >= 1"),
    (dict(num_token_slices=2.0), "num_token_slices must be an int >= 1"),
    (dict(num_token_slices=True), "num_token_slices must be an int >= 1"),
    (dict(num_token_slices=2, token_slice_lengths=[3, 4, 1]),
     r"token_slice_lengths must be None or a list of num_token_slices=2 ints >= 1"),
    (dict(num_token_slices=2, token_slice_lengths=[8, 0]), "token_slice_lengths must be"),
    (dict(num_token_slices=2, token_slice_lengths="4,4"), "token_slice_lengths must be"),
    (dict(num_token_slices=2, schedule="zb_h1"), "schedule must be one of"),
    (dict(num_token_slices=2, schedule="interleaved_1f1b", virtual_stages=2),
     "schedule must be one of"),
])
def test_bad_slice_params_are_named(cpu_devices, settings, message):
  with pytest.raises(gpipe.PipelineError, match=message):
    lm_params(gpipe.PipeliningLayer, num_cells=2, devices=cpu_devices[:2],
              **settings).instantiate()


def test_more_slices_than_tokens_is_named(cpu_devices):
  model = lm_params(gpipe.PipeliningLayer, num_cells=2, num_token_slices=8,
                    devices=cpu_devices[:2]).instantiate()
  data = batch(2, 4)
  with pytest.raises(gpipe.PipelineError, match="num_token_slices=8 must be in 1..4"):
    with base_layer.step_context(training=True, layer_stats=[]):
      train_step.loss_and_gradients(
          train_step.StackWithLoss(model, head),
          {"inputs": (data["ids"], data["paddings"]), "labels": data["labels"],
           "paddings": data["paddings"]}, stacked_variables.trainable_weights(model))


def test_layers_that_are_not_causal_refuse_slices(cpu_devices):
  stack = transformer.encoder_decoder_stack(VOCAB, DIM, 16, 2, 1)
  with pytest.raises(gpipe.PipelineError, match="encoder_000.*TransformerEncoderLayer"):
    gpipe.PipeliningLayer.Params().set(name="stack", layers=stack.layers, num_cells=2,
                                       num_token_slices=2,
                                       devices=cpu_devices[:2]).instantiate()


def test_amoeba_net_refuses_slices(cpu_devices):
  body = amoeba_net.amoeba_net("D", num_normal_cells=3, filters=8, image_size=32,
                               num_classes=10, stem="cifar", stem_filters=16)
  with pytest.raises(gpipe.PipelineError, match=r"causal in the sequence; net/.* is not"):
    gpipe.PipeliningLayer.Params().set(name="net", layers=body.stack.layers, num_cells=2,
                                       num_token_slices=2,
                                       devices=cpu_devices[:2]).instantiate()


def test_the_chart_draws_one_bar_per_slice():
  """A measured step of K=2, M=2, S=2 (the plan's simulated times) drawn: every bar
  numbered m.j, the title counting micro-batches and slices."""
  plan = schedule.make("gpipe", 2, 2, num_token_slices=2)
  times = plan.simulate(1.0, 2.0, 0.0)
  keys = [timeline.SpanKey(k, a.unit, a.phase) for (k, a) in times]
  measured = timeline.MeasuredTimeline.from_spans(np.array(list(times.values())), keys)
  axes = schedule_chart.figure(measured, None, plan).axes[0]
  assert sorted(t.get_text() for t in axes.texts) == sorted(
      f"{m}.{j}" for m in range(2) for j in range(2) for _ in range(2 * 2))
  assert axes.get_title().startswith("K=2 cells, M=2 micro-batches × S=2 token slices")


@EXHAUSTIVE
def test_the_profiler_counts_a_causal_layers_cache():
  """The keys and values [B, N, T, H] and key paddings [B, T] of a causal layer; none
  for a layer that works token by token."""
  specs = (tf.TensorSpec([2, 12, DIM], tf.float32), tf.TensorSpec([2, 12], tf.float32))
  causal = transformer.TransformerLmLayer.Params().set(name="layer", input_dim=DIM,
                                                       hidden_dim=16, num_heads=2)
  softmax = transformer.SoftmaxLogits.Params().set(name="logits", input_dim=DIM,
                                                   vocab_size=VOCAB)
  costs = layer_profiler.measure_layer_costs([causal, softmax], specs, steps=1)
  assert [c.cache_bytes for c in costs] == [4 * (2 * 12 + 2 * 2 * 2 * 12 * 4), 0]


@pytest.mark.parametrize("recompute", ["always", "never"])
def test_the_cost_model_counts_units_and_caches_by_hand(recompute):
  """1f1b, 2 cells of 2 layers, M=2 of 4 examples, S=4: each unit is a quarter of a
  micro-batch (its input, hand-offs and the tensors its forward keeps but the cache),
  while the cache entries a unit's forward keeps span the whole sequence; each cell
  holds the caches of max_cached micro-batches (entries and their gradients) and, in a
  backward, makes two more (the entries it extends, the gradient of those it read).
  Re-materialized, the stash holds a unit's input and the working set is what its
  forward keeps; otherwise the stash holds what the forward keeps."""
  layer = LayerCost(forward_s=1e-3, backward_s=2e-3, weight_bytes=1000, input_bytes=16,
                    kept_bytes=160, batch=2, cache_bytes=48)  # kept_bytes includes the cache
  costs = [layer] * 4
  machine = Machine(2, np.inf, slot_factor=1.0)
  got = planner.predict(costs, machine, 1, (2, 4), 2, recompute, "1f1b", 8,
                        num_token_slices=4)
  # By hand: 1f1b over units warms up with S + K−k−1 forwards (5 on cell 0, 4 on cell
  # 1), its most in flight; each cell caches both micro-batches at once.
  in_flight, cached = [5, 4], [2, 2]
  layout = schedule.make("1f1b", 2, 2, num_token_slices=4)
  assert [layout.max_cached(k) for k in range(2)] == cached
  assert [layout.max_in_flight(k) for k in range(2)] == in_flight
  unit = 4 / 4 / 2  # a unit's share of the profiled batch of 2
  weights, inputs = 2 * 1000 * 4.0, 16 * unit
  cache = 2 * 48 * 4 / 2  # two layers' entries for a micro-batch of 4 sequences
  kept = 2 * (160 - 48) * unit + cache  # a quarter of the tokens, all T keys and values
  stash, working = (inputs, kept) if recompute == "always" else (kept, 0.0)
  batch_inputs = 16 * 8 / 2
  for k in range(2):
    hand_offs = inputs + (inputs if k == 0 else 0.0)  # the inbox, and what cell 0 sends
    assert got.peak_bytes[k] == pytest.approx(
        weights + in_flight[k] * stash + hand_offs + 2 * cached[k] * cache
        + working + 2 * cache + (batch_inputs if k == 0 else 0.0)), k
  assert got.shape.num_token_slices == 4 and "num_token_slices=4" in got.shape.params_override()


def test_the_planner_picks_slices_where_the_bubble_dominates():
  """Two sequences on two cells (M ≤ 2): the fastest two-cell plan slices them, with
  (K−1)/(M·S+K−1) of a bubble."""
  layer = LayerCost(forward_s=1e-2, backward_s=2e-2, weight_bytes=1000, input_bytes=16,
                    kept_bytes=160, batch=1, cache_bytes=48)
  machine = Machine(2, np.inf, slot_factor=1.0, action_overhead_s=1e-5)
  plans = planner.plan([layer] * 4, machine, 2, schedules=("gpipe", "1f1b"),
                       token_slices=(1, 4), top=100)
  two_cells = [p for p in plans if p.shape.num_cells == 2]
  best = two_cells[0]
  assert (best.shape.num_micro_batches, best.shape.num_token_slices) == (2, 4)
  assert best.bubble == pytest.approx(1 / 9)
  unsliced = [p for p in two_cells if p.shape.num_token_slices == 1][0]
  assert best.step_s < unsliced.step_s


def lm_trainer(logdir, overrides: str):
  from lingvo_gpipe import model_registry, trainer
  from lingvo_gpipe.core import hyperparams

  model_registry.load_param_files()
  params = model_registry.get_params("lm.TransformerTiny")
  for name, value in hyperparams.parse_overrides(
      "task.train.save_interval_steps=100;task.train.summary_interval_steps=1;"
      "task.pipeline.num_cells=2;task.pipeline.schedule=1f1b;" + overrides):
    params.set_from_text(name, value)
  return trainer.Trainer(params.freeze(), str(logdir), log=lambda _: None)


@EXHAUSTIVE
def test_the_trainer_with_replicas_and_slices_trains_like_one_unsliced_pipeline(tmp_path):
  """lm.TransformerTiny (dropout, Adam), 32 sequences of 12 tokens: R=2 replicas of
  K=2 cells with M=2 micro-batches of S=3 token slices each gives the losses of one
  K=2 pipeline over M=4 whole micro-batches, and writes its schedule summaries: the
  measured bubble beside GPipe's over replica 0's D = 2 devices and U = M·S = 6 units,
  (D−1)/(U+D−1) = 1/7, and the chart."""
  from conftest import summary_values

  losses = {}
  for name, overrides in (("whole", "task.pipeline.num_micro_batches=4"),
                          ("sliced", "task.pipeline.num_micro_batches=2;"
                                     "task.pipeline.num_token_slices=3;"
                                     "task.pipeline.num_replicas=2")):
    run = lm_trainer(tmp_path / name, overrides)
    losses[name] = []
    run.train(2, on_step=lambda _, v, out=losses[name]: out.append(float(v["loss"])))
  assert_all_close(np.array(losses["sliced"], np.float32),
                   np.array(losses["whole"], np.float32), ulps=TRAINED)
  summaries = summary_values(tmp_path / "sliced" / "train")
  assert summaries["pipeline/bubble_theoretical"] == pytest.approx([1 / 7] * 2)
  assert all(0.0 <= b < 1.0 for b in summaries["pipeline/bubble_measured"])
  assert summaries["pipeline/cells_following_plan"] == [1.0, 1.0]
  assert len(summaries["pipeline/schedule"]) == 2


def test_a_plan_sets_near_equal_slices_and_the_params_as_given_keep_their_lengths():
  """planning.with_plan writes every field of the shape: the planner's shapes plan
  near-equal slices (lengths None); the shape of the params as given
  (PlanShape.from_pipeline, what --plan=check predicts) keeps their lengths."""
  from lingvo_gpipe import planning
  from lingvo_gpipe.core.hyperparams import Params
  from lingvo_gpipe.pipeline.step_model import PlanShape
  from lingvo_gpipe.tasks import base_task

  params = Params()
  params.define("task", Params(), "")
  params.task.define("pipeline", base_task.pipeline_params(), "")
  params.task.pipeline.set(num_token_slices=2, token_slice_lengths=[5, 3])
  planned = PlanShape(1, (2,), 2, "always", "1f1b", num_token_slices=4)
  assert planning.with_plan(params, planned).task.pipeline.token_slice_lengths is None
  own = PlanShape.from_pipeline(params.task.pipeline, (2,))
  assert planning.with_plan(params, own).task.pipeline.token_slice_lengths == [5, 3]
