"""The transport interface: non-blocking sends and receives posted ahead of time."""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Collection
from dataclasses import dataclass

import torch.distributed as dist
from torch import Tensor

__all__: list[str] = []


class TransportTimeout(TimeoutError):
    """A receive did not finish in time; the message names the peer."""


class PeerLost(ConnectionError):
    """The process of pipeline rank ``peer`` is gone (its connection closed, or it exited);
    the message names it and what this rank was doing."""

    def __init__(self, text: str, peer: int) -> None:
        super().__init__(text)
        self.peer = peer


@dataclass(frozen=True)
class Message:
    """Tensors of one micro-batch crossing a stage boundary, or a failure notice.

    ``tensors`` may hold ``None`` (a missing gradient). ``microbatches`` is the number of
    micro-batches of the step, so a receiver can learn it from its first message.
    """

    microbatch: int
    microbatches: int
    tensors: tuple[Tensor | None, ...]
    error: str | None = None

    def values(self, sender: int, what: str) -> list[float]:
        """The numbers of a one-tensor message (end-of-step news, values ranks exchange); a
        RuntimeError naming ``sender`` and ``what`` if it brought an error or no tensor."""
        tensor = self.tensors[0] if self.tensors else None
        if self.error is not None or tensor is None:
            raise RuntimeError(f"rank {sender} sent no {what}: {self.error}")
        values: list[float] = tensor.cpu().reshape(-1).tolist()
        return values


class PendingRecv(abc.ABC):
    """A receive posted ahead of time; :meth:`wait` returns its message."""

    @abc.abstractmethod
    def wait(self, timeout: float) -> Message:
        """Block until the message arrives, or raise TransportTimeout after ``timeout`` s."""


class Transport(abc.ABC):
    """Moves messages between the ranks of one pipeline.

    ``channel`` separates independent streams between the same two ranks (e.g. activations
    into stage 3 and gradients into stage 1); messages on one channel arrive in send order.
    """

    rank: int
    world_size: int
    early_receives: bool = True
    """Whether receives may be posted ahead of time, in any number per channel. NCCL matches
    point-to-point operations between two ranks in posting order regardless of tags, so the
    p2p transport over NCCL posts each receive only when the runtime reaches it."""
    rendezvous: bool = False
    """Whether a send completes only once its receiver posts the matching receive, and a wait
    for one that never does breaks the transport for good (p2p over gloo, which closes every
    connection of the process group when a wait times out). A failed step then learns which
    peers have ended theirs before it waits for its sends (see :meth:`flush_failed`); the
    other transports deliver into the peer's ring or mailbox whether it reads or not."""

    @abc.abstractmethod
    def send(self, dst: int, channel: int, message: Message) -> None:
        """Start sending ``message``; returns without waiting for the receiver."""

    @abc.abstractmethod
    def recv(self, src: int, channel: int, slot: int = 0) -> PendingRecv:
        """Post a receive for the next message from ``src`` on ``channel``.

        ``slot`` is the micro-batch of the message expected (the sender's
        ``message.microbatch``); a transport may use it to size the receive ahead of time, so
        post the next receive of a (``src``, ``channel``, ``slot``) only after the previous one
        completed (the runtime does: each slot is used once per step).
        """

    def settle(self, dst: int, channel: int, slot: int, timeout: float) -> None:  # noqa: B027
        """Release the buffers of the messages sent to ``dst`` on ``channel`` for ``slot``,
        which the caller knows were taken (e.g. the gradient of that micro-batch came back)."""

    def defer(self, dst: int, channel: int, slot: int) -> None:  # noqa: B027
        """Leave the sends started so far to ``dst`` on ``channel`` for ``slot`` out of the
        next :meth:`flush`; the flush after it waits for them. For a message the receiver
        takes only after it may have waited for this rank (e.g. in its next step): a flush
        before then might wait forever for a transport that needs the receiver to take it."""

    @abc.abstractmethod
    def flush(self, timeout: float) -> None:
        """Wait, at most ``timeout`` s in all, until every send started so far has been taken
        by its receiver (but those :meth:`defer` put off since the last flush); raise
        TransportTimeout if some were not."""

    def flush_received(self, timeout: float) -> None:
        """:meth:`flush`, for a rank that has received every message it needs of an
        exchange: what it got is complete, and the receipts still owed only confirm that the
        peers took its own messages, which a peer needs and waits for on its side. So a peer
        gone meanwhile (over RPC a peer that took the message and ended its process at once
        can take the receipt with it) is no failure here; it fails the next exchange with
        it, or that peer's own wait."""
        with contextlib.suppress(TransportTimeout, ConnectionError):
            self.flush(timeout)

    def flush_failed(self, timeout: float, ended: Collection[int] = ()) -> None:
        """The flush of a failed step, which never raises: wait, at most ``timeout`` s, until
        the sends started so far have been taken, but for those to the ranks in ``ended``,
        which said that their own step has ended (failed, or done without this rank's
        messages): they take no more messages of this pipeline, so a wait for them would only
        time out (over gloo, closing the process group's connections for every later
        collective). Those sends are let go without a wait; a transport that has to keep
        them alive does so until :meth:`close`."""
        with contextlib.suppress(Exception):  # a peer that is gone cannot be told
            self.flush(timeout)

    def check(self) -> None:  # noqa: B027 - optional hook
        """Raise a RuntimeError if this transport can carry no more messages (e.g. its process
        group was destroyed). The runtime calls it as each step begins: it must be cheap."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources (pending messages are dropped)."""


class GroupTransport(Transport):
    """A transport whose pipeline ranks are the ranks of a ``torch.distributed`` process
    group, in order (p2p, shm): the group can also carry the pipeline's collectives (shared
    weights, ``balance="auto"``)."""

    def _join(self, group: dist.ProcessGroup | None) -> None:
        """Take this rank's place in ``group`` (default: the whole world)."""
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self._ranks = [
            dist.get_global_rank(group, r) if group else r for r in range(self.world_size)
        ]

    def global_rank(self, rank: int) -> int:
        """The rank in the default group of pipeline rank ``rank``."""
        return self._ranks[rank]
