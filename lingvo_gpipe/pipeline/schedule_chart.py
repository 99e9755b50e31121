"""The measured schedule of a step as a labelled chart, for TensorBoard's image tab.

One row per cell, cell 0 on top, labelled with the cell and its device; the step's
time on the x axis in milliseconds; forward calls blue, backward calls (recompute
included) orange, deferred weight-gradient calls green, darker for later units, each
bar numbered with its unit (the micro-batch; m.j, slice j of micro-batch m, with token
slices) where it is wide enough; white is idle (the bubble). With the plan, a thin row
of outlined bars under each cell shows the plan's simulated timeline with the step's
own measured call times (`MeasuredTimeline.planned`): where a measured bar starts
later than its planned one, the cell waited on something the plan does not model
(hand-offs, the host). The title gives the measured bubble beside GPipe's theoretical
(D−1)/(U+D−1) over U = M·S units and, with the plan, the planned bubble.

Sized for TensorBoard's image card, which shows images about 330-400 px wide: the chart
is 400 px wide with text of 10-12 px, so it is read without "show actual image size".

Drawn with matplotlib's object API on its Agg canvas (no pyplot state, no display), so
it is safe in the trainer's thread.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from lingvo_gpipe.pipeline.schedule import (
  BACKWARD,
  FORWARD,
  WEIGHT_GRADIENT,
  Action,
  PipelineSchedule,
  idle_fraction,
)
from lingvo_gpipe.pipeline.timeline import MeasuredTimeline

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


WIDTH_INCHES, DPI = 4.2, 96  # 403 px
# Below this many pixels a bar carries no unit number (it would not fit).
_MIN_NUMBERED_BAR_PX = 11


def figure(schedule: MeasuredTimeline, devices: Sequence[str] | None = None,
           plan: PipelineSchedule | None = None) -> Figure:
  """The chart as a matplotlib Figure (tests read its artists; `render` rasterizes)."""
  num_cells, num_units = schedule.num_cells, schedule.num_units
  phases = [FORWARD, BACKWARD] + ([WEIGHT_GRADIENT] if any(
      key.phase == WEIGHT_GRADIENT for key in schedule.keys) else [])
  legend_rows = (len(phases) + 2 + (plan is not None)) // 2  # two per row, idle included
  legend_inches = 0.2 * legend_rows + 0.05
  fig = Figure(figsize=(WIDTH_INCHES, 1.15 + 0.38 * num_cells + legend_inches), dpi=DPI)
  axes = fig.add_subplot()
  duration_ms = schedule.duration * 1e3
  px_per_ms = 0.78 * WIDTH_INCHES * DPI / max(duration_ms, 1e-9)  # the axes' share
  # One artist per row (a cell's bars with their colors), not one per bar: a step of
  # 128 cells and 512 micro-batches has 131,072 bars, and drawing them one artist
  # each took matplotlib 12 minutes.
  rows: dict[int, tuple[list, list]] = {}
  for (start, end), key in zip(schedule.times, schedule.keys):
    shade = 1.0 - 0.5 * key.unit / max(num_units - 1, 1)
    start_ms, width_ms = start * 1e3, (end - start) * 1e3
    bars, colors = rows.setdefault(key.cell, ([], []))
    bars.append((start_ms, width_ms))
    colors.append(tuple(c * shade for c in PHASE_COLORS[key.phase]))
    if width_ms * px_per_ms >= _MIN_NUMBERED_BAR_PX:
      # the unit: a micro-batch, or with token slices (the plan's) micro-batch.slice
      number = (plan.label(Action(key.phase, key.unit))[1:] if plan is not None
                else str(key.unit))
      axes.text(start_ms + width_ms / 2, key.cell - (0.1 if plan else 0.0), number,
                ha="center",
                va="center", fontsize=7, color="white" if shade < 0.75 else "black")
  for cell, (bars, colors) in rows.items():
    axes.broken_barh(bars, (cell - 0.4, 0.6 if plan else 0.8), facecolors=colors,
                     edgecolor="black", linewidth=0.3)
  planned = schedule.planned(plan) if plan is not None else {}
  planned_rows: dict[int, tuple[list, list]] = {}
  for (k, action), (start, end) in planned.items():
    bars, colors = planned_rows.setdefault(k, ([], []))
    bars.append((start * 1e3, (end - start) * 1e3))
    colors.append(PHASE_COLORS[action.phase])
  for k, (bars, colors) in planned_rows.items():
    axes.broken_barh(bars, (k + 0.24, 0.16), facecolors=colors, edgecolor="black",
                     linewidth=0.3)
  labels = [f"cell {k}" + (f"\n{_short_device(devices[k])}" if devices else "")
            for k in range(num_cells)]
  axes.set_yticks(range(num_cells), labels, fontsize=8)
  axes.set_ylim(num_cells - 0.5, -0.5)  # cell 0 on top
  axes.set_xlim(0, max([duration_ms] + [end * 1e3 for _, end in planned.values()]))
  axes.set_xlabel("time in the step (ms)", fontsize=8)
  axes.tick_params(axis="x", labelsize=7.5)
  axes.set_facecolor("white")
  if plan is not None and plan.slices > 1:
    units = f"M={plan.micro_batches} micro-batches × S={plan.slices} token slices"
  else:
    units = f"M={num_units} micro-batches"
  title = (f"K={num_cells} cells, {units}\nbubble: measured "
           f"{schedule.bubble():.0%}, GPipe theory {schedule.theoretical_bubble():.0%}")
  if plan is not None:
    title += f", {plan.name} plan {idle_fraction(planned, plan.num_devices):.0%}"
  axes.set_title(title, fontsize=8.5)
  handles = [Patch(facecolor=PHASE_COLORS[p], edgecolor="black", label=LEGEND[p])
             for p in phases]
  handles.append(Patch(facecolor="white", edgecolor="black", label="idle (bubble)"))
  if plan is not None:
    handles.append(Patch(facecolor="lightgray", edgecolor="black",
                         label="thin: the plan, measured call times"))
  legend_height = legend_inches / fig.get_figheight()
  axes.legend(handles=handles, loc="lower center", bbox_to_anchor=(0.5, 0.0), ncol=2,
              fontsize=7.5, frameon=False, bbox_transform=fig.transFigure,
              handlelength=1.2, columnspacing=1.0, labelspacing=0.3)
  fig.tight_layout(rect=(0, legend_height, 1, 1), pad=0.3)
  return fig


def render(fig: Figure) -> np.ndarray:
  """uint8 [height, width, 3] pixels of `fig`."""
  canvas = FigureCanvasAgg(fig)
  canvas.draw()
  return np.asarray(canvas.buffer_rgba())[..., :3].copy()


def chart(schedule: MeasuredTimeline, devices: Sequence[str] | None = None,
          plan: PipelineSchedule | None = None) -> np.ndarray:
  """uint8 [height, width, 3]: the labelled chart of `schedule`."""
  return render(figure(schedule, devices, plan))
