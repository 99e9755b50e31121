"""Image classification: body network → softmax; cross-entropy, top-1 and top-5 accuracy."""

from __future__ import annotations

import tensorflow as tf

from lingvo_gpipe.core import layers
from lingvo_gpipe.core.hyperparams import ParamsError
from lingvo_gpipe.tasks.base_task import BaseTask, Metrics


class ImageClassificationTask(BaseTask):
  """batch {'image': [B, H, W, C] float, 'label': [B] int} → metrics.

  `body` maps images to features [B, D]; `softmax` maps features to logits [B, K].
  """

  @classmethod
  def Params(cls):  # noqa: N802
    p = super().Params()
    p.define("body", None, "Params of the network: images [B, H, W, C] → features [B, D].")
    p.define("softmax", layers.Softmax.Params(), "Params of the classifier.")
    p.define("aux_loss_weight", 0.4, "Weight of the auxiliary head's loss, when the body "
             "returns (features, aux_logits) (AmoebaNet with aux_head).")
    return p

  def __init__(self, params):
    super().__init__(params)
    if self.params.body is None:
      raise ParamsError(f"{self.path}: params.body is not set")
    self.create_stack("body", self.params.body)
    # Under pipelining the classifier sits with the last cell.
    with tf.device(self.output_device):
      self.create_child("softmax", self.params.softmax)

  def stack_inputs(self, batch: dict[str, tf.Tensor]) -> tf.Tensor:
    return batch["image"]

  def head_inputs(self, batch: dict[str, tf.Tensor]) -> dict[str, tf.Tensor]:
    return {"label": batch["label"]}

  def head(self, features, head_inputs: dict[str, tf.Tensor]) -> Metrics:
    aux_logits = None
    if isinstance(features, tuple):
      features, aux_logits = features
    with tf.device(self.output_device):
      return self._metrics(self.softmax(features), aux_logits, head_inputs)

  def _metrics(self, logits: tf.Tensor, aux_logits: tf.Tensor | None,
               batch: dict[str, tf.Tensor]) -> Metrics:
    labels = tf.cast(batch["label"], tf.int32)
    weight = tf.cast(tf.shape(labels)[0], tf.float32)
    xent = tf.reduce_mean(self.softmax.xent_loss(logits, labels))
    loss = xent
    if aux_logits is not None:
      aux_xent = tf.reduce_mean(self.softmax.xent_loss(aux_logits, labels))
      loss = xent + self.params.aux_loss_weight * aux_xent
    metrics = {
        "loss": (loss, weight),
        "accuracy": (_top_k_accuracy(logits, labels, 1), weight),
    }
    if aux_logits is not None:
      metrics["xent"] = (xent, weight)
    if self.params.softmax.num_classes > 5:
      metrics["top5_accuracy"] = (_top_k_accuracy(logits, labels, 5), weight)
    return metrics


def _top_k_accuracy(logits: tf.Tensor, labels: tf.Tensor, k: int) -> tf.Tensor:
  hits = tf.math.in_top_k(labels, tf.cast(logits, tf.float32), k)
  return tf.reduce_mean(tf.cast(hits, tf.float32))
