"""Mixed precision: fprop_dtype (bfloat16, float16) through layers, the pipeline, the
trainer, and dynamic loss scaling, each against a reference computed another way."""

import numpy as np
import pytest
import tensorflow as tf
from conftest import engine_loss_and_grads
from gpipe_test import STEP, inputs, pair_layers
from numerics import HALF_REORDERED, assert_all_close, assert_close
from tiers import EXHAUSTIVE

from lingvo_gpipe import model_registry, train_step, trainer
from lingvo_gpipe.core import base_layer, hyperparams, layers, loss_scale, stacked_variables
from lingvo_gpipe.pipeline.layer import PipeliningLayer

HALF = ["bfloat16", "float16"]


def loss_of(outputs, target):
  """gpipe_test's loss, computed in float32 from outputs in any dtype."""
  out, skip = (tf.cast(t, tf.float32) for t in outputs)
  return tf.reduce_mean(tf.square(out - target)) + 0.1 * tf.reduce_mean(tf.square(skip))


def loss_head(outputs, head_inputs):
  target = head_inputs["target"]
  return {"loss": (loss_of(outputs, target), tf.cast(tf.shape(target)[0], tf.float32))}


def build(dtype, **pipeline):
  cls = PipeliningLayer if pipeline else layers.Sequential
  return cls.Params().set(name="stack", layers=pair_layers(), random_seed=11,
                          fprop_dtype=dtype, **pipeline).instantiate()


def step_loss_and_grads(model, scale=None, head=loss_head):
  """One training step's loss and gradients through TrainStep's path (the pipeline's
  schedule, or tf.gradients of the whole batch), with loss scale `scale`."""
  x, skip, target = inputs()
  return engine_loss_and_grads(model, train_step.StackWithLoss(model, head),
                               {"inputs": (x, skip), "target": target}, STEP, scale)


# -- layers ----------------------------------------------------------------------------


def test_fprop_dtype_is_inherited_and_variables_stay_float32():
  """A task-level fprop_dtype reaches every layer below (Lingvo-style inheritance), a
  layer's own setting wins for it and its children, variables stay float32."""
  p = layers.Sequential.Params().set(name="stack", fprop_dtype="bfloat16", layers=[
      layers.FeedForwardBlock.Params().set(name="ff", input_dim=4, hidden_dim=8),
      layers.Softmax.Params().set(name="softmax", input_dim=4, num_classes=3,
                                  fprop_dtype=tf.float32)])
  stack = p.instantiate()
  dtypes = {layer.path: layer.fprop_dtype for layer in stack.walk()}
  assert dtypes["stack/ff/inner"] == tf.bfloat16
  assert dtypes["stack/softmax"] == tf.float32
  assert {v.dtype for v in stack.variables} == {tf.float32}
  ff_out = stack.layers[0](tf.ones([2, 4]))
  assert ff_out.dtype == tf.bfloat16
  assert stack(tf.ones([2, 4])).dtype == tf.float32  # logits: float32 whatever the dtype


@pytest.mark.parametrize("value", ["float8", "int32", 3])
def test_a_bad_fprop_dtype_is_named(value):
  with pytest.raises(hyperparams.ParamsError, match=r"fprop_dtype .* valid: \['float32', "
                     r"'bfloat16', 'float16', 'float64'\]"):
    layers.Linear.Params().set(name="fc", input_dim=2, output_dim=2,
                               fprop_dtype=value).instantiate()


@pytest.mark.parametrize("dtype", HALF)
def test_each_layer_computes_in_the_dtype_against_a_float32_twin(dtype):
  """Every layer kind with weights, in the half dtype, against the same layer in float32
  on the same inputs (same float32 weights): within a few units of the half dtype's
  eps; outputs in the half dtype (Softmax: float32 logits)."""
  x_img = tf.random.stateless_normal([2, 6, 6, 4], [1, 2])
  x_seq = tf.random.stateless_normal([2, 5, 4], [3, 4])
  cases = [
      (layers.Conv2D.Params().set(filter_shape=(3, 3, 4, 4)), x_img),
      (layers.DepthwiseSeparableConv2D.Params().set(input_dim=4, output_dim=4), x_img),
      (layers.BatchNorm.Params().set(dim=4), x_img),
      (layers.LayerNorm.Params().set(dim=4), x_seq),
      (layers.FeedForwardBlock.Params().set(input_dim=4, hidden_dim=8), x_seq),
      (layers.Softmax.Params().set(input_dim=4, num_classes=3), x_seq),
  ]
  for params, x in cases:
    twin = params.copy().set(name="layer", random_seed=5).instantiate()
    half = params.copy().set(name="layer", random_seed=5, fprop_dtype=dtype).instantiate()
    with base_layer.step_context(training=True):
      want, got = twin(x), half(x)
    expected = tf.float32 if isinstance(half, layers.Softmax) else tf.as_dtype(dtype)
    assert got.dtype == expected, type(half).__name__
    assert_close(tf.cast(got, tf.float32), want, ulps=HALF_REORDERED, dtype=dtype,
                 err_msg=type(half).__name__)


@pytest.mark.parametrize("dtype", HALF)
def test_half_layer_norm_gradient_equals_tensorflows_of_the_float32_arithmetic(dtype):
  """The written-out gradient of a half-dtype layer norm (it keeps no float32 copies)
  against TensorFlow's gradient of the same arithmetic in float32 from the same
  half-dtype input: dx in the dtype, dscale and dbias float32 (float32's bound)."""
  x = tf.cast(tf.random.stateless_normal([3, 5, 16], [7, 8]) * 3.0 + 1.0, dtype)
  dy = tf.cast(tf.random.stateless_normal([3, 5, 16], [9, 10]), dtype)
  scale = tf.random.stateless_normal([16], [1, 1]) + 1.0
  bias = tf.random.stateless_normal([16], [2, 2])
  with tf.GradientTape() as tape:
    tape.watch([x, scale, bias])
    got = layers.half_layer_norm(x, scale, bias, 1e-6)
  got_grads = tape.gradient(got, [x, scale, bias], output_gradients=dy)
  with tf.GradientTape() as tape:
    x32 = tf.cast(x, tf.float32)
    tape.watch([x32, scale, bias])
    mean, variance = tf.nn.moments(x32, axes=[-1], keepdims=True)
    want = (x32 - mean) * tf.math.rsqrt(variance + 1e-6) * scale + bias
  want_grads = tape.gradient(want, [x32, scale, bias], output_gradients=tf.cast(dy, tf.float32))
  assert got.dtype == tf.as_dtype(dtype) and got_grads[0].dtype == tf.as_dtype(dtype)
  assert_close(tf.cast(got, tf.float32), tf.cast(tf.cast(want, dtype), tf.float32),
               ulps=1, dtype=dtype)
  assert_close(tf.cast(got_grads[0], tf.float32), want_grads[0], ulps=1, dtype=dtype)
  assert_all_close(got_grads[1:], want_grads[1:], dtype=np.float32)


def test_dropout_drops_what_float32_drops():
  """Masks are drawn in float32 whatever the dtype: a bfloat16 model drops exactly the
  elements its float32 twin drops."""
  x = tf.ones([6, 40])
  masks = {}
  for dtype in ("float32", "bfloat16", "float16"):
    drop = layers.Dropout.Params().set(name="drop", keep_prob=0.7, fprop_dtype=dtype,
                                       random_seed=2).instantiate()
    with base_layer.step_context(training=True, step=5):
      masks[dtype] = tf.cast(drop(x), tf.float32).numpy() > 0
  np.testing.assert_array_equal(masks["bfloat16"], masks["float32"])
  np.testing.assert_array_equal(masks["float16"], masks["float32"])


# -- the pipeline --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def one_cell():
  """Per half dtype, K=1 and M=4 (the micro-batch arithmetic every K below repeats):
  (shared layer functions, layers traced in the cell)."""
  return {dtype: (step_loss_and_grads(build(dtype, num_cells=1, num_micro_batches=4,
                                            stack_variables=False)),
                  step_loss_and_grads(build(dtype, num_cells=1, num_micro_batches=4,
                                            share_layer_functions=False,
                                            stack_variables=False)))
          for dtype in HALF}


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("pipeline", [
    dict(num_cells=2, schedule="gpipe"),
    dict(num_cells=4, schedule="1f1b", recompute="never"),
    dict(num_cells=4, schedule="zb_h1"),
    dict(num_cells=2, schedule="zb_h1", recompute="never"),
    dict(num_cells=4, schedule="interleaved_1f1b", virtual_stages=2),
    dict(num_cells=4, schedule="zbv", virtual_stages=2),
], ids=["gpipe-k2", "1f1b-k4-never", "zb_h1-k4", "zb_h1-k2-never", "interleaved-k4v2",
        "zbv-k4"])
@EXHAUSTIVE
def test_partitioning_changes_nothing_in_a_half_dtype(cpu_devices, one_cell, dtype, pipeline):
  """K ∈ {2, 4} and every schedule give K=1's loss and gradients with the same M: the
  same micro-batch arithmetic in the same dtype, only placed elsewhere (float32's
  bound; seen equal to the bit). Cells that defer weight gradients (zb_h1) call each
  layer in the cell, not through a shared function, so they compare with K=1 traced
  that way (the two orders of one bfloat16 backward differ by a rounding).

  Weights unstacked: stacked (the default), layers of one kind take their weights as
  tensors of known shape, and Grappler's remapper then fuses some bias-add and
  activation pairs where a cell's graph allows it, so a half dtype's results move by
  a rounding with the cells' composition (equal again with remapping off); the
  stacked pipeline is held to the unpartitioned model's bound below."""
  model = build(dtype, num_micro_batches=4, devices=cpu_devices, stack_variables=False,
                **pipeline)
  loss, grads = step_loss_and_grads(model)
  shared, in_cell = one_cell[dtype]
  want_loss, want_grads = in_cell if pipeline["schedule"] in ("zb_h1", "zbv") and \
      pipeline.get("recompute", "always") == "always" else shared
  assert_close(loss, want_loss)
  assert_all_close(grads, want_grads, dtype=np.float32)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("pipeline", [
    pytest.param(dict(num_cells=2), id="gpipe-k2"),
    pytest.param(dict(num_cells=4, schedule="zb_h1"), id="zb_h1-k4", marks=EXHAUSTIVE)])
def test_the_pipeline_equals_the_unpartitioned_model_in_its_dtype(cpu_devices, dtype,
                                                                  pipeline):
  """M=4 (weights stacked) against the unpartitioned model in the same dtype
  differentiated by a GradientTape: within HALF_REORDERED units of the dtype's eps
  (see its comment); and the float32 model is farther than that, so the comparison
  sees the dtype."""
  pipelined = step_loss_and_grads(build(dtype, num_micro_batches=4, devices=cpu_devices,
                                        **pipeline))
  x, skip, target = inputs()
  reference = build(dtype)
  with tf.GradientTape() as tape:
    with base_layer.step_context(training=True, step=tf.constant(STEP, tf.int64)):
      loss = loss_of(reference(x, skip), target)
  grads = tape.gradient(loss, reference.trainable_variables)
  assert_close(pipelined[0], loss.numpy(), ulps=HALF_REORDERED, dtype=dtype)
  assert_all_close(pipelined[1], [g.numpy() for g in grads], ulps=HALF_REORDERED,
                   dtype=dtype)
  float32 = step_loss_and_grads(build("float32", num_micro_batches=4, devices=cpu_devices,
                                      **pipeline))
  with pytest.raises(AssertionError):
    assert_all_close(float32[1], pipelined[1], dtype=np.float32)


def traced_step_graph(model):
  x, skip, target = inputs()
  wrapped = train_step.StackWithLoss(model, loss_head)

  @tf.function
  def step():
    with base_layer.step_context(training=True, step=tf.constant(STEP, tf.int64),
                                 layer_stats=[], spans=[]):
      return train_step.loss_and_gradients(
          wrapped, {"inputs": (x, skip), "target": target},
          stacked_variables.trainable_weights(model))

  return step.get_concrete_function().graph.as_graph_def()


def handoff_dtypes(graph_def) -> set:
  """The dtypes of every Send and Recv in the step's functions (the hand-offs)."""
  found = set()
  for function in graph_def.library.function:
    for node in function.node_def:
      if node.op == "Send":
        found.add(tf.as_dtype(node.attr["T"].type))
      elif node.op == "Recv":
        found.add(tf.as_dtype(node.attr["tensor_type"].type))
  return found


@pytest.mark.parametrize("dtype, schedule", [("bfloat16", "1f1b"), ("float16", "zb_h1"),
                                             ("float32", "gpipe")])
def test_handoffs_and_stash_are_in_the_compute_dtype_and_sums_float32(cpu_devices, dtype,
                                                                      schedule):
  """The traced step: every Send/Recv between the cells carries the compute dtype
  (activations forward, their gradients back), every stashed input and deferred
  product is in it, and the running gradient sums and the variables are float32."""
  model = build(dtype, num_cells=2, num_micro_batches=4, devices=cpu_devices,
                schedule=schedule)
  graph_def = traced_step_graph(model)
  assert handoff_dtypes(graph_def) == {tf.as_dtype(dtype)}
  for cell in model.cell_functions(train_step.StackWithLoss(model, loss_head).head):
    for sig in cell._signatures.values():  # noqa: SLF001
      kept = [s.dtype for s in [*sig.saved.flat(), *sig.products.inputs, *sig.products.grads]
              if s.dtype.is_floating]
      assert set(kept) <= {tf.as_dtype(dtype)}, kept
      assert {spec.dtype for spec in sig.layout.specs()} == {tf.float32}
  assert {v.dtype for v in model.variables} == {tf.float32}


# -- loss scaling ------------------------------------------------------------------------------


@pytest.mark.parametrize("pipelined", [True, False])
def test_a_loss_scale_changes_no_gradient(cpu_devices, pipelined):
  """S = 2^10 (a power of two: scaling is exact) gives the unscaled loss and gradients:
  the pipeline's seeds and its division by S, or tf.gradients of S·loss divided by S
  (seen equal to the bit pipelined, 1 ulp apart unpipelined: Grappler folds S in)."""
  pipeline = dict(num_cells=2, num_micro_batches=3, devices=cpu_devices) if pipelined else {}
  plain = step_loss_and_grads(build("float32", **pipeline))
  scaled = step_loss_and_grads(build("float32", **pipeline), scale=tf.constant(1024.0))
  # (the loss is computed before S seeds the backward: only the gradients can differ)
  assert_all_close(scaled[1], plain[1])


@EXHAUSTIVE
def test_float16_gradients_underflow_without_a_loss_scale(cpu_devices):
  """The reason for scaling: with the loss multiplied by 1e-8, float16 gradients
  (smallest 6e-8) flush to zero unscaled, and a scale of 2^24 brings float32's back
  (within float16's precision)."""
  def tiny_head(outputs, head_inputs):
    metrics = loss_head(outputs, head_inputs)
    return {"loss": (metrics["loss"][0] * 1e-8, metrics["loss"][1])}

  def grads(dtype, scale=None):
    model = build(dtype, num_cells=2, num_micro_batches=2, devices=cpu_devices)
    return step_loss_and_grads(model, scale, tiny_head)[1]

  want = grads("float32")
  unscaled = grads("float16")
  assert sum(np.count_nonzero(g) for g in unscaled) < 0.5 * sum(g.size for g in want)
  scaled = grads("float16", tf.constant(2.0 ** 24))
  assert_all_close(scaled, want, ulps=HALF_REORDERED * 4, dtype=np.float16)


def test_the_dynamic_scale_halves_on_overflow_and_doubles_after_good_steps():
  """The rule against a hand-worked sequence (growth_interval 2, min_scale 4)."""
  params = loss_scale.loss_scale_params().set(initial_scale=16.0, growth_interval=2,
                                             min_scale=4.0)
  scale = loss_scale.DynamicLossScale(params)
  seen = [float(scale.update(tf.constant(finite)))
          for finite in (True, True, True, False, False, False, True, True)]
  assert seen == [16.0, 32.0, 32.0, 16.0, 8.0, 4.0, 4.0, 8.0]


@pytest.mark.parametrize("settings, message", [
    ("mode='always'", r"loss_scale.mode must be one of \('auto', 'dynamic', 'off'\), "
                      "got 'always'"),
    ("growth_interval=0", "growth_interval must be an int >= 1, got 0"),
    ("initial_scale=-1.0", "initial_scale must be a finite number > 0, got -1.0"),
    ("initial_scale=2.0;min_scale=4.0", r"initial_scale \(2.0\) must be >= min_scale"),
])
def test_bad_loss_scale_params_are_named(settings, message):
  params = loss_scale.loss_scale_params()
  for key, value in hyperparams.parse_overrides(settings):
    params.set_from_text(key, value)
  with pytest.raises(hyperparams.ParamsError, match=message):
    loss_scale.check_loss_scale_params(params)


def make_trainer(logdir, overrides: str, logs: list | None = None,
                 model: str = "lm.TransformerTiny"):
  model_registry.load_param_files()
  params = model_registry.get_params(model)
  for key, value in hyperparams.parse_overrides(
      "task.pipeline.num_cells=2;task.pipeline.num_micro_batches=2;"
      "task.train.save_interval_steps=2;" + overrides):
    params.set_from_text(key, value)
  log = logs.append if logs is not None else (lambda _: None)
  return trainer.Trainer(params.freeze(), str(logdir), log=log)


@EXHAUSTIVE
def test_float16_overflow_skips_the_step_halves_the_scale_and_resumes_it(tmp_path):
  """TransformerTiny in float16 from a scale of 2^40: the first steps overflow and are
  skipped (global step unchanged, scale halved each time, said in the log) until the
  gradients fit; the checkpoint holds only finite values and the scale; a resumed
  run restores the scale and the good-step count."""
  logs: list = []
  run = make_trainer(tmp_path, "task.fprop_dtype='float16';"
                   "task.train.loss_scale.initial_scale=1099511627776.0", logs)
  run.train(2)
  skips = [line for line in logs if "gradient overflow" in line]
  assert skips and skips[0].startswith("step 1:"), logs
  scale = float(run.loss_scale.scale.numpy())
  assert 1.0 <= scale <= 2.0 ** 40 / 2 ** len(skips)
  assert int(run.global_step.numpy()) == 2
  reader = tf.train.load_checkpoint(run.checkpoints.latest)
  assert reader.get_tensor("loss_scale/scale/.ATTRIBUTES/VARIABLE_VALUE") == scale
  floats = [name for name, dtype in reader.get_variable_to_dtype_map().items()
            if dtype.is_floating]
  assert len(floats) > 20
  for name in floats:
    assert np.all(np.isfinite(reader.get_tensor(name))), name
  resumed = make_trainer(tmp_path, "task.fprop_dtype='float16'")
  assert resumed.restore_latest() == 2
  assert float(resumed.loss_scale.scale.numpy()) == scale
  assert int(resumed.loss_scale.good_steps.numpy()) == int(run.loss_scale.good_steps.numpy())


def test_bfloat16_and_float32_runs_have_no_loss_scale(tmp_path):
  """auto: no scale without a float16 layer (checkpoints as before)."""
  for dtype in ("bfloat16", "float32"):
    run = make_trainer(tmp_path / dtype, f"task.fprop_dtype='{dtype}'")
    assert run.loss_scale is None
  forced = make_trainer(tmp_path / "forced", "task.train.loss_scale.mode='dynamic'")
  assert forced.loss_scale is not None


@EXHAUSTIVE
def test_data_and_pipeline_parallel_in_bfloat16_equal_one_pipeline(tmp_path):
  """TinyConvNet (convolutions, batch norm) in bfloat16 through the trainer: R=2 ×
  (K=2, M=2) makes R=1 × (K=2, M=4)'s micro-batches of the same 32 examples, so its
  first loss and the weights, slots and batch-norm statistics after one step equal
  R=1's (float32 sums all-reduced instead of summed: float32's bound)."""
  common = "task.fprop_dtype='bfloat16';"
  single = make_trainer(tmp_path / "r1", common + "task.pipeline.num_micro_batches=4",
                        model="demo.TinyConvNet")
  replicated = make_trainer(tmp_path / "r2", common + "task.pipeline.num_replicas=2",
                            model="demo.TinyConvNet")
  losses = [run.train(1)["loss"] for run in (single, replicated)]
  assert_close(losses[1], losses[0])
  want = single.train_step.checkpointed_variables()
  got = replicated.train_step.checkpointed_variables()
  assert [v.name for v in got] == [v.name for v in want]
  assert_all_close([v.numpy() for v in got], [v.numpy() for v in want])


@EXHAUSTIVE
def test_the_profile_counts_inputs_in_the_compute_dtype():
  """The partitioner's and planner's costs (layer_profiler): a bfloat16 layer's input
  is counted at half float32's bytes (the pipeline casts it before it is stashed), its
  weights at float32's (master weights), and it keeps fewer bytes for its backward."""
  from lingvo_gpipe.pipeline import layer_profiler

  spec = tf.TensorSpec([16, 64], tf.float32)
  costs = {dtype: layer_profiler.measure_layer_costs(
      [layers.Linear.Params().set(name="fc", input_dim=64, output_dim=64, activation="TANH",
                                  fprop_dtype=dtype)], spec, steps=1)[0]
      for dtype in ("float32", "bfloat16")}
  assert costs["bfloat16"].input_bytes * 2 == costs["float32"].input_bytes
  assert costs["bfloat16"].weight_bytes == costs["float32"].weight_bytes
  assert costs["bfloat16"].kept_bytes < costs["float32"].kept_bytes
