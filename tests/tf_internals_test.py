"""An upgrade tripwire: the TensorFlow behaviours the engine relies on beyond the
documented API (lingvo_gpipe/pipeline/tf_internals.py) were checked on this version."""

import numpy as np
import tensorflow as tf

from lingvo_gpipe.pipeline import channels, tf_internals


def test_the_tensorflow_internals_were_checked_on_this_version():
  assert tf.__version__ == tf_internals.TENSORFLOW_CHECKED, (
      f"TensorFlow is {tf.__version__}; the tricks in tf_internals.py were checked on "
      f"{tf_internals.TENSORFLOW_CHECKED}: re-check each with the test named beside it, "
      "then update TENSORFLOW_CHECKED")


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
  np.testing.assert_allclose(outputs[0].numpy(), h.numpy(), rtol=1e-6)
  for g, ref in zip(got, want):
    np.testing.assert_allclose(g.numpy(), tf.convert_to_tensor(ref).numpy(), rtol=1e-5,
                               atol=1e-6)


def test_this_process_has_a_host_address_space():
  """Item 6: the prefix of this process's full device names."""
  assert tf_internals.host_address_space() == "/job:localhost/replica:0/task:0"
  assert channels.full_device_name("/device:CPU:1") == (
      "/job:localhost/replica:0/task:0/device:CPU:1")


def _call_configs(graph_def) -> list:
  """The ConfigProto in each function call op of a graph and its library."""
  from tensorflow.core.protobuf import config_pb2

  nodes = list(graph_def.node) + [n for f in graph_def.library.function for n in f.node_def]
  return [config_pb2.ConfigProto.FromString(n.attr["config_proto"].s) for n in nodes
          if n.op in ("PartitionedCall", "StatefulPartitionedCall")]


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
