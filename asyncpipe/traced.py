"""The tracing side of AsyncPipe: building its recorder, handing it each finished step, and the
user's spans (``trace_span``, ``trace_optimizer``)."""

from __future__ import annotations

import contextlib
import copy
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from .trace import TraceWriter
from .trace.recorder import Recorder
from .trace.run import stream_window

if TYPE_CHECKING:
    from collections.abc import Iterator

    from .runtime import Runtime
    from .schedule import Plan
    from .transport import Transport
    from .work import Work

__all__: list[str] = []


class TracedSteps:
    """AsyncPipe's tracing: the recorder (None when not tracing) and the calls that feed it."""

    _recorder: Recorder | None
    _runtime: Runtime
    chunks: int
    num_stages: int
    balance: list[int]
    lookahead: int
    checkpoint: str
    deferred_batch_norm: bool
    device: torch.device
    timeout: float
    data_parallel_size: int
    data_parallel_rank: int

    def _start_trace(
        self,
        trace: str | os.PathLike[str] | TraceWriter | None,
        trace_every: int,
        schedule: str | Plan,
        virtual_stages: int,
        transport: Transport,
    ) -> None:
        """Build the recorder of a pipeline given ``trace`` (none without)."""
        self._recorder = None
        if trace is None:
            return
        if self.data_parallel_size > 1:  # one trace per replica: they must not share files
            replica = f"replica{self.data_parallel_rank}"
            if isinstance(trace, TraceWriter):  # a copy: the caller's writer keeps its own
                trace = copy.copy(trace)
                trace.directory, trace.plans = trace.directory / replica, dict(trace.plans)
            else:
                trace = Path(trace) / replica
        writer = trace if isinstance(trace, TraceWriter) else TraceWriter(trace, trace_every)
        config = {
            "ranks": self.num_stages,
            "balance": self.balance,
            "chunks": self.chunks,
            "schedule": schedule if isinstance(schedule, str) else "custom plan",
            "virtual_stages": virtual_stages,
            "lookahead": self.lookahead,
            "checkpoint": self.checkpoint,
            "transport": type(transport).__name__
            + (f" ({dist.get_backend()})" if dist.is_initialized() else ""),
            "deferred_batch_norm": self.deferred_batch_norm,
            "device": str(self.device),
        }
        self._recorder = Recorder(
            writer, transport, self.timeout, self.device, self._runtime.plan_for, config
        )

    def _traced(self, work: Work | None, loss: float | None, window: str | None = None) -> None:
        """Hand the finished step to the recorder (if tracing); ``window``: the 2BW window it
        ran (its work is the new mini-batch, none for the drain). The first window has no loss
        yet (NaN by design): it is recorded as none; any other NaN loss (a diverged run) is
        recorded as NaN."""
        if self._recorder is not None:
            inputs = work.inputs if work is not None else None
            samples = sum(int(x[0].shape[0]) for x in inputs or () if x and x[0].dim())
            m = work.microbatches if work is not None else self.chunks
            train = work.train if work is not None else True
            cut = None if window is None else stream_window(f"{m}/{window}")
            if loss is not None and math.isnan(loss) and cut is not None and cut[1] == 0:
                loss = None  # the first 2BW window: no mini-batch has finished yet
            self._recorder.end_step(
                loss=loss, samples=samples, microbatches=m, train=train, window=window
            )

    @property
    def trace_directory(self) -> Path | None:
        """Where this pipeline's trace goes (``None`` when not tracing)."""
        return None if self._recorder is None else self._recorder.writer.directory

    @contextlib.contextmanager
    def trace_span(self, name: str) -> Iterator[None]:
        """Time a block of the training loop (e.g. the optimizer step) into the trace and a
        ``torch.profiler`` range named ``name``.

        Example:
            >>> with pipe.trace_span("optimizer"):   # doctest: +SKIP
            ...     optimizer.step()
        """
        if self._recorder is None:
            with torch.autograd.profiler.record_function(name):
                yield
        else:
            with self._recorder.span(name):
                yield

    def trace_optimizer(self, optimizer: torch.optim.Optimizer, name: str = "optimizer") -> None:
        """Time every ``optimizer.step()`` into the trace (through the optimizer's step hooks),
        as :meth:`trace_span` would; nothing happens when not tracing.

        Example:
            >>> pipe.trace_optimizer(optimizer)   # doctest: +SKIP
        """
        if self._recorder is not None:
            self._recorder.watch(optimizer, name)
