"""Writes tests/data/logdir_of_fb46c18: `earlier_version_lm.SmallLm` trained 2 steps by
the library as it was at commit fb46c18^ (before length buckets and tied weights), its
params.txt and checkpoint, and expected_scores.json: that version's served `score` of
the first eval batch. Run once with that version's packages first on the path, from a
checkout of it (`git worktree add /tmp/old fb46c18^`):

  mkdir -p /tmp/oldpath && ln -s /tmp/old/params /tmp/oldpath/lingvo_gpipe_params
  cd /tmp/old && PYTHONPATH=/tmp/old:/tmp/oldpath python \\
      <this checkout>/tests/data/make_logdir_of_an_earlier_version.py
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "logdir_of_fb46c18")


def main() -> None:
  from lingvo_gpipe.core import layers
  if "tie_to" in layers.Softmax.Params():
    sys.exit("this library ties weights: run with the packages of commit fb46c18^ first on "
             "the path (see the docstring); the fixture is unchanged")
  work = tempfile.mkdtemp()
  logdir = os.path.join(work, "run")
  common = ["--model=earlier_version_lm.SmallLm", f"--params_path={HERE}/earlier_version_lm.py",
            f"--logdir={logdir}"]
  subprocess.run([sys.executable, "tools/trainer.py", *common, "--devices=cpu:1",
                  "--max_steps=2"], check=True)
  subprocess.run([sys.executable, "tools/trainer.py", *common, "--mode=export"], check=True)

  import numpy as np
  import tensorflow as tf

  from lingvo_gpipe import model_registry
  model_registry.load_param_files([f"{HERE}/earlier_version_lm.py"])
  params = model_registry.get_params("earlier_version_lm.SmallLm")
  batch = next(iter(params.eval_input.instantiate().dataset()))
  served = tf.saved_model.load(os.path.join(logdir, "export", "2")).signatures["score"](
      ids=batch["ids"], paddings=tf.cast(batch["paddings"], tf.float32))
  shutil.rmtree(OUT, ignore_errors=True)
  os.makedirs(os.path.join(OUT, "train"))
  shutil.copy(os.path.join(logdir, "params.txt"), OUT)
  for name in os.listdir(os.path.join(logdir, "train")):
    if name == "checkpoint" or name.startswith("ckpt-2."):
      shutil.copy(os.path.join(logdir, "train", name), os.path.join(OUT, "train"))
  with open(os.path.join(OUT, "expected_scores.json"), "w") as f:
    json.dump({"ids": batch["ids"].numpy().tolist(),
               "paddings": np.asarray(batch["paddings"], np.float32).tolist(),
               "token_log_probs": served["token_log_probs"].numpy().tolist()}, f)
  shutil.rmtree(work)


if __name__ == "__main__":
  main()
