"""The measured schedule of a step as a labelled chart, for TensorBoard's image tab.

One row per cell, cell 0 on top, labelled with the cell and its device; the step's
time on the x axis in milliseconds; forward calls blue, backward calls (recompute
included) orange, deferred weight-gradient calls green, darker for later micro-batches;
white is idle (the bubble). The title
gives the measured bubble beside GPipe's theoretical (K−1)/(M+K−1) and, with the plan,
the simulated bubble of the schedule that was run.

Drawn with matplotlib's object API on its Agg canvas (no pyplot state, no display), so
it is safe in the trainer's thread.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from lingvo_gpipe.pipeline.schedule import BACKWARD, FORWARD, WEIGHT_GRADIENT, PipelineSchedule
from lingvo_gpipe.pipeline.timeline import Schedule

PHASE_COLORS = {FORWARD: (0.26, 0.52, 0.96), BACKWARD: (0.96, 0.56, 0.26),
                WEIGHT_GRADIENT: (0.30, 0.70, 0.35)}
LEGEND = {FORWARD: "forward", BACKWARD: "backward (with recompute)",
          WEIGHT_GRADIENT: "weight gradients (deferred)"}


def _short_device(device: str) -> str:
  """'/job:worker/replica:0/task:1/device:CPU:0' → 'task:1 CPU:0'; a local device
  ('/job:localhost/...') → 'CPU:0'."""
  local = "/job:localhost/" in device
  parts = [p for p in device.split("/")
           if p.startswith("device:") or (p.startswith("task:") and not local)]
  return " ".join(p.removeprefix("device:") for p in parts) or device


def figure(schedule: Schedule, devices: Sequence[str] | None = None,
           plan: PipelineSchedule | None = None) -> Figure:
  """The chart as a matplotlib Figure (tests read its artists; `render` rasterizes)."""
  num_cells, num_micro = schedule.num_cells, schedule.num_micro_batches
  fig = Figure(figsize=(10, 1.2 + 0.45 * num_cells), dpi=96)
  axes = fig.add_subplot()
  for (start, end), key in zip(schedule.times, schedule.keys):
    shade = 1.0 - 0.5 * key.micro_batch / max(num_micro - 1, 1)
    color = tuple(c * shade for c in PHASE_COLORS[key.phase])
    axes.broken_barh([(start * 1e3, (end - start) * 1e3)], (key.cell - 0.4, 0.8),
                     facecolors=color, edgecolor="black", linewidth=0.3)
  labels = [f"cell {k}" + (f"  {_short_device(devices[k])}" if devices else "")
            for k in range(num_cells)]
  axes.set_yticks(range(num_cells), labels)
  axes.set_ylim(num_cells - 0.5, -0.5)  # cell 0 on top
  axes.set_xlim(0, schedule.duration * 1e3)
  axes.set_xlabel("time in the step (ms)")
  axes.set_facecolor("white")
  title = (f"{num_cells} cells × {num_micro} micro-batches: bubble measured "
           f"{schedule.bubble():.0%}, GPipe theory {schedule.theoretical_bubble():.0%}")
  if plan is not None:
    title += f", {plan.name} plan {plan.bubble():.0%}"
  axes.set_title(title, fontsize=10)
  phases = [FORWARD, BACKWARD] + ([WEIGHT_GRADIENT] if any(
      key.phase == WEIGHT_GRADIENT for key in schedule.keys) else [])
  handles = [Patch(facecolor=PHASE_COLORS[p], edgecolor="black", label=LEGEND[p])
             for p in phases]
  handles.append(Patch(facecolor="white", edgecolor="black", label="idle (bubble)"))
  legend_height = 0.35 / fig.get_figheight()  # a third of an inch, as a figure fraction
  axes.legend(handles=handles, loc="lower center", bbox_to_anchor=(0.5, 0.0),
              ncol=len(handles),
              fontsize=8, frameon=False, bbox_transform=fig.transFigure)
  fig.tight_layout(rect=(0, legend_height, 1, 1))
  return fig


def render(fig: Figure) -> np.ndarray:
  """uint8 [height, width, 3] pixels of `fig`."""
  canvas = FigureCanvasAgg(fig)
  canvas.draw()
  return np.asarray(canvas.buffer_rgba())[..., :3].copy()


def chart(schedule: Schedule, devices: Sequence[str] | None = None,
          plan: PipelineSchedule | None = None) -> np.ndarray:
  """uint8 [height, width, 3]: the labelled chart of `schedule`."""
  return render(figure(schedule, devices, plan))
