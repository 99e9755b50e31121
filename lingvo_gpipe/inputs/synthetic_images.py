"""An offline image-classification set that small networks can learn.

Each class has a fixed template: a sum of a few 2-D sinusoids per channel with
class-specific frequencies, orientations, phases and colours (drawn from `seed`). An
example of class c is `contrast · roll(template_c, shift) + noise`: a random
circular shift (so the network must be translation invariant), a random contrast
and Gaussian pixel noise. Everything is a function of (seed, split, index), so the
set is identical on every run and machine, and train and eval never share noise.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from lingvo_gpipe.core.hyperparams import ParamsError
from lingvo_gpipe.inputs.base_input import BaseInputGenerator

_SPLIT_SEEDS = {"train": 1, "eval": 2, "test": 3}


def class_templates(num_classes: int, image_size: int, num_channels: int, seed: int,
                    num_waves: int = 3) -> np.ndarray:
  """Templates [num_classes, image_size, image_size, num_channels], unit std each."""
  rng = np.random.RandomState(seed)
  coords = np.arange(image_size) / image_size
  yy, xx = np.meshgrid(coords, coords, indexing="ij")
  templates = np.zeros([num_classes, image_size, image_size, num_channels], np.float32)
  max_freq = max(2, image_size // 4)
  for c in range(num_classes):
    for _ in range(num_waves):
      fy, fx = rng.randint(-max_freq, max_freq + 1, size=2)
      phase = rng.uniform(0, 2 * np.pi)
      colour = rng.normal(size=num_channels)
      wave = np.sin(2 * np.pi * (fy * yy + fx * xx) + phase)
      templates[c] += wave[..., None] * colour
    templates[c] /= templates[c].std() + 1e-6
  return templates


class SyntheticImages(BaseInputGenerator):
  """Examples {'image': float32 [H, W, C], 'label': int32 []}."""

  @classmethod
  def Params(cls):  # noqa: N802
    p = super().Params()
    p.define("image_size", 32, "Height and width H = W.")
    p.define("num_channels", 3, "Channels C.")
    p.define("num_classes", 10, "Number of classes.")
    p.define("num_examples", 50000, "Examples in one pass over the split.")
    p.define("split", "train", f"One of {sorted(_SPLIT_SEEDS)}; selects the noise.")
    p.define("template_seed", 1234, "Seed of the class templates (shared by all splits).")
    p.define("noise_stddev", 1.0, "Pixel noise; templates have unit std.")
    p.define("max_shift", 4, "Largest circular shift in pixels, each axis.")
    p.define("contrast_range", (0.6, 1.4), "Range of the random contrast factor.")
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    if p.split not in _SPLIT_SEEDS:
      raise ParamsError(f"{p.name}: split must be one of {sorted(_SPLIT_SEEDS)}, got {p.split!r}")
    for key in ("image_size", "num_channels", "num_examples"):
      if getattr(p, key) < 1:
        raise ParamsError(f"{p.name}: {key} must be >= 1, got {getattr(p, key)}")
    if p.num_classes < 2:
      raise ParamsError(f"{p.name}: num_classes must be >= 2, got {p.num_classes}")
    self.templates = tf.constant(class_templates(p.num_classes, p.image_size,
                                                 p.num_channels, p.template_seed))

  def _example(self, index: tf.Tensor) -> dict[str, tf.Tensor]:
    p = self.params
    seed = tf.stack([tf.constant(p.seed * 1000 + _SPLIT_SEEDS[p.split], tf.int64), index])
    seeds = tf.random.experimental.stateless_split(seed, num=4)
    label = tf.random.stateless_uniform([], seeds[0], 0, p.num_classes, dtype=tf.int32)
    shift = tf.random.stateless_uniform([2], seeds[1], -p.max_shift, p.max_shift + 1,
                                        dtype=tf.int32)
    low, high = p.contrast_range
    contrast = tf.random.stateless_uniform([], seeds[2], low, high)
    noise = tf.random.stateless_normal([p.image_size, p.image_size, p.num_channels],
                                       seeds[3], stddev=p.noise_stddev)
    image = tf.roll(self.templates[label], shift, axis=[0, 1]) * contrast + noise
    return {"image": image, "label": label}

  def id_space_size(self) -> int:
    return self.params.num_classes

  def examples(self) -> tf.data.Dataset:
    return tf.data.Dataset.range(self.params.num_examples).map(
        self._example, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
