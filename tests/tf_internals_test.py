"""An upgrade tripwire: the TensorFlow behaviours the engine relies on beyond the
documented API (lingvo_gpipe/core/tf_internals.py) were checked on this minor
version, and a test here pins each (items 1, 3 to 10; item 2 is a timing)."""

import numpy as np
import tensorflow as tf
from numerics import assert_close
from tensorflow.python.eager import context
from tiers import EXHAUSTIVE

from lingvo_gpipe.core import layers, tf_internals
from lingvo_gpipe.pipeline import channels


def test_the_tensorflow_internals_were_checked_on_this_version():
  """A patch release passes; a new minor version fails until it has been checked."""
  minor = ".".join(tf.__version__.split(".")[:2])
  assert minor == tf_internals.TENSORFLOW_CHECKED, (
      f"TensorFlow is {tf.__version__}; the tricks in tf_internals.py were checked on "
      f"{tf_internals.TENSORFLOW_CHECKED}. On a new minor version, re-check each numbered "
      "item of tf_internals.py's docstring with the tests named beside it (this file, "
      "tests/pipeline_graph_test.py, tests/hybrid_test.py, tests/loopback_test.py, the "
      "recompute=never rows of tests/gpipe_test.py; item 2 with bench/startup_time.py), "
      f"then set TENSORFLOW_CHECKED to {minor!r}")


def _executed_graphs(fn, *args) -> list:
  """The partition graphs TensorFlow runs for one call of `fn`, after its rewrites
  (inlining, Grappler)."""
  ctx = context.context()
  ctx.enable_graph_collection()
  try:
    fn(*args)
    metadata = ctx.export_run_metadata()
  finally:
    ctx.disable_graph_collection()
  return [g for f in metadata.function_graphs for g in f.partition_graphs]


def test_calls_marked_not_inlined_stay_calls():
  """Item 1: in the graph TensorFlow runs, calls of functions marked NOT_INLINED stay
  calls, also with Grappler's function optimizer off (the engine turns it off, item 2);
  unmarked, the same calls are inlined (and the sine both compute is merged)."""
  tf_internals.disable_function_specialization()

  def outer_calling(attributes):
    @tf.function(experimental_attributes=attributes, autograph=False)
    def forward(x):
      return tf.sin(x) * 3.0

    @tf.function(experimental_attributes=attributes, autograph=False)
    def recompute(x):  # the same sine, as a backward's recompute would compute it
      return tf.sin(x) * 3.0 + 1.0

    return tf.function(lambda x: forward(x) + recompute(x), autograph=False)

  def ops_run(attributes) -> list[str]:
    graphs = _executed_graphs(outer_calling(attributes), tf.ones([3]))
    # the outer function's graph: the one that adds the two results
    (graph,) = [g for g in graphs if any(n.op == "AddV2" for n in g.node)]
    return [n.op for n in graph.node]

  marked = ops_run(tf_internals.NOT_INLINED)
  assert marked.count("PartitionedCall") == 2 and "Sin" not in marked, marked
  unmarked = ops_run(None)
  assert "PartitionedCall" not in unmarked and "Sin" in unmarked, unmarked


def test_sends_and_receives_in_two_device_loops_match_first_in_first_out(cpu_devices):
  """Item 3 and 4: a loop per device, kept functional; the i-th Recv of a name gets the
  i-th Send, across iterations; the Recv sits in a Case branch some iterations skip."""
  sender, receiver = (channels.full_device_name(d) for d in cpu_devices[:2])
  num = 5

  @tf.function
  def step():
    with tf.device(cpu_devices[0]):
      def send_body(i):
        tf_internals.send(tf.cast(i, tf.float32) * 10.0, "pin/link", sender, 0, receiver)
        return i + 1
      tf_internals.unlowered(lambda: tf.while_loop(lambda i: i < num, send_body, [0]))
    with tf.device(cpu_devices[1]):
      def receive_body(i, got):
        def receive():
          return got.write(i, tf_internals.recv(tf.TensorSpec([], tf.float32), "pin/link",
                                                sender, 0, receiver))
        def wait():  # an iteration that receives nothing: its branch is not run
          return got.write(i, -1.0)
        return i + 1, tf_internals.unlowered(lambda: tf.switch_case(
            tf.minimum(i % 2, 1), [receive, wait]))
      _, got = tf_internals.unlowered(lambda: tf.while_loop(
          lambda i, _: i < 2 * num, receive_body, [0, tf.TensorArray(tf.float32, 2 * num)]))
    return got.stack()

  graph = step.get_concrete_function().graph
  loops = [op for op in graph.get_operations() if op.type in ("While", "StatelessWhile")]
  assert len(loops) == 2 and not any(op.get_attr("_lower_using_switch_merge") for op in loops)
  np.testing.assert_array_equal(step().numpy()[0::2], [0.0, 10.0, 20.0, 30.0, 40.0])


def test_forward_backward_pair_gives_the_gradient():
  """Item 5: the forward's kept intermediates and the backward reproduce a tape's
  gradients, for the arguments and the captured variables (a dense one, a gathered one)."""
  rng = np.random.RandomState(0)
  w = tf.Variable(rng.randn(3, 4).astype(np.float32))
  table = tf.Variable(rng.randn(10, 3).astype(np.float32))

  @tf.function(experimental_attributes=tf_internals.NOT_INLINED, autograph=False)
  def f(ids, x):
    h = tf.tanh(tf.matmul(x * tf.gather(table, ids), w))
    return [h, tf.reduce_sum(h * h)]

  ids, x = tf.constant([1, 2, 1]), tf.constant(rng.randn(3, 3).astype(np.float32))
  seed = tf.constant(rng.randn(3, 4).astype(np.float32))

  @tf.function
  def by_pair():
    pair = tf_internals.forward_backward_pair(f.get_concrete_function(ids, x))
    outputs, kept = pair.forward([ids, x])
    grads = pair.backward([seed, tf.constant(2.0)], kept)
    by_capture = {id(c): g for c, g in zip(pair.captured_inputs, grads[2:])}
    return (outputs, grads[1], tf.convert_to_tensor(by_capture[id(w.handle)]),
            tf.convert_to_tensor(by_capture[id(table.handle)]))

  with tf.GradientTape() as tape:
    tape.watch(x)
    h, square = f(ids, x)
    loss = tf.reduce_sum(h * seed) + 2.0 * square
  want = tape.gradient(loss, [x, w, table])
  outputs, *got = by_pair()
  assert_close(outputs[0].numpy(), h.numpy())
  for g, ref in zip(got, want):
    assert_close(g.numpy(), tf.convert_to_tensor(ref).numpy())


def test_this_process_has_a_host_address_space():
  """Item 6: the prefix of this process's full device names."""
  assert tf_internals.host_address_space() == "/job:localhost/replica:0/task:0"
  assert channels.full_device_name("/device:CPU:1") == (
      "/job:localhost/replica:0/task:0/device:CPU:1")


def test_collective_reduce_is_a_mean_ordered_per_device(cpu_devices):
  """Item 7: CollectiveReduceV2 (Add, Div) gives every device of the group the mean;
  with an ordering token on each op's device, the automatic control dependencies
  leave the two devices' ops unchained (without, the second would wait for the first:
  the deadlock), and a second call reuses the group and instance keys."""
  devices = cpu_devices[2:4]
  rng = np.random.RandomState(0)
  values = [rng.randn(2, 3).astype(np.float32) for _ in devices]
  tokens = []
  for device in devices:
    with tf.device(device):
      tokens.append(tf.Variable(0.0, trainable=False))

  def all_reduce(with_tokens: bool):
    def reduce():
      results = []
      for device, value, token in zip(devices, values, tokens):
        with tf.device(device):
          results.append(tf.raw_ops.CollectiveReduceV2(
              input=tf.constant(value), group_size=len(devices), group_key=7_000_001,
              instance_key=1, ordering_token=[token.handle] if with_tokens else [],
              merge_op="Add", final_op="Div"))
      return results
    return tf.function(reduce, autograph=False)

  def control_inputs(fn) -> list[list[str]]:
    ops = [op for op in fn.get_concrete_function().graph.get_operations()
           if op.type == "CollectiveReduceV2"]
    return [[c.name for c in op.control_inputs if c in ops] for op in ops]

  ordered = all_reduce(with_tokens=True)
  assert control_inputs(ordered) == [[], []]
  assert control_inputs(all_reduce(with_tokens=False))[1]  # chained (traced, not run)
  for _ in range(2):
    for got in ordered():
      assert_close(got.numpy(), np.mean(values, axis=0))


_PHILOX_MULTIPLIERS = (0xD2511F53, 0xCD9E8D57)
_PHILOX_KEY_STEPS = (0x9E3779B9, 0xBB67AE85)


def _philox_4x32_10(key: tuple[int, int], counter: int) -> list[int]:
  """The four 32-bit words of Philox-4x32-10 (Salmon et al. 2011) for a 128-bit
  counter whose low 64 bits are `counter` and high 64 bits are 0."""
  mask = 0xFFFFFFFF
  c = [counter & mask, counter >> 32, 0, 0]
  k0, k1 = key
  for _ in range(10):
    p0, p1 = _PHILOX_MULTIPLIERS[0] * c[0], _PHILOX_MULTIPLIERS[1] * c[2]
    c = [(p1 >> 32) ^ c[1] ^ k0, p1 & mask, (p0 >> 32) ^ c[3] ^ k1, p0 & mask]
    k0, k1 = (k0 + _PHILOX_KEY_STEPS[0]) & mask, (k1 + _PHILOX_KEY_STEPS[1]) & mask
  return c


def _philox_uniform(key: int, start: int, num: int) -> np.ndarray:
  """float32 elements start .. start+num-1 of the stream: word i mod 4 of counter
  block i div 4, its low 23 bits as the mantissa of a float in [1, 2), minus 1."""
  words = [w for block in range(start // 4, (start + num + 3) // 4 + 1)
           for w in _philox_4x32_10((key & 0xFFFFFFFF, key >> 32), block)]
  words = np.array(words, np.uint32)[start % 4:start % 4 + num]
  return ((words & np.uint32(0x7FFFFF)) | np.uint32(0x3F800000)).view(np.float32) - 1.0


def test_philox_counter_layout_of_position_keyed_masks():
  """Item 9: StatelessRandomUniformV2 with the counter [c, 0] draws the stream from
  block c on, four float32 elements per block, as Philox computed in numpy; so
  position_keyed_uniform's rows at any offset are that stream's elements there."""
  seed = tf.constant([12345, 678], tf.int64)
  key, _ = tf.raw_ops.StatelessRandomGetKeyCounter(seed=seed)
  drawn = tf.raw_ops.StatelessRandomUniformV2(
      shape=[10], key=key, counter=tf.constant([5, 0], tf.uint64), alg=1, dtype=tf.float32)
  key = int(key.numpy()[0])
  np.testing.assert_array_equal(drawn.numpy(), _philox_uniform(key, 4 * 5, 10))
  rows, columns, offset = 4, 3, 3  # starts at element 9: block 2, one element in
  got = layers.position_keyed_uniform(tf.constant([rows, columns]), seed, offset)
  np.testing.assert_array_equal(
      got.numpy(), _philox_uniform(key, offset * columns, rows * columns).reshape(rows, 3))


def _call_configs(graph_def) -> list:
  """The ConfigProto in each function call op of a graph and its library."""
  from tensorflow.core.protobuf import config_pb2

  nodes = list(graph_def.node) + [n for f in graph_def.library.function for n in f.node_def]
  return [config_pb2.ConfigProto.FromString(n.attr["config_proto"].s) for n in nodes
          if n.op in ("PartitionedCall", "StatefulPartitionedCall")]


# Run in a process of its own: the function optimizer is a process-wide setting, and
# this test process has it off (item 2) once any pipeline has been built.
SPECIALIZATION_PROBE = r"""
import json, sys
import tensorflow as tf
from tensorflow.python.eager import context
from lingvo_gpipe.core import tf_internals
if sys.argv[1] == "off":
  tf_internals.disable_function_specialization()

@tf.function(experimental_attributes=tf_internals.NOT_INLINED, autograph=False)
def cell(x, k):
  return x * k

@tf.function(autograph=False)
def step(x):  # two call sites, each with a constant input
  return cell(x, tf.constant(2.0)) + cell(x, tf.constant(3.0))

ctx = context.context()
ctx.enable_graph_collection()
step(tf.ones([3]))
metadata = ctx.export_run_metadata()
print(json.dumps(sorted({n.attr["f"].func.name for f in metadata.function_graphs
                         for g in f.partition_graphs for n in g.node if "f" in n.attr})))
"""


@EXHAUSTIVE
def test_function_specialization_copies_a_body_per_call_site_unless_disabled(tmp_path):
  """Item 2: with Grappler's function optimizer on (TensorFlow's default), each call
  site of a function with a constant input runs a specialized copy of the body (a
  cell called per micro-batch: layers × micro-batches copies to instantiate);
  after `disable_function_specialization()` every call runs the one body."""
  import json
  import subprocess
  import sys

  script = tmp_path / "probe.py"
  script.write_text(SPECIALIZATION_PROBE)

  def called(setting: str) -> list[str]:
    done = subprocess.run([sys.executable, str(script), setting], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])

  on = called("on")
  assert len(on) == 2 and all("_specialized_for_" in name for name in on), on
  off = called("off")
  assert len(off) == 1 and "_specialized_for_" not in off[0], off


def test_step_options_reach_nested_calls():
  """Item 8: calls traced under step_options carry its Grappler settings (TensorFlow
  optimizes each function it instantiates with its call's settings); calls traced
  after it do not."""
  inner = tf.function(lambda x: x * 2.0)
  outer = tf.function(lambda x: inner(x) + 1.0)
  spec = tf.TensorSpec([3], tf.float32)
  with tf_internals.step_options():
    tuned = _call_configs(outer.get_concrete_function(spec).graph.as_graph_def())
    assert float(tf.reduce_sum(outer(tf.ones([3])))) == 9.0
  other = tf.function(lambda x: inner(x) - 1.0)
  plain = _call_configs(other.get_concrete_function(spec).graph.as_graph_def())
  assert tuned and plain
  for config in tuned:
    rewrites = config.graph_options.rewrite_options
    for field, value in tf_internals.STEP_REWRITES.items():
      assert getattr(rewrites, field) == value, field
  for config in plain:
    assert not config.graph_options.rewrite_options.disable_tfg_optimizer


def test_inplace_add_writes_into_its_input():
  """Item 10: InplaceAdd returns its input's buffer with the rows added (the input
  itself changes), while a DeepCopy taken before stays as it was; in a traced
  function the chain of adds on a copy gives the plain sum."""
  x = tf.zeros([3, 2])
  copy = tf.raw_ops.DeepCopy(x=x)
  y = tf.raw_ops.InplaceAdd(x=copy, i=[1], v=tf.ones([1, 2]))
  np.testing.assert_array_equal(copy.numpy(), [[0, 0], [1, 1], [0, 0]])  # written into
  np.testing.assert_array_equal(y.numpy(), copy.numpy())
  np.testing.assert_array_equal(x.numpy(), np.zeros([3, 2]))

  @tf.function
  def chained(total, rows):
    total = tf.raw_ops.DeepCopy(x=total)
    for i in reversed(range(3)):
      total = tf.raw_ops.InplaceAdd(x=total, i=[i], v=rows[i][None])
    return total

  start = tf.constant([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
  rows = [tf.constant([float(i), 10.0 * i]) for i in range(3)]
  for _ in range(2):  # the constant start is not written into: the second call agrees
    np.testing.assert_array_equal(chained(start, rows).numpy(),
                                  start.numpy() + np.stack([r.numpy() for r in rows]))


def test_unstacking_a_variable_read_copies_nothing(cpu_allocator_stats):
  """Item 11: the rows of an unstacked variable read [16, 256, 256] (256 KiB each)
  take no new memory, eagerly and inside a function; a row-by-row product does (the
  allocator's count works)."""
  def allocated() -> int:
    return tf.config.experimental.get_memory_info("CPU:0")["current"]

  stack = tf.Variable(tf.random.normal([16, 256, 256]))
  value = stack.read_value()
  before = allocated()
  rows = tf.unstack(value)
  assert allocated() - before < 256 * 1024
  doubled = [row * 2.0 for row in rows]
  assert allocated() - before >= 16 * 256 * 1024
  del rows, doubled

  @tf.function
  def row_sums():
    return tf.stack([tf.reduce_sum(row) for row in tf.unstack(stack.read_value())])

  row_sums()
  before = allocated()
  tf.config.experimental.reset_memory_stats("CPU:0")
  # (a row's sum of 65,536 normals can cancel to near 0: compared at the sums' scale)
  assert_close(row_sums().numpy(), stack.numpy().sum(axis=(1, 2)))
  assert tf.config.experimental.get_memory_info("CPU:0")["peak"] - before < 256 * 1024


def test_kernel_registry_matches_type_constraints():
  """tf_internals item 13: TensorFlow's matcher, on this build's CPU kernels."""
  node = tf.compat.v1.NodeDef(name="m", op="MatMul", device="/device:CPU:0")
  node.attr["T"].type = tf.float32.as_datatype_enum
  assert tf_internals.registered_kernel(node)
  node.attr["T"].type = tf.string.as_datatype_enum
  assert tf_internals.registered_kernel(node) == b""


def test_a_loop_body_runs_on_the_loops_device_and_a_call_keeps_its_own(cpu_devices, tmp_path):
  """tf_internals item 16, from what executed: an op of a While's body that names
  another device runs on the loop's device; inside a function call it runs where it
  names (placement_audit walks bodies so; device_loop's host clock relies on it)."""
  from pipeline_placement_test import executed_ops

  @tf.function(experimental_attributes=tf_internals.NOT_INLINED, autograph=False)
  def elsewhere(x):
    with tf.device(cpu_devices[2]):
      return tf.math.cos(x, name="called_elsewhere")

  def step(call: bool):
    @tf.function
    def fn(x):
      with tf.device(cpu_devices[1]):
        def body(i, x):
          if call:
            return i + 1, elsewhere(x)
          with tf.device(cpu_devices[2]):
            return i + 1, tf.math.sin(x, name="named_elsewhere")
        return tf_internals.unlowered(lambda: tf.while_loop(
            lambda i, _: i < 2, body, (tf.constant(0), x)))
    return lambda: fn(tf.constant(1.0))

  def ran_on(call: bool, op_type: str) -> set:
    ran = executed_ops(step(call), str(tmp_path / f"dump_{call}"))
    return {tf.DeviceSpec.from_string(d).device_index for _, _, t, d in ran if t == op_type}

  loop, named = (tf.DeviceSpec.from_string(d).device_index for d in cpu_devices[1:3])
  assert ran_on(call=False, op_type="Sin") == {loop}
  assert ran_on(call=True, op_type="Cos") == {named}


def _bytes_held_after_two_calls(zeros) -> int:
  """Allocator bytes a loop whose state starts at `zeros([512, 512], tf.float32, step)`
  (1 MiB) holds after two calls: a constant the function keeps, beyond its results
  (freed)."""
  def allocated() -> int:
    return tf.config.experimental.get_memory_info("CPU:0")["current"]

  @tf.function
  def loop(x, step):
    state = tf.experimental.Optional.from_value((zeros([512, 512], tf.float32, step),))

    def body(i, state):
      (value,) = state.get_value()
      return i + 1, tf.experimental.Optional.from_value((value + x,))

    _, state = tf.while_loop(lambda i, _: i < 3, body, (tf.constant(0), state))
    return state.get_value()[0][0, 0]

  x = tf.ones([512, 512])
  before = allocated()
  for step in range(2):
    assert float(loop(x, tf.constant(step, tf.int64))) == 3.0
  return allocated() - before


def test_zeros_in_a_loop_state_are_not_folded_into_a_constant(cpu_allocator_stats):
  """Item 17: Grappler folds `tf.zeros` into a Const the function holds (1 MiB kept
  after the calls); `tf_internals.zeros` is made at run time and freed, as an Empty
  and as a Fill of the step's runtime zero (not stateful: not ordered after the ops
  traced before it)."""
  assert _bytes_held_after_two_calls(lambda shape, dtype, _: tf.zeros(shape, dtype)) >= 2**20
  assert _bytes_held_after_two_calls(lambda shape, dtype, _: tf_internals.zeros(
      shape, dtype)) < 2**16
  assert _bytes_held_after_two_calls(lambda shape, dtype, step: tf_internals.zeros(
      shape, dtype, tf_internals.runtime_zero(step))) < 2**16
  filled = tf.function(lambda step: tf_internals.zeros(
      [2], tf.float32, tf_internals.runtime_zero(step))).get_concrete_function(
          tf.TensorSpec([], tf.int64))
  assert not any(op.op_def.is_stateful for op in filled.graph.get_operations())
  assert tf_internals.zeros([2, 3], tf.bfloat16).shape == [2, 3]
  assert not tf_internals.zeros([2, 3], tf.bool).numpy().any()
  zero = tf_internals.runtime_zero(tf.constant(3, tf.int64))
  assert not tf_internals.zeros([2, 3], tf.bool, zero).numpy().any()
  assert list(tf_internals.zeros([2], tf.string, zero).numpy()) == [b"", b""]  # (no cast)
