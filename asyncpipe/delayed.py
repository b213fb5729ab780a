"""PipeDream-2BW's side of AsyncPipe: ``step()`` runs one window of the stream, ``flush()``
drains it, and each update applies the previous mini-batch's gradient (clipped, if asked)."""

from __future__ import annotations

import contextlib
import math
from typing import TYPE_CHECKING

from .arguments import check_step
from .batchnorm import commit_all
from .failure import StageFailure, StepReport
from .trace.run import window_name

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from torch import nn

    from .stream import Stream
    from .trace.recorder import Recorder
    from .work import LossFn, Work

__all__: list[str] = []


class DelayedUpdates:
    """AsyncPipe's 2BW steps: one window per ``step()``, ``flush()``, and ``grad_norm``."""

    _stream: Stream | None
    _recorder: Recorder | None
    _broken: StageFailure | None
    last_step: StepReport | None
    grad_norm: float
    lookahead: int
    stage: int
    deferred_batch_norm: bool
    layers: nn.ModuleList

    if TYPE_CHECKING:  # provided by AsyncPipe

        def _guard(self) -> None: ...

        def _prepare(
            self, input: object, target: object, loss_fn: LossFn | None, train: bool
        ) -> Callable[[int | None], Work]: ...

        def _traced(
            self, work: Work | None, loss: float | None, window: str | None = None
        ) -> None: ...

    def _two_bw_step(
        self,
        input: object,
        target: object,
        loss_fn: LossFn,
        optimizer: object,
        max_norm: float | None,
    ) -> float:
        assert self._stream is not None
        self._guard()
        make = self._prepare(input, target, loss_fn, train=True)

        # A rank without parameters has no optimizer to pass (torch refuses an empty one)
        stepped = bool(self._stream.versions.params)

        def prepare(microbatches: int | None) -> Work:  # where a rejection reaches every rank
            check_step(loss_fn, optimizer, max_norm, stepped=stepped)
            return make(microbatches)

        window = window_name("steady" if self._stream.in_flight else "first", self.lookahead)
        with self._breaking():
            if self._recorder is not None:
                self._recorder.begin()
            work, loss, report = self._stream.step(prepare, optimizer, max_norm)
        if self.deferred_batch_norm:
            commit_all(self.layers)
        self._windowed(report, work, loss, window)
        return loss

    @property
    def in_flight(self) -> bool:
        """Whether a 2BW mini-batch still owes backwards and its update (:meth:`flush` drains
        it); always False for the schedules that flush every step."""
        return self._stream is not None and self._stream.in_flight

    def flush(self) -> float:
        """Drain the pipeline: with ``schedule="2bw"``, run the backwards the last mini-batch
        still owes and apply its update, so the parameters hold every mini-batch's gradient and
        nothing is in flight (call it on every rank at the end of training and before saving
        a checkpoint). Other schedules never leave anything in flight.

        Returns:
            the mean loss of the mini-batch it drained, on every rank (NaN if none).

        Example:
            >>> for x, y in batches:                                     # doctest: +SKIP
            ...     pipe.step(x, y, loss_fn, optimizer=optimizer)
            >>> last_loss = pipe.flush()                                 # doctest: +SKIP
        """
        if self._stream is None or not self.in_flight:
            return math.nan
        self._guard()
        with self._breaking():
            loss, report = self._stream.drain()
        self._windowed(report, None, loss, window_name("drain", self.lookahead))
        return loss

    @contextlib.contextmanager
    def _breaking(self) -> Iterator[None]:
        """Run a 2BW window: any error leaves the pipeline broken (ranks may hold messages)."""
        try:
            yield
        except BaseException as e:
            self._broken = (
                e
                if isinstance(e, StageFailure)
                else StageFailure(str(e), rank=self.stage, stage=-1, microbatch=-1, action="")
            )
            raise

    def _windowed(self, report: StepReport, work: Work | None, loss: float, window: str) -> None:
        """Keep the report and the gradient norm of a 2BW window (or the drain), and hand the
        window to the recorder."""
        assert self._stream is not None
        self.last_step = report
        self.grad_norm = self._stream.grad_norm
        if self._recorder is not None:
            self._recorder.add(report)
            self._traced(work, loss, window)
