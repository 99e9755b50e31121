"""The GPipe engine: cells on devices, micro-batches, schedules, re-materialization.

  layer.py          PipeliningLayer: partition into cells, placement, the training entry
  cell_function.py  a cell's forward and backward, traced once, called per micro-batch
  schedule.py       the order of each cell's calls as data (gpipe, 1f1b)
  executor.py       builds one training step's calls from a schedule; sums the gradients
  partition.py      the exact min-bottleneck partitioner and measured layer costs
  timeline.py       the measured schedule: spans, busy fractions, bubble
  schedule_chart.py the measured schedule drawn for TensorBoard
  tf_internals.py   the TensorFlow behaviours relied on beyond its documented API
  hybrid.py         R replicas of a pipeline, gradients averaged by all-reduce
"""

from lingvo_gpipe.pipeline.layer import PipelineError, PipeliningLayer, micro_batch_sizes

__all__ = ["PipelineError", "PipeliningLayer", "micro_batch_sizes"]
