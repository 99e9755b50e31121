"""The chunked per-variable work of a step leaves nothing of its variables behind."""

import gc

import numpy as np
import tensorflow as tf

from lingvo_gpipe.core import variable_chunks

MIB = 2**20
# What a few small tensors of the traces take (the BFC allocator counts them too; the
# default CPU allocator only buffers of 256 KiB or more): far under one variable here.
SMALL = MIB // 4


def held_bytes() -> int:
  gc.collect()
  return tf.config.experimental.get_memory_info("CPU:0")["current"]


def test_a_module_level_function_traced_with_variables_keeps_them_alive(cpu_allocator_stats):
  """The TensorFlow behaviour `variable_chunks._all_finite` works around (seen on 2.21):
  the first variables a module-level tf.function is traced with stay allocated after
  every Python reference to them is gone; their resource handles do not. Fails (and
  the workaround can go) when TensorFlow stops keeping them."""
  @tf.function(autograph=False)
  def by_variable(variables):
    return tf.add_n([tf.reduce_sum(v.read_value()) for v in variables])

  @tf.function(autograph=False)
  def by_handle(handles):
    return tf.add_n([tf.reduce_sum(tf.raw_ops.ReadVariableOp(resource=h, dtype=tf.float32))
                     for h in handles])

  def call(function, as_handles):
    variables = [tf.Variable(tf.zeros([512, 512])) for _ in range(2)]  # 1 MiB each
    function([v.handle for v in variables] if as_handles else variables)

  before = held_bytes()
  call(by_handle, True)
  assert held_bytes() - before < SMALL  # (a kept variable here is 1 MiB or more)
  call(by_variable, False)
  assert held_bytes() - before >= 2 * MIB


def test_the_finite_check_and_the_norm_release_their_variables(cpu_allocator_stats):
  """A calibration's variables (planning, before training) must not stay in the
  trainer's memory: after global_norm and all_finite over variables that then go out
  of scope, the allocator holds what it held before."""
  def check():
    # (a shape no other test traces: the first trace is the one that would keep them)
    variables = [tf.Variable(tf.ones([509, 521]) * i) for i in range(3)]
    assert bool(variable_chunks.all_finite(variables))
    norm = variable_chunks.global_norm([v.read_value() for v in variables], variables)
    assert norm.numpy() > 0

  before = held_bytes()
  check()
  assert held_bytes() - before < SMALL  # (a kept variable here is 1 MiB or more)


def test_the_finite_check_reads_each_shape_and_finds_a_nan():
  """Chunks of several shapes and ranks in one check (each traced for its own shape),
  a NaN in any of them found; numpy is the reference."""
  values = [np.ones([3, 4, 5]), np.ones([6, 7]), np.ones([2]), np.ones([6, 7])]
  variables = [tf.Variable(v, dtype=tf.float32) for v in values]
  assert bool(variable_chunks.all_finite(variables))
  for i, v in enumerate(variables):
    poisoned = values[i].copy()
    poisoned.flat[-1] = np.nan
    v.assign(poisoned)
    assert not bool(variable_chunks.all_finite(variables)), i
    v.assign(values[i])


def test_the_finite_check_finds_each_kind_of_non_finite_value_in_each_dtype():
  """+inf, −inf, both at once (their sum is NaN) and NaN, in float32, float64,
  bfloat16 and float16 (checked element by element: a float16 sum overflows at
  65504); finite values large enough to overflow a float16 sum pass. numpy is the
  reference."""
  for dtype in (tf.float32, tf.float64, tf.bfloat16, tf.float16):
    base = np.full([64, 33], 60000.0 if dtype == tf.float16 else 1.0)
    variable = tf.Variable(base, dtype=dtype)
    assert bool(variable_chunks.all_finite([variable])), dtype
    for bad in ([np.inf], [-np.inf], [np.inf, -np.inf], [np.nan]):
      poisoned = base.copy()
      poisoned.flat[:len(bad)] = bad
      variable.assign(tf.cast(poisoned, dtype))
      assert not np.isfinite(poisoned).all()
      assert not bool(variable_chunks.all_finite([variable])), (dtype, bad)


def test_the_global_norm_equals_numpys_in_each_dtype():
  """√(Σ‖t‖²) over tensors of several shapes and dtypes (float16 values whose squares
  overflow float16: summed in float32), against numpy in float64, to float32's
  rounding of the sum."""
  rng = np.random.default_rng(0)
  values = [rng.normal(size=[17, 5]) * 300, rng.normal(size=[4]), rng.normal(size=[3, 3, 3])]
  for dtype in (tf.float32, tf.bfloat16, tf.float16):
    variables = [tf.Variable(v, dtype=dtype) for v in values]
    tensors = [v.read_value() for v in variables]
    expected = np.sqrt(sum(np.sum(np.square(t.numpy().astype(np.float64))) for t in tensors))
    norm = variable_chunks.global_norm(tensors, variables).numpy()
    np.testing.assert_allclose(norm, expected, rtol=1e-5)
