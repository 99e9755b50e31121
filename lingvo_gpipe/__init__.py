"""lingvo_gpipe: GPipe pipeline parallelism for TensorFlow 2.

The public API: what a model param file, a user's own layer or a training script needs.

  import lingvo_gpipe as g

  @g.register
  class MyModel(g.SingleTaskModelParams):
    def task(self):
      p = g.ImageClassificationTask.Params()
      p.body = g.layers.Sequential.Params().set(layers=[...])
      ...

A Keras model becomes a stack with `g.from_keras(model)` (one Keras layer in a stack:
`g.layers.Keras`). Layers, optimizers and learning-rate schedules are modules (`g.layers.Linear`,
`g.optimizers.Adam`, `g.lr_schedules.LinearWarmupRsqrtDecay`); everything else is a name
here. Deeper module paths keep working (and are what params.txt records). A layer of
your own raises `g.ParamsError` for a bad params value: the trainer then exits with code
2 and one line naming it, where any other exception is reported as a bug (traceback).
"""

from lingvo_gpipe.base_model_params import SingleTaskModelParams
from lingvo_gpipe.core import attention, layers, lr_schedules, optimizers
from lingvo_gpipe.core.base_layer import BaseLayer
from lingvo_gpipe.core.from_keras import from_keras, load_keras_weights
from lingvo_gpipe.core.hyperparams import Instantiable, InstantiableParams, Params, ParamsError
from lingvo_gpipe.inputs.base_input import BaseInputGenerator
from lingvo_gpipe.inputs.synthetic_images import SyntheticImages
from lingvo_gpipe.inputs.synthetic_text import SyntheticLm, SyntheticTranslation
from lingvo_gpipe.inputs.tfds_inputs import TfdsImages, TfdsLm, TfdsManyToEnglish
from lingvo_gpipe.model_registry import register
from lingvo_gpipe.pipeline.hybrid import ReplicatedPipeline
from lingvo_gpipe.pipeline.layer import PipelineError, PipeliningLayer
from lingvo_gpipe.runtime.devices import configure_devices
from lingvo_gpipe.tasks.base_task import BaseTask
from lingvo_gpipe.tasks.image_classification import ImageClassificationTask
from lingvo_gpipe.tasks.language_model import LanguageModelTask
from lingvo_gpipe.tasks.translation import TranslationTask
from lingvo_gpipe.train_step import TrainStep
from lingvo_gpipe.trainer import Trainer

__all__ = [
    "BaseInputGenerator", "BaseLayer", "BaseTask", "ImageClassificationTask",
    "Instantiable", "InstantiableParams", "LanguageModelTask", "Params", "ParamsError",
    "PipelineError", "PipeliningLayer",
    "ReplicatedPipeline", "SingleTaskModelParams", "SyntheticImages", "SyntheticLm",
    "SyntheticTranslation", "TfdsImages", "TfdsLm", "TfdsManyToEnglish", "TrainStep",
    "Trainer", "TranslationTask", "attention", "configure_devices", "layers", "optimizers",
    "register", "lr_schedules", "from_keras", "load_keras_weights",
]
