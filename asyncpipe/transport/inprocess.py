"""In-process transport: ranks are threads of one process, messages go through queues."""

from __future__ import annotations

import queue
import threading

from .base import Message, PendingRecv, Transport, TransportTimeout

__all__: list[str] = []


class InProcessHub:
    """Shared state of a group of in-process ranks; hand one :meth:`transport` to each thread.

    Example:
        >>> hub = InProcessHub(2)
        >>> a, b = hub.transport(0), hub.transport(1)
        >>> a.send(1, 0, Message(0, 1, ()))
        >>> b.recv(0, 0).wait(1.0).microbatch
        0
    """

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._queues: dict[tuple[int, int, int], queue.Queue[Message]] = {}
        self._lock = threading.Lock()

    def queue(self, src: int, dst: int, channel: int) -> queue.Queue[Message]:
        with self._lock:
            return self._queues.setdefault((src, dst, channel), queue.Queue())

    def transport(self, rank: int) -> InProcessTransport:
        """The transport of pipeline rank ``rank`` (one per thread), on this hub's queues."""
        return InProcessTransport(self, rank)


class _QueuedRecv(PendingRecv):
    def __init__(self, source: queue.Queue[Message], src: int, rank: int) -> None:
        self.source, self.src, self.rank = source, src, rank

    def wait(self, timeout: float) -> Message:
        try:
            return self.source.get(timeout=timeout)
        except queue.Empty:
            raise TransportTimeout(
                f"rank {self.rank} timed out after {timeout:.1f} s waiting for a message from "
                f"rank {self.src}"
            ) from None


class InProcessTransport(Transport):
    """One rank's end of an :class:`InProcessHub`."""

    def __init__(self, hub: InProcessHub, rank: int) -> None:
        self.hub, self.rank, self.world_size = hub, rank, hub.world_size

    def send(self, dst: int, channel: int, message: Message) -> None:
        tensors = tuple(None if t is None else t.detach().clone() for t in message.tensors)
        flags = tuple(t is not None and t.requires_grad for t in message.tensors)
        for tensor, flag in zip(tensors, flags):
            if tensor is not None and flag:
                tensor.requires_grad_(True)
        copy = Message(message.microbatch, message.microbatches, tensors, message.error)
        self.hub.queue(self.rank, dst, channel).put(copy)

    def recv(self, src: int, channel: int, slot: int = 0) -> PendingRecv:
        return _QueuedRecv(self.hub.queue(src, self.rank, channel), src, self.rank)

    def flush(self, timeout: float) -> None:
        return None
