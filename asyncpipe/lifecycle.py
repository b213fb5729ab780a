"""AsyncPipe's life cycle: asking every rank to stop together, refusing calls once the
pipeline failed or was closed, the replicas' share of a step's end, and :meth:`close`, which
releases what the pipeline created::

    AsyncPipe(...) ──steps──> close()  (drain 2BW, finish the trace, close the transport it
         │                              built, destroy the groups it created)
         └─ a failed step ──> _broken: later calls raise; close() still releases
"""

from __future__ import annotations

import contextlib
import weakref
from typing import TYPE_CHECKING, NoReturn, SupportsIndex

from .failure import StageFailure
from .group import release

if TYPE_CHECKING:
    import torch.distributed as dist

    from .parallel import GradientAverager
    from .runtime import Runtime
    from .trace.recorder import Recorder
    from .transport import Transport

__all__: list[str] = []

_NOT_COPIED = (
    "an AsyncPipe cannot be copied or pickled: it holds this rank's connections to the other "
    "stages, and a copy would take the original's messages (its stages would run with another "
    "model's); copy the model instead (copy.deepcopy(model)) and build a second AsyncPipe over "
    "the copy on every rank, in the same order; to save weights use pipe.state_dict() or "
    "asyncpipe.checkpoint.save"
)


class LifeCycle:
    """AsyncPipe's stopping, refusing and closing (mixed into :class:`~asyncpipe.AsyncPipe`)."""

    _runtime: Runtime
    _averager: GradientAverager | None
    _recorder: Recorder | None
    _broken: StageFailure | None
    _closed: bool
    _owns_transport: bool
    _created: list[weakref.ref[dist.ProcessGroup]]
    transport: Transport

    if TYPE_CHECKING:  # provided by AsyncPipe

        @property
        def in_flight(self) -> bool: ...

        def flush(self) -> float: ...

    def _replicas_max(self, value: float) -> float:
        """The largest ``value`` over this stage's replicas (``value`` with one replica), for
        a flag they must agree on; call it on every rank."""
        return value if self._averager is None else self._averager.reduce_max(value)

    # ----- stopping together -------------------------------------------------------------

    def request_stop(self) -> None:
        """Ask every rank to stop: the end of the next step tells them all (see
        :attr:`stop_agreed`). Safe to call from a signal handler.

        Example:
            >>> signal.signal(signal.SIGTERM, lambda *_: pipe.request_stop())  # doctest: +SKIP
        """
        self._runtime.stop_requested = True

    @property
    def stop_agreed(self) -> bool:
        """Whether any rank had called :meth:`request_stop` when the last step ended; the same
        on every rank, so all can save and stop at the same step."""
        return self._runtime.stop_agreed

    def _guard(self) -> None:
        if self._closed:
            raise RuntimeError(
                "this pipeline was closed (close() released its process groups and "
                "connections); build a new AsyncPipe to go on"
            )
        if self._broken is not None:
            raise RuntimeError(
                f"this pipeline failed in an earlier call ({self._broken}); its ranks may hold "
                f"messages of that call, so build a new process group and AsyncPipe (or restart "
                f"the job) to go on"
            ) from self._broken

    def _tell_replicas(self, failure: BaseException, averages: bool) -> None:
        """A step that the replicas would average failed here (on every rank of this replica):
        let the other replicas, which wait for its gradients, raise instead."""
        if averages and self._averager is not None:
            self._averager.fail(failure)

    def _average(self) -> None:
        """Average the step's gradients over the replicas and learn how their steps ended:
        raise a StageFailure if one failed; stop when any replica's ranks asked to."""
        assert self._averager is not None
        try:
            self._averager.finish(self._runtime.stop_agreed)
        except StageFailure as e:
            self._broken = e
            raise
        self._runtime.stop_agreed = self._averager.stop_asked

    def _abandon(self, transport: Transport, created: list[dist.ProcessGroup]) -> None:
        """Release the transport built by name and the groups the pipeline created (those it
        holds once built; for a constructor that failed before, ``created`` by ``connect()``),
        for :meth:`close` and for a constructor that failed. Never raises."""
        self._closed = True
        if self._owns_transport:
            with contextlib.suppress(Exception):
                transport.close()
        release(getattr(self, "_created", None) or [weakref.ref(g) for g in created])

    def __deepcopy__(self, memo: dict[int, object]) -> NoReturn:
        raise TypeError(_NOT_COPIED)

    def __reduce_ex__(self, protocol: SupportsIndex) -> NoReturn:
        raise TypeError(_NOT_COPIED)

    def close(self) -> None:
        """Drain the pipeline (see :meth:`flush`), finish the trace (rank 0 writes the last
        step, the Chrome trace and the timeline pictures), then release what the pipeline
        created: the transport it built by name (its connections, mailboxes or rings; a
        Transport passed in stays open, its owner closes it) and the process groups of
        ``data_parallel_size`` and ``shared_weights``, with their connections and threads.

        Call it on every rank after the last step, and before building another pipeline in a
        long-lived process (a sweep, or a rebuild after a failure): a pipeline left open keeps
        its groups until the default group ends, so a process building many runs out of file
        descriptors. It releases on this rank alone, waiting for no other (a failed pipeline,
        or one whose peers closed already, closes too); calling it again does nothing. The
        pipeline cannot run after it (a step raises a RuntimeError saying so).

        Example:
            >>> for lr in (0.1, 0.01):                                   # doctest: +SKIP
            ...     pipe = asyncpipe.AsyncPipe(model, [2, 2], data_parallel_size=2)
            ...     train(pipe, lr)
            ...     pipe.close()
        """
        if self._closed:
            return
        try:
            if self.in_flight and self._broken is None:
                self.flush()
            if self._recorder is not None:
                self._recorder.close(drain=self._broken is None)
        finally:  # a flush that failed leaves nothing to keep the groups for
            self._abandon(self.transport, [])
