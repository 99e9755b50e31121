"""BaseLayer: frozen params, children, checkpoints, and inspection without allocation."""

import math
import resource

import numpy as np
import pytest
import tensorflow as tf
from numerics import assert_close

from lingvo_gpipe.core import base_layer, layers, model_stats
from lingvo_gpipe.core.hyperparams import ParamsError


def small_net():
  return layers.Sequential.Params().set(name="net", layers=[
      layers.Conv2D.Params().set(name="conv", filter_shape=(3, 3, 3, 8)),
      layers.BatchNorm.Params().set(name="bn", dim=8),
      layers.Activation.Params().set(name="relu"),
      layers.GlobalPooling.Params().set(name="pool"),
      layers.Linear.Params().set(name="fc", input_dim=8, output_dim=4),
  ])


def test_layer_requires_frozen_params():
  with pytest.raises(ParamsError, match="frozen"):
    layers.Linear(layers.Linear.Params().set(input_dim=1, output_dim=1))


def test_children_paths_and_duplicate_names():
  net = small_net().instantiate()
  assert [c.path for c in net.children()] == [
      "net/conv", "net/bn", "net/relu", "net/pool", "net/fc"]
  assert net.layers[4].w.name == "net/fc/w:0"
  dup = layers.Sequential.Params().set(layers=[layers.Activation.Params()] * 2).instantiate()
  assert [c.name for c in dup.children()] == ["activation_0", "activation_1"]

  class Twice(base_layer.BaseLayer):
    def __init__(self, params):
      super().__init__(params)
      self.create_child("x", layers.Activation.Params())
      self.create_child("x", layers.Activation.Params())

  with pytest.raises(ValueError, match="'x' is already used"):
    Twice.Params().instantiate()


def test_a_layer_built_under_a_device_scope_keeps_every_variable_there(cpu_devices):
  with tf.device(cpu_devices[1]):
    net = small_net().instantiate()
  assert {tf.DeviceSpec.from_string(v.device).device_index for v in net.variables} == {1}


def test_checkpoint_saves_and_restores_whole_tree(tmp_path):
  net = small_net().instantiate()
  x = tf.random.stateless_normal([2, 6, 6, 3], seed=[1, 2])
  before = net(x).numpy()
  path = tf.train.Checkpoint(model=net).save(str(tmp_path / "ckpt"))
  other = small_net().set(random_seed=99).instantiate()
  assert not np.allclose(other(x).numpy(), before)
  tf.train.Checkpoint(model=other).restore(path).assert_consumed()
  assert_close(other(x).numpy(), before)
  saved = {name for name, _ in tf.train.list_variables(path)}
  assert sum(n.startswith("model/") for n in saved) == len(net.variables) == 7


def test_analyze_matches_real_variables_and_shapes():
  p = small_net()
  stats = model_stats.analyze(p, tf.TensorSpec([2, 6, 6, 3]))
  real = p.instantiate()
  assert stats[0].num_params == sum(int(np.prod(v.shape)) for v in real.trainable_variables)
  by_path = {s.path: s for s in stats}
  assert by_path["net/conv"].output_shapes == [2, 6, 6, 8]
  assert by_path["net/fc"].output_shapes == [2, 4]
  assert by_path["net"].output_shapes == list(real(tf.zeros([2, 6, 6, 3])).shape)
  # FLOPs by hand: conv 2·out·(3·3·3), matmul 2·B·8·4 plus the bias add B·4.
  assert by_path["net/conv"].flops == 2 * (2 * 6 * 6 * 8) * 27
  assert by_path["net/fc"].flops == 2 * 2 * 8 * 4 + 2 * 4
  assert by_path["net"].flops == sum(s.flops for s in stats if s.depth == 1)
  assert "fc" in model_stats.format_table(stats)


def test_analyze_does_not_allocate_a_huge_model():
  # 16 layers of 32768 x 32768 floats: 17.2B parameters, 69 GB if allocated.
  dim, depth = 32768, 16
  p = layers.Sequential.Params().set(layers=[
      layers.Linear.Params().set(input_dim=dim, output_dim=dim, has_bias=False)] * depth)
  rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  stats = model_stats.analyze(p, tf.TensorSpec([4, dim]))
  rss_growth_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before
  assert stats[0].num_params == depth * dim * dim
  assert stats[0].flops == depth * 2 * 4 * dim * dim
  assert rss_growth_kb < 500 * 1024  # far below the 69 GB the weights would take


def test_einsum_flops_count_contracted_dims():
  g = tf.Graph()
  with g.as_default():
    a = tf.compat.v1.placeholder(tf.float32, [2, 3, 5])
    b = tf.compat.v1.placeholder(tf.float32, [5, 7])
    out = tf.einsum("btd,dk->btk", a, b)
  assert model_stats.op_flops(out.op) == 2 * 2 * 3 * 7 * 5
  assert math.isclose(model_stats.op_flops(out.op), 420)


def test_param_counts_equal_the_built_layers_variables():
  """Layers differing only in name are counted once by kind; another width or another
  class is its own kind. Against the variables each layer makes when built."""
  params = [layers.Linear.Params().set(name="a", input_dim=8, output_dim=16),
            layers.Linear.Params().set(name="b", input_dim=8, output_dim=16),
            layers.Linear.Params().set(name="c", input_dim=8, output_dim=32),
            layers.FeedForwardBlock.Params().set(name="d", input_dim=8, hidden_dim=16)]
  built = [sum(int(np.prod(v.shape)) for v in p.instantiate().trainable_variables)
           for p in params]
  assert model_stats.param_counts(params) == built
  assert built[:3] == [8 * 16 + 16, 8 * 16 + 16, 8 * 32 + 32]
