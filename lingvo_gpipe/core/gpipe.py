"""Where `PipeliningLayer` lived before the engine moved to `lingvo_gpipe.pipeline`.

Params text files name a layer class by its module path, and those written before the
move say `lingvo_gpipe.core.gpipe.PipeliningLayer`; this alias keeps them loading
(`tests/pipeline_compat_test.py`). New code imports `lingvo_gpipe.pipeline`.
"""

from lingvo_gpipe.pipeline.layer import PipelineError, PipeliningLayer, micro_batch_sizes

__all__ = ["PipelineError", "PipeliningLayer", "micro_batch_sizes"]
