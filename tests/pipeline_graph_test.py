"""The traced training step's size: one loop per device, cells traced once per shape."""

import collections

import pytest
import tensorflow as tf
from tiers import quick_sample

from lingvo_gpipe import train_step
from lingvo_gpipe.core import base_layer, layers
from lingvo_gpipe.pipeline import device_loop, schedule
from lingvo_gpipe.pipeline.layer import PipeliningLayer

DIM = 8


def build(num_cells: int, num_micro_batches: int, devices, schedule: str = "gpipe",
          recompute: str = "always", weight_gradient_group: int = 1,
          virtual_stages: int = 1):
  stack = []
  for i in range(8):
    stack += [layers.Linear.Params().set(name=f"fc{i}", input_dim=DIM, output_dim=DIM,
                                         activation="TANH"),
              layers.Dropout.Params().set(name=f"drop{i}", keep_prob=0.9)]
  model = PipeliningLayer.Params().set(
      name="stack", layers=stack, num_cells=num_cells, num_micro_batches=num_micro_batches,
      devices=devices[:num_cells // virtual_stages], schedule=schedule,
      virtual_stages=virtual_stages, recompute=recompute,
      weight_gradient_group=weight_gradient_group, random_seed=3).instantiate()
  wrapped = train_step.StackWithLoss(model, lambda out, h: {
      "loss": (tf.reduce_mean(tf.square(out - h["y"])),
               tf.cast(tf.shape(out)[0], tf.float32))})
  return model, wrapped


def traced_step(model, wrapped, batch_size: int):
  """The concrete training-step function of `model` at `batch_size`."""
  batch = {"inputs": tf.ones([batch_size, DIM]), "y": tf.zeros([batch_size, DIM])}

  @tf.function
  def step():
    with base_layer.step_context(training=True, step=tf.constant(1, tf.int64),
                                 layer_stats=[], spans=[]):
      return train_step.loss_and_gradients(wrapped, batch, model.trainable_variables)

  return step.get_concrete_function()


def sizes(concrete) -> tuple[int, dict[str, int]]:
  """(ops in the outer graph, {function name: ops in its body})."""
  graph_def = concrete.graph.as_graph_def()
  return len(graph_def.node), {f.signature.name: len(f.node_def)
                               for f in graph_def.library.function}


def total_nodes(concrete) -> int:
  outer, functions = sizes(concrete)
  return outer + sum(functions.values())


@pytest.mark.parametrize("num_cells", quick_sample([2, 4], quick=[4]))
@pytest.mark.parametrize("schedule, recompute, group", quick_sample([
    ("gpipe", "always", 1), ("1f1b", "never", 1), ("1f1b", "except_last", 4)],
    quick=[("1f1b", "except_last", 4)]))
def test_the_step_graph_does_not_grow_with_micro_batches(cpu_devices, num_cells, schedule,
                                                         recompute, group):
  """One loop per device over a constant table: M=4 and M=64 micro-batches (of 2
  examples each) trace to graphs of the same size (the step, and every function in
  its library)."""
  counts = {}
  for m in (4, 64):
    model, wrapped = build(num_cells, m, cpu_devices, schedule, recompute, group)
    concrete = traced_step(model, wrapped, batch_size=2 * m)
    counts[m] = (sizes(concrete)[0], sorted(sizes(concrete)[1].values()))
    loops = [op for op in concrete.graph.get_operations() if op.type == "While"]
    assert [op.device for op in loops] == model.cell_devices
    for op in loops:
      assert not op.get_attr("_lower_using_switch_merge"), op.name
  assert counts[4] == counts[64]


def test_each_cell_is_traced_once_per_micro_batch_shape(cpu_devices):
  model, wrapped = build(2, 3, cpu_devices)
  traced_step(model, wrapped, batch_size=13)  # micro-batches of 5, 4, 4: two shapes
  for cell in model.cell_functions(wrapped.head):
    assert cell.tracing_count() == 2 * 2  # forward and backward, per shape
  model, wrapped = build(2, 8, cpu_devices)
  traced_step(model, wrapped, batch_size=16)  # eight micro-batches of 2: one shape
  for cell in model.cell_functions(wrapped.head):
    assert cell.tracing_count() == 2


def test_cell_calls_are_not_inlined(cpu_devices):
  """Grappler would inline them and re-optimize the flat graph (slow; and CSE could
  merge a recompute into its forward)."""
  model, wrapped = build(2, 2, cpu_devices)
  graph_def = traced_step(model, wrapped, batch_size=4).graph.as_graph_def()
  names = {f.signature.name: f for f in graph_def.library.function}
  called = {node.attr["f"].func.name for f in graph_def.library.function for node in f.node_def
            if node.op in ("PartitionedCall", "StatefulPartitionedCall")}
  cell_bodies = {name for name in called if "_forward_body" in name or "_backward_body" in name}
  assert len(cell_bodies) == 2 * 2  # K cells × (forward, backward)
  for name in cell_bodies:
    assert names[name].attr["_noinline"].b, name


@pytest.mark.parametrize("recompute", quick_sample(["always", "never"], quick=["always"]))
def test_deferred_weight_gradients_add_each_stack_whole(cpu_devices, recompute):
  """zb_h1's W actions: a cell's stack of projection weights (4 rows [8, 8] in each of
  the 2 cells here) gets
  its gradient as its rows' products [b, I]ᵀ·[b, O] stacked and added whole, not row
  by row into a copy of the sums (a DeepCopy, then an InplaceAdd per row: 1.6× the
  time, docs/benchmarks.md "Split backward's cost"), nor as one batched product of
  the stacked inputs (4-7% dearer: "The engine's own cost"). Its values are the
  unpartitioned model's (gpipe_test's zb_h1 and zbv grids)."""
  model, wrapped = build(2, 4, cpu_devices, schedule="zb_h1", recompute=recompute)
  graph_def = traced_step(model, wrapped, 8).graph.as_graph_def()
  bodies = [f for f in graph_def.library.function if "_weight_body" in f.signature.name]
  # Per cell, its W at group size 1; without re-materialization a second for its first
  # W, which takes the stack's gradient as the sum (the test below).
  assert len(bodies) == (2 if recompute == "always" else 4)
  for body in bodies:
    ops = collections.Counter(n.op for n in body.node_def)
    assert (ops["BatchMatMulV2"], ops["MatMul"], ops["Pack"]) == (0, 4, 1), \
        body.signature.name
    assert (ops["InplaceAdd"], ops["DeepCopy"]) == (0, 0), body.signature.name


@pytest.mark.parametrize("name, num_cells, virtual_stages", [
    ("1f1b", 2, 1), ("gpipe", 4, 1), ("zbv", 4, 2), ("interleaved_1f1b", 4, 2)])
def test_each_cells_first_backward_has_a_branch_of_its_own(name, num_cells, virtual_stages):
  """In every device's table, each cell's first B (in the device's order; nothing adds to
  its sums before it) runs the cell's `first` branch, and no other row does. Uneven
  micro-batches (two shape classes): the later Bs of each class have their own
  branches."""
  plan = schedule.build(name, num_cells, 3, virtual_stages=virtual_stages)
  shape_class = [0, 1, 1]
  for d, order in enumerate(plan.device_orders):
    table = device_loop.action_table(plan, d, shape_class, [0, 5, 9], 2)
    branches = [table.branches[row[device_loop.COLUMNS.branch]] for row in table.rows]
    first_rows = {}
    for i, (k, action) in enumerate(order):
      if action.phase == schedule.BACKWARD:
        first_rows.setdefault(k, i)
      assert branches[i].cell == k and branches[i].phase == action.phase
    assert [i for i, b in enumerate(branches)
            if b.first and b.phase == schedule.BACKWARD] == sorted(first_rows.values())
    assert {(b.cell, b.shape_class) for b in branches if b.phase == schedule.BACKWARD
            and not b.first} == {(k, shape_class[a.unit]) for i, (k, a) in enumerate(order)
                                 if a.phase == schedule.BACKWARD and i not in
                                 first_rows.values()}


def test_each_cells_first_weight_gradient_has_a_branch_of_its_own():
  """In every device's table of the split-backward schedules, each cell's first W (in
  the device's order) runs the cell's `first` W branch, and no other row does; a cell
  whose sums W is not the only one to add to (`first_weight_cells`) has none."""
  for name, num_cells, virtual_stages in [("zb_h1", 2, 1), ("zbv", 4, 2),
                                          ("interleaved_zb", 4, 2)]:
    plan = schedule.build(name, num_cells, 3, virtual_stages=virtual_stages)
    for d, order in enumerate(plan.device_orders):
      first_rows = {}
      for i, (k, action) in enumerate(order):
        if action.phase == schedule.WEIGHT_GRADIENT:
          first_rows.setdefault(k, i)
      assert len(first_rows) == len({k for k, _ in order}), (name, d)
      for cells in (None, [0]):
        table = device_loop.action_table(plan, d, [0, 0, 0], [0, 4, 8], 1,
                                         first_weight_cells=cells)
        branches = [table.branches[row[device_loop.COLUMNS.branch]] for row in table.rows]
        assert [i for i, b in enumerate(branches)
                if b.first and b.phase == schedule.WEIGHT_GRADIENT] == sorted(
                    i for k, i in first_rows.items() if cells is None or k in cells), (name, d)


@pytest.mark.parametrize("num_micro_batches, adds", quick_sample([(1, 0), (3, 4)],
                                                                quick=[(3, 4)]))
def test_a_first_weight_gradient_takes_its_stack_as_the_sum_without_an_add(
    cpu_devices, num_micro_batches, adds):
  """zb_h1 without re-materialization: each cell's stack of projection weights gets
  its gradient from the W actions only (the backward, TensorFlow's pair, gives it
  none: `CallSignature.weight_only_sums`), so the cell's first W takes its stacked
  products as the sum, and the first B takes the biases' stack: no add at M=1; at M=3,
  one per stack in each later branch (B: biases, W: weights) of the 2 cells. The
  values are the unpartitioned model's (gpipe_test's zb_h1, zbv and interleaved_zb
  grids)."""
  model, wrapped = build(2, num_micro_batches, cpu_devices, "zb_h1", "never")
  graph_def = traced_step(model, wrapped, 2 * num_micro_batches).graph.as_graph_def()
  stack_adds = [n.name for f in graph_def.library.function for n in f.node_def
                if n.op == "AddV2" and "accumulate/add" in n.name]
  assert len(stack_adds) == adds, stack_adds


@pytest.mark.parametrize("num_micro_batches, adds", quick_sample([(1, 0), (3, 4)],
                                                                quick=[(3, 4)]))
def test_a_first_backward_takes_its_gradient_as_the_sum_without_an_add(
    cpu_devices, num_micro_batches, adds):
  """Without re-materialization each cell's stack of weights gets its gradient whole
  (the unstack's gradient); the cell's first B takes it as the sum, and only the later
  Bs add to it: no add at M=1; at M=3 one per stack (weights, biases) in the later B's
  branch of each of the 2 cells (a weight-sized pass each; 2-3% of an MLP's step at
  M=1, docs/benchmarks.md). The values are the unpartitioned model's (gpipe_test's
  grid, recompute 'never')."""
  model, wrapped = build(2, num_micro_batches, cpu_devices, "1f1b", "never")
  graph_def = traced_step(model, wrapped, 2 * num_micro_batches).graph.as_graph_def()
  stack_adds = [n.name for f in graph_def.library.function for n in f.node_def
                if n.op == "AddV2" and "/accumulate/add" in n.name]
  assert len(stack_adds) == adds, stack_adds


@pytest.mark.parametrize("name, num_cells, virtual_stages, recompute", quick_sample([
    ("1f1b", 2, 1, "never"), ("zbv", 4, 2, "never"), ("interleaved_zb", 4, 2, "always")],
    quick=[("interleaved_zb", 4, 2, "always")]))
def test_each_cells_state_crosses_the_loop_and_its_case_as_one_tensor(
    cpu_devices, name, num_cells, virtual_stages, recompute):
  """Each device's action Case takes and returns one variant per cell of the device
  (its state packed: sums, stash, products, kept outputs), not the state's tens to
  hundreds of tensors (each costs an argument, an Identity and a result per branch and
  action). BATCH=13 splits into uneven micro-batches: two shape classes, two stashes
  per cell."""
  model, wrapped = build(num_cells, 3, cpu_devices, name, recompute,
                         virtual_stages=virtual_stages)
  graph_def = traced_step(model, wrapped, batch_size=13).graph.as_graph_def()
  variant = tf.variant.as_datatype_enum
  action_cases = []
  for function in graph_def.library.function:
    action_cases += [n for n in function.node_def if n.op in ("Case", "StatelessCase")
                     and n.attr["Tout"].list.type
                     and all(t == variant for t in n.attr["Tout"].list.type)]
  assert len(action_cases) == num_cells // virtual_stages  # one loop per device
  for case in action_cases:
    assert len(case.attr["Tout"].list.type) == virtual_stages, case.name
    assert list(case.attr["Tin"].list.type).count(variant) == virtual_stages, case.name
