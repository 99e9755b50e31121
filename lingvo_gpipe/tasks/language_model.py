"""Language modelling: a Transformer stack over token ids; log-perplexity per token."""

from __future__ import annotations

import tensorflow as tf

from lingvo_gpipe.core import layers
from lingvo_gpipe.core.hyperparams import ParamsError
from lingvo_gpipe.tasks.base_task import BaseTask, Metrics


def token_metrics(logits: tf.Tensor, labels: tf.Tensor, paddings: tf.Tensor,
                  label_smoothing: float = 0.0) -> Metrics:
  """Per-token metrics over the non-padded positions, weighted by their count.

  logits [B, T, V], labels [B, T] int, paddings [B, T] (1.0 = padded) →
  loss (cross-entropy with label smoothing), log_pplx (without), token_accuracy.
  """
  weights = 1.0 - tf.cast(paddings, tf.float32)
  num_tokens = tf.reduce_sum(weights)
  denominator = tf.maximum(num_tokens, 1.0)
  labels = tf.cast(labels, tf.int32)
  logits = tf.cast(logits, tf.float32)
  xent = layers.softmax_cross_entropy(logits, labels)
  loss = xent if not label_smoothing else layers.softmax_cross_entropy(
      logits, labels, label_smoothing)
  correct = tf.cast(tf.equal(tf.argmax(logits, axis=-1, output_type=tf.int32), labels),
                    tf.float32)
  return {
      "loss": (tf.reduce_sum(loss * weights) / denominator, num_tokens),
      "log_pplx": (tf.reduce_sum(xent * weights) / denominator, num_tokens),
      "token_accuracy": (tf.reduce_sum(correct * weights) / denominator, num_tokens),
  }


class LanguageModelTask(BaseTask):
  """batch {'ids': [B, T] int, 'labels': [B, T] int, 'paddings': [B, T]} → metrics.

  `stack` maps (ids, paddings) to logits [B, T, V] (transformer.lm_stack); it is the
  task's pipelined stack.
  """

  @classmethod
  def Params(cls):  # noqa: N802
    p = super().Params()
    p.define("stack", None, "Params of the layer stack: (ids, paddings) → logits [B, T, V].")
    p.define("label_smoothing", 0.0, "Label smoothing of the training loss.")
    return p

  def __init__(self, params):
    super().__init__(params)
    if self.params.stack is None:
      raise ParamsError(f"{self.path}: params.stack is not set")
    self.create_stack("stack", self.params.stack)

  def stack_inputs(self, batch: dict[str, tf.Tensor]) -> tuple[tf.Tensor, tf.Tensor]:
    return batch["ids"], tf.cast(batch["paddings"], tf.float32)

  def head_inputs(self, batch: dict[str, tf.Tensor]) -> dict[str, tf.Tensor]:
    return {"labels": batch["labels"], "paddings": batch["paddings"]}

  def head(self, logits: tf.Tensor, head_inputs: dict[str, tf.Tensor]) -> Metrics:
    with tf.device(self.output_device):
      return token_metrics(logits, head_inputs["labels"],
                           tf.cast(head_inputs["paddings"], tf.float32),
                           self.params.label_smoothing)
