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
        self._barrier = threading.Barrier(world_size)
        self._slots: list[list[float]] = [[] for _ in range(world_size)]

    def queue(self, src: int, dst: int, channel: int) -> queue.Queue[Message]:
        with self._lock:
            return self._queues.setdefault((src, dst, channel), queue.Queue())

    def transport(self, rank: int) -> InProcessTransport:
        return InProcessTransport(self, rank)

    def exchange(self, rank: int, values: list[float], timeout: float) -> list[list[float]]:
        try:
            self._barrier.wait(timeout)
            self._slots[rank] = list(values)
            self._barrier.wait(timeout)
            result = [list(v) for v in self._slots]
            self._barrier.wait(timeout)
        except threading.BrokenBarrierError as e:
            raise TransportTimeout(
                f"rank {rank} timed out after {timeout:.1f} s waiting for the other ranks to "
                f"finish the step (exchange of step status)"
            ) from e
        return result


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

    def recv(self, src: int, channel: int) -> PendingRecv:
        return _QueuedRecv(self.hub.queue(src, self.rank, channel), src, self.rank)

    def flush(self, timeout: float) -> None:
        return None

    def exchange(self, values: list[float], timeout: float) -> list[list[float]]:
        return self.hub.exchange(self.rank, values, timeout)
