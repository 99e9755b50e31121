"""Writes tests/data/legacy_unstacked_adam_k2: a checkpoint of `stacked_variables_test.
model_params` (K=2, M=2) and its Adam slots after two training steps, by the engine
before weights were stacked (one tf.Variable per weight). Run once with that engine's
package first on the path (from a checkout of commit b44a798):

  PYTHONPATH=<old checkout> python tests/data/make_legacy_unstacked_checkpoint.py
"""

import os
import sys

import numpy as np
import tensorflow as tf

tf.config.set_logical_device_configuration(
    tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * 2)

from lingvo_gpipe import train_step  # noqa: E402
from lingvo_gpipe.core import layers, optimizers  # noqa: E402
from lingvo_gpipe.pipeline.layer import PipeliningLayer  # noqa: E402


def main() -> None:
  if hasattr(PipeliningLayer.Params(), "stack_variables"):
    sys.exit("this engine stacks variables: run with the package of commit b44a798 first on "
             "the path (see the docstring); the fixture is unchanged")
  out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "legacy_unstacked_adam_k2")
  blocks = [layers.FeedForwardBlock.Params().set(name=f"ff{i}", input_dim=8, hidden_dim=16)
            for i in range(4)]
  model = PipeliningLayer.Params().set(name="stack", layers=blocks, random_seed=7, num_cells=2,
                                       num_micro_batches=2).instantiate()
  opt = optimizers.Adam.Params().set(learning_rate=0.05).instantiate()
  opt.create_slots(model.trainable_variables)
  wrapped = train_step.StackWithLoss(model, lambda out, _: {
      "loss": (tf.reduce_mean(tf.square(out)), tf.constant(6.0))})
  step = tf.function(train_step.TrainStep(wrapped, opt, tf.Variable(0, dtype=tf.int64)))
  x = tf.constant(np.random.RandomState(0).randn(6, 8), tf.float32)
  for _ in range(2):
    step({"inputs": x})
  print(tf.train.Checkpoint(model=model, optimizer=opt).write(os.path.join(out, "ckpt")),
        file=sys.stderr)


if __name__ == "__main__":
  main()
