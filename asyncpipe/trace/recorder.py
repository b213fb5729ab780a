"""The recorder: each rank times its steps; rank 0 collects them, after each step, for the writer.

The runtime already times every action of a step (``StepReport.events``) and wraps each in a
``torch.profiler`` range named by the action string. The recorder adds the wait before a rank's
first action and the end-of-step exchange, moves the times onto rank 0's clock and ships one
small message per step to rank 0, after the step::

    rank r:  step k ──> [payload k] ──send──>                       step k+1 ...
    rank 0:  step k ──> post receives k ──> write step k-1 ──> step k+1 ...

With a transport that takes receives early (gloo), rank 0 takes step ``k - 1``'s payloads after
step ``k``, so it never waits for them; otherwise (NCCL) it takes step ``k``'s at once. Decoding
and writing happen on a writer thread that the recorder starts and joins, so the training loop
only hands bytes over.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import queue
import resource
import sys
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch.autograd.profiler import record_function

from ..failure import StepReport
from ..runtime import TRACE_CHANNEL
from ..schedule import Plan, forward_only, lower, two_bw
from ..transport import Message, PendingRecv, Transport
from .clock import clock_offset
from .run import STREAM_BATCHES, SYNC, WAIT, Event, RankStep, StepTrace, stream_window
from .writer import TraceWriter

__all__: list[str] = []

_POLL = 0.25  # seconds between the writer thread's batches
_SALVAGE = 5.0  # seconds close() gives, after a failure, to payloads of the completed steps
_LATE = 2.0
"""Seconds a step may have waited for the writer thread and still get its timeline image (a
tenth of a second to draw): a writer further behind writes steps without them until it has
caught up with a pipeline that steps faster than it draws."""
_BACKLOG = 1024
"""Steps that may wait for the writer thread; beyond, the training loop waits for it (a
writer that cannot keep up even without images must not hold ever more steps in memory)."""


def peak_memory(device: torch.device) -> int:
    """Peak bytes of this process: the CUDA allocator's on a GPU, else the resident set."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def _phase_events(report: StepReport, offset: float) -> list[Event]:
    """The report's events on the shared clock, with the first wait and the end-of-step
    exchange as events of their own."""
    base = report.start + offset
    events = [(name, base + start, base + end) for name, start, end in report.events]
    first = min((start for _, start, _ in report.events), default=report.seconds)
    last = max((end for _, _, end in report.events), default=first)
    if first > 0:
        events.insert(0, (WAIT, base, base + first))
    if report.seconds > last:
        events.append((SYNC, base + last, base + report.seconds))
    return events


class Recorder:
    """One rank's recorder; on rank 0 it also owns the writer.

    Args:
        writer: where rank 0 writes (other ranks ignore it).
        transport: the pipeline's transport (one extra channel carries the payloads).
        timeout: seconds any wait may take.
        device: where message tensors live.
        plan_for: the unlowered plan for a number of micro-batches.
        config: the run's configuration, written as text.
    """

    def __init__(
        self,
        writer: TraceWriter,
        transport: Transport,
        timeout: float,
        device: torch.device,
        plan_for: Callable[[int], Plan],
        config: Mapping[str, object],
    ) -> None:
        self.writer, self.transport, self.timeout, self.device = writer, transport, timeout, device
        self.plan_for, self.config = plan_for, dict(config)
        self.rank = transport.rank
        self.offset = 0.0
        self.started = self.closed = False
        self.step = 0
        self._phases: list[Event] = []
        self._phase_start: float | None = None
        self._phase_end = 0.0
        self._extra: list[Event] = []
        self._plans: dict[str, str] = {}  # a step's plan key -> the writer's key for it
        self._inbox: deque[tuple[dict[str, Any], dict[int, PendingRecv]]] = deque()
        self._lag = 1 if transport.early_receives else 0
        # steps for the writer thread: rank 0's payload, the others', when they were queued
        self._queue: queue.Queue[tuple[dict[str, Any], dict[int, bytes], float] | None]
        self._queue = queue.Queue(maxsize=_BACKLOG)
        self._late = False  # the writer thread has left images out (said once)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._after_close = False  # a step after close() was not traced (said once)

    def begin(self) -> None:
        """Align the clocks and open the writer: every rank, before the first step (not after
        :meth:`close`: the steps after it are not traced)."""
        if self.started or self.closed:
            return
        self.started = True
        self.offset = clock_offset(self.transport, self.timeout, self.device)
        if self.rank == 0:
            self.writer.open(self.config)
            self._thread = threading.Thread(target=self._write_loop, name="asyncpipe-trace")
            self._thread.daemon = True
            self._thread.start()
            atexit.register(self._at_exit)  # a run that never calls close() keeps its trace

    @contextlib.contextmanager
    def span(self, name: str) -> Iterator[None]:
        """Time a block of the caller's (e.g. the optimizer step) into the next payload (on
        this rank's clock: :meth:`end_step` moves it onto rank 0's, whose offset a span before
        the first step does not know yet)."""
        start = time.perf_counter()
        with record_function(name):
            yield
        self._extra.append((name, start, time.perf_counter()))

    def watch(self, optimizer: torch.optim.Optimizer, name: str) -> None:
        """Time every ``optimizer.step()`` as a span, through the optimizer's step hooks."""
        open_spans: list[tuple[float, contextlib.ExitStack]] = []

        def before(*_: object) -> None:
            profiled = contextlib.ExitStack()
            profiled.enter_context(record_function(name))
            open_spans.append((time.perf_counter(), profiled))

        def after(*_: object) -> None:
            if open_spans:
                start, profiled = open_spans.pop()
                profiled.close()
                self._extra.append((name, start, time.perf_counter()))

        optimizer.register_step_pre_hook(before)
        optimizer.register_step_post_hook(after)

    def _at_exit(self) -> None:
        """Write what rank 0 holds when the process ends without :meth:`close` (the peers'
        payloads still on their way are dropped: the process group may be gone)."""
        with contextlib.suppress(Exception):
            self._finish(None)

    def add(self, report: StepReport) -> None:
        """One run of the runtime (a whole step, or its forward or backward phase)."""
        if self.closed:
            return
        if self._phase_start is None:
            self._phase_start = report.start + self.offset
        self._phases += _phase_events(report, self.offset)
        self._phase_end = report.start + self.offset + report.seconds

    def end_step(
        self,
        *,
        loss: float | None,
        samples: int,
        microbatches: int,
        train: bool,
        window: str | None = None,
    ) -> None:
        """Ship the step's payload (rank 0 keeps its own) and write what has arrived.

        ``window``: the step ran one window of the 2BW stream (named by
        :func:`~asyncpipe.trace.run.window_name`), not a whole plan; its plan in the trace is
        the stream it is a window of.

        After :meth:`close` (which every rank calls) a step is not traced, on any rank: rank 0
        no longer writes, so no rank sends (a warning says so, once)."""
        if self.closed:
            self._phases, self._extra, self._phase_start = [], [], None
            if not self._after_close:
                self._after_close = True
                warnings.warn(
                    "asyncpipe: this step ran after pipe.close(), which ended the trace "
                    f"({self.writer.directory}): it and the steps after it are not traced",
                    stacklevel=4,
                )
            return
        assert self._phase_start is not None
        shift = self.offset  # the spans were timed on this rank's clock
        shared = [(name, start + shift, end + shift) for name, start, end in self._extra]
        payload: dict[str, Any] = {
            "start": self._phase_start,
            "seconds": self._phase_end - self._phase_start,
            "events": self._phases,
            "peak_memory": peak_memory(self.device),
            "samples": samples,
            "extra": shared,
        }
        self._phases, self._extra, self._phase_start = [], [], None
        step, self.step = self.step, self.step + 1
        if self.rank != 0:
            data = torch.frombuffer(bytearray(json.dumps(payload).encode()), dtype=torch.uint8)
            message = Message(step % 2, step, (data.to(self.device),))
            self.transport.send(0, TRACE_CHANNEL, message)
            return
        key = f"{microbatches}/{window or ('train' if train else 'eval')}"
        if key not in self._plans:
            self._plans[key] = key
            if window is not None:
                cut = stream_window(key)
                if cut is None:
                    raise ValueError(
                        f"no 2BW window is named {window!r}: e.g. '2bw-first', '2bw', "
                        f"'2bw-drain', '2bw-lookahead2'"
                    )
                world, lookahead = self.transport.world_size, cut[2]
                stream = two_bw(world, microbatches, STREAM_BATCHES, lookahead=lookahead)
                stored = self.writer.add_plan(key, lower(stream))
            else:
                plan = lower(self.plan_for(microbatches))
                stored = self.writer.add_plan(key, plan if train else forward_only(plan))
            self._plans[key] = stored if isinstance(stored, str) else key
        # numbered after the steps an earlier run recorded in the directory
        payload.update(step=self.writer.first_step + step, loss=loss, plan=self._plans[key])
        peers = range(1, self.transport.world_size)
        # Two slots: a slot's next receive is posted only after its last message was taken,
        # so a transport that sizes receives by slot (p2p over gloo) sees them in order.
        posted = {p: self.transport.recv(p, TRACE_CHANNEL, step % 2) for p in peers}
        self._inbox.append((payload, posted))
        while len(self._inbox) > self._lag:
            self._collect(*self._inbox.popleft())

    def _collect(
        self, own: dict[str, Any], pending: dict[int, PendingRecv], deadline: float | None = None
    ) -> None:
        """Take the peers' payloads of one step (by ``deadline``, a ``time.monotonic()``, if
        given) and hand them to the writer thread."""
        raw = {}
        for peer, receive in pending.items():
            left = self.timeout if deadline is None else max(deadline - time.monotonic(), 0.01)
            message = receive.wait(left)
            tensor = message.tensors[0] if message.tensors else None
            if message.error is not None or tensor is None:
                raise RuntimeError(f"rank {peer} sent no trace of step {own['step']}")
            raw[peer] = tensor.cpu().numpy().tobytes()
        try:
            self._queue.put((own, raw, time.monotonic()), timeout=self.timeout)
        except queue.Full:
            raise RuntimeError(
                f"the trace writer ({self.writer.directory}) is {_BACKLOG} steps behind the "
                f"pipeline and wrote none of them in {self.timeout:.1f} s: is its disk stuck?"
            ) from None

    def _write_loop(self) -> None:
        """Write what arrived, a batch every ``_POLL`` seconds: the training loop never wakes
        this thread, so the two meet for the interpreter lock only once per batch."""
        done = False
        while not done:
            time.sleep(_POLL)
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    done = True
                    break
                if self._error is None:
                    try:
                        own, raw, queued = item
                        picture = self._picture(time.monotonic() - queued)
                        self.writer.write(assemble(own, raw), picture=picture)
                    except BaseException as e:  # reported by close()
                        self._error = e

    def _picture(self, waited: float) -> bool:
        """Whether a step that waited ``waited`` seconds for the writer thread may have its
        timeline image: not after ``_LATE`` seconds (said once, on stderr)."""
        if waited <= _LATE:
            return True
        if not self._late:
            self._late = True
            print(
                f"asyncpipe: the trace writer is {waited:.1f} s behind the pipeline (a timeline "
                f"image takes about 0.1 s to draw; this run draws one every "
                f"{self.writer.every} steps): the steps it is late with are written without "
                f"their images",
                file=sys.stderr,
                flush=True,
            )
        return False

    def close(self, drain: bool = True) -> None:
        """Write what is still due and close the writer; rank 0 also renders the timeline and
        the Chrome trace of the run.

        ``drain=False`` (the pipeline failed): every step that completed is still written,
        but its peers' payloads get a few seconds in all, not the pipeline's timeout, and a
        step whose payloads do not come (a peer that failed before it sent them) is left
        out, with the steps after it."""
        self._finish(self.timeout if drain else min(self.timeout, _SALVAGE), strict=drain)

    def _finish(self, wait: float | None, strict: bool = False) -> None:
        """Close: take the steps still due within ``wait`` seconds (none if None); with
        ``strict``, a payload that does not come is an error."""
        if self.closed:
            return
        self.closed = True
        atexit.unregister(self._at_exit)
        if self.rank != 0:
            if wait is not None and self.started:
                with contextlib.suppress(Exception):
                    if strict:
                        self.transport.flush(wait)
                    else:  # only the payloads: sends to a failed peer may never complete
                        for slot in (0, 1):
                            self.transport.settle(0, TRACE_CHANNEL, slot, wait)
            return
        deadline = None if wait is None else time.monotonic() + wait
        try:
            while deadline is not None and self._inbox:
                if strict:
                    self._collect(*self._inbox.popleft())
                    continue
                try:
                    self._collect(*self._inbox.popleft(), deadline=deadline)
                except Exception:  # noqa: BLE001 - a failed peer sent no payload: stop here
                    break
        finally:
            self._inbox.clear()
            if self._thread is not None:
                self._queue.put(None)
                self._thread.join()
            if self.started:
                self.writer.close()
        if self._error is not None:
            raise RuntimeError(f"the trace writer failed: {self._error}") from self._error


def assemble(own: dict[str, Any], raw: Mapping[int, bytes]) -> StepTrace:
    """Rank 0's payload and the others' (JSON bytes) as one step on rank 0's clock."""
    payloads = {0: own, **{peer: json.loads(data.decode()) for peer, data in raw.items()}}
    # The step begins with the first action anywhere (the first stage's first forward):
    # a rank that waited for it before is not inside the step yet.
    actions = [s for p in payloads.values() for n, s, _ in p["events"] if n != WAIT]
    origin = min(actions or [p["start"] for p in payloads.values()])

    def shift(events: list[Any]) -> tuple[Event, ...]:
        moved = ((str(n), max(s, origin) - origin, e - origin) for n, s, e in events)
        return tuple(e for e in moved if e[2] > e[1] or e[0] != WAIT)

    ranks = {}
    for rank, p in sorted(payloads.items()):
        start = max(p["start"], origin)
        seconds = p["start"] + p["seconds"] - start
        ranks[rank] = RankStep(start - origin, seconds, shift(p["events"]), p["peak_memory"])
    extra = tuple(
        (rank, str(n), s - origin, e - origin)
        for rank, p in sorted(payloads.items())
        for n, s, e in p["extra"]
    )
    samples = sum(int(p["samples"]) for p in payloads.values())
    return StepTrace(own["step"], origin, own["loss"], samples, ranks, own["plan"], extra)
