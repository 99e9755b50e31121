"""Token vocabularies: reserved ids, language tags, words or subwords.

Every vocabulary reserves id 0 for padding, 1 for beginning-of-sentence and 2 for
end-of-sentence, then one id per language tag (`<2en>`: "translate into English"),
then its own tokens. Tokens of a `WordVocabulary` are whitespace-separated words; a
`SubwordVocabulary` wraps TFDS's subword text encoder (built from a corpus or
loaded from a file).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

import numpy as np
import tensorflow as tf

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
NUM_RESERVED = 3


class Vocabulary:
  """Base: reserved ids and language tags; subclasses map text to token ids."""

  def __init__(self, language_tags: Sequence[str] = ()):
    self.language_tags = list(language_tags)

  @property
  def num_reserved(self) -> int:
    return NUM_RESERVED + len(self.language_tags)

  @property
  def size(self) -> int:
    return self.num_reserved + self._num_tokens()

  def tag_id(self, language: str) -> int:
    """Id of the tag `<2{language}>`."""
    if language not in self.language_tags:
      raise ValueError(f"no tag for language {language!r}; tags: {self.language_tags}")
    return NUM_RESERVED + self.language_tags.index(language)

  def encode(self, text: str) -> list[int]:
    return [i + self.num_reserved for i in self._encode(text)]

  def decode(self, ids: Iterable[int]) -> str:
    """Text of `ids` up to the first EOS; padding, BOS and tags are dropped."""
    tokens = []
    for i in ids:
      i = int(i)
      if i == EOS_ID:
        break
      if i >= self.num_reserved:
        tokens.append(i - self.num_reserved)
    return self._decode(tokens)

  def _num_tokens(self) -> int:
    raise NotImplementedError

  def _encode(self, text: str) -> list[int]:
    raise NotImplementedError

  def _decode(self, ids: list[int]) -> str:
    raise NotImplementedError


class WordVocabulary(Vocabulary):
  """A fixed list of words; text is words separated by single spaces."""

  def __init__(self, words: Sequence[str], language_tags: Sequence[str] = ()):
    super().__init__(language_tags)
    self.words = list(words)
    self._index = {w: i for i, w in enumerate(self.words)}

  def _num_tokens(self) -> int:
    return len(self.words)

  def _encode(self, text: str) -> list[int]:
    try:
      return [self._index[w] for w in text.split()]
    except KeyError as e:
      raise ValueError(f"word {e.args[0]!r} is not in the vocabulary") from None

  def _decode(self, ids: list[int]) -> str:
    return " ".join(self.words[i] for i in ids if i < len(self.words))

  # In the graph, for serving functions (tasks/translation.py): the same maps as
  # encode and decode, as TensorFlow ops.

  def lookup_table(self) -> tf.lookup.StaticHashTable:
    """word → its id (−1: not a word of the vocabulary)."""
    return tf.lookup.StaticHashTable(tf.lookup.KeyValueTensorInitializer(
        tf.constant(self.words), tf.range(len(self.words), dtype=tf.int32) + self.num_reserved),
        default_value=-1)

  def encode_in_graph(self, table: tf.lookup.StaticHashTable,
                      texts: tf.Tensor) -> tf.RaggedTensor:
    """texts [B] string → ids [B, None] int32 (encode's; an unknown word fails the call
    with an InvalidArgumentError naming it)."""
    words = tf.strings.split(texts)
    ids = tf.ragged.map_flat_values(table.lookup, words)
    unknown = tf.boolean_mask(words.flat_values, ids.flat_values < 0)
    # (Bytes that are not UTF-8 shown as U+FFFD: raw, they made the error's message
    # undecodable, a Python UnicodeDecodeError instead of an InvalidArgumentError.)
    shown = tf.strings.unicode_transcode(unknown, "UTF-8", "UTF-8", errors="replace")
    check = tf.debugging.Assert(tf.size(unknown) == 0, [
        "words not in the vocabulary:", shown],
        summarize=5)
    with tf.control_dependencies([check]):
      return ids.with_flat_values(tf.identity(ids.flat_values))

  def decode_in_graph(self, ids: tf.Tensor) -> tf.Tensor:
    """ids [B, T] → texts [B] string (decode's: up to the first EOS, reserved ids and
    tags dropped, words joined by spaces)."""
    ids = tf.cast(ids, tf.int32)
    words = tf.gather(tf.constant([""] * self.num_reserved + self.words),
                      tf.clip_by_value(ids, 0, self.size - 1))
    keep = (tf.cumsum(tf.cast(tf.equal(ids, EOS_ID), tf.int32), axis=1) == 0) & \
        (ids >= self.num_reserved) & (ids < self.size)
    return tf.strings.reduce_join(tf.ragged.boolean_mask(words, keep), axis=1, separator=" ")


class SubwordVocabulary(Vocabulary):
  """TFDS's SubwordTextEncoder behind the reserved ids (a well-kept wordpiece builder)."""

  def __init__(self, encoder, language_tags: Sequence[str] = ()):
    super().__init__(language_tags)
    self.encoder = encoder

  @classmethod
  def build(cls, corpus: Iterable[str], target_size: int, vocab_file: str = "",
            language_tags: Sequence[str] = ()) -> SubwordVocabulary:
    """Loads `vocab_file` (its prefix) if it exists, else builds from `corpus` and saves it."""
    import tensorflow_datasets as tfds

    encoder_cls = tfds.deprecated.text.SubwordTextEncoder
    if vocab_file and os.path.exists(vocab_file + ".subwords"):
      return cls(encoder_cls.load_from_file(vocab_file), language_tags)
    encoder = encoder_cls.build_from_corpus(corpus, target_vocab_size=target_size)
    if vocab_file:
      encoder.save_to_file(vocab_file)
    return cls(encoder, language_tags)

  def _num_tokens(self) -> int:
    return self.encoder.vocab_size

  def _encode(self, text: str) -> list[int]:
    return self.encoder.encode(text)

  def _decode(self, ids: list[int]) -> str:
    return self.encoder.decode([i for i in ids if 0 < i < self.encoder.vocab_size])


def pad_to(ids: Sequence[int], length: int) -> tuple[np.ndarray, np.ndarray]:
  """(ids [length] int32 truncated or zero-padded, paddings [length] float32, 1 = pad)."""
  ids = list(ids)[:length]
  out = np.zeros([length], np.int32)
  out[:len(ids)] = ids
  paddings = np.ones([length], np.float32)
  paddings[:len(ids)] = 0.0
  return out, paddings
