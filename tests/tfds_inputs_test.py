"""TFDS input generators under tfds.testing.mock_data (no network): shapes, and the
preprocessing checked against the raw examples."""

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_datasets as tfds
from numerics import assert_close

from lingvo_gpipe.inputs import tfds_inputs, vocabulary


def first_batch(input_params):
  gen = input_params.instantiate()
  batch = next(iter(gen.dataset()))
  spec = gen.batch_spec()
  assert {k: (v.shape, v.dtype) for k, v in batch.items()} == \
      {k: (v.shape, v.dtype) for k, v in spec.items()}
  return gen, batch


@pytest.mark.parametrize("dataset,classes", [("cifar10", 10), ("cifar100", 100)])
def test_cifar_eval_is_normalized_pixels_of_the_raw_images(dataset, classes):
  with tfds.testing.mock_data(num_examples=8):
    params = tfds_inputs.TfdsImages.Params().set(dataset=dataset, split="test",
                                                 training=False, batch_size=4, repeat=False)
    gen, batch = first_batch(params)
    raw = [ex for ex in tfds.load(dataset, split="test").take(4)]
  mean, std = tfds_inputs._MEAN_STD[dataset]
  want = np.stack([(ex["image"].numpy() / 255.0 - mean) / std for ex in raw])
  assert_close(batch["image"].numpy(), want)
  np.testing.assert_array_equal(batch["label"].numpy(), [int(ex["label"]) for ex in raw])
  assert gen.num_classes == classes


def test_cifar_training_crops_are_shifted_windows_of_the_padded_image():
  with tfds.testing.mock_data(num_examples=4):
    params = tfds_inputs.TfdsImages.Params().set(dataset="cifar10", split="train", batch_size=2,
                                                 shuffle_buffer=0)
    gen = params.instantiate()
    raw = next(iter(tfds.load("cifar10", split="train", shuffle_files=False)))["image"].numpy()
    image = gen.preprocess(tf.constant(raw), tf.constant([3, 0], tf.int64)).numpy()
  mean, std = tfds_inputs._MEAN_STD["cifar10"]
  pixels = image * std + mean  # back to [0, 1]; padding shows as zeros
  padded = np.pad(raw / 255.0, [[4, 4], [4, 4], [0, 0]])
  windows = [padded[y:y + 32, x:x + 32] for y in range(9) for x in range(9)]
  candidates = windows + [w[:, ::-1] for w in windows]
  assert min(np.abs(pixels - w).max() for w in candidates) < 1e-5


@pytest.mark.parametrize("training", [True, False])
def test_imagenet_batches_have_the_requested_size(training):
  with tfds.testing.mock_data(num_examples=4):
    params = tfds_inputs.TfdsImages.Params().set(
        dataset="imagenet2012", split="train" if training else "validation",
        training=training, image_size=64, batch_size=2)
    _, batch = first_batch(params)
  assert batch["image"].shape == [2, 64, 64, 3]
  assert np.all(np.isfinite(batch["image"].numpy()))
  assert abs(float(tf.reduce_mean(batch["image"]))) < 3.0  # normalized, not raw pixels


def test_lm1b_ids_and_labels_are_the_subwords_of_the_text_shifted_by_one():
  with tfds.testing.mock_data(num_examples=6):
    params = tfds_inputs.TfdsLm.Params().set(split="test", training=False, batch_size=3,
                                             sequence_length=64, target_vocab_size=300,
                                             vocab_build_examples=6, repeat=False)
    gen, batch = first_batch(params)
    texts = [ex["text"].numpy().decode() for ex in tfds.load("lm1b", split="test").take(3)]
  ids, labels, paddings = (batch[k].numpy() for k in ("ids", "labels", "paddings"))
  for i, text in enumerate(texts):
    n = int((1 - paddings[i]).sum())
    assert ids[i, 0] == vocabulary.BOS_ID
    np.testing.assert_array_equal(ids[i, 1:n], labels[i, :n - 1])
    if n < 64:  # not truncated: the labels end with EOS and decode to the text
      assert labels[i, n - 1] == vocabulary.EOS_ID
      assert gen.vocab.decode(labels[i]) == text


def test_many_to_english_tags_sources_and_records_the_language(tmp_path):
  pairs = [("wmt14_translate/de-en", "de"), ("wmt14_translate/fr-en", "fr")]
  vocab_file = str(tmp_path / "vocab")
  with tfds.testing.mock_data(num_examples=4):
    params = tfds_inputs.TfdsManyToEnglish.Params().set(
        pairs=pairs, split="validation", training=False, batch_size=8, repeat=False,
        sequence_length=48, target_vocab_size=300, vocab_build_examples=8,
        vocab_file=vocab_file)
    gen, batch = first_batch(params)
    english = [ex["en"].numpy().decode() for name, _ in pairs
               for ex in tfds.load(name, split="validation").take(4)]
  assert (tmp_path / "vocab.subwords").exists()  # saved for the next run
  assert np.all(batch["src_ids"].numpy()[:, 0] == gen.vocab.tag_id("en"))
  np.testing.assert_array_equal(batch["language"].numpy(), [0] * 4 + [1] * 4)
  tgt_ids, labels = batch["tgt_ids"].numpy(), batch["tgt_labels"].numpy()
  assert np.all(tgt_ids[:, 0] == vocabulary.BOS_ID)
  for i, text in enumerate(english):
    if labels[i, -1] == 0:  # not truncated
      assert gen.vocab.decode(labels[i]) == text
  # A second generator loads the saved vocabulary instead of building it.
  with tfds.testing.mock_data(num_examples=4):
    again = params.copy().set(vocab_build_examples=1).instantiate()
    assert again.vocab.size == gen.vocab.size


def test_bad_dataset_names_the_valid_ones():
  with pytest.raises(ValueError, match="dataset must be one of .*cifar10"):
    tfds_inputs.TfdsImages.Params().set(dataset="mnist").instantiate()


@pytest.mark.parametrize("prepared_folder", [False, True])
def test_missing_data_is_reported_and_never_downloaded(tmp_path, prepared_folder):
  """With or without an (empty) dataset folder under data_dir: MissingDataError naming the
  dataset, the directory and how to prepare it; TFDS is not asked to download."""
  if prepared_folder:
    (tmp_path / "cifar10").mkdir()
  before = sorted(tmp_path.rglob("*"))
  params = tfds_inputs.TfdsImages.Params().set(dataset="cifar10", split="train", batch_size=2,
                                               data_dir=str(tmp_path))
  with pytest.raises(tfds_inputs.MissingDataError,
                     match=f"TFDS dataset 'cifar10' is not prepared in {tmp_path}; nothing is "
                     f"downloaded here: .*`tfds build cifar10 --data_dir={tmp_path}`"):
    params.instantiate().dataset()
  assert sorted(tmp_path.rglob("*")) == before
