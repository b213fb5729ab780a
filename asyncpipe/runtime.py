"""The runtime: one per rank, it executes exactly its row of the lowered plan.

Each action kind has a handler. Segment boundaries always cut the autograd graph: a segment's
inputs are fresh leaves, its backward is an explicit ``torch.autograd.backward`` on its outputs,
and the gradients of its inputs travel to the previous segment (by message, or by hand when that
segment is on the same rank)::

    seg s-1 ──outputs──> [RECV_F] inputs(leaves) ──F──> outputs ──> [SEND_F] seg s+1
    seg s-1 <──x.grad── [SEND_B] inputs.grad <──B── grads of outputs <── [RECV_B] seg s+1

Every step ends with each rank telling every other how it went, so a failure reaches all.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence

import torch

from .blame import FAILED, KINDS, NEWS_SECONDS, OK, PEER_ERRORS, RELAYED, FailureBlame, failure_in
from .compute import Compute, warm_autograd
from .failure import Failed, MismatchedBatch, StageFailure, StepReport
from .labels import profiler_range
from .microbatch import Tensors
from .schedule import Action, Kind, Plan, PlanError, forward_only, lower, validate
from .schedule.messages import misordered_pair, settle_points
from .skip.routes import SkipRoutes
from .transport import Message, PendingRecv, Transport, TransportTimeout
from .work import Grads, Work

__all__: list[str] = []

# Channels of the messages beside a plan's, one each: two uses sharing a channel would take
# each other's messages (a receive posted ahead for one matches the other's message first).
STATUS_CHANNEL = 1 << 20  # every rank tells every other how its step ended
EXCHANGE_CHANNEL = STATUS_CHANNEL + 1  # small all-to-all exchanges between steps
CLOCK_CHANNEL = STATUS_CHANNEL + 2  # tracing: clock offsets, once
NORM_CHANNEL = STATUS_CHANNEL + 3  # 2BW: each rank's part of the norm of the gradient it applies
TRACE_CHANNEL = STATUS_CHANNEL + 4  # tracing: each step's events, to rank 0
CHECKPOINT_CHANNEL = STATUS_CHANNEL + 5  # checkpoints: saves report to rank 0, which answers


def _kind_code(action: str) -> int:
    """The index in ``Kind`` of a compute action's kind, or -1 if ``action`` is not one."""
    try:
        kind = Action.parse(action).kind
    except ValueError:
        return -1
    return KINDS.index(kind) if kind.is_compute else -1


def rows_of(pieces: list[Tensors] | None) -> int:
    """Rows of a scattered batch, or -1 if this rank has none."""
    return sum(piece[0].shape[0] for piece in pieces) if pieces else -1


class Runtime(FailureBlame, Compute):
    """Runs the local segments of one rank.

    Args:
        rank: this rank in the pipeline.
        segments: for each local segment index, the callables it applies in order.
        owners: the rank of every segment (index = segment).
        plan_for: the (unlowered) plan of a step with a given number of micro-batches.
        transport: how messages travel.
        timeout: seconds any wait may take before it fails naming the peer.
        device: where this rank computes (for RNG state).
        routes: the skip connections between segments.
    """

    def __init__(
        self,
        rank: int,
        segments: dict[int, list[torch.nn.Module]],
        owners: list[int],
        plan_for: Callable[[int], Plan],
        transport: Transport,
        timeout: float,
        device: torch.device,
        routes: SkipRoutes | None = None,
    ) -> None:
        warm_autograd()
        self.rank, self.segments, self.owners = rank, segments, owners
        self.routes = routes or SkipRoutes()
        self.plan_for = plan_for
        self.transport, self.timeout = transport, timeout
        self.device = device
        self.last = len(owners) - 1
        self.in_place: dict[int, bool] = {}
        self._plans: dict[tuple[int, bool], tuple[list[Action], frozenset[tuple[int, int]]]] = {}
        self._settle: dict[tuple[int, bool], dict[Action, list[Action]]] = {}
        self._statuses: dict[int, PendingRecv] = {}
        self._heard: dict[int, float] = {}
        self.after_backward: Callable[[], None] | None = None
        """Called right after this rank's last backward action of a training step (e.g. to
        start averaging gradients while the rest of the pipeline finishes)."""
        self.first_microbatch = 0
        """The micro-batch of the first message from the segment before this rank's first
        (where that is not segment 0), received before the step is planned: 0 in every plan
        asyncpipe makes; a plan the user gave may start with another."""
        self.stop_requested = False
        """Set (e.g. by a signal handler) to tell every rank at the end of the step."""
        self.stop_agreed = False
        """Whether some rank had asked to stop when the last step ended."""
        self.handlers: dict[Kind, Callable[[Work, Action], None]] = {
            Kind.FORWARD: self.forward,
            Kind.BACKWARD: self.backward,
            Kind.WEIGHT: self.weight,
            Kind.SEND_F: self.send_forward,
            Kind.SEND_B: self.send_backward,
            Kind.RECV_F: self.recv,
            Kind.RECV_B: self.recv,
        }

    # ----- plans -------------------------------------------------------------------------

    def plan(
        self, microbatches: int, train: bool
    ) -> tuple[list[Action], frozenset[tuple[int, int]]]:
        """This rank's row of the lowered plan (validated once per configuration), and the
        (segment, micro-batch) pairs whose backward the plan splits into B and W."""
        key = (microbatches, train)
        if key not in self._plans:
            plan = lower(self.plan_for(microbatches), self.routes.edges())
            if not train:
                plan = forward_only(plan)
            validate(plan)
            if not self.transport.early_receives:
                _check_posting_order(plan)
            row = [a for a in plan[self.rank] if a is not None]
            split = frozenset((a.stage, a.microbatch) for a in row if a.kind is Kind.WEIGHT)
            self._plans[key] = (row, split)
            self._settle[key] = settle_points(plan, self.rank)
        return self._plans[key]

    def check_fixed_plan(self, microbatches: int) -> None:
        """For a plan the user gave: check it with the sends and receives between ranks added
        (``lower``, with the pipeline's skips), and learn :attr:`first_microbatch` from it.

        Raises:
            ValueError: the plan cannot run once its messages are added."""
        try:
            row, _ = self.plan(microbatches, True)
        except PlanError as e:
            raise ValueError(
                f"the schedule plan cannot run once the sends and receives between ranks are "
                f"added (asyncpipe.schedule.lower, which AsyncPipe applies): {e}"
            ) from e
        seg = min(self.segments)
        firsts = (
            a.microbatch
            for a in row
            if a.kind is Kind.RECV_F and a.stage == seg and a.peer == seg - 1
        )
        self.first_microbatch = next(firsts, 0)

    def channel(self, action: Action) -> tuple[int, int]:
        """(peer rank, channel) of a send or receive: each (sending segment, receiving segment,
        direction) has its own channel, ``2 * (receiver * segments + sender) + backward``."""
        assert action.peer is not None
        backward = action.kind in (Kind.SEND_B, Kind.RECV_B)
        if action.kind.is_send:
            sender, receiver = action.stage, action.peer
        else:
            sender, receiver = action.peer, action.stage
        return self.owners[action.peer], self._channel(sender, receiver, backward)

    def _channel(self, sender: int, receiver: int, backward: bool) -> int:
        return 2 * (receiver * len(self.owners) + sender) + int(backward)

    def outgoing(self) -> set[tuple[int, int]]:
        """Every (peer rank, channel) that peers read from this rank."""
        out = set()
        for seg in self.segments:
            later = [seg + 1] if seg < self.last else []
            earlier = [seg - 1] if seg > 0 else []
            later += list(self.routes.outgoing.get(seg, {}))
            earlier += list(self.routes.incoming.get(seg, {}))
            for dest in later:
                if self.owners[dest] != self.rank:
                    out.add((self.owners[dest], self._channel(seg, dest, False)))
            for source in earlier:
                if self.owners[source] != self.rank:
                    out.add((self.owners[source], self._channel(seg, source, True)))
        return out

    # ----- the step ----------------------------------------------------------------------

    def run(
        self,
        prepare: Callable[[int | None], Work],
        phase: Callable[[Action], bool] = lambda a: True,
        resume: Work | None = None,
    ) -> tuple[Work, StepReport]:
        """Run the actions of this rank's row for which ``phase`` holds.

        ``prepare(m)`` builds the step's :class:`Work`; it gets the number of micro-batches
        when this rank learnt it from a message (ranks without segment 0), else ``None``.
        ``resume`` continues a step begun by an earlier call instead (e.g. its backward).
        """
        start = time.perf_counter()
        events: list[tuple[str, float, float]] = []
        busy = 0.0
        work: Work | None = None
        current = ""
        failure: Failed | None = None
        original: BaseException | None = None
        self._statuses = {}
        try:
            self.transport.check()
            first: PendingRecv | None = None
            first_action: Action | None = None
            microbatches: int | None = None
            if 0 not in self.segments and resume is None:
                seg = min(self.segments)
                first_action = Action(seg, Kind.RECV_F, self.first_microbatch, seg - 1)
                first = self.transport.recv(*self.channel(first_action), 0)
                self._post_statuses()
                current = str(first_action)
                message = first.wait(self.timeout)
                self._check_error(message, first_action)
                microbatches = message.microbatches
                first = _Ready(message)
            current = "prepare"
            work = resume if resume is not None else prepare(microbatches)
            full, work.split = self.plan(work.microbatches, work.train)
            work.settle = self._settle[(work.microbatches, work.train)]
            row = [a for a in full if phase(a)]
            if first is not None and first_action is not None:
                work.pending[first_action] = first
            work.unposted = [a for a in row if a.kind.is_recv and a not in work.pending]
            backwards = [n for n, a in enumerate(row) if a.kind in (Kind.BACKWARD, Kind.WEIGHT)]
            hook_at = backwards[-1] if backwards and self.after_backward else -1
            for index, action in enumerate(row):
                current = str(action)
                began = time.perf_counter()
                with profiler_range(current):
                    self.handlers[action.kind](work, action)
                ended = time.perf_counter()
                if action.kind.is_compute:
                    busy += ended - began
                events.append((current, began - start, ended - start))
                if index == hook_at and self.after_backward is not None:
                    self.after_backward()
        except Failed as e:
            failure, original = e, e
        except Exception as e:
            failed = Action.parse(current) if current not in ("", "prepare") else None
            found = self._peer_failure(failed, current, e) if isinstance(e, PEER_ERRORS) else None
            failure, original = found or self._own_failure(failed, current, e), e
        if failure is not None:
            self._notify(failure)
        self._finish(work, failure, original)
        seconds = time.perf_counter() - start
        assert work is not None
        return work, StepReport(seconds, busy, events, start, work.peak)

    def _finish(
        self,
        work: Work | None,
        failure: Failed | None,
        original: BaseException | None,
    ) -> None:
        """Tell every rank how this step ended and learn how theirs did: raise if any failed,
        else settle the sends. A failed rank waits for the others' news a moment at most
        (see :func:`end_failed`)."""
        # loss, outcome, failed stage, micro-batch, rank, stop asked, input rows, target
        # rows, failed action's kind (-1: none or unknown), whether this rank timed out
        # waiting for the failed rank (which then learns it was the slow one)
        status = [work.local_loss() if work else 0.0, OK, -1.0, -1.0, -1.0]
        if failure is not None:
            status[1] = RELAYED if failure.relayed else FAILED
            status[2:5] = [float(failure.stage), float(failure.microbatch), float(failure.rank)]
        status.append(float(self.stop_requested))
        status += (
            [float(rows_of(work.inputs)), float(rows_of(work.targets))] if work else [-1.0] * 2
        )
        status.append(float(_kind_code(failure.action)) if failure is not None else -1.0)
        waited = failure is not None and failure.rank != self.rank
        status.append(float(waited and isinstance(original, TransportTimeout)))
        news = Message(0, 0, (torch.tensor(status, dtype=torch.float64, device=self.device),))
        try:
            self._post_statuses()
        except Exception:
            if failure is None:
                raise
        for peer in range(self.transport.world_size):
            if peer == self.rank:
                continue
            try:
                self.transport.send(peer, STATUS_CHANNEL, news)
            except Exception:
                if failure is None:
                    raise
        if failure is not None:
            # Give the news a moment to leave before the caller (maybe) ends the process.
            end_failed(self.transport, self._statuses, min(self.timeout, NEWS_SECONDS))
            raise self._raise(failure, original)
        table, sources = [status], [self.rank]
        # A peer that waits for a message this rank never sends (the ranks ran different
        # calls) times out about when this rank's own wait would: a moment more lets its news,
        # which names the mismatch, come first.
        waits = self.timeout + min(self.timeout, NEWS_SECONDS)
        deadline = time.monotonic() + waits
        for peer, pending in self._post_statuses(now=True).items():
            try:
                message = pending.wait(max(deadline - time.monotonic(), 0.001))
                self._heard_from(peer)
                table.append(message.values(peer, "status"))
                sources.append(peer)
            except Exception as e:
                stage = self.owners.index(peer)
                raise StageFailure(
                    f"rank {peer} (stage {stage}) did not say how its step ended: rank "
                    f"{self.rank} finished its own work and waited {waits:.1f} s at most "
                    f"for that news ({e}); rank {peer} crashed, was killed or is stuck after "
                    f"its last message",
                    rank=peer,
                    stage=stage,
                    microbatch=-1,
                    action="",
                ) from e
        broken = [n for n, row in enumerate(table) if row[1] == FAILED] or [
            n for n, row in enumerate(table) if row[1] != OK
        ]
        if broken:
            row, reporter = table[broken[0]], sources[broken[0]]
            stage, mb, rank, action, where = failure_in(row)
            text = (
                f"{where} (see that rank's error for the cause); rank {self.rank} finished its "
                f"own work"
            )
            if rank == self.rank and len(row) > 9 and row[9]:  # the blame is this rank's own
                text = (
                    f"rank {reporter} timed out waiting for this rank (rank {rank}, stage "
                    f"{stage}) {f'in {action} ' if action else ''}(micro-batch {mb}): this rank "
                    f"was slower than the pipeline's timeout={self.timeout:g} s (it began the "
                    f"step late, its work took that long, or it ran another call or pipeline "
                    f"meanwhile); it finished its own work since. Call the same methods in the "
                    f"same order on every rank, or raise AsyncPipe(timeout=...) if its work "
                    f"really takes that long"
                )
            raise StageFailure(
                text,
                rank=rank,
                stage=stage,
                microbatch=mb,
                action=action,
            )
        assert work is not None
        work.loss_sum = sum(row[0] for row in table)
        self.stop_agreed = any(row[5] for row in table)
        self._statuses = {}
        # Every rank said its step went well, so each took every message it needed; what is
        # left unconfirmed is a peer's receipt of this rank's news. A peer that ended right
        # after its step (a kill between steps) fails the next step instead of this one,
        # which ran everywhere.
        self.transport.flush_received(self.timeout)
        inputs = {int(row[6]) for row in table if row[6] >= 0}
        targets = {int(row[7]) for row in table if row[7] >= 0}
        if inputs and targets and inputs != targets:
            raise MismatchedBatch(
                f"input and target must have the same batch size (input: {min(inputs)} rows, "
                f"target: {min(targets)} rows); the step ran but its loss and gradients mean "
                f"nothing, so do not apply them (zero the gradients, e.g. optimizer.zero_grad(), "
                f"which step(..., optimizer=...) does): pass a target with one row per input row"
            )

    def exchange(self, values: Sequence[float]) -> list[list[float]]:
        """Every rank's ``values`` (index = rank): one message to and from every other rank.
        Call it on every rank, between steps."""
        mine = torch.tensor(list(values), dtype=torch.float64, device=self.device)
        pending = _exchange_round(self.transport, Message(0, 0, (mine,)))
        table: list[list[float]] = [[] for _ in range(self.transport.world_size)]
        table[self.rank] = [float(v) for v in values]
        failure: StageFailure | None = None
        for peer, receive in pending.items():
            try:  # after a peer's error, the rest only so that no receive is left posted
                message = receive.wait(self.timeout if failure is None else NEWS_SECONDS)
                self._heard_from(peer)
            except PEER_ERRORS:
                if failure is None:
                    raise
                continue
            if message.error is not None:  # see refuse_exchange
                failure = failure or StageFailure(
                    message.error, rank=peer, stage=-1, microbatch=-1, action=""
                )
                continue
            table[peer] = message.values(peer, "values")
        if failure is not None:
            with contextlib.suppress(Exception):  # this rank's values leave before it raises
                self.transport.flush_received(NEWS_SECONDS)
            raise failure
        self.transport.flush_received(self.timeout)
        return table

    # ----- handlers ----------------------------------------------------------------------

    def _post_statuses(self, now: bool = False) -> dict[int, PendingRecv]:
        """Post the receives of the other ranks' end-of-step news (once per call of run).

        Posted ahead where the transport allows it; a transport that matches messages in
        posting order (NCCL) gets them only ``now``, after this rank's last data receive and
        its own news, in the order its peers send."""
        if not self._statuses and (now or self.transport.early_receives):
            peers = [r for r in range(self.transport.world_size) if r != self.rank]
            self._statuses = {peer: self.transport.recv(peer, STATUS_CHANNEL) for peer in peers}
        return self._statuses

    def _post_receives(self, work: Work) -> None:
        """Post every receive of the step not posted yet. Called just before this rank would
        block, so posting costs nothing on the critical path and each message finds its
        receive waiting (senders never block, but a message moves only once it is posted)."""
        self._post_statuses()
        if self.transport.early_receives:
            for action in work.unposted:
                work.pending[action] = self.transport.recv(*self.channel(action), action.microbatch)
        work.unposted = []

    def _post_next(self, work: Work, action: Action) -> None:
        """Post the next receive of ``action``'s channel only: what the rank will wait for
        next there, posted now so that its message can move during the coming compute."""
        for index, later in enumerate(work.unposted):
            if (later.kind, later.stage, later.peer) == (action.kind, action.stage, action.peer):
                del work.unposted[index]
                work.pending[later] = self.transport.recv(*self.channel(later), later.microbatch)
                return

    def recv(self, work: Work, action: Action) -> None:
        if work.unposted:
            if isinstance(work.pending.get(action), _Ready) and self.transport.early_receives:
                # The message is here already (a rank's first, taken before the step was
                # planned): the rank does not block, so posting the whole step's receives
                # now (tenths of a millisecond to milliseconds) would only delay the compute
                # the next rank waits for. Post the next one of this channel; the rest go
                # when the rank may block next.
                self._post_next(work, action)
            else:
                self._post_receives(work)
        pending = work.pending.pop(action, None)
        if pending is None:  # this transport takes receives only when they are due
            pending = self.transport.recv(*self.channel(action), action.microbatch)
        message = pending.wait(self.timeout)
        self._check_error(message, action)
        if message.microbatch != action.microbatch or message.microbatches != work.microbatches:
            raise RuntimeError(
                f"{action} expected micro-batch {action.microbatch} of {work.microbatches} but "
                f"received {message.microbatch} of {message.microbatches}: the ranks run "
                f"different plans (same chunks and batch size on every rank?)"
            )
        key = (action.stage, action.microbatch)
        assert action.peer is not None
        tensors = message.tensors
        if action.kind is Kind.RECV_F:
            keys = self.routes.incoming.get(action.stage, {}).get(action.peer, ())
            if keys:
                tensors, skips = tensors[: len(tensors) - len(keys)], tensors[-len(keys) :]
                work.skip_feed.setdefault(key, {}).update(zip(keys, skips))
            if action.peer == action.stage - 1:
                if tensors and tensors[-1] is None:  # see send_forward
                    work.tuples.add((action.peer, action.microbatch))
                work.feed[key] = tuple(t for t in tensors if t is not None)
        else:
            keys = self.routes.outgoing.get(action.stage, {}).get(action.peer, ())
            if keys:
                tensors, skips = tensors[: len(tensors) - len(keys)], tensors[-len(keys) :]
                work.skip_grads.setdefault(key, {}).update(zip(keys, skips))
            if action.peer == action.stage + 1:
                work.grads[key] = tensors
        for send in work.settle.get(action, ()):
            self.transport.settle(*self.channel(send), send.microbatch, self.timeout)

    def send_forward(self, work: Work, action: Action) -> None:
        seg, i = action.stage, action.microbatch
        assert action.peer is not None
        out: Grads = work.outputs[(seg, i)] if action.peer == seg + 1 else ()
        if out and (seg, i) in work.tuples:  # a trailing None: the output was a tuple of one
            out = (*out, None)
        keys = self.routes.outgoing.get(seg, {}).get(action.peer, ())
        if keys:
            stashed = work.skip_out[(seg, i)]
            out = out + tuple(stashed[k] for k in keys)
        if work.send_dtype is not None:
            dtype = work.send_dtype
            out = tuple(
                t.to(dtype) if t is not None and t.dtype == torch.float32 else t for t in out
            )
        peer, channel = self.channel(action)
        self.transport.send(peer, channel, Message(i, work.microbatches, out))

    def send_backward(self, work: Work, action: Action) -> None:
        seg, i = action.stage, action.microbatch
        assert action.peer is not None
        grads: Grads = work.grads.pop((seg - 1, i)) if action.peer == seg - 1 else ()
        keys = self.routes.incoming.get(seg, {}).get(action.peer, ())
        if keys:
            back = work.skip_back.get((seg, i), {})
            grads = grads + tuple(back.pop(k) for k in keys)
            if not back:
                work.skip_back.pop((seg, i), None)
        peer, channel = self.channel(action)
        self.transport.send(peer, channel, Message(i, work.microbatches, grads))


def _exchange_round(transport: Transport, message: Message) -> dict[int, PendingRecv]:
    """Send ``message`` to every other rank on the exchange channel; the receives of theirs,
    by rank. Posted ahead where the transport allows it, else after sending, in the order the
    peers send (NCCL)."""
    peers = [r for r in range(transport.world_size) if r != transport.rank]

    def post() -> dict[int, PendingRecv]:
        return {peer: transport.recv(peer, EXCHANGE_CHANNEL) for peer in peers}

    pending = post() if transport.early_receives else {}
    for peer in peers:
        transport.send(peer, EXCHANGE_CHANNEL, message)
    return pending or post()


def refuse_exchange(transport: Transport, text: str, timeout: float) -> None:
    """Take part in the next :meth:`Runtime.exchange` with ``text`` as an error in place of
    this rank's values: the other ranks raise it as a StageFailure naming this rank instead of
    waiting for values that never come. This rank takes their messages too (their values, or
    their own errors where they failed as well), ``timeout`` seconds at most, so that the
    channel holds nothing stale for a later exchange. Never raises: the caller raises its own
    error after."""
    deadline = time.monotonic() + timeout
    pending: dict[int, PendingRecv] = {}
    with contextlib.suppress(Exception):  # a peer that is gone cannot be told
        pending = _exchange_round(transport, Message(0, 0, (), error=text))
    for receive in pending.values():
        with contextlib.suppress(Exception):
            receive.wait(max(deadline - time.monotonic(), 0.001))
    with contextlib.suppress(Exception):
        transport.flush_received(max(deadline - time.monotonic(), 0.001))


def end_failed(
    transport: Transport,
    ends: dict[int, PendingRecv],
    seconds: float,
    ended: Callable[[Message], bool] = lambda message: True,
) -> None:
    """Let a failed step's messages leave, ``seconds`` at most; never raises.

    ``ends`` holds the receives of each peer's message that says how its own step ended (its
    news). Over a rendezvous transport (p2p over gloo) a send is taken only by a receive the
    peer posts, and a wait that times out closes every connection of the process group; a
    notice to a peer that failed as well, or that had all it needed from this rank, is never
    taken. So those messages come first: the sends to a peer whose message says it takes
    nothing more (``ended``) are let go, not waited for. The peer posted its receive of this
    rank's own message before it sent its own, so that one is taken, and waited for."""
    deadline = time.monotonic() + seconds
    over: set[int] = set()
    for peer, pending in ends.items() if transport.rendezvous else ():
        try:
            message = pending.wait(max(deadline - time.monotonic(), 0.001))
        except Exception:  # noqa: S112 - gone or silent: its sends wait below, as any
            continue
        if ended(message):
            over.add(peer)
            with contextlib.suppress(Exception):
                transport.settle(peer, STATUS_CHANNEL, 0, seconds)
    transport.flush_failed(max(deadline - time.monotonic(), 0.001), over)


def _check_posting_order(plan: Plan) -> None:
    """Refuse a plan that a transport matching messages in posting order (NCCL) cannot run."""
    pair = misordered_pair(plan)
    if pair is not None:
        raise ValueError(
            f"this schedule receives messages from rank {pair[0]} on rank {pair[1]} in "
            f"another order than they are sent, which a transport that matches messages "
            f"in posting order (NCCL) cannot do; use schedule='gpipe' or '1f1b', or the "
            f"gloo backend"
        )


class _Ready(PendingRecv):
    """A receive whose message is already here."""

    def __init__(self, message: Message) -> None:
        self.message = message

    def wait(self, timeout: float) -> Message:
        return self.message
