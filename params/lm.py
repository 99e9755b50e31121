"""Transformer language models: the GPipe paper's Table 1 and 2 models and a tiny one.

Table 1: vocabulary 32k, model dimension 2048, feed-forward 8192, 32 heads, sequence
1024; L layers pipelined over K cells (L3/K1 282.2M ... L1663/K128 83.9B). Full-size
models read LM1B through TFDS (--data_dir). Paper settings: Adam with linear warmup
and rsqrt decay (Adafactor for the largest, whose Adam slots would not fit), the
feed-forward initialization scaled down by depth, clipped logits, M ≥ 4K.
"""

from lingvo_gpipe import model_registry
from lingvo_gpipe.base_model_params import SingleTaskModelParams
from lingvo_gpipe.core import lr_schedules, optimizers
from lingvo_gpipe.inputs.synthetic_text import SyntheticLm
from lingvo_gpipe.inputs.tfds_inputs import TfdsLm
from lingvo_gpipe.models import transformer
from lingvo_gpipe.tasks.language_model import LanguageModelTask


class TransformerLm(SingleTaskModelParams):
  """A decoder-only Transformer LM on LM1B, pipelined over NUM_CELLS cells."""

  VOCAB_SIZE = 32000
  MODEL_DIM = 2048
  HIDDEN_DIM = 8192
  NUM_HEADS = 32
  NUM_LAYERS = 3
  SEQUENCE_LENGTH = 1024
  NUM_CELLS = 1
  NUM_MICRO_BATCHES = 4
  BATCH_SIZE = 32
  OPTIMIZER = "adam"
  KEEP_PROB = 0.9

  def task(self):
    p = LanguageModelTask.Params().set(name="transformer_lm", label_smoothing=0.0)
    p.stack = transformer.lm_stack(
        self.VOCAB_SIZE, self.MODEL_DIM, self.HIDDEN_DIM, self.NUM_HEADS, self.NUM_LAYERS,
        residual_keep_prob=self.KEEP_PROB, atten_keep_prob=self.KEEP_PROB,
        relu_keep_prob=self.KEEP_PROB, logits_abs_max=30.0)
    # Cells beyond the devices given wrap around, so every key can be inspected anywhere.
    p.pipeline.set(num_cells=self.NUM_CELLS, num_micro_batches=self.NUM_MICRO_BATCHES,
                   round_robin_devices=True)
    p.train.optimizer = self._optimizer()
    p.train.set(max_steps=100000, save_interval_steps=1000, summary_interval_steps=100,
                log_interval_steps=100)
    return p

  def _optimizer(self):
    schedule = lr_schedules.LinearWarmupRsqrtDecay.Params().set(warmup_steps=4000)
    if self.OPTIMIZER == "adafactor":
      return optimizers.Adafactor.Params().set(learning_rate=0.01, lr_schedule=schedule)
    return optimizers.Adam.Params().set(learning_rate=1e-3, beta1=0.9, beta2=0.98,
                                        epsilon=1e-9, lr_schedule=schedule,
                                        clip_gradient_norm=1.0)

  def _lm1b(self, split: str, training: bool):
    return TfdsLm.Params().set(name=f"lm1b_{split}", split=split, training=training,
                               sequence_length=self.SEQUENCE_LENGTH,
                               target_vocab_size=self.VOCAB_SIZE, batch_size=self.BATCH_SIZE,
                               shuffle_buffer=10000 if training else 0)

  def train_input(self):
    return self._lm1b("train", training=True)

  def eval_input(self):
    return self._lm1b("test", training=False).set(repeat=False)


@model_registry.register
class TransformerL3(TransformerLm):
  """Table 1: 3 layers, 1 cell (282.2M)."""
  NUM_LAYERS, NUM_CELLS, NUM_MICRO_BATCHES = 3, 1, 4


@model_registry.register
class TransformerL13(TransformerLm):
  """Table 1: 13 layers, 1 cell (785.8M)."""
  NUM_LAYERS, NUM_CELLS, NUM_MICRO_BATCHES = 13, 1, 4


@model_registry.register
class TransformerL103(TransformerLm):
  """Table 1: 103 layers, 8 cells (5.3B)."""
  NUM_LAYERS, NUM_CELLS, NUM_MICRO_BATCHES = 103, 8, 32
  OPTIMIZER = "adafactor"


@model_registry.register
class TransformerL415(TransformerLm):
  """Table 1: 415 layers, 32 cells (21.0B)."""
  NUM_LAYERS, NUM_CELLS, NUM_MICRO_BATCHES = 415, 32, 128
  OPTIMIZER = "adafactor"
  BATCH_SIZE = 128


@model_registry.register
class TransformerL1663(TransformerLm):
  """Table 1: 1663 layers, 128 cells (83.9B)."""
  NUM_LAYERS, NUM_CELLS, NUM_MICRO_BATCHES = 1663, 128, 512
  OPTIMIZER = "adafactor"
  BATCH_SIZE = 512


@model_registry.register
class Transformer48(TransformerLm):
  """Table 2 (throughput): 48 layers over K = 8 cells, M = 32 (override to compare)."""
  NUM_LAYERS, NUM_CELLS, NUM_MICRO_BATCHES = 48, 8, 32


@model_registry.register
class TransformerTiny(SingleTaskModelParams):
  """2-layer, 64-wide LM on the synthetic corpus, 2 cells and 4 micro-batches (CPU); the
  softmax projects with the embedding table (tied: one [V, 64] variable, read by the
  first cell and the last)."""

  def task(self):
    vocab_size = self.train_input().instantiate().vocab.size
    p = LanguageModelTask.Params().set(name="transformer_tiny")
    p.stack = transformer.lm_stack(vocab_size, model_dim=64, hidden_dim=256, num_heads=4,
                                   num_layers=2, residual_keep_prob=0.9,
                                   atten_keep_prob=0.9, relu_keep_prob=0.9,
                                   logits_abs_max=30.0, tie_embedding_softmax=True)
    p.pipeline.set(num_cells=2, num_micro_batches=4, round_robin_devices=True)
    p.train.optimizer = optimizers.Adam.Params().set(
        learning_rate=3e-3, beta1=0.9, beta2=0.98, epsilon=1e-9,
        lr_schedule=lr_schedules.CosineDecay.Params().set(warmup_steps=20, total_steps=300))
    p.train.set(max_steps=300, save_interval_steps=100, summary_interval_steps=10,
                log_interval_steps=25)
    return p

  def _corpus(self, split: str, num_examples: int):
    return SyntheticLm.Params().set(name=f"synthetic_lm_{split}", split=split,
                                    num_examples=num_examples, batch_size=32)

  def train_input(self):
    return self._corpus("train", 20000)

  def eval_input(self):
    return self._corpus("eval", 512).set(repeat=False)


@model_registry.register
class TransformerTinyBuckets(TransformerTiny):
  """TransformerTiny on long-tailed sentences (Zipf lengths, 4 to 46 words) batched by
  length buckets: each batch padded to its bucket's bound only, about 400 tokens per
  batch whatever the bucket (inputs/buckets.py)."""

  BUCKET_UPPER_BOUNDS = [8, 12, 16, 24, 32, 48]
  BUCKET_BATCH_SIZES = [48, 32, 24, 16, 12, 8]

  def _corpus(self, split: str, num_examples: int):
    return super()._corpus(split, num_examples).set(
        max_length=46, sequence_length=48, length_distribution="zipf",
        bucket_upper_bounds=self.BUCKET_UPPER_BOUNDS,
        bucket_batch_sizes=self.BUCKET_BATCH_SIZES)

