"""The 2BW stream: runs one window of the PipeDream-2BW plan per step, never draining between.

Each ``step()`` runs this rank's window of :func:`~asyncpipe.schedule.two_bw`: the forwards of
the new mini-batch and the backwards beside them, some of the previous mini-batch (stale: they
run on the stashed weights) and some of the new one. The state of the micro-batches still in
flight stays here between calls, and the update lands at the end of the window::

    window t:  F(t, 0) B(t-1, M-w) ... F(t, w-1) B(t-1, M-1) | take g(t-1) | F(t, w) B(t, 0) ...
    end:       stash weights v(t) if B(t, M-w..M-1) are owed; optimizer.step() with g(t-1)
    flush():   B(t, M-w) ... B(t, M-1) on the stash, then optimizer.step() with g(t)

Ranks report how a window went to every other rank without waiting for each other: a window's
news is read at the end of the next one (or by ``flush()``), so the pipeline stays full.

Between two windows the caller may change what the stale backwards depend on: the parameters'
``requires_grad`` (recorded as each mini-batch's forwards begin and put back for its stale
backwards) and ``.grad``, which holds the running gradient of the mini-batch in flight (a
change there, e.g. ``optimizer.zero_grad()``, is refused at the start of the next window).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator

import torch
from torch import nn

from .blame import NEWS_SECONDS, OK, PEER_ERRORS
from .failure import Failed, MismatchedBatch, StageFailure, StepReport
from .labels import profiler_range
from .options import IN_ORDER
from .precision import SpreadNorm
from .runtime import NORM_CHANNEL, STATUS_CHANNEL, Runtime, end_failed, rows_of
from .schedule import Action, Kind, lower, validate
from .schedule.two_bw import two_bw, windows
from .transport import Message, PendingRecv, Transport, TransportTimeout
from .versions import WeightVersions
from .work import Work

__all__: list[str] = []


class Stream:
    """Runs the 2BW windows of one rank, keeping the previous mini-batch in flight.

    Args:
        runtime: this rank's runtime (handlers, channels, transport, timeout).
        params: this rank's parameters.
        stages: segments of the pipeline.
        microbatches: micro-batches of every mini-batch.
        lookahead: micro-batches each rank's forwards run ahead of the next rank's (see
            :func:`~asyncpipe.schedule.two_bw`).
    """

    def __init__(
        self,
        runtime: Runtime,
        params: list[nn.Parameter],
        stages: int,
        microbatches: int,
        lookahead: int = 1,
    ) -> None:
        self.runtime = runtime
        self.microbatches = microbatches
        self.lookahead = lookahead
        plan = two_bw(stages, microbatches, batches=2, lookahead=lookahead)
        plan = validate(lower(plan, runtime.routes.edges()))
        cut = windows(plan, stages, microbatches, batches=2, lookahead=lookahead)
        first, steady, drain = cut[runtime.rank]
        self.windows = {"first": first, "steady": steady, "drain": drain}
        self._crossing = {
            name: _crossing(cut, runtime.rank, window, microbatches)
            for name, window in (("first", 0), ("steady", 1))
        }
        self.versions = WeightVersions(params)
        self.previous: Work | None = None
        """The mini-batch whose last backwards the next window (or the drain) runs."""
        self.batches = 0
        """Mini-batches begun since the start or the last drain (numbers trace events)."""
        self.optimizer: torch.optim.Optimizer | None = None
        """The last step's optimizer (None on a rank without parameters)."""
        self.flags: list[bool] | None = None
        """The parameters' ``requires_grad`` as the forwards of the mini-batch in flight began."""
        self._stale_flags: list[bool] | None = None
        """Those flags, for the stale backwards of this window, where the caller changed some."""
        self.max_norm: float | None = None
        """Clip each applied gradient to this 2-norm over every stage (the last step's)."""
        self.grad_norm = math.nan
        """The norm over every stage of the gradient the last update applied, before clipping
        (NaN when the update did not clip, or there was none)."""
        self._norm = SpreadNorm(runtime.transport, NORM_CHANNEL, runtime.timeout, runtime.device)
        self._unread: dict[int, PendingRecv] = {}
        self._posted: dict[int, PendingRecv] = {}
        """The receives of the peers' news of the window under way (``_unread`` once it ends)."""
        self._status: list[float] = []
        self._draining = False
        """Whether the drain runs: a failure then is told to every rank on the status channel,
        whose drain news (:meth:`_ended`) it stands in for."""

    @property
    def in_flight(self) -> bool:
        """Whether a mini-batch still owes backwards (the pipeline is not drained)."""
        return self.previous is not None

    def step(
        self,
        prepare: Callable[[int | None], Work],
        optimizer: object,
        max_norm: float | None = None,
    ) -> tuple[Work, float, StepReport]:
        """Run the next window: the forwards of a new mini-batch. Returns its work, the mean
        loss of the previous mini-batch (NaN if there was none) and the timing of the window,
        from the call to the end of the update and the news. ``max_norm``: clip the gradient
        that the update at its end applies (and the drain's) to this 2-norm over every stage."""
        start = time.perf_counter()
        steady = self.previous is not None
        window = self.windows["steady" if steady else "first"]
        current = 1 if steady else 0
        with self._before(window, current):  # a rejection reaches every rank
            work = prepare(self.microbatches)
            checked = _optimizer(optimizer, bool(self.versions.params))
            if work.microbatches != self.microbatches:
                raise ValueError(
                    f"schedule '2bw' needs every mini-batch to split into chunks="
                    f"{self.microbatches} micro-batches (this one split into "
                    f"{work.microbatches} with torch.chunk); pass batches whose rows are a "
                    f"multiple of {self.microbatches}"
                )
            posted = self._posted = self._post_news()
        self.optimizer, self.max_norm = checked, max_norm
        flags = self.versions.requires_grad()  # as this mini-batch's forwards begin
        self._stale_flags = self.flags if self.flags != flags else None
        events, busy, peak = self._run(
            window, {current: work, current - 1: self.previous}, current, start
        )
        owed = {(a.stage, a.microbatch) for a in window if a.kind is Kind.FORWARD}
        owed -= {(a.stage, a.microbatch) for a in window if a.kind is Kind.BACKWARD}
        status = [work.local_loss(), OK, float(self.runtime.stop_requested)]
        status += [float(rows_of(work.inputs)), float(rows_of(work.targets))]
        self._send_news(status)
        loss = math.nan
        if self.previous is not None:
            loss = self._read_news()
        self._unread, self._posted, self._status = posted, {}, status
        self._post(self.windows["steady"], {0: work}, only=0)
        transport = self.runtime.transport
        for send in self._crossing["steady" if steady else "first"]:
            transport.defer(*self.runtime.channel(send), send.microbatch)
        transport.flush(self.runtime.timeout)
        # Last, when the peers have all they need of this window: a failure here reaches
        # them in their next window, not as a send that nobody takes.
        self._update(self.optimizer, keep=bool(owed))
        self.versions.hold()  # the running gradient of ``work``: nothing may change it now
        self.previous, self.flags = work, flags
        self.batches += 1
        seconds = time.perf_counter() - start
        return work, loss, StepReport(seconds, busy, events, start, peak)

    def drain(self) -> tuple[float, StepReport]:
        """Run the backwards still owed and apply the last mini-batch's update: the pipeline is
        then empty. Returns the mean loss of that mini-batch (NaN if nothing was in flight) and
        the timing of the drain."""
        start = time.perf_counter()
        if self.previous is None:
            return math.nan, StepReport(0.0, 0.0, [], start)
        flags = self.versions.requires_grad()
        self._stale_flags = self.flags if self.flags != flags else None
        self._draining = True
        try:
            events, busy, peak = self._run(self.windows["drain"], {1: self.previous}, 2, start)
        finally:
            self._draining = False
        loss = self._read_news()  # first: a mini-batch whose news says it was wrong is not applied
        self._ended()  # and none is applied unless every rank's drain went well
        self._update(self.optimizer, keep=False)
        self.runtime.transport.flush_received(self.runtime.timeout)  # every rank's news is in
        self.previous, self.flags, self._stale_flags = None, None, None
        self.batches = 0
        return loss, StepReport(time.perf_counter() - start, busy, events, start, peak)

    # ----- news of each window, read one window late --------------------------------------

    def _post_news(self) -> dict[int, PendingRecv]:
        transport = self.runtime.transport
        peers = [r for r in range(transport.world_size) if r != self.runtime.rank]
        return {peer: transport.recv(peer, STATUS_CHANNEL) for peer in peers}

    def _send_news(self, status: list[float]) -> None:
        transport = self.runtime.transport
        tensor = torch.tensor(status, dtype=torch.float64, device=self.runtime.device)
        for peer in range(transport.world_size):
            if peer != self.runtime.rank:
                transport.send(peer, STATUS_CHANNEL, Message(0, 0, (tensor,)))

    def _ended(self) -> None:
        """Every rank tells every other that its drain went well, and waits for theirs. No
        window follows the drain whose news would carry a failure in it, and a rank whose
        drain needs nothing from the rank that failed or died (the last stage's is empty)
        would otherwise return as if all went well. A rank that failed in its drain sends its
        failure here instead (:meth:`_ends`); one that died is seen gone, or is waited for a
        margin longer than its own waits, so that a peer's failure naming it comes first."""
        runtime = self.runtime
        pending = self._post_news()
        self._send_news([0.0, OK])
        waits = runtime.timeout + min(runtime.timeout, NEWS_SECONDS)
        deadline = time.monotonic() + waits
        for peer, receive in pending.items():
            try:
                message = receive.wait(max(deadline - time.monotonic(), 0.001))
            except PEER_ERRORS as e:
                stage = runtime.owners.index(peer)
                raise StageFailure(
                    f"rank {peer} (stage {stage}) did not say how its 2BW drain went: rank "
                    f"{runtime.rank} drained its own part and waited {waits:.1f} s at most for "
                    f"that news ({e}); rank {peer} crashed, was killed or is stuck",
                    rank=peer,
                    stage=stage,
                    microbatch=-1,
                    action="",
                ) from e
            if message.error is not None:  # it failed, or learned of a failure elsewhere
                raise runtime._raise(Failed.decode(message.error, peer), None)

    def _read_news(self) -> float:
        """Every rank's news of the previous window: its mini-batch's mean loss."""
        table = [self._status]
        unread, self._unread = self._unread, {}
        for peer, pending in unread.items():
            try:
                message = pending.wait(self.runtime.timeout)
            except Exception as e:
                raise TransportTimeout(
                    f"rank {peer} did not say how its last 2BW window went: rank "
                    f"{self.runtime.rank} waited {self.runtime.timeout:.1f} s; rank {peer} "
                    f"crashed, was killed or is stuck"
                ) from e
            table.append(message.values(peer, "news of its last 2BW window"))
        self.runtime.stop_agreed = any(row[2] for row in table)
        inputs = {int(row[3]) for row in table if row[3] >= 0}
        targets = {int(row[4]) for row in table if row[4] >= 0}
        if inputs and targets and inputs != targets:  # every rank finds it, before the update
            raise MismatchedBatch(
                f"input and target must have the same batch size, and the mini-batch of the "
                f"previous step had {min(inputs)} input rows and {min(targets)} target rows; its "
                f"gradient is not applied, and as schedule '2bw' keeps a mini-batch in flight "
                f"this pipeline cannot go on: build it again (or resume from a checkpoint) and "
                f"pass a target with one row per input row"
            )
        return sum(row[0] for row in table) / self.microbatches

    def _post(
        self, window: list[Action], batches: dict[int, Work | None], only: int | None = None
    ) -> None:
        """Post the receives of ``window`` not posted yet (of mini-batch ``only``, if given).

        The end of a window posts the next one's receives for the mini-batch it leaves in
        flight: a peer that sent it a gradient in its own window waits until that is taken
        before it returns, so nothing between two steps (a barrier, a checkpoint) can wait on
        a receive that nobody posted."""
        transport, m = self.runtime.transport, self.microbatches
        if not transport.early_receives:
            return
        for a in window:
            batch = a.microbatch // m
            if not a.kind.is_recv or (only is not None and batch != only):
                continue
            owner = batches[batch]
            mine = Action(a.stage, a.kind, a.microbatch % m, a.peer)
            if owner is not None and mine not in owner.pending:
                owner.pending[mine] = transport.recv(*self.runtime.channel(mine), mine.microbatch)

    # ----- one window ----------------------------------------------------------------------

    def _global(self, action: Action, current: int) -> Action:
        """``action`` of a window numbered in the stream since the start or the last drain:
        micro-batch ``i`` of mini-batch ``t`` is ``t * M + i`` (as in traces and errors)."""
        offset = (self.batches - current) * self.microbatches
        return Action(action.stage, action.kind, action.microbatch + offset, action.peer)

    @contextlib.contextmanager
    def _before(self, window: list[Action], current: int) -> Iterator[None]:
        """Run what comes before the first action of ``window`` (checking the arguments,
        building the window): a failure there is sent to the peers, so that every rank raises
        it naming this stage and the action it did not begin."""
        try:
            yield
        except Exception as e:
            runtime, m = self.runtime, self.microbatches
            stage = min(runtime.segments)
            computes = [a for a in window if a.kind.is_compute]
            if computes:
                first = self._global(computes[0], current)
                where = (
                    f"before its first action {first} (micro-batch {first.microbatch % m} of "
                    f"mini-batch {first.microbatch // m})"
                )
            else:
                first, where = None, "before its drain"
            argument = isinstance(e, (TypeError, ValueError))
            failure = Failed(
                f"stage {stage} {'rejected its arguments' if argument else 'failed'} on rank "
                f"{runtime.rank} {where}: {type(e).__name__}: {e}",
                stage,
                first.microbatch % m if first is not None else -1,
                str(first) if first is not None else "",
                runtime.rank,
            )
            raise self._tell(failure, e, raise_original=argument) from e

    def _run(
        self, window: list[Action], batches: dict[int, Work | None], current: int, start: float
    ) -> tuple[list[tuple[str, float, float]], float, int]:
        """Run ``window``; its micro-batch ``g`` is micro-batch ``g % M`` of
        ``batches[g // M]``. The previous mini-batch's gradient is taken after its last action
        (at once if it has none here). Returns the events (times since ``start``), the seconds
        of compute and the most micro-batches in flight."""
        m = self.microbatches
        runtime = self.runtime
        stale = current - 1
        with self._before(window, current):
            self.versions.check_held()  # first: the running gradient is as the last window left it
            local = [(a, Action(a.stage, a.kind, a.microbatch % m, a.peer)) for a in window]
            older = [n for n, (a, _) in enumerate(local) if a.microbatch // m == stale]
            take_at = older[-1] if older else -1
            if self.previous is not None and self.max_norm is not None:
                self._norm.post()  # the previous mini-batch's gradient is applied at the end
            if self.previous is not None and take_at < 0:
                self._take()
            self._post(window, batches)
        events: list[tuple[str, float, float]] = []
        busy, peak = 0.0, 0
        action: Action | None = None
        mine: Action | None = None
        try:
            for index, (action, mine) in enumerate(local):
                work = batches[action.microbatch // m]
                assert work is not None
                text = str(self._global(action, current))
                began = time.perf_counter()
                with profiler_range(text), self._versioned(action, stale):
                    runtime.handlers[action.kind](work, mine)
                ended = time.perf_counter()
                if action.kind.is_compute:
                    busy += ended - began
                    peak = max(peak, sum(w.live for w in batches.values() if w is not None))
                events.append((text, began - start, ended - start))
                if index == take_at:
                    self._take()
        except Exception as e:
            raise self._failed(e, action, mine, current) from e
        return events, busy, peak

    def _take(self) -> None:
        """The previous mini-batch's gradient is complete here: set it aside (and, to clip it,
        send this rank's part of its norm to the others at once)."""
        self.versions.take_gradient()
        if self.max_norm is not None and self.versions.ready is not None:
            self._norm.send(self.versions.ready)

    def _update(self, optimizer: torch.optim.Optimizer | None, keep: bool) -> None:
        """Apply the previous mini-batch's gradient (clipped by its norm over every stage, with
        ``max_norm``; no optimizer: a rank without parameters); a failure there reaches every
        rank."""
        try:
            ready = self.versions.ready
            self.grad_norm = math.nan
            if ready is not None and self.max_norm is not None:
                self.grad_norm = self._norm.clip(ready, self.max_norm)
            self.versions.update(optimizer, keep=keep)
        except Exception as e:
            runtime = self.runtime
            stage = min(runtime.segments)
            failure = Failed(
                f"stage {stage} failed on rank {runtime.rank} in the update at the end of its "
                f"window (optimizer.step() with the gradient of the previous mini-batch): "
                f"{type(e).__name__}: {e}",
                stage,
                -1,
                "",
                runtime.rank,
            )
            raise self._tell(failure, e) from e

    def _failed(
        self, error: Exception, action: Action | None, mine: Action | None, current: int
    ) -> BaseException:
        """Tell the peers that read from this rank, and the error to raise here."""
        runtime = self.runtime
        if isinstance(error, Failed):
            failure = error
            if action is not None and mine is not None:  # where it waited, as in traces
                here = self._global(action, current)
                failure.text = failure.text.replace(f"waited in {mine})", f"waited in {here})")
        elif mine is not None and mine.kind.is_recv and isinstance(error, PEER_ERRORS):
            failure = runtime._silent_peer(mine, error)
        elif action is not None and mine is not None:
            text = self._global(action, current)
            failure = Failed(
                f"stage {mine.stage} failed in {text} (micro-batch {mine.microbatch} of "
                f"mini-batch {text.microbatch // self.microbatches}) on rank {runtime.rank}: "
                f"{type(error).__name__}: {error}",
                mine.stage,
                mine.microbatch,
                str(text),
                runtime.rank,
            )
        else:
            failure = Failed(
                f"rank {runtime.rank} failed: {type(error).__name__}: {error}",
                -1,
                -1,
                "",
                runtime.rank,
            )
        return self._tell(failure, error)

    def _tell(
        self, failure: Failed, error: BaseException, raise_original: bool = False
    ) -> BaseException:
        """Send ``failure`` to the peers that read from this rank (they relay it on), give
        the notices a moment to leave, and return the error to raise here: the caller's own
        bad argument as it is (``raise_original``), else a StageFailure."""
        runtime = self.runtime
        runtime._notify(failure)
        seconds = min(runtime.timeout, NEWS_SECONDS)
        end_failed(runtime.transport, self._ends(failure), seconds, lambda m: bool(m.error))
        if raise_original:
            return error
        return runtime._raise(failure, error)

    def _ends(self, failure: Failed) -> dict[int, PendingRecv]:
        """Over a rendezvous transport (see :func:`~asyncpipe.runtime.end_failed`), send
        ``failure`` to every other rank where its news of this window would go, and return the
        receives of theirs: a rank that failed as well (both refused a short last batch) says
        so there at once, and takes none of this rank's notices. Each rank's messages on the
        status channel are its news of every window it finished, then its failure; the
        receives of the window under way are posted already once its arguments passed."""
        transport, rank = self.runtime.transport, self.runtime.rank
        notice = Message(0, 0, (), error=failure.encode())
        if not transport.rendezvous:
            if self._draining:  # every rank waits for this rank's drain news: tell them all
                for peer in (r for r in range(transport.world_size) if r != rank):
                    with contextlib.suppress(Exception):
                        transport.send(peer, STATUS_CHANNEL, notice)
            return {}
        posted, self._posted = self._posted, {}
        ends: dict[int, PendingRecv] = {}
        for peer in (r for r in range(transport.world_size) if r != rank):
            with contextlib.suppress(Exception):  # a peer that is gone cannot be told
                ends[peer] = posted.get(peer) or transport.recv(peer, STATUS_CHANNEL)
            with contextlib.suppress(Exception):
                transport.send(peer, STATUS_CHANNEL, notice)
        return ends

    @contextlib.contextmanager
    def _versioned(self, action: Action, stale: int) -> Iterator[None]:
        """Forwards save the live version; backwards of the older mini-batch use the stash,
        and its ``requires_grad`` flags where the caller changed some since."""
        if action.kind is Kind.FORWARD:
            with self.versions.saving():
                yield
        elif action.kind is Kind.BACKWARD and action.microbatch // self.microbatches == stale:
            with self.versions.stale(self._stale_flags):
                yield
        else:
            yield


def _optimizer(optimizer: object, needed: bool) -> torch.optim.Optimizer | None:
    """``optimizer``, checked: a rank without parameters (not ``needed``) may pass None."""
    if optimizer is None and not needed:
        return None
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"schedule '2bw' applies each mini-batch's update itself, one step late: pass this "
            f"rank's optimizer, pipe.step(x, y, loss_fn, optimizer=optimizer) (got "
            f"{type(optimizer).__name__}; only a rank without parameters passes None)"
        )
    return optimizer


def _crossing(
    cut: dict[int, list[list[Action]]], rank: int, window: int, microbatches: int
) -> list[Action]:
    """The sends of ``rank``'s ``window`` (numbered by micro-batch within its mini-batch) that
    their receivers take only in a later window of theirs: a gradient sent at the end of a
    window for a backward of the next one. The end of the window does not wait for them (its
    peer may be waiting for this rank between two steps, e.g. in a barrier, and over gloo a
    large message is taken only when its receive runs); the end of the next one does."""
    opposite = {Kind.SEND_F: Kind.RECV_F, Kind.SEND_B: Kind.RECV_B}
    where = {a: k for row in cut.values() for k, part in enumerate(row) for a in part}
    out = []
    for a in cut[rank][window]:
        if a.kind.is_send:
            assert a.peer is not None
            if where[Action(a.peer, opposite[a.kind], a.microbatch, a.stage)] > window:
                out.append(Action(a.stage, a.kind, a.microbatch % microbatches, a.peer))
    return out


def check_two_bw_transport(transport: Transport) -> None:
    """Refuse, for ``schedule="2bw"``, a transport that cannot post receives ahead."""
    if not transport.early_receives:
        raise ValueError(IN_ORDER)
