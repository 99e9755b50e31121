"""Input generators over TensorFlow Datasets: CIFAR-10/100, ImageNet, LM1B, and
many-to-English translation from WMT pairs.

`data_dir` (the trainer's --data_dir) points TFDS at prepared data; these machines
have no network, so tests run them under `tfds.testing.mock_data`. `batch_spec()`
is computed from the params, so a model can be inspected without any data.
"""

from __future__ import annotations

import os

import tensorflow as tf

from lingvo_gpipe.core.hyperparams import ParamsError
from lingvo_gpipe.inputs import vocabulary
from lingvo_gpipe.inputs.base_input import BaseInputGenerator
from lingvo_gpipe.inputs.buckets import SequenceGroup

IMAGE_DATASETS = {"cifar10": 10, "cifar100": 100, "imagenet2012": 1000}
# Per-channel statistics of the training sets, for pixels in [0, 1].
_MEAN_STD = {
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
    "imagenet2012": ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
}


class MissingDataError(ValueError):
  """A TFDS dataset that is not prepared where the params say; never downloaded here."""


def _missing(name: str, data_dir: str | None) -> MissingDataError:
  where = data_dir or "TFDS's default directory (~/tensorflow_datasets)"
  target = f" --data_dir={data_dir}" if data_dir else ""
  manual = (f" ({name} needs its archives in <data_dir>/downloads/manual first)"
            if name == "imagenet2012" else "")
  return MissingDataError(
      f"TFDS dataset {name!r} is not prepared in {where}; nothing is downloaded here: "
      f"prepare it on a machine with network (`tfds build {name}{target}`){manual} and "
      "copy it, or point --data_dir at the directory that holds it")


def _load(name: str, split: str, data_dir: str | None, shuffle_files: bool) -> tf.data.Dataset:
  """The prepared split; raises MissingDataError instead of downloading (a training run
  reads prepared data: no network here, and a download would write into data_dir)."""
  import tensorflow_datasets as tfds

  if data_dir and not os.path.isdir(os.path.join(data_dir, name)):
    raise _missing(name, data_dir)  # before TFDS logs its own warnings about the folder
  try:
    return tfds.load(name, split=split, data_dir=data_dir or None,
                     shuffle_files=shuffle_files, download=False)
  except AssertionError as e:  # TFDS's "Dataset X: could not find data in DIR"
    if "could not find data" not in str(e):
      raise
    raise _missing(name, data_dir) from None


class TfdsBase(BaseInputGenerator):
  """Params shared by the TFDS-backed inputs."""

  @classmethod
  def Params(cls):  # noqa: N802
    p = super().Params()
    p.define("dataset", "", "TFDS name.")
    p.define("split", "train", "TFDS split, e.g. 'train', 'validation', 'train[:90%]'.")
    p.define("data_dir", "", "Where the prepared TFDS data is ('' : TFDS's default).")
    p.define("training", True, "Training-time preprocessing (random crops, flips).")
    return p


class TfdsImages(TfdsBase):
  """{'image': float32 [S, S, 3] normalized, 'label': int32 []} from cifar10/100, imagenet2012.

  CIFAR (S = 32): training pads 4 pixels and takes a random 32×32 crop, flips left-right.
  ImageNet (S = image_size: 224, 331, 480...): training takes an Inception-style random
  crop (8%-100% of the area, aspect ratio 3/4-4/3) resized to S, and a flip; eval takes
  the central 87.5% and resizes it. Pixels are normalized by the set's channel statistics.
  """

  @classmethod
  def Params(cls):  # noqa: N802
    p = super().Params()
    p.dataset = "cifar10"
    p.define("image_size", 32, "Output height and width S.")
    return p

  def __init__(self, params):
    super().__init__(params)
    if params.dataset not in IMAGE_DATASETS:
      raise ParamsError(f"{params.name}: dataset must be one of {sorted(IMAGE_DATASETS)}, got "
                       f"{params.dataset!r}")
    if params.image_size < 8:
      raise ParamsError(f"{params.name}: image_size must be >= 8, got {params.image_size}")

  @property
  def num_classes(self) -> int:
    return IMAGE_DATASETS[self.params.dataset]

  def id_space_size(self) -> int:
    return self.num_classes

  def preprocess(self, image: tf.Tensor, seed: tf.Tensor) -> tf.Tensor:
    """uint8 [H, W, 3] → float32 [S, S, 3]; `seed` [2] makes the augmentation stateless."""
    p = self.params
    size = p.image_size
    if not p.training:
      return self.eval_view(image[None])[0]
    image = tf.image.convert_image_dtype(image, tf.float32)
    seeds = tf.random.experimental.stateless_split(seed, num=2)
    if p.dataset.startswith("cifar"):
      image = tf.image.resize(image, [size, size]) if image.shape[0] != size else image
      image = tf.image.pad_to_bounding_box(image, 4, 4, size + 8, size + 8)
      image = tf.image.stateless_random_crop(image, [size, size, 3], seeds[0])
    else:
      begin, crop_size, _ = tf.image.stateless_sample_distorted_bounding_box(
          tf.shape(image), tf.zeros([1, 0, 4]), seed=seeds[0], min_object_covered=0.1,
          aspect_ratio_range=(0.75, 1.33), area_range=(0.08, 1.0), max_attempts=10,
          use_image_if_no_bounding_boxes=True)
      image = tf.slice(image, begin, crop_size)
      image = tf.image.resize(image, [size, size])
    image = tf.image.stateless_random_flip_left_right(image, seeds[1])
    return tf.ensure_shape(self._normalized(image), [size, size, 3])

  def eval_view(self, images: tf.Tensor) -> tf.Tensor:
    """uint8 [B, H, W, 3] → float32 [B, S, S, 3]: what eval feeds the model (and a
    served model's classify_pixels): CIFAR resized to S where it is not; ImageNet's
    central 87.5% resized to S; normalized by the set's channel statistics."""
    p = self.params
    size = p.image_size
    images = tf.image.convert_image_dtype(images, tf.float32)
    if not p.dataset.startswith("cifar"):
      images = tf.image.central_crop(images, 0.875)
    if not p.dataset.startswith("cifar") or images.shape[1] != size or images.shape[2] != size:
      images = tf.image.resize(images, [size, size])
    return tf.ensure_shape(self._normalized(images), [None, size, size, 3])

  def _normalized(self, images: tf.Tensor) -> tf.Tensor:
    mean, std = _MEAN_STD[self.params.dataset]
    return (images - tf.constant(mean)) / tf.constant(std)

  def examples(self) -> tf.data.Dataset:
    p = self.params
    ds = _load(p.dataset, p.split, p.data_dir, shuffle_files=p.training)
    ds = ds.enumerate()

    def convert(index, example):
      seed = tf.stack([tf.constant(p.seed, tf.int64), index])
      return {"image": self.preprocess(example["image"], seed),
              "label": tf.cast(example["label"], tf.int32)}

    return ds.map(convert, num_parallel_calls=tf.data.AUTOTUNE)

  def full_batch_spec(self) -> dict[str, tf.TensorSpec]:
    p = self.params
    return {"image": tf.TensorSpec([p.batch_size, p.image_size, p.image_size, 3], tf.float32),
            "label": tf.TensorSpec([p.batch_size], tf.int32)}


class _TfdsText(TfdsBase):
  """Subword vocabulary handling shared by the text inputs."""

  @classmethod
  def Params(cls):  # noqa: N802
    p = super().Params()
    p.define("sequence_length", 256, "Padded length T of every sequence.")
    p.define("vocab_file", "", "Prefix of a saved subword vocabulary; built from the "
             "training data (and saved here, when set) if it does not exist.")
    p.define("target_vocab_size", 32000, "Approximate subword vocabulary size when building.")
    p.define("vocab_build_examples", 20000, "Sentences read to build the vocabulary.")
    return p

  def __init__(self, params):
    super().__init__(params)
    if params.sequence_length < 2:
      raise ParamsError(f"{params.name}: sequence_length must be >= 2, got "
                       f"{params.sequence_length}")
    self._vocab = None

  def _corpus(self):
    raise NotImplementedError

  def _language_tags(self) -> list[str]:
    return []

  @property
  def vocab(self) -> vocabulary.SubwordVocabulary:
    if self._vocab is None:
      self._vocab = vocabulary.SubwordVocabulary.build(
          self._corpus(), self.params.target_vocab_size, self.params.vocab_file,
          self._language_tags())
    return self._vocab

  def _encode(self, ids_fn, text_tensors, out_types):
    """Runs the Python tokenizer inside tf.data (the subword encoder is Python code)."""
    return tf.numpy_function(ids_fn, text_tensors, out_types, stateful=False)


class TfdsLm(_TfdsText):
  """LM1B sentences → {'ids': BOS + subwords, 'labels': subwords + EOS, 'paddings'}, [T]."""

  @classmethod
  def Params(cls):  # noqa: N802
    p = super().Params()
    p.dataset = "lm1b"
    return p

  def sequence_groups(self) -> list[SequenceGroup]:
    return [SequenceGroup("paddings", ("ids", "labels", "paddings"),
                          self.params.sequence_length)]

  def _corpus(self):
    p = self.params
    ds = _load(p.dataset, "train", p.data_dir, shuffle_files=False)
    for example in ds.take(p.vocab_build_examples):
      yield example["text"].numpy().decode("utf-8")

  def examples(self) -> tf.data.Dataset:
    p = self.params
    vocab, length = self.vocab, p.sequence_length

    def tokenize(text):
      words = vocab.encode(text.decode("utf-8"))
      ids, paddings = vocabulary.pad_to([vocabulary.BOS_ID] + words, length)
      labels, _ = vocabulary.pad_to(words + [vocabulary.EOS_ID], length)
      return ids, labels, paddings

    def convert(example):
      ids, labels, paddings = self._encode(tokenize, [example["text"]],
                                           [tf.int32, tf.int32, tf.float32])
      return {"ids": tf.ensure_shape(ids, [length]), "labels": tf.ensure_shape(labels, [length]),
              "paddings": tf.ensure_shape(paddings, [length])}

    ds = _load(p.dataset, p.split, p.data_dir, shuffle_files=p.training)
    return ds.map(convert, num_parallel_calls=tf.data.AUTOTUNE)

  def full_batch_spec(self) -> dict[str, tf.TensorSpec]:
    p = self.params
    shape = [p.batch_size, p.sequence_length]
    return {"ids": tf.TensorSpec(shape, tf.int32), "labels": tf.TensorSpec(shape, tf.int32),
            "paddings": tf.TensorSpec(shape, tf.float32)}


class TfdsManyToEnglish(_TfdsText):
  """Many-to-English translation mixed from TFDS pairs (e.g. wmt19_translate/de-en).

  `pairs` lists (tfds name, source language); the target is always 'en'. Languages
  are sampled with probability ∝ rate^(1/temperature) (`rates`: default equal), so
  low-resource pairs can be up-sampled. Every source starts with the tag `<2en>`.
  Examples as SyntheticTranslation's: src_ids/src_paddings/tgt_ids/tgt_labels/
  tgt_paddings [T] and language [] (index into `pairs`).
  """

  @classmethod
  def Params(cls):  # noqa: N802
    p = super().Params()
    p.dataset = "many_to_english"
    p.define("pairs", [("wmt19_translate/de-en", "de")],
             "(TFDS name, source language) of each language pair into English.")
    p.define("rates", None, "Relative size of each pair (None: equal).")
    p.define("temperature", 1.0, "Sampling temperature over the pairs' rates.")
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    if not p.pairs:
      raise ParamsError(f"{p.name}: pairs is empty; give (tfds name, source language) pairs")
    rates = p.rates or [1.0] * len(p.pairs)
    if len(rates) != len(p.pairs) or min(rates) <= 0 or p.temperature <= 0:
      raise ParamsError(f"{p.name}: rates must be {len(p.pairs)} positive numbers and "
                       f"temperature positive, got {rates}, {p.temperature}")
    weights = [r ** (1.0 / p.temperature) for r in rates]
    self.weights = [w / sum(weights) for w in weights]

  @property
  def language_names(self) -> list[str]:
    return [lang for _, lang in self.params.pairs]

  def _language_tags(self) -> list[str]:
    return ["en"]

  def sequence_groups(self) -> list[SequenceGroup]:
    length = self.params.sequence_length
    return [SequenceGroup("src_paddings", ("src_ids", "src_paddings"), length),
            SequenceGroup("tgt_paddings", ("tgt_ids", "tgt_labels", "tgt_paddings"), length)]

  def _corpus(self):
    p = self.params
    per_pair = max(p.vocab_build_examples // len(p.pairs), 1)
    for name, lang in p.pairs:
      for example in _load(name, "train", p.data_dir, shuffle_files=False).take(per_pair):
        yield example[lang].numpy().decode("utf-8")
        yield example["en"].numpy().decode("utf-8")

  def examples(self) -> tf.data.Dataset:
    p = self.params
    vocab, length = self.vocab, p.sequence_length
    tag = vocab.tag_id("en")

    def tokenize(source, target):
      src_words = vocab.encode(source.decode("utf-8"))
      tgt_words = vocab.encode(target.decode("utf-8"))
      src, src_pad = vocabulary.pad_to([tag] + src_words + [vocabulary.EOS_ID], length)
      tgt, tgt_pad = vocabulary.pad_to([vocabulary.BOS_ID] + tgt_words, length)
      labels, _ = vocabulary.pad_to(tgt_words + [vocabulary.EOS_ID], length)
      return src, src_pad, tgt, labels, tgt_pad

    def pair_dataset(index: int, name: str, lang: str) -> tf.data.Dataset:
      def convert(example):
        out = self._encode(tokenize, [example[lang], example["en"]],
                           [tf.int32, tf.float32, tf.int32, tf.int32, tf.float32])
        keys = ("src_ids", "src_paddings", "tgt_ids", "tgt_labels", "tgt_paddings")
        result = {k: tf.ensure_shape(v, [length]) for k, v in zip(keys, out)}
        result["language"] = tf.constant(index, tf.int32)
        return result

      ds = _load(name, p.split, p.data_dir, shuffle_files=p.training)
      if p.repeat:
        ds = ds.repeat()
      return ds.map(convert, num_parallel_calls=tf.data.AUTOTUNE)

    datasets = [pair_dataset(i, name, lang) for i, (name, lang) in enumerate(p.pairs)]
    if len(datasets) == 1:
      return datasets[0]
    if not p.repeat:  # eval: every example of every pair once
      out = datasets[0]
      for ds in datasets[1:]:
        out = out.concatenate(ds)
      return out
    return tf.data.Dataset.sample_from_datasets(datasets, self.weights, seed=p.seed)

  def full_batch_spec(self) -> dict[str, tf.TensorSpec]:
    p = self.params
    shape = [p.batch_size, p.sequence_length]
    spec = {k: tf.TensorSpec(shape, tf.int32) for k in ("src_ids", "tgt_ids", "tgt_labels")}
    spec.update({k: tf.TensorSpec(shape, tf.float32) for k in ("src_paddings",
                                                               "tgt_paddings")})
    spec["language"] = tf.TensorSpec([p.batch_size], tf.int32)
    return spec
