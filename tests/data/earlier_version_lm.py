"""`SmallLm`: lm.TransformerTiny shrunk (16 wide, one layer), for the logdir an earlier
version of the library wrote (tests/data/logdir_of_fb46c18, logdirs_test.py).

Since that version its softmax is tied to the embedding, as lm.TransformerTiny's was
once tying existed: the param file asks for it where `lm_stack` takes it, so the model
registered today differs from the one that logdir trained (untied), through a param
(`Softmax.tie_to`) its params.txt does not have.
"""

import inspect

from lingvo_gpipe_params import lm

import lingvo_gpipe as g
from lingvo_gpipe.models import transformer


@g.register
class SmallLm(lm.TransformerTiny):
  def task(self):
    p = super().task().set(name="small_lm")
    tie = ({"tie_embedding_softmax": True}
           if "tie_embedding_softmax" in inspect.signature(transformer.lm_stack).parameters
           else {})
    p.stack = transformer.lm_stack(self.train_input().instantiate().vocab.size, model_dim=16,
                                   hidden_dim=32, num_heads=2, num_layers=1, **tie)
    p.pipeline.set(num_cells=1, num_micro_batches=2)
    return p

  def train_input(self):
    return super().train_input().set(batch_size=8)

  def eval_input(self):
    return super().eval_input().set(batch_size=8, num_examples=16)
