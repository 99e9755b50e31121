"""A pipeline step's cost per action, from its median step times at several M.

Pure Python, shared by bench/pipeline_speedup.py (TensorFlow) and
bench/torch_pipeline.py (PyTorch's venv), so both libraries' figures are computed one
way. On a model whose layers compute next to nothing (`tiny`), a step is the library's
own work: a fixed cost per step plus a cost per action a worker runs.

  actions_per_worker(schedule, m)       F, B (and W) actions one worker runs at K=2
  per_action_figures(steps_by_m, ...)   {"ms_per_action": {M: step ÷ actions},
                                         "marginal_ms_per_action": the slope between
                                         the smallest and the largest M}
"""

from __future__ import annotations

# Per micro-batch and cell: F and B, and a W where the backward is split; cells per
# worker: 2 for the schedules that give each worker two (interleaved, V).
_ACTIONS_PER_MICRO_BATCH = {"gpipe": 2, "1f1b": 2, "zb_h1": 3, "interleaved_1f1b": 2,
                            "interleaved_zb": 3, "zbv": 3}
_CELLS_PER_WORKER = {"interleaved_1f1b": 2, "interleaved_zb": 2, "zbv": 2}


def actions_per_worker(schedule: str, m: int) -> int:
  """The actions one worker runs in a step of `schedule` at M=m, one W per micro-batch
  (weight_gradient_group 1)."""
  return _ACTIONS_PER_MICRO_BATCH[schedule] * _CELLS_PER_WORKER.get(schedule, 1) * m


def per_action_figures(steps_by_m: dict[int, float], schedule: str) -> dict:
  """steps_by_m: M → median step seconds of `schedule`. → milliseconds per action at
  each M (the step over its actions per worker: fixed costs included) and the marginal
  cost of one more action (what each added micro-batch's actions add, over the
  smallest and largest M run; None with one M)."""
  if schedule not in _ACTIONS_PER_MICRO_BATCH:
    return {}
  per_action = {m: round(1e3 * s / actions_per_worker(schedule, m), 3)
                for m, s in sorted(steps_by_m.items())}
  low, high = min(steps_by_m), max(steps_by_m)
  marginal = (round(1e3 * (steps_by_m[high] - steps_by_m[low])
                    / (actions_per_worker(schedule, high) - actions_per_worker(schedule, low)), 3)
              if high > low else None)
  return {"ms_per_action": per_action, "marginal_ms_per_action": marginal}
