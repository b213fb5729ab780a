"""Graceful stop: on SIGTERM or SIGUSR1 every rank finishes the step, saves, and exits cleanly.

A signal may reach one rank or all of them, at any moment. Its handler only marks the request
(:meth:`AsyncPipe.request_stop`); the end-of-step news every rank sends every other carries the
mark, so all ranks learn at the end of the same step that some rank asked, and all save the
same step::

    rank 1   SIGTERM ──> request_stop()
    step k   ... end-of-step news (rank 1: "stop") ──> pipe.stop_agreed on every rank
    check(k + 1) on every rank ──> save(pipe, optimizer, path, step=k + 1) ──> SystemExit(0)
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Sequence
from types import FrameType, TracebackType
from typing import Any

import torch

from ..pipe import AsyncPipe
from .files import save

__all__: list[str] = []

_Handler = Any  # what signal.signal returns: a callable, SIG_DFL, SIG_IGN or None


class GracefulStop:
    """Save a checkpoint on every rank and exit with status 0 when the job is asked to stop.

    Building it installs handlers for ``signals`` (from the main thread); :meth:`restore`, or
    leaving a ``with`` block, puts the previous handlers back. Call :meth:`check` after each
    optimizer step: once any rank got a signal, it saves on every rank at the same step and
    raises ``SystemExit(0)``, so the job ends cleanly (``torchrun`` sees success) and a new one
    resumes with :func:`asyncpipe.checkpoint.load`.

    Args:
        pipe: this rank's pipeline.
        optimizer: the optimizer to save with it, or None.
        path: the checkpoint directory (see :func:`asyncpipe.checkpoint.save`).
        signals: the signals that ask for a stop.

    Example:
        >>> stop = asyncpipe.checkpoint.GracefulStop(pipe, optimizer, "ckpt")  # doctest: +SKIP
        >>> for step in range(start, steps):                                   # doctest: +SKIP
        ...     pipe.step(x, y, loss_fn)
        ...     optimizer.step()
        ...     optimizer.zero_grad()
        ...     stop.check(step + 1)
    """

    def __init__(
        self,
        pipe: AsyncPipe,
        optimizer: torch.optim.Optimizer | None,
        path: str | os.PathLike[str],
        *,
        signals: Sequence[signal.Signals] = (signal.SIGTERM, signal.SIGUSR1),
    ) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError(
                "GracefulStop installs signal handlers, which only the main thread may do; "
                "build it in the main thread of the training process"
            )
        self.pipe, self.optimizer, self.path = pipe, optimizer, path
        self.received: signal.Signals | None = None
        """The signal this rank received, if any."""
        self._previous: dict[signal.Signals, _Handler] = {}
        for signum in signals:
            self._previous[signum] = signal.signal(signum, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = signal.Signals(signum)
        self.pipe.request_stop()

    def check(self, step: int, extra: Any = None) -> None:
        """Save and exit if any rank asked to stop by the end of the last step. Under
        ``schedule="2bw"`` it first drains the pipeline (``pipe.flush()``), so the checkpoint
        holds the update of every mini-batch begun.

        Args:
            step: the number of steps finished (what :func:`load` will return).
            extra: a JSON value to store with the checkpoint (from rank 0).

        Raises:
            SystemExit: with status 0, after the checkpoint is complete on every rank.
        """
        if not self.pipe.stop_agreed:
            return
        if self.pipe.in_flight:
            self.pipe.flush()
        save(self.pipe, self.optimizer, self.path, step=step, extra=extra)
        self.restore()
        raise SystemExit(0)

    def restore(self) -> None:
        """Put back the signal handlers that were there before."""
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

    def __enter__(self) -> GracefulStop:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.restore()
