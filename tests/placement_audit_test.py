"""The GPU audit: where each op of a traced step runs, and whether a kernel admits it.

The walk's rules (devices inherited through calls, loops and branches, host reasons,
frames) are tested everywhere with a kernel check of the test's own. The checks
against TensorFlow's GPU kernels run only where the full `tensorflow` wheel is
installed (`make gpu-audit`); with `tensorflow-cpu` they are skipped.
"""

import inspect
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
from conftest import REPO
from tiers import quick_sample

from lingvo_gpipe.core import tf_internals
from lingvo_gpipe.pipeline import placement_audit
from lingvo_gpipe.pipeline.placement_audit import on_host

pytestmark = pytest.mark.op_tracebacks  # the audit names the frame that made an op

gpu_kernels = pytest.mark.skipif(
    not tf.test.is_built_with_cuda(),
    reason="needs the GPU kernels' registry of the full tensorflow wheel (make gpu-audit)")


def stand_in_gpu(spec):
  """CPU:1.. stand for GPU:0..; CPU:0 is the host (as tools/gpu_audit.py does)."""
  return spec.device_index - 1 if spec.device_type == "CPU" and spec.device_index else None


def no_string_kernels(node_def) -> bool:
  """A kernel check for the walk's tests: every op has a GPU kernel but the string
  ops of `cell` (as in TensorFlow's GPU build)."""
  return node_def.op not in ("AsString", "StringLength")


def line_of(text: str) -> int:
  """The line of this file that holds `text` (once)."""
  lines = [i + 1 for i, line in enumerate(inspect.getsource(sys.modules[__name__]).split("\n"))
           if text in line and "line_of(" not in line]
  assert len(lines) == 1, (text, lines)
  return lines[0]


def cell(x):
  """A cell body: a string op among float ones (traced as its own function)."""
  y = tf.tanh(x) * 2.0
  text = tf.strings.as_string(tf.reduce_sum(y))
  return y + tf.cast(tf.strings.length(text), tf.float32) * 0.0


cell_function = tf.function(cell, experimental_attributes=tf_internals.NOT_INLINED)


def device_loop_step(device: str, steps: int = 3):
  """A device's loop as the engine builds it: a functional While whose body picks an
  action by a Case, the action a call of the cell's function; a timestamp on the host
  on purpose, and one op put on the host without a reason."""
  def step(x):
    with tf.device(device):
      def body(i, x):
        branches = [lambda: cell_function(x), lambda: x - 1.0]
        x = tf_internals.unlowered(lambda: tf.switch_case(i % 2, branches))
        return i + 1, x
      _, x = tf_internals.unlowered(lambda: tf.while_loop(
          lambda i, _: i < steps, body, (tf.constant(0), x)))
      with on_host(device, "the test's stamp"):
        stamp = tf.timestamp()
      with tf.device("/device:CPU:0"):
        host_sum = tf.reduce_sum(x)
    return x, stamp, host_sum
  return tf.function(step)


def test_an_op_without_a_kernel_deep_in_a_cell_is_found_with_its_frame(cpu_devices):
  step = device_loop_step(cpu_devices[1])
  graph = step.get_concrete_function(tf.TensorSpec([4], tf.float32)).graph
  report = placement_audit.audit(graph, stand_in_gpu, no_string_kernels)

  assert not report.clean
  found = {(e.op_type, e.device): e for e in report.without_kernel}
  assert set(found) == {("AsString", "GPU:0"), ("StringLength", "GPU:0")}, found
  assert found[("AsString", "GPU:0")].frame.endswith(
      f"placement_audit_test.py:{line_of('text = tf.strings.as_string')} in cell")
  assert found[("AsString", "GPU:0")].dtypes == "T=float32"
  # The float ops around it, in the same function, were checked and passed.
  assert report.gpu_ops > 10
  # The timestamp is on the host for the reason given; the sum on CPU:0 gives none.
  assert [(e.op_type, e.reason) for e in report.on_host] == [("Timestamp", "the test's stamp")]
  unexplained = list(report.unexplained_host)
  assert [e.op_type for e in unexplained] == ["Sum"]
  assert unexplained[0].frame.endswith(f":{line_of('host_sum = tf.reduce_sum')} in step")


def test_a_clean_step_is_clean_and_on_host_changes_no_result(cpu_devices):
  step = device_loop_step(cpu_devices[2])
  x = tf.constant([0.5, -1.0, 2.0, 3.0])
  report = placement_audit.audit(step.get_concrete_function(x).graph, stand_in_gpu,
                                 lambda node_def: True)
  assert report.without_kernel == {} and report.gpu_ops > 10
  out, stamp, _ = step(x)
  expected = np.tanh(np.tanh(x.numpy()) * 2.0 - 1.0) * 2.0  # actions 0, 1, 0
  np.testing.assert_allclose(out.numpy(), expected, rtol=1e-5)  # float32 tanh twice
  assert stamp.dtype == tf.float64 and stamp.numpy() > 1e9


def test_the_reason_travels_into_functions_called_from_the_host(cpu_devices):
  @tf.function(experimental_attributes=tf_internals.NOT_INLINED)
  def host_work(x):
    return tf.strings.length(tf.strings.as_string(x))

  @tf.function
  def step(x):
    with tf.device(cpu_devices[1]):
      y = x * 3.0
      with on_host(cpu_devices[1], "string work belongs to the host"):
        n = host_work(y)
    return y, n

  report = placement_audit.audit(step.get_concrete_function(tf.TensorSpec([2])).graph,
                                 stand_in_gpu, no_string_kernels)
  assert report.clean, report
  reasons = {e.op_type: e.reason for e in report.on_host}
  assert reasons["AsString"] == reasons["StringLength"] == "string work belongs to the host"


@gpu_kernels
def test_gpu_registry_refuses_a_string_op_and_admits_the_engine_ops(cpu_devices):
  step = device_loop_step(cpu_devices[1])
  report = placement_audit.audit(
      step.get_concrete_function(tf.TensorSpec([4], tf.float32)).graph, stand_in_gpu)
  assert {e.op_type for e in report.without_kernel} == {"AsString", "StringLength"}
  node = tf.compat.v1.NodeDef(name="w", op="While", device="/device:GPU:0")
  assert tf_internals.registered_kernel(node)  # a DEFAULT kernel


@gpu_kernels
def test_the_audit_binary_finds_the_shipped_model_clean():
  result = subprocess.run(
      [sys.executable, str(REPO / "tools" / "gpu_audit.py"), "--quick",
       "--models=lm.TransformerTiny"], capture_output=True, text=True, cwd=REPO,
      timeout=600)
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  assert '"clean": true' in result.stdout.splitlines()[-1]


def test_a_host_device_inside_a_loop_body_is_ignored_but_a_call_keeps_it(cpu_devices):
  """A While's body runs every op on the loop's device (seen on a GPU): a Timestamp
  there that names the host is a GPU op; inside a function call it stays on the host."""
  @tf.function(experimental_attributes=tf_internals.NOT_INLINED, autograph=False)
  def clock():
    with on_host(cpu_devices[1], "a call's body keeps its devices"):
      return tf.timestamp()

  def step(x, call: bool):
    with tf.device(cpu_devices[1]):
      def body(i, t):
        if call:
          return i + 1, clock()
        with on_host(cpu_devices[1], "ignored in a loop's body"):
          return i + 1, tf.timestamp()
      return tf_internals.unlowered(lambda: tf.while_loop(
          lambda i, _: i < 2, body, (tf.constant(0), tf.constant(0.0, tf.float64))))

  def report(call):
    graph = tf.function(lambda x: step(x, call)).get_concrete_function(
        tf.TensorSpec([], tf.float32)).graph
    return placement_audit.audit(graph, stand_in_gpu, lambda nd: nd.op != "Timestamp")

  in_body = report(call=False)
  assert [(e.op_type, e.device) for e in in_body.without_kernel] == [("Timestamp", "GPU:0")]
  in_call = report(call=True)
  assert in_call.clean and [e.op_type for e in in_call.on_host] == ["Timestamp"]


def test_the_loops_slice_no_int32_batch(cpu_devices):
  """A GPU runs an int32 Slice with a host kernel. The LM's int32 token batch sliced
  inside a GPU's loop reached it in the GPU's memory and crashed every step on an H200;
  the loops slice it as int64 (device_loop._int32_as_int64) and cast each micro-batch
  back. Walks the traced step of the tiny LM (int32 ids and labels) for Slice ops of
  int32 made in device_loop.py: none, while the step's int64 slices are found there
  (the walk sees the loops)."""
  from lingvo_gpipe.tools import gpu_audit

  from lingvo_gpipe import model_registry

  model_registry.load_param_files([])
  graph = gpu_audit.trace_step(gpu_audit.Config("lm.TransformerTiny", "1f1b", "always",
                                                "float32"))

  report = placement_audit.audit(graph, lambda spec: 0,
                                 lambda node_def: node_def.op != "Slice")  # Slices only
  loop_slices = {e.dtypes for e in report.without_kernel if "device_loop.py" in e.frame}
  assert loop_slices, "the walk found none of the loops' slices"
  assert not [d for d in loop_slices if "T=int32" in d], loop_slices


@pytest.mark.parametrize("schedule, slices", quick_sample([("1f1b", 1), ("zb_h1", 1), ("1f1b", 2)],
                                                          quick=[("zb_h1", 1)]))
def test_no_int32_crosses_a_branch_of_the_loops(cpu_devices, schedule, slices):
  """On a GPU an int32 passed into (or out of) a Case arrives in the GPU's memory where
  the branch takes it for host memory (placement_audit's docstring; a segmentation
  fault in TensorListSetItem on an H200). The tiny LM's traced step, every op counted as
  on a GPU (and with two token slices, whose cache reads sit in a cond): no Case or If
  takes or gives an int32, while the walk sees the loops' Cases."""
  from lingvo_gpipe.tools import gpu_audit

  from lingvo_gpipe import model_registry

  model_registry.load_param_files([])
  graph = gpu_audit.trace_step(gpu_audit.Config("lm.TransformerTiny", schedule, "always",
                                                "float32", token_slices=slices))
  cases = placement_audit.audit(graph, lambda spec: 0,
                                lambda node_def: node_def.op not in ("Case", "StatelessCase"))
  assert cases.without_kernel, "the walk found none of the loops' Cases"
  report = placement_audit.audit(graph, lambda spec: 0, lambda node_def: True)
  assert not report.int32_across_branches, placement_audit.table(report.int32_across_branches)
