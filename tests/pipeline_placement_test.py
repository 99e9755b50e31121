"""Where a pipelined step's ops *executed*, read from TensorFlow's debugger dump.

The cells' bodies are functions called per micro-batch; their ops carry no device in
the traced outer graph (a call's device is the default for its body at run time), so
placement is proven from what ran: `enable_dump_debug_info` records every executed
graph op with its device and the function graph it belongs to.
"""

import collections
import re

import pytest
import tensorflow as tf
from tensorflow.python.debug.lib import debug_events_reader
from tiers import quick_sample

from lingvo_gpipe import train_step
from lingvo_gpipe.core import layers, optimizers, stacked_variables
from lingvo_gpipe.core.tf_internals import step_function
from lingvo_gpipe.pipeline.layer import PipeliningLayer

COMPUTE_OPS = {"MatMul", "Conv2D", "Conv2DBackpropInput", "Conv2DBackpropFilter", "Tanh",
               "TanhGrad", "Relu", "ReluGrad"}


def _device(name: str) -> tuple[str, int]:
  spec = tf.DeviceSpec.from_string(name)
  return spec.device_type, spec.device_index


def _layer_index(op_name: str, prefix: str) -> int | None:
  found = {int(m) for m in re.findall(rf"(?:^|/){prefix}(\d+)(?:_\d+)?(?:/|$)", op_name)}
  assert len(found) <= 1, op_name
  return found.pop() if found else None


def executed_ops(fn, dump_root: str) -> list[tuple[str, str, str, str]]:
  """(function graph name, op name, op type, device) of every graph op `fn()` ran."""
  # A buffer for every op the step runs (the default keeps the last 1,000; -1,
  # unbounded, crashed TensorFlow 2.21 here).
  tf.debugging.experimental.enable_dump_debug_info(
      dump_root, tensor_debug_mode="NO_TENSOR", circular_buffer_size=100000)
  try:
    fn()
  finally:
    tf.debugging.experimental.disable_dump_debug_info()
  with debug_events_reader.DebugDataReader(dump_root) as reader:
    reader.update()
    return [(reader.graph_by_id(t.graph_id).name, t.op_name, t.op_type, t.device_name)
            for t in reader.graph_execution_traces()]


def run_step(dump_root: str, devices, schedule: str, recompute: str, share: bool):
  """One Adam step of four Linear layers on two cells: (ops that ran, model, optimizer)."""
  num_micro = 2
  fcs = [layers.Linear.Params().set(name=f"fc{i}", input_dim=4, output_dim=4,
                                    activation="TANH") for i in range(4)]
  model = PipeliningLayer.Params().set(
      name="stack", layers=fcs, splits=[2, 4], devices=devices, schedule=schedule,
      recompute=recompute, num_micro_batches=num_micro,
      share_layer_functions=share).instantiate()
  head = layers.Linear.Params().set(name="head", input_dim=4, output_dim=1)
  with tf.device(model.output_device):
    head_layer = head.instantiate()
  wrapped = train_step.StackWithLoss(model, lambda out, h: {
      "loss": (tf.reduce_mean(tf.square(head_layer(out) - h["y"])), tf.constant(4.0))})
  wrapped.head_layer = head_layer
  variables = wrapped.trainable_variables
  opt = optimizers.Adam.Params().instantiate()
  opt.create_slots(variables)
  step = step_function(train_step.TrainStep(wrapped, opt, tf.Variable(0, dtype=tf.int64)))
  batch = {"inputs": tf.ones([4, 4]), "y": tf.zeros([4, 1])}
  return executed_ops(lambda: step(batch), dump_root), model, opt


def compute_ops_by_device(ran) -> collections.Counter:
  return collections.Counter((_device(device), op_type) for _, _, op_type, device in ran
                             if op_type in COMPUTE_OPS)


@pytest.mark.parametrize("schedule, recompute", quick_sample(
    [("gpipe", "always"), ("1f1b", "always"), ("gpipe", "never"), ("1f1b", "except_last")],
    quick=[("1f1b", "except_last")]))
def test_every_compute_op_executes_on_its_cells_device(cpu_devices, tmp_path, schedule,
                                                       recompute):
  """Each layer traced apart: its ops are named after it, so each op's device is
  checked against its layer's cell. Layers sharing one traced function
  (share_layer_functions) run ops named after the kind's first layer; their run must
  execute the same compute ops on each device."""
  num_micro = 2
  devices = cpu_devices[1:3]  # not the default device, so defaults would show up
  ran, model, opt = run_step(str(tmp_path / "apart"), devices, schedule, recompute,
                             share=False)
  shared_ran, _, _ = run_step(str(tmp_path / "shared"), devices, schedule, recompute,
                              share=True)
  assert any(graph.endswith("_layer_body") for graph, _, _, _ in shared_ran)
  shared_ops, apart_ops = compute_ops_by_device(shared_ran), compute_ops_by_device(ran)
  assert set(shared_ops) == set(apart_ops)  # the same op types on the same devices
  # ... each as often, except that a layer function's backward also computes the
  # gradient of the first cell's input, which a cell traced apart prunes (MatMul).
  assert all(shared_ops[key] >= count for key, count in apart_ops.items())
  assert shared_ops - apart_ops <= collections.Counter({(_device(devices[0]), "MatMul"):
                                                        num_micro})

  cell_of = {i: 0 if i < 2 else 1 for i in range(4)}
  seen = collections.Counter()
  for graph, name, op_type, device in ran:
    if op_type not in COMPUTE_OPS:
      continue
    index = _layer_index(name, "fc")
    want = devices[cell_of[index]] if index is not None else devices[1]  # the head: last
    assert _device(device) == _device(want), (graph, name, device)
    seen[(index, "gradient" if "grad" in name.lower() else "forward")] += 1
  # Every layer ran forward and backward ops on every micro-batch (a recompute adds its
  # forward again).
  for i in range(4):
    recomputed = recompute == "always" or (recompute == "except_last" and cell_of[i] == 0)
    assert seen[(i, "forward")] == num_micro * 2 * (2 if recomputed else 1), (i, seen)
    assert seen[(i, "gradient")] >= num_micro, (i, seen)
  for var in stacked_variables.trainable_weights(model):
    index = _layer_index(var.name, "fc")
    assert _device(var.device) == _device(devices[cell_of[index]])
    for slot in opt.slots_of(var).values():
      assert _device(slot.device) == _device(var.device)
