"""The GPU features a pipeline step uses, one at a time, so that a crash names its feature.

A segmentation fault ends a process without a Python error. This script runs the pieces a
pipeline step is made of in order of growing reach (one kernel, cuDNN, bfloat16, control
flow on the GPU, a hand-off between two logical GPUs, a TensorList stash, a cell's state
packed in an Optional (device_loop._packed), the host clock inside a GPU loop, then a
whole pipelined training step) and prints each name before it runs, with Python's fault
handler on: the last name printed is the feature that crashed.

  python tools/gpu_smoke.py [--devices=gpu:2:2048]

Exits 0 when every step ran and agreed with the same computation on the host's CPU.
"""

from __future__ import annotations

import faulthandler
import json
import sys
import time

from absl import app, flags

flags.DEFINE_string("devices", "gpu:2:2048", "Two logical devices to run on (devices.py's spec).")
FLAGS = flags.FLAGS


# float32 products on a GPU since Ampere run in TensorFloat-32 by default (TensorFlow's
# `enable_tensor_float_32_execution`): a 10-bit mantissa, relative error ~2**-11 per product.
TF32_RTOL = 5e-3


def _check(name: str, run, reference=None, rtol: float = TF32_RTOL) -> dict:
  """Runs `run()` (and `reference()`, on the host, to compare), printing the name first."""
  import numpy as np
  print(f"-- {name}", flush=True)
  start = time.perf_counter()
  got = run()
  seconds = time.perf_counter() - start
  result = {"step": name, "seconds": round(seconds, 3)}
  if reference is not None:
    want = reference()
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    error = float(np.max(np.abs(got - want)) / max(float(np.max(np.abs(want))), 1e-30))
    result["relative_error"] = error
    if not error <= rtol:
      raise AssertionError(f"{name}: relative error {error:.3g} > {rtol:g}")
  print(f"   ok {json.dumps(result)}", flush=True)
  return result


def main(argv) -> int:
  del argv
  faulthandler.enable()
  import tensorflow as tf

  from lingvo_gpipe.runtime.devices import configure_devices

  names = configure_devices(FLAGS.devices)
  if len(names) < 2:
    raise app.UsageError(f"--devices={FLAGS.devices!r} gives {names}; the smoke test takes two")
  first, second = names[0], names[1]
  host = "/device:CPU:0"
  print(json.dumps({"tensorflow": tf.__version__, "devices": names,
                    "tensor_float_32": tf.config.experimental.tensor_float_32_execution_enabled(),
                    "build": {k: str(v) for k, v in tf.sysconfig.get_build_info().items()
                              if "version" in k}}), flush=True)
  rng = tf.random.Generator.from_seed(1)
  a, b = rng.normal([512, 512]), rng.normal([512, 512])
  images, kernel = rng.normal([4, 16, 16, 8]), rng.normal([3, 3, 8, 16])
  results = []

  def on(device, fn):
    def run():
      with tf.device(device):
        return fn()
    return run

  results.append(_check("matmul float32", on(first, lambda: tf.matmul(a, b)),
                        on(host, lambda: tf.matmul(a, b))))
  results.append(_check(
      "matmul bfloat16",
      on(first, lambda: tf.cast(tf.matmul(tf.cast(a, tf.bfloat16), tf.cast(b, tf.bfloat16)),
                                tf.float32)),
      on(host, lambda: tf.matmul(a, b)), rtol=3e-2))

  def conv_and_grads():
    with tf.GradientTape() as tape:
      tape.watch(kernel)
      out = tf.nn.conv2d(images, kernel, 1, "SAME")
      loss = tf.reduce_sum(out * out)
    return tape.gradient(loss, kernel)
  results.append(_check("conv2d and its gradient (cuDNN)", on(first, conv_and_grads),
                        on(host, conv_and_grads)))

  @tf.function
  def loop_of_cases(x):
    def body(i, x):
      x = tf.switch_case(i % 2, [lambda: tf.matmul(x, b) / 20.0, lambda: tf.nn.relu(x)])
      return i + 1, x
    return tf.while_loop(lambda i, x: i < 6, body, (tf.constant(0), x))[1]
  results.append(_check("tf.function: While of Case", on(first, lambda: loop_of_cases(a)),
                        on(host, lambda: loop_of_cases(a))))

  @tf.function
  def hand_off(x):
    with tf.device(first):
      y = tf.matmul(x, b)
    with tf.device(second):
      return tf.nn.relu(y) + 1.0
  results.append(_check("hand-off between two logical GPUs", lambda: hand_off(a),
                        on(host, lambda: tf.nn.relu(tf.matmul(a, b)) + 1.0)))

  @tf.function
  def stash(x):
    def push(i, x, stack):
      return i + 1, tf.matmul(x, b) / 20.0, stack.write(i, x)
    _, _, stack = tf.while_loop(lambda i, *_: i < 4, push,
                                (tf.constant(0), x, tf.TensorArray(tf.float32, size=4)))
    return tf.reduce_sum(stack.stack(), axis=0)
  results.append(_check("TensorList stash in a While", on(first, lambda: stash(a)),
                        on(host, lambda: stash(a))))

  from lingvo_gpipe.pipeline import device_loop
  pack, unpack = device_loop._packed, device_loop._unpacked  # pylint: disable=protected-access

  @tf.function
  def packed_state(x):
    # A cell's loop state as the device loop carries it (`pack`: one Optional of its sums
    # and slot lists), opened, a slot written and packed again inside a Case branch; the
    # slot index crosses into the branch as int64 and is cast there, as the rows are.
    like = device_loop.CellState(sums=[x], stash=[[tf.TensorArray(tf.float32, size=4)]],
                                 outputs=[], stats=[], product_inputs=[], product_grads=[],
                                 cache=[], cache_grads=[])

    def body(i, packed):
      slot = tf.cast(i, tf.int64)

      def act():
        state = unpack(packed, like)
        (y,), ((stash,),) = state.sums, state.stash
        return pack(state._replace(sums=[tf.matmul(y, b) / 20.0],
                                   stash=[[stash.write(tf.cast(slot, tf.int32), y)]]))
      return i + 1, tf.switch_case(i % 2, [act, act])
    _, packed = tf.while_loop(lambda i, _: i < 4, body, (tf.constant(0), pack(like)))
    return tf.reduce_sum(unpack(packed, like).stash[0][0].stack(), axis=0)
  results.append(_check("a state packed in an Optional through a While of Case",
                        on(first, lambda: packed_state(a)), on(host, lambda: packed_state(a))))


  @tf.function
  def stamped_loop(x):
    def body(i, x, _):
      x = tf.matmul(x, b) / 20.0
      return i + 1, x, device_loop._timestamp(first, [x])  # pylint: disable=protected-access
    return tf.while_loop(lambda i, *_: i < 3, body,
                         (tf.constant(0), x, tf.constant(0.0, tf.float64)))[1]
  results.append(_check("the host clock's call inside a GPU While (device_loop)",
                        on(first, lambda: stamped_loop(a)), on(host, lambda: stamped_loop(a))))
  one_device = FLAGS.devices.split(":")
  one_device[1] = "1"
  results.append(_check("a training step on one device (tools/trainer.py, K=1)",
                        lambda: _train_two_steps(":".join(one_device))))
  results.append(_check("a pipelined training step (tools/trainer.py, K=2)",
                        lambda: _train_two_steps(FLAGS.devices)))
  print(json.dumps({"smoke": "passed", "steps": results}), flush=True)
  return 0


def _train_two_steps(devices: str) -> None:
  """Two steps of the tiny LM pipelined over the two devices, through the trainer binary."""
  import subprocess
  import tempfile
  with tempfile.TemporaryDirectory() as logdir:
    command = [sys.executable, "-X", "faulthandler", "-m", "lingvo_gpipe.tools.trainer",
               "--model=lm.TransformerTiny", f"--devices={devices}", f"--logdir={logdir}",
               "--mode=train", "--max_steps=2"]
    print("   " + " ".join(command), flush=True)
    subprocess.run(command, check=True)


if __name__ == "__main__":
  app.run(main)
