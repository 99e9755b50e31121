"""What a model param file registers: a task, its inputs and its training settings."""

from __future__ import annotations

from lingvo_gpipe.core.hyperparams import Params


class SingleTaskModelParams:
  """Subclass, fill in `task`, `train_input` and `eval_input`, and register it.

  `model_params()` combines them into the one Params tree that the trainer prints
  (`--mode=inspect_params`), overrides (`--params_override`) and writes to
  `<logdir>/params.txt`.
  """

  def task(self) -> Params:
    """Task params, including `task.train` (optimizer, steps, intervals)."""
    raise NotImplementedError

  def train_input(self) -> Params:
    """Input generator params of the training data."""
    raise NotImplementedError

  def eval_input(self) -> Params | None:
    """Input generator params of the eval data (None: no eval)."""
    return None

  def model_params(self) -> Params:
    p = Params()
    p.define("task", self.task(), "The task: model, loss, metrics, training settings.")
    p.define("train_input", self.train_input(), "Training input generator.")
    p.define("eval_input", self.eval_input(), "Eval input generator (None: no eval).")
    return p
