"""The synthetic image set: shapes, determinism, splits, learnable signal."""

import re

import numpy as np
import pytest

from lingvo_gpipe.inputs.synthetic_images import SyntheticImages, class_templates


def first_batch(**overrides):
  p = SyntheticImages.Params().set(batch_size=16, num_examples=64, image_size=12,
                                   num_classes=4, **overrides)
  gen = p.instantiate()
  return gen, next(iter(gen.dataset()))


def test_shapes_specs_and_label_range():
  gen, batch = first_batch(num_channels=2)
  assert batch["image"].shape == (16, 12, 12, 2) and batch["label"].shape == (16,)
  spec = gen.batch_spec()
  assert spec["image"].shape.as_list() == [16, 12, 12, 2]
  labels = batch["label"].numpy()
  assert labels.min() >= 0 and labels.max() < 4


def test_deterministic_by_seed_and_split():
  _, a = first_batch()
  _, b = first_batch()
  np.testing.assert_array_equal(a["image"].numpy(), b["image"].numpy())
  _, other_seed = first_batch(seed=2)
  _, eval_split = first_batch(split="eval")
  assert not np.allclose(a["image"].numpy(), other_seed["image"].numpy())
  assert not np.allclose(a["image"].numpy(), eval_split["image"].numpy())


def test_examples_carry_their_class_template():
  # Without noise or shift, an image is its class template times a contrast > 0.
  templates = class_templates(4, 12, 3, seed=1234)
  _, batch = first_batch(noise_stddev=0.0, max_shift=0)
  for image, label in zip(batch["image"].numpy(), batch["label"].numpy()):
    correlations = [np.corrcoef(image.ravel(), t.ravel())[0, 1] for t in templates]
    assert int(np.argmax(correlations)) == label and max(correlations) > 0.999


def test_eval_pass_is_finite_and_bad_params_are_named():
  p = SyntheticImages.Params().set(batch_size=10, num_examples=35, repeat=False)
  assert sum(1 for _ in p.instantiate().dataset()) == 3  # partial batch dropped
  with pytest.raises(ValueError, match="split must be one of"):
    SyntheticImages.Params().set(split="dev").instantiate()
  with pytest.raises(ValueError, match="batch_size must be >= 1, got 0"):
    SyntheticImages.Params().set(batch_size=0).instantiate()


def test_autotuning_is_off_unless_asked_and_changes_no_batch():
  """tf.data's autotuning (its model thread, whose end can stall a freed iterator for
  up to a minute: docs/library.md) is off by default and on when asked; the batches
  are the same either way."""
  gen, _ = first_batch()
  assert gen.dataset().options().autotune.enabled is False
  tuned = gen.params.copy().set(autotune=True).instantiate()
  assert tuned.dataset().options().autotune.enabled is True
  for a, b in zip(gen.dataset().take(3), tuned.dataset().take(3)):
    for key in a:
      np.testing.assert_array_equal(a[key].numpy(), b[key].numpy())


def test_an_unknown_word_fails_the_in_graph_encode_by_name_even_if_not_utf8():
  """A source word not in the vocabulary fails `translate` with an InvalidArgumentError
  naming it; one that is not UTF-8 too (its raw bytes made the message undecodable: a
  Python UnicodeDecodeError), shown with U+FFFD."""
  import tensorflow as tf

  from lingvo_gpipe.inputs.vocabulary import WordVocabulary

  vocab = WordVocabulary(["hello", "world"])
  table = vocab.lookup_table()
  ids = vocab.encode_in_graph(table, tf.constant(["hello world"]))
  assert ids.to_list() == [vocab.encode("hello world")]
  for text, shown in ((b"hello there", "there"),
                      (b"hello \xff\xfeworld", "\ufffd\ufffdworld")):
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"(?s)words not in the vocabulary:.*" + re.escape(shown)):
      tf.function(lambda texts: vocab.encode_in_graph(table, texts).flat_values)(
          tf.constant([text]))  # (traced, as the served translate is)
