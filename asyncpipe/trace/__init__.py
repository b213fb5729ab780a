"""Tracing of pipeline runs: TensorBoard scalars and timelines, Chrome traces, a summary CLI.

Pass ``trace="runs/exp1"`` to :class:`~asyncpipe.AsyncPipe`; every rank times each action it
runs and rank 0 writes the run into that directory. ``python -m asyncpipe.trace runs/exp1``
prints a per-rank summary and writes ``timeline.png``, ``timeline.html`` and ``trace.json``.

Example:
    >>> pipe = asyncpipe.AsyncPipe(model, [2, 2], chunks=8, trace="runs/exp1")  # doctest: +SKIP
    >>> for x, y in data:                                                      # doctest: +SKIP
    ...     pipe.step(x, y, loss_fn)
    ...     with pipe.trace_span("optimizer"):
    ...         optimizer.step()
    >>> pipe.close()                                                           # doctest: +SKIP
"""

from .chrome import chrome_trace
from .render import Rendered, render
from .run import RankStep, StageSummary, StepTrace, summarize
from .writer import TraceWriter, load_plans, load_steps

__all__ = [
    "RankStep",
    "Rendered",
    "StageSummary",
    "StepTrace",
    "TraceWriter",
    "chrome_trace",
    "load_plans",
    "load_steps",
    "render",
    "summarize",
]
