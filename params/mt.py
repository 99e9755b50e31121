"""Multilingual many-to-English Transformers (GPipe §5) and a tiny one.

T(L, H, A): L encoder and L decoder layers, feed-forward H, A attention heads of 64
dimensions each, model dimension 1024, a shared 64k subword vocabulary over the
source languages and English, every source tagged `<2en>`. The paper trained on an
internal corpus of 103 languages; the full-size keys here read the WMT pairs TFDS
has (`train_input.pairs`; point --data_dir at prepared data), with temperature
sampling between high- and low-resource pairs. Paper settings: Adafactor-style
optimizer with warmup, label smoothing 0.1, M ≥ 4K.
"""

from lingvo_gpipe import model_registry
from lingvo_gpipe.base_model_params import SingleTaskModelParams
from lingvo_gpipe.core import lr_schedules, optimizers
from lingvo_gpipe.inputs.synthetic_text import SyntheticTranslation
from lingvo_gpipe.inputs.tfds_inputs import TfdsManyToEnglish
from lingvo_gpipe.models import transformer
from lingvo_gpipe.tasks.translation import TranslationTask

WMT_PAIRS = [
    ("wmt19_translate/de-en", "de"), ("wmt19_translate/ru-en", "ru"),
    ("wmt19_translate/zh-en", "zh"), ("wmt19_translate/cs-en", "cs"),
    ("wmt19_translate/fi-en", "fi"), ("wmt19_translate/lt-en", "lt"),
    ("wmt19_translate/kk-en", "kk"), ("wmt19_translate/gu-en", "gu"),
]


class MultilingualTransformer(SingleTaskModelParams):
  """T(NUM_LAYERS, HIDDEN_DIM, NUM_HEADS) many-to-English, over NUM_CELLS cells."""

  VOCAB_SIZE = 64000
  MODEL_DIM = 1024
  DIM_PER_HEAD = 64
  NUM_LAYERS = 6
  HIDDEN_DIM = 8192
  NUM_HEADS = 16
  NUM_LANGUAGES = 103  # the paper's corpus; WMT_PAIRS are those TFDS can provide
  SEQUENCE_LENGTH = 128
  NUM_CELLS = 1
  NUM_MICRO_BATCHES = 4
  BATCH_SIZE = 256

  def task(self):
    p = TranslationTask.Params().set(name="multilingual", label_smoothing=0.1)
    p.stack = transformer.encoder_decoder_stack(
        self.VOCAB_SIZE, self.MODEL_DIM, self.HIDDEN_DIM, self.NUM_HEADS, self.NUM_LAYERS,
        dim_per_head=self.DIM_PER_HEAD, residual_keep_prob=0.9, atten_keep_prob=0.9,
        relu_keep_prob=0.9, logits_abs_max=30.0)
    p.pipeline.set(num_cells=self.NUM_CELLS, num_micro_batches=self.NUM_MICRO_BATCHES,
                   round_robin_devices=True)
    p.train.optimizer = optimizers.Adafactor.Params().set(
        learning_rate=0.01,
        lr_schedule=lr_schedules.LinearWarmupRsqrtDecay.Params().set(warmup_steps=4000))
    p.train.set(max_steps=500000, save_interval_steps=1000, summary_interval_steps=100,
                log_interval_steps=100)
    return p

  def _pairs(self, split: str, training: bool):
    return TfdsManyToEnglish.Params().set(
        name=f"many_to_english_{split}", pairs=list(WMT_PAIRS), split=split,
        training=training, temperature=5.0, sequence_length=self.SEQUENCE_LENGTH,
        target_vocab_size=self.VOCAB_SIZE, batch_size=self.BATCH_SIZE)

  def train_input(self):
    return self._pairs("train", training=True)

  def eval_input(self):
    return self._pairs("validation", training=False).set(repeat=False)


@model_registry.register
class Multilingual400M(MultilingualTransformer):
  """T(6, 8192, 16), 1 cell: 400M."""
  NUM_LAYERS, HIDDEN_DIM, NUM_HEADS, NUM_CELLS, NUM_MICRO_BATCHES = 6, 8192, 16, 1, 4


@model_registry.register
class MultilingualDeep1p3B(MultilingualTransformer):
  """T(24, 8192, 16), 4 cells: 1.3B."""
  NUM_LAYERS, HIDDEN_DIM, NUM_HEADS, NUM_CELLS, NUM_MICRO_BATCHES = 24, 8192, 16, 4, 16


@model_registry.register
class MultilingualWide1p3B(MultilingualTransformer):
  """T(12, 16384, 32), 2 cells: 1.3B."""
  NUM_LAYERS, HIDDEN_DIM, NUM_HEADS, NUM_CELLS, NUM_MICRO_BATCHES = 12, 16384, 32, 2, 8


@model_registry.register
class Multilingual3B(MultilingualTransformer):
  """T(32, 16384, 32), 8 cells: 3B."""
  NUM_LAYERS, HIDDEN_DIM, NUM_HEADS, NUM_CELLS, NUM_MICRO_BATCHES = 32, 16384, 32, 8, 32


@model_registry.register
class Multilingual128L6B(MultilingualTransformer):
  """T(64, 16384, 32), 16 cells: 6B, 128 layers."""
  NUM_LAYERS, HIDDEN_DIM, NUM_HEADS, NUM_CELLS, NUM_MICRO_BATCHES = 64, 16384, 32, 16, 64


@model_registry.register
class MultilingualTiny(SingleTaskModelParams):
  """T(2, 256, 4) at model dim 64 on the synthetic many-to-English corpus (CPU); source
  embedding, target embedding and softmax share one table."""

  def task(self):
    vocab_size = self.train_input().instantiate().vocab.size
    p = TranslationTask.Params().set(name="multilingual_tiny", label_smoothing=0.1)
    p.stack = transformer.encoder_decoder_stack(
        vocab_size, model_dim=64, hidden_dim=256, num_heads=4, num_layers=2, dim_per_head=16,
        logits_abs_max=30.0, tie_embedding_softmax=True)
    p.pipeline.set(num_cells=2, num_micro_batches=4, round_robin_devices=True)
    p.train.optimizer = optimizers.Adam.Params().set(
        learning_rate=3e-3, beta1=0.9, beta2=0.98, epsilon=1e-9,
        lr_schedule=lr_schedules.CosineDecay.Params().set(warmup_steps=30, total_steps=600))
    p.train.set(max_steps=600, save_interval_steps=200, summary_interval_steps=20,
                log_interval_steps=50)
    return p

  def _corpus(self, split: str, num_examples: int):
    return SyntheticTranslation.Params().set(name=f"synthetic_mt_{split}", split=split,
                                             num_examples=num_examples, batch_size=32)

  def train_input(self):
    return self._corpus("train", 20000)

  def eval_input(self):
    return self._corpus("eval", 512).set(repeat=False)


@model_registry.register
class MultilingualTinyBuckets(MultilingualTiny):
  """MultilingualTiny on long-tailed sentences (Zipf lengths, 4 to 30 words) batched by
  length buckets of about 384 tokens per batch (inputs/buckets.py): each batch padded to
  its bucket's bound, source and target alike."""

  BUCKET_UPPER_BOUNDS = [8, 12, 16, 24, 32]
  BUCKET_BATCH_SIZES = [48, 32, 24, 16, 12]

  def _corpus(self, split: str, num_examples: int):
    return super()._corpus(split, num_examples).set(
        max_length=30, sequence_length=32, length_distribution="zipf",
        bucket_upper_bounds=self.BUCKET_UPPER_BOUNDS,
        bucket_batch_sizes=self.BUCKET_BATCH_SIZES)

