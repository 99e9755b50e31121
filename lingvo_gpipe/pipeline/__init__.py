"""The GPipe engine: cells on devices, micro-batches, schedules, re-materialization.

  layer.py          PipeliningLayer: partition into cells, placement, the training entry
  cell_function.py  a cell's forward and backward, traced once per unit shape
  layer_function.py layers of one kind share one traced function (variables as arguments)
  schedule.py       each cell's actions and each device's order as data (gpipe, 1f1b,
                    zb_h1, interleaved_1f1b, zbv, interleaved_zb; F, B, W), where each
                    cell runs (placement), validated and simulated
  device_loop.py    one loop per device runs its cells' actions; sums the gradients
  gradient_sums.py  a cell's running gradient sums, one stacked tensor per shape and dtype
  channels.py       Send/Recv hand-offs between neighbouring cells
  partition.py      the one exact min-bottleneck split solver; the partitioner
  layer_profiler.py each layer's measured seconds and bytes (LayerCost), and their cache
  step_model.py     a plan's predicted step time and per-device peak memory
  planner.py        an automatic plan (R, K, split, M, recompute, schedule) from those
                    costs and a per-device memory budget
  memory.py         a step's peak activation memory, from TensorFlow's allocator
  timeline.py       the measured schedule: spans, busy fractions, bubble
  schedule_chart.py the measured schedule drawn for TensorBoard
  placement_audit.py where a traced step's ops would run, and whether a GPU kernel
                    admits each; `on_host`, ops on the host on purpose
  hybrid.py         R replicas of a pipeline, gradients averaged by all-reduce
  tied_weights.py   a weight two cells read (a tied softmax): its per-step copy on the
                    other cell's device, the copy's gradient added back

Below it, core/tf_internals.py names the TensorFlow behaviours relied on beyond its
documented API; above it, lingvo_gpipe/calibration.py measures the machine's figures
(action overhead, update, link, concurrency) by running the training step.
"""

from lingvo_gpipe.pipeline.layer import PipelineError, PipeliningLayer, micro_batch_sizes

__all__ = ["PipelineError", "PipeliningLayer", "micro_batch_sizes"]
