"""A transport that matches messages the way NCCL does, for tests on CPU threads.

NCCL has no tags: the receives one rank posts for another are matched with that rank's sends
in posting order, whatever channel either side meant. A runtime that posts a receive early on
one channel while another channel's message is due first gets the wrong message (on a GPU: a
size error or silently wrong data). This transport makes that mistake loud: each receive takes
the next position in the sender's stream when it is posted, and waiting on it raises if the
message at that position was sent on another channel.
"""

from __future__ import annotations

import threading

from asyncpipe.transport import Message, PendingRecv, Transport, TransportTimeout

__all__ = ["MisorderedError", "OrderedHub", "OrderedTransport"]


class MisorderedError(RuntimeError):
    """A receive was matched with a message of another channel."""


class OrderedHub:
    """Shared state of in-process ranks whose messages match in posting order."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.changed = threading.Condition()
        self.sent: dict[tuple[int, int], list[tuple[int, Message]]] = {}
        self.posted: dict[tuple[int, int], int] = {}

    def transport(self, rank: int) -> OrderedTransport:
        return OrderedTransport(self, rank)


class _OrderedRecv(PendingRecv):
    def __init__(self, hub: OrderedHub, src: int, dst: int, channel: int, index: int) -> None:
        self.hub, self.src, self.dst, self.channel, self.index = hub, src, dst, channel, index

    def wait(self, timeout: float) -> Message:
        stream = self.hub.sent.setdefault((self.src, self.dst), [])
        with self.hub.changed:
            if not self.hub.changed.wait_for(lambda: len(stream) > self.index, timeout):
                raise TransportTimeout(
                    f"rank {self.dst} timed out after {timeout:.1f} s waiting for a message "
                    f"from rank {self.src}"
                )
            channel, message = stream[self.index]
        if channel != self.channel:
            raise MisorderedError(
                f"rank {self.dst} posted its receive #{self.index} from rank {self.src} for "
                f"channel {self.channel}, but message #{self.index} from that rank went on "
                f"channel {channel}: with posting-order matching it gets the wrong message"
            )
        return message


class OrderedTransport(Transport):
    """One rank's end of an :class:`OrderedHub`; receives are posted only when due."""

    early_receives = False

    def __init__(self, hub: OrderedHub, rank: int) -> None:
        self.hub, self.rank, self.world_size = hub, rank, hub.world_size

    def send(self, dst: int, channel: int, message: Message) -> None:
        tensors = tuple(None if t is None else t.detach().clone() for t in message.tensors)
        for tensor, sent in zip(tensors, message.tensors):
            if tensor is not None and sent is not None and sent.requires_grad:
                tensor.requires_grad_(True)
        copy = Message(message.microbatch, message.microbatches, tensors, message.error)
        with self.hub.changed:
            self.hub.sent.setdefault((self.rank, dst), []).append((channel, copy))
            self.hub.changed.notify_all()

    def recv(self, src: int, channel: int, slot: int = 0) -> PendingRecv:
        with self.hub.changed:
            index = self.hub.posted.get((src, self.rank), 0)
            self.hub.posted[(src, self.rank)] = index + 1
        return _OrderedRecv(self.hub, src, self.rank, channel, index)

    def flush(self, timeout: float) -> None:
        return None
