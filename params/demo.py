"""Small demo models that train on offline synthetic data in a minute or two."""

from lingvo_gpipe import model_registry
from lingvo_gpipe.base_model_params import SingleTaskModelParams
from lingvo_gpipe.core import layers, lr_schedules, optimizers
from lingvo_gpipe.inputs.synthetic_images import SyntheticImages
from lingvo_gpipe.tasks.image_classification import ImageClassificationTask


def conv_bn_relu(name: str, in_channels: int, out_channels: int) -> list:
  return [
      layers.Conv2D.Params().set(name=name, filter_shape=(3, 3, in_channels, out_channels)),
      layers.BatchNorm.Params().set(name=f"{name}_bn", dim=out_channels),
      layers.Activation.Params().set(name=f"{name}_relu", activation="RELU"),
  ]


@model_registry.register
class TinyConvNet(SingleTaskModelParams):
  """Two conv-BN-ReLU blocks and a softmax on 10-class 32×32 synthetic images."""

  IMAGE_SIZE = 32
  NUM_CLASSES = 10

  def task(self):
    p = ImageClassificationTask.Params().set(name="tiny_conv_net")
    p.body = layers.Sequential.Params().set(name="body", layers=[
        *conv_bn_relu("conv1", 3, 16),
        layers.Pooling.Params().set(name="pool1"),
        *conv_bn_relu("conv2", 16, 32),
        layers.GlobalPooling.Params().set(name="global_pool"),
    ])
    p.softmax.set(input_dim=32, num_classes=self.NUM_CLASSES)
    p.train.optimizer = optimizers.SGD.Params().set(
        learning_rate=0.05, momentum=0.9,
        lr_schedule=lr_schedules.CosineDecay.Params().set(warmup_steps=10, total_steps=200))
    p.train.set(max_steps=200, save_interval_steps=50, summary_interval_steps=10,
                log_interval_steps=20)
    return p

  def _images(self, split: str, num_examples: int):
    return SyntheticImages.Params().set(
        name=f"synthetic_{split}", split=split, batch_size=32, num_examples=num_examples,
        image_size=self.IMAGE_SIZE, num_classes=self.NUM_CLASSES, noise_stddev=2.5)

  def train_input(self):
    return self._images("train", 50000)

  def eval_input(self):
    return self._images("eval", 1024).set(repeat=False)
