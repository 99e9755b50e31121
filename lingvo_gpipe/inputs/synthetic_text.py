"""Offline text sets a small Transformer can learn: an LM corpus and a multilingual
many-to-English translation corpus.

The target language ("en") has `num_words` words and a first-order grammar: each
word has a few likely successors. Every source language has a lexicon (a random
bijection onto its own words, except a fraction of shared words spelled as in
English, so that copying the source is a weak but non-zero baseline) and a word
order: 'same', 'reversed' or 'swapped' (adjacent pairs exchanged). Languages are
sampled with unequal rates (high- and low-resource). Sources start with the target
tag `<2en>`; each example records its source language so BLEU is reported per
language. Everything is a function of (seed, split), identical on every machine.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import tensorflow as tf

from lingvo_gpipe.core.hyperparams import ParamsError
from lingvo_gpipe.inputs import vocabulary
from lingvo_gpipe.inputs.base_input import BaseInputGenerator
from lingvo_gpipe.inputs.buckets import SequenceGroup

_SPLIT_SEEDS = {"train": 1, "eval": 2, "test": 3}
LENGTH_DISTRIBUTIONS = ("uniform", "zipf")
WORD_ORDERS = ("same", "reversed", "swapped")


def _choices(rng: np.random.RandomState, probs: np.ndarray, n: int | None = None) -> Any:
  """`rng.choice(len(probs), n, p=probs)`, the same draws from the same stream (one
  uniform double per choice, looked up in the cumulative sums, as numpy's legacy
  `choice` does) without its per-call checks, which were most of the time of making
  20,000 sentences (2.4 s per input generator, paid by every trainer start)."""
  cdf = np.cumsum(probs)
  cdf /= cdf[-1]
  return cdf.searchsorted(rng.random_sample(n), side="right")


@dataclasses.dataclass
class SyntheticLanguages:
  """The target grammar and the source languages' lexicons and word orders."""
  num_words: int
  num_languages: int
  shared_fraction: float
  seed: int

  def __post_init__(self):
    rng = np.random.RandomState(self.seed)
    n = self.num_words
    # Each word's successors: 3 preferred words with most of the probability mass.
    self.successors = rng.randint(0, n, size=[n, 3])
    self.successor_probs = np.array([0.6, 0.25, 0.15])
    self.target_words = [f"en{i}" for i in range(n)]
    self.lexicons, self.source_words = [], []
    for lang in range(self.num_languages):
      shared = rng.rand(n) < self.shared_fraction
      perm = rng.permutation(n)
      self.lexicons.append([self.target_words[w] if shared[w] else f"x{lang}_{perm[w]}"
                            for w in range(n)])
      self.source_words += [f"x{lang}_{i}" for i in range(n)]

  @property
  def language_names(self) -> list[str]:
    return [f"x{lang}" for lang in range(self.num_languages)]

  def word_order(self, lang: int) -> str:
    return WORD_ORDERS[lang % len(WORD_ORDERS)]

  def vocabulary(self) -> vocabulary.WordVocabulary:
    return vocabulary.WordVocabulary(self.target_words + self.source_words,
                                     language_tags=["en"])

  def sentence(self, rng: np.random.RandomState, length: int) -> list[int]:
    words = [rng.randint(self.num_words)]
    for choice in _choices(rng, self.successor_probs, length - 1):
      words.append(int(self.successors[words[-1], choice]))
    return words

  def translate_to_source(self, words: list[int], lang: int) -> list[str]:
    src = [self.lexicons[lang][w] for w in words]
    order = self.word_order(lang)
    if order == "reversed":
      src = src[::-1]
    elif order == "swapped":
      for i in range(0, len(src) - 1, 2):
        src[i], src[i + 1] = src[i + 1], src[i]
    return src


class _SyntheticText(BaseInputGenerator):
  """Shared params and the in-memory examples of both synthetic text inputs."""

  @classmethod
  def Params(cls):  # noqa: N802
    p = super().Params()
    p.define("split", "train", f"One of {sorted(_SPLIT_SEEDS)}.")
    p.define("num_examples", 20000, "Examples in one pass over the split.")
    p.define("num_words", 40, "Words of the target language.")
    p.define("num_languages", 4, "Source languages (translation).")
    p.define("shared_fraction", 0.3, "Fraction of words a source language shares with en.")
    p.define("min_length", 4, "Shortest sentence in words.")
    p.define("max_length", 10, "Longest sentence in words.")
    p.define("sequence_length", 12, "Padded length of every sequence (BOS/EOS included).")
    p.define("length_distribution", "uniform", "How sentence lengths in [min_length, "
             f"max_length] are drawn: one of {LENGTH_DISTRIBUTIONS}. 'uniform': each length "
             "alike; 'zipf': P(n) ∝ 1 / (n − min_length + 1), mostly short sentences with a "
             "long tail, as real text has (what length buckets are for).")
    p.define("language_seed", 4321, "Seed of the grammar and lexicons (shared by splits).")
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    if p.split not in _SPLIT_SEEDS:
      raise ParamsError(f"{p.name}: split must be one of {sorted(_SPLIT_SEEDS)}, got {p.split!r}")
    if not 1 <= p.min_length <= p.max_length <= p.sequence_length - 2:
      raise ParamsError(f"{p.name}: need 1 <= min_length <= max_length <= sequence_length - 2 "
                       "(room for a tag or BOS, and EOS), got "
                       f"{p.min_length}, {p.max_length}, {p.sequence_length}")
    if p.num_examples < 1 or p.num_words < 2 or p.num_languages < 1:
      raise ParamsError(f"{p.name}: num_examples, num_languages must be >= 1 and num_words "
                       ">= 2")
    if p.length_distribution not in LENGTH_DISTRIBUTIONS:
      raise ParamsError(f"{p.name}: length_distribution must be one of "
                        f"{LENGTH_DISTRIBUTIONS}, got {p.length_distribution!r}")
    self.languages = SyntheticLanguages(p.num_words, p.num_languages, p.shared_fraction,
                                        p.language_seed)
    self.vocab = self.languages.vocabulary()
    self._cached: dict[str, np.ndarray] | None = None

  def id_space_size(self) -> int:
    return self.vocab.size

  def _length(self) -> int:
    p = self.params
    if p.length_distribution == "zipf":
      ranks = np.arange(1, p.max_length - p.min_length + 2)
      return p.min_length + int(_choices(self._rng, (1 / ranks) / np.sum(1 / ranks)))
    return self._rng.randint(p.min_length, p.max_length + 1)

  def _arrays(self) -> dict[str, np.ndarray]:
    raise NotImplementedError

  def examples(self) -> tf.data.Dataset:
    if self._cached is None:
      p = self.params
      self._rng = np.random.RandomState(p.seed * 1000 + _SPLIT_SEEDS[p.split])
      self._cached = self._arrays()
    return tf.data.Dataset.from_tensor_slices(self._cached)


class SyntheticLm(_SyntheticText):
  """{'ids': [T] int32 (BOS + sentence), 'labels': [T] (sentence + EOS), 'paddings': [T]}."""

  def sequence_groups(self) -> list[SequenceGroup]:
    return [SequenceGroup("paddings", ("ids", "labels", "paddings"),
                          self.params.sequence_length)]

  def _arrays(self):
    p = self.params
    ids, labels, paddings = [], [], []
    for _ in range(p.num_examples):
      words = self.vocab.encode(" ".join(
          self.languages.target_words[w] for w in self.languages.sentence(self._rng,
                                                                          self._length())))
      x, pad = vocabulary.pad_to([vocabulary.BOS_ID] + words, p.sequence_length)
      y, _ = vocabulary.pad_to(words + [vocabulary.EOS_ID], p.sequence_length)
      ids.append(x)
      labels.append(y)
      paddings.append(pad)
    return {"ids": np.stack(ids), "labels": np.stack(labels), "paddings": np.stack(paddings)}


class SyntheticTranslation(_SyntheticText):
  """Many-to-English examples of the synthetic languages.

  {'src_ids': [S] (<2en> + source + EOS), 'src_paddings': [S],
   'tgt_ids': [T] (BOS + target), 'tgt_labels': [T] (target + EOS), 'tgt_paddings': [T],
   'language': [] int32 (source language index)}, S = sequence_length, T =
  target_sequence_length (S when None). A sentence of n words is n source and n target
  tokens, so T >= max_length + 1 (BOS or EOS beside the target).
  """

  @classmethod
  def Params(cls):  # noqa: N802
    p = super().Params()
    p.define("language_rates", None, "Sampling weight of each source language (None: "
             "0.5^index, so the first languages are high-resource and the last low).")
    p.define("target_sequence_length", None, "Padded length T of the target sequences "
             "(None: sequence_length). Real translation data has S != T.")
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    self.target_length = (p.sequence_length if p.target_sequence_length is None
                          else p.target_sequence_length)
    if (not isinstance(self.target_length, int) or isinstance(self.target_length, bool)
        or self.target_length < p.max_length + 1):
      raise ParamsError(f"{p.name}: target_sequence_length must be an int >= max_length + 1 "
                        f"= {p.max_length + 1} (the target and BOS or EOS), got "
                        f"{p.target_sequence_length!r}")
    rates = p.language_rates or [0.5 ** i for i in range(p.num_languages)]
    if len(rates) != p.num_languages or min(rates) <= 0:
      raise ParamsError(f"{p.name}: language_rates must be {p.num_languages} positive "
                       f"weights, got {rates}")
    self.rates = np.asarray(rates, np.float64) / np.sum(rates)

  @property
  def language_names(self) -> list[str]:
    return self.languages.language_names

  def sequence_groups(self) -> list[SequenceGroup]:
    return [SequenceGroup("src_paddings", ("src_ids", "src_paddings"),
                          self.params.sequence_length),
            SequenceGroup("tgt_paddings", ("tgt_ids", "tgt_labels", "tgt_paddings"),
                          self.target_length)]

  def _arrays(self):
    p = self.params
    out = {k: [] for k in ("src_ids", "src_paddings", "tgt_ids", "tgt_labels",
                           "tgt_paddings", "language")}
    tag = self.vocab.tag_id("en")
    for _ in range(p.num_examples):
      lang = int(_choices(self._rng, self.rates))
      words = self.languages.sentence(self._rng, self._length())
      target = self.vocab.encode(" ".join(self.languages.target_words[w] for w in words))
      source = self.vocab.encode(" ".join(self.languages.translate_to_source(words, lang)))
      src, src_pad = vocabulary.pad_to([tag] + source + [vocabulary.EOS_ID],
                                       p.sequence_length)
      tgt, tgt_pad = vocabulary.pad_to([vocabulary.BOS_ID] + target, self.target_length)
      labels, _ = vocabulary.pad_to(target + [vocabulary.EOS_ID], self.target_length)
      for key, value in (("src_ids", src), ("src_paddings", src_pad), ("tgt_ids", tgt),
                         ("tgt_labels", labels), ("tgt_paddings", tgt_pad),
                         ("language", np.int32(lang))):
        out[key].append(value)
    return {k: np.stack(v) for k, v in out.items()}
