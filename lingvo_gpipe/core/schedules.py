"""Renamed `lr_schedules.py` ("schedule" alone is the pipeline's order of calls); this
module keeps the old class paths of params.txt files loading
(`lingvo_gpipe.core.schedules.LinearWarmupRsqrtDecay` and the others)."""

from lingvo_gpipe.core.lr_schedules import (
                                            Constant,
                                            CosineDecay,
                                            ExponentialDecay,
                                            LinearWarmupRsqrtDecay,
                                            Schedule,
)

__all__ = ["Constant", "CosineDecay", "ExponentialDecay", "LinearWarmupRsqrtDecay", "Schedule"]
