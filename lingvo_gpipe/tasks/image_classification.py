"""Image classification: body network → softmax; cross-entropy, top-1 and top-5 accuracy."""

from __future__ import annotations

import tensorflow as tf

from lingvo_gpipe.core import layers
from lingvo_gpipe.core.hyperparams import ParamsError
from lingvo_gpipe.tasks import serving
from lingvo_gpipe.tasks.base_task import BaseTask, IdBound, Metrics


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

  @classmethod
  def id_bounds(cls, task_params) -> dict:
    classes = task_params.softmax.num_classes
    if not isinstance(classes, int) or isinstance(classes, bool):
      return {}
    return {"label": IdBound(classes, "task.softmax.num_classes", "the softmax's classes")}

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


  def serving_functions(self, model, input_generator, options) -> dict:
    """classify(images float32 [B, H, W, C], as the eval input makes them) →
    probabilities [B, N], top_k_classes [B, k], top_k_probabilities [B, k] (k = min(5,
    N)); and, where the input says how pixels become model inputs (TFDS images),
    classify_pixels(images uint8 [B, height, width, 3]) → the same."""
    del model, options  # no tables; the dtype is in the weights
    spec = input_generator.batch_spec()["image"]
    k = min(5, self.params.softmax.num_classes)

    def classify(images):
      # B = 0 runs on one example of zeros, its outputs then dropped: a convolution of
      # an empty batch gives its input's shape back on CPU (oneDNN), which the layers
      # after it refuse. (Data ops only: no branch around the pipeline.)
      count = tf.shape(images)[0]
      images = tf.pad(images, [[0, tf.maximum(1 - count, 0)]] + [[0, 0]] * (
          images.shape.rank - 1))
      features = self.serve_stack(images)
      if isinstance(features, tuple):  # (features, aux_logits): the aux head is training's
        features = features[0]
      with tf.device(self.output_device):
        probabilities = tf.nn.softmax(tf.cast(self.softmax(features), tf.float32))[:count]
        top_probabilities, top_classes = tf.math.top_k(probabilities, k)
      return {"probabilities": probabilities, "top_k_classes": top_classes,
              "top_k_probabilities": top_probabilities}

    functions = {"classify": serving.traced(
        {"images": tf.TensorSpec([None, *spec.shape[1:]], tf.float32)})(classify)}
    eval_view = getattr(input_generator, "eval_view", None)
    if eval_view is not None:
      def classify_pixels(images):
        return classify(eval_view(images))

      functions["classify_pixels"] = serving.traced(
          {"images": tf.TensorSpec([None, None, None, 3], tf.uint8)})(classify_pixels)
    return functions

  def serving_examples(self, model, batch: dict, input_generator) -> list[dict]:
    """decode mode: one eval batch through `classify` → one record per example {label,
    top_k_classes, top_k_probabilities}."""
    del input_generator
    out = model("classify", images=batch["image"])
    top, probabilities = out["top_k_classes"].numpy(), out["top_k_probabilities"].numpy()
    return [{"label": int(label), "top_k_classes": top[i].tolist(),
             "top_k_probabilities": [round(float(p), 6) for p in probabilities[i]]}
            for i, label in enumerate(batch["label"].numpy())]

  def serving_metrics(self, records, input_generator) -> dict[str, float]:
    """accuracy: the share of records whose first class is the label."""
    del input_generator
    return {"accuracy": sum(r["top_k_classes"][0] == r["label"] for r in records)
            / max(len(records), 1)}


def _top_k_accuracy(logits: tf.Tensor, labels: tf.Tensor, k: int) -> tf.Tensor:
  hits = tf.math.in_top_k(labels, tf.cast(logits, tf.float32), k)
  return tf.reduce_mean(tf.cast(hits, tf.float32))
