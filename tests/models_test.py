"""AmoebaNet and Transformer built small: shapes, parameter counts, masks, attention."""

import math

import numpy as np
import pytest
import tensorflow as tf
from numerics import assert_close

from lingvo_gpipe.core import attention, base_layer, model_stats
from lingvo_gpipe.models import amoeba_net, transformer


def real_param_count(layer) -> int:
  return sum(int(np.prod(v.shape)) for v in layer.trainable_variables)


def shapes_only_count(params) -> int:
  return model_stats.param_counts([params])[0]


@pytest.mark.parametrize("genotype", sorted(amoeba_net.GENOTYPES))
def test_amoeba_net_cifar_shapes_and_counts(genotype):
  body = amoeba_net.amoeba_net(genotype, num_normal_cells=3, filters=8, image_size=32,
                               num_classes=10, stem="cifar", stem_filters=16, aux_head=True)
  net = body.stack.instantiate()
  features, aux_logits = net(tf.random.normal([2, 32, 32, 3]))
  assert features.shape == [2, body.feature_dim]
  assert aux_logits.shape == [2, 10]
  assert real_param_count(net) == shapes_only_count(body.stack) == net.num_params()
  # Three stacks: 32×32 at D, 16×16 at 2D, 8×8 at 4D; the last cell's concat sets C.
  spec = amoeba_net.GENOTYPES[genotype].normal
  assert body.feature_dim == 4 * 8 * len(spec.concat)


def test_amoeba_net_imagenet_stem_reduces_four_times():
  body = amoeba_net.amoeba_net("D", num_normal_cells=3, filters=8, image_size=64,
                               stem="imagenet", stem_filters=8)
  net = body.stack.instantiate()
  x = tf.random.normal([1, 64, 64, 3])
  shapes = []
  carry = x
  for layer in net.layers[:-1]:
    carry = layer(*carry) if isinstance(carry, tuple) else layer(carry)
    shapes.append((carry[0] if isinstance(carry, tuple) else carry).shape[1])
  # stem conv (stride 2, VALID): 31; two stem reduction cells: 16, 8; then 8, 4, 4, 2, 2.
  assert shapes == [31, 16, 8, 8, 4, 4, 2, 2]
  assert net(x).shape == [1, body.feature_dim]


def test_amoeba_net_rejects_bad_configs():
  with pytest.raises(ValueError, match="genotype 'Z'"):
    amoeba_net.amoeba_net("Z")
  with pytest.raises(ValueError, match="multiple of 3"):
    amoeba_net.amoeba_net("D", num_normal_cells=4)
  with pytest.raises(ValueError, match="unknown AmoebaNet operation"):
    amoeba_net.operation_layers("conv_9x9", 8, 8, 1)


def test_drop_path_is_per_example_and_identity_in_eval():
  body = amoeba_net.amoeba_net("D", num_normal_cells=3, filters=8, image_size=16,
                               stem="cifar", stem_filters=8, drop_path_keep_prob=0.5)
  net = body.stack.instantiate()
  x = tf.random.normal([8, 16, 16, 3])
  with base_layer.step_context(training=False):
    a, b = net(x), net(x)
  np.testing.assert_array_equal(a.numpy(), b.numpy())
  # The mask of an example depends on its position in the mini-batch, so a
  # micro-batch at offset 4 draws the rows 4.. of the whole batch's mask.
  cell = net.layers[1]
  with base_layer.step_context(training=True, step=3):
    full = cell._drop_path(tf.ones([8, 2, 2, 1]), 0).numpy()
  with base_layer.step_context(training=True, step=3, example_offset=4):
    part = cell._drop_path(tf.ones([4, 2, 2, 1]), 0).numpy()
  np.testing.assert_array_equal(full[4:], part)
  kept = full[:, 0, 0, 0] > 0
  keep = amoeba_net.drop_path_keep_prob(0.5, cell.params.cell_index, cell.params.num_cells,
                                        3, 0)
  np.testing.assert_allclose(full[kept], 1.0 / keep, rtol=1e-6)


def numpy_attention(q_in, kv_in, wq, wk, wv, wo, num_heads, mask):
  """Reference multi-head attention in numpy; mask [T, S] True = may attend."""
  q, k, v = q_in @ wq, kv_in @ wk, kv_in @ wv
  b, t, _ = q.shape
  head = q.shape[-1] // num_heads
  out = np.zeros_like(q)
  for h in range(num_heads):
    sl = slice(h * head, (h + 1) * head)
    logits = np.einsum("btd,bsd->bts", q[..., sl], k[..., sl]) / math.sqrt(head)
    logits = np.where(mask[None], logits, -1e30)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out[..., sl] = np.einsum("bts,bsd->btd", probs, v[..., sl])
  return out @ wo


def test_multi_head_attention_matches_numpy_with_causal_mask():
  p = attention.MultiHeadAttention.Params().set(input_dim=8, num_heads=2, dim_per_head=6,
                                                use_bias=False)
  layer = p.instantiate()
  x = np.random.RandomState(0).normal(size=[2, 5, 8]).astype(np.float32)
  bias = attention.attention_bias(None, 5, causal=True)
  got = layer(tf.constant(x), None, bias).numpy()
  mask = np.tril(np.ones([5, 5], bool))
  want = numpy_attention(x, x, layer.query.w.numpy(), layer.key.w.numpy(),
                         layer.value.w.numpy(), layer.post.w.numpy(), 2, mask)
  assert_close(got, want)
  assert layer.query.w.shape == [8, 12]  # per-head dimension is its own parameter


def test_lm_stack_is_causal_and_counts_match():
  params = transformer.lm_stack(vocab_size=30, model_dim=16, hidden_dim=32, num_heads=2,
                                num_layers=2)
  stack = params.instantiate()
  ids = tf.constant(np.random.RandomState(1).randint(3, 30, size=[2, 7]), tf.int32)
  paddings = tf.zeros([2, 7])
  logits = stack(ids, paddings).numpy()
  assert logits.shape == (2, 7, 30)
  changed = tf.tensor_scatter_nd_update(ids, [[0, 5], [1, 6]], [4, 4])
  logits2 = stack(changed, paddings).numpy()
  assert_close(logits[:, :5], logits2[:, :5])
  assert not np.allclose(logits[0, 5:], logits2[0, 5:])
  assert real_param_count(stack) == shapes_only_count(params)
  # Per layer: 4 projections D×D + biases, two layer norms, the feed-forward block.
  d, h, v = 16, 32, 30
  per_layer = 4 * (d * d + d) + 2 * 2 * d + (d * h + h + h * d + d)
  assert real_param_count(stack) == v * d + 2 * per_layer + 2 * d + d * v + v


def test_encoder_decoder_ignores_padded_source_and_counts_match():
  params = transformer.encoder_decoder_stack(vocab_size=40, model_dim=16, hidden_dim=32,
                                             num_heads=2, num_layers=2, dim_per_head=4)
  stack = params.instantiate()
  rng = np.random.RandomState(2)
  src = tf.constant(rng.randint(3, 40, size=[2, 6]), tf.int32)
  src_pad = tf.constant([[0, 0, 0, 0, 1, 1], [0, 0, 0, 0, 0, 0]], tf.float32)
  tgt = tf.constant(rng.randint(3, 40, size=[2, 5]), tf.int32)
  tgt_pad = tf.zeros([2, 5])
  logits = stack(src, src_pad, tgt, tgt_pad).numpy()
  assert logits.shape == (2, 5, 40)
  other_src = tf.tensor_scatter_nd_update(src, [[0, 4], [0, 5]], [7, 9])
  assert_close(logits[0], stack(other_src, src_pad, tgt, tgt_pad).numpy()[0])
  assert real_param_count(stack) == shapes_only_count(params)


def test_deep_transformer_feed_forward_init_shrinks_with_depth():
  shallow = transformer.lm_stack(20, 16, 64, 2, num_layers=1).layers[1]
  deep = transformer.lm_stack(20, 16, 64, 2, num_layers=8).layers[1]
  assert deep.ff_init.scale == pytest.approx(shallow.ff_init.scale / 8)
