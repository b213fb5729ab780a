"""asyncpipe: pipeline-parallel training of PyTorch models across processes.

Example:
    >>> import asyncpipe                                                   # doctest: +SKIP
    >>> asyncpipe.init()                                                   # doctest: +SKIP
    >>> pipe = asyncpipe.AsyncPipe(model, balance=[4, 3, 3, 4], chunks=8)  # doctest: +SKIP
    >>> loss = pipe.step(x, y, loss_fn)                                    # doctest: +SKIP
"""

from . import balance, checkpoint, partition, schedule, transport
from .batchnorm import DeferredBatchNorm
from .cut import sequentialize
from .cutpoint import CutPoint
from .failure import MismatchedBatch, StageFailure, StepReport
from .group import init, shutdown
from .lazy import LazyModule
from .pipe import AsyncPipe

__version__ = "0.1.0"

__all__ = [
    "AsyncPipe",
    "CutPoint",
    "DeferredBatchNorm",
    "LazyModule",
    "MismatchedBatch",
    "StageFailure",
    "StepReport",
    "balance",
    "checkpoint",
    "init",
    "shutdown",
    "partition",
    "schedule",
    "sequentialize",
    "transport",
]
