"""AmoebaNet image classifiers: the GPipe paper's Table 1 and 2 models and a tiny one.

AmoebaNet-<genotype> (L, D): L normal cells in all (three stacks of L/3), D filters in
the first stack. The full-size models read ImageNet through TFDS (--data_dir); their
`total_params` in --mode=inspect_model are the paper's (± a few %; README table).
Paper settings: RMSProp (decay 0.9, momentum 0.9, ε 1.0), exponential learning-rate
decay, label smoothing 0.1, drop-path, an auxiliary head, M ≥ 4K micro-batches.
"""

from lingvo_gpipe import model_registry
from lingvo_gpipe.base_model_params import SingleTaskModelParams
from lingvo_gpipe.core import lr_schedules, optimizers
from lingvo_gpipe.inputs.synthetic_images import SyntheticImages
from lingvo_gpipe.inputs.tfds_inputs import TfdsImages
from lingvo_gpipe.models import amoeba_net
from lingvo_gpipe.tasks.image_classification import ImageClassificationTask

IMAGENET_TRAIN_EXAMPLES = 1281167


class AmoebaNetImageNet(SingleTaskModelParams):
  """AmoebaNet on ImageNet (TFDS imagenet2012), pipelined over NUM_CELLS cells."""

  GENOTYPE = "D"
  NUM_NORMAL_CELLS = 18  # L
  FILTERS = 208  # D
  IMAGE_SIZE = 224
  NUM_CLASSES = 1000
  NUM_CELLS = 1  # K
  NUM_MICRO_BATCHES = 4  # M
  BATCH_SIZE = 256
  MAX_STEPS = 250000

  def task(self):
    body = amoeba_net.amoeba_net(
        self.GENOTYPE, self.NUM_NORMAL_CELLS, self.FILTERS, image_size=self.IMAGE_SIZE,
        num_classes=self.NUM_CLASSES, stem="imagenet", drop_path_keep_prob=0.7,
        drop_path_burn_in_steps=self.MAX_STEPS, dense_keep_prob=0.5, aux_head=True)
    p = ImageClassificationTask.Params().set(name=f"amoeba_net_{self.GENOTYPE.lower()}")
    p.body = body.stack
    p.softmax.set(input_dim=body.feature_dim, num_classes=self.NUM_CLASSES,
                  label_smoothing=0.1)
    # Cells beyond the devices given wrap around, so any key can be inspected on a laptop;
    # train with --devices=gpu:K (or a cluster of K workers) for one cell per device.
    p.pipeline.set(num_cells=self.NUM_CELLS, num_micro_batches=self.NUM_MICRO_BATCHES,
                   round_robin_devices=True)
    steps_per_epoch = IMAGENET_TRAIN_EXAMPLES // self.BATCH_SIZE
    p.train.optimizer = optimizers.RMSProp.Params().set(
        learning_rate=0.016 * self.BATCH_SIZE / 64, decay=0.9, momentum=0.9, epsilon=1.0,
        lr_schedule=lr_schedules.ExponentialDecay.Params().set(
            decay_rate=0.97, decay_steps=int(2.4 * steps_per_epoch)))
    p.train.set(max_steps=self.MAX_STEPS, save_interval_steps=1000, summary_interval_steps=100,
                log_interval_steps=100)
    return p

  def _imagenet(self, split: str, training: bool):
    return TfdsImages.Params().set(
        name=f"imagenet_{split}", dataset="imagenet2012", split=split, training=training,
        image_size=self.IMAGE_SIZE, batch_size=self.BATCH_SIZE,
        shuffle_buffer=10000 if training else 0)

  def train_input(self):
    return self._imagenet("train", training=True)

  def eval_input(self):
    return self._imagenet("validation", training=False).set(repeat=False)


# GPipe Table 1 (parameter counts 82M, 318M, 542M, 1.05B, 1.8B; K = 1, 1, 2, 4, 8).
@model_registry.register
class AmoebaNetD_18_208(AmoebaNetImageNet):  # noqa: N801
  """AmoebaNet-D (18, 208) at 224×224, 1 cell(s), 4 micro-batches."""
  GENOTYPE, NUM_NORMAL_CELLS, FILTERS, IMAGE_SIZE = "D", 18, 208, 224
  NUM_CELLS, NUM_MICRO_BATCHES = 1, 4


@model_registry.register
class AmoebaNetD_18_416(AmoebaNetImageNet):  # noqa: N801
  """AmoebaNet-D (18, 416) at 224×224, 1 cell(s), 4 micro-batches."""
  GENOTYPE, NUM_NORMAL_CELLS, FILTERS, IMAGE_SIZE = "D", 18, 416, 224
  NUM_CELLS, NUM_MICRO_BATCHES = 1, 4


@model_registry.register
class AmoebaNetD_18_544(AmoebaNetImageNet):  # noqa: N801
  """AmoebaNet-D (18, 544) at 224×224, 2 cell(s), 8 micro-batches."""
  GENOTYPE, NUM_NORMAL_CELLS, FILTERS, IMAGE_SIZE = "D", 18, 544, 224
  NUM_CELLS, NUM_MICRO_BATCHES = 2, 8


@model_registry.register
class AmoebaNetD_36_544(AmoebaNetImageNet):  # noqa: N801
  """AmoebaNet-D (36, 544) at 224×224, 4 cell(s), 16 micro-batches."""
  GENOTYPE, NUM_NORMAL_CELLS, FILTERS, IMAGE_SIZE = "D", 36, 544, 224
  NUM_CELLS, NUM_MICRO_BATCHES = 4, 16


@model_registry.register
class AmoebaNetD_72_512(AmoebaNetImageNet):  # noqa: N801
  """AmoebaNet-D (72, 512) at 224×224, 8 cell(s), 32 micro-batches."""
  GENOTYPE, NUM_NORMAL_CELLS, FILTERS, IMAGE_SIZE = "D", 72, 512, 224
  NUM_CELLS, NUM_MICRO_BATCHES = 8, 32


# GPipe Table 2 (throughput): AmoebaNet-D (18, 256) over K = 8 cells, M = 32 (its best
# column); other K and M by --params_override=task.pipeline.num_cells=...
@model_registry.register
class AmoebaNetD_18_256(AmoebaNetImageNet):  # noqa: N801
  """AmoebaNet-D (18, 256) at 224×224, 8 cell(s), 32 micro-batches."""
  GENOTYPE, NUM_NORMAL_CELLS, FILTERS, IMAGE_SIZE = "D", 18, 256, 224
  NUM_CELLS, NUM_MICRO_BATCHES = 8, 32


# GPipe §3 (84.4% top-1 on ImageNet): AmoebaNet-B (18, 512) at 480×480 over 4 cells.
@model_registry.register
class AmoebaNetB_18_512(AmoebaNetImageNet):  # noqa: N801
  """AmoebaNet-B (18, 512) at 480×480, 4 cell(s), 16 micro-batches."""
  GENOTYPE, NUM_NORMAL_CELLS, FILTERS, IMAGE_SIZE = "B", 18, 512, 480
  NUM_CELLS, NUM_MICRO_BATCHES = 4, 16


@model_registry.register
class AmoebaNetTiny(SingleTaskModelParams):
  """AmoebaNet-D (3, 16) on 32×32 synthetic images, 2 cells, 4 micro-batches (CPU)."""

  NUM_CLASSES = 10

  def task(self):
    body = amoeba_net.amoeba_net("D", num_normal_cells=3, filters=16, image_size=32,
                                 num_classes=self.NUM_CLASSES, stem="cifar", stem_filters=32)
    p = ImageClassificationTask.Params().set(name="amoeba_net_tiny")
    p.body = body.stack
    p.softmax.set(input_dim=body.feature_dim, num_classes=self.NUM_CLASSES)
    # Balanced on each layer's measured time (profiled when the trainer starts, ~4 s):
    # by parameter count the cells' time split about 84/16 (a 42% bubble against 20% in
    # theory), by FLOPs 63/37 (29%); measured, 20% (docs/benchmarks.md).
    p.pipeline.set(num_cells=2, num_micro_batches=4, round_robin_devices=True,
                   partition_cost="measured")
    p.train.optimizer = optimizers.RMSProp.Params().set(
        learning_rate=0.01, decay=0.9, momentum=0.9, epsilon=1.0,
        lr_schedule=lr_schedules.CosineDecay.Params().set(warmup_steps=20, total_steps=300))
    p.train.set(max_steps=300, save_interval_steps=100, summary_interval_steps=10,
                log_interval_steps=25)
    return p

  def _images(self, split: str, num_examples: int):
    return SyntheticImages.Params().set(
        name=f"synthetic_{split}", split=split, batch_size=32, num_examples=num_examples,
        image_size=32, num_classes=self.NUM_CLASSES, noise_stddev=2.5)

  def train_input(self):
    return self._images("train", 50000)

  def eval_input(self):
    return self._images("eval", 1024).set(repeat=False)
