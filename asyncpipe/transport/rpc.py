"""RPC transport: messages travel as ``torch.distributed.rpc`` calls (TensorPipe).

A send is an asynchronous remote call that drops the message into the receiver's mailbox; a
receive waits on that mailbox. The sender never blocks, and a message needs no receive posted
ahead of it, so any order of sends and receives works::

    rank 0  send(1, ch, m) ──rpc_async(deliver)──> rank 1 mailbox[(0, ch)] ──> recv(0, ch).wait()
            flush(): wait until every delivery was acknowledged

A remote call costs far more than the bytes of a small message (a request, a reply, the
receiver's thread pool), so calls to a peer are not stacked without limit: with
``_IN_FLIGHT`` calls to it unacknowledged, later messages to it wait in its outbox, and the
acknowledgement of the oldest of those calls sends the whole outbox as one call (only then
does Python run when a call is acknowledged)::

    send m1..m4 ──4 calls──> (none acknowledged yet)     send m5..m9 ──> outbox [m5 .. m9]
    m1 acknowledged ──> one call [m5 .. m9]              (a pipeline, which sends one message
                                                          per action, rarely has an outbox)

With CUDA tensors, :func:`asyncpipe.init` configures TensorPipe's device maps so tensors go
from device to device without a trip through host memory.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc
from torch import Tensor

from .base import Message, PeerLost, PendingRecv, Transport, TransportTimeout

__all__: list[str] = []


_IN_FLIGHT = 4
"""Remote calls to one peer that may be unacknowledged before its later messages wait in its
outbox, to go together in one call."""

_BATCH = 64
"""Messages of one remote call at most (the rest of an outbox waits for the next
acknowledgement)."""

_PROBE_S = 1.0
"""A receive that has waited this long asks the sender's process whether it is still there
(a remote call that fails at once once that process is gone), then again every as long."""

_Item = tuple[int, int, int, int, list[Tensor | None], list[bool], str | None]
"""One message on the wire: channel, sequence, micro-batch, micro-batches, tensors, their
requires_grad flags, error text."""


class _Mailbox:
    """The messages that arrived for one transport of this process.

    Remote calls may run in any order on the receiver's thread pool, so each message carries
    its number on its (source, channel) stream and a receive waits for its own number.
    """

    def __init__(self) -> None:
        self._arrived: dict[tuple[int, int, int], Message] = {}
        self._ready = threading.Condition()

    def put(self, src: int, channel: int, sequence: int, message: Message) -> None:
        with self._ready:
            self._arrived[(src, channel, sequence)] = message
            self._ready.notify_all()

    def take(self, src: int, channel: int, sequence: int, timeout: float) -> Message | None:
        key = (src, channel, sequence)
        with self._ready:
            if not self._ready.wait_for(lambda: key in self._arrived, timeout):
                return None
            return self._arrived.pop(key)


class _Post:
    """The mailboxes of this process, by transport name.

    A remote call runs a module-level function on the receiver, so the receiving side needs a
    place where that function finds the mailbox; this is the one piece of process-wide state,
    and it holds only mailboxes of transports that exist (``close`` removes them).
    """

    _boxes: dict[str, _Mailbox] = {}
    _lock = threading.Lock()

    @classmethod
    def box(cls, name: str) -> _Mailbox:
        with cls._lock:
            return cls._boxes.setdefault(name, _Mailbox())

    @classmethod
    def remove(cls, name: str) -> None:
        with cls._lock:
            cls._boxes.pop(name, None)


def _deliver(name: str, src: int, items: list[_Item]) -> None:
    """Runs on the receiver: put the messages of one call into its mailbox."""
    box = _Post.box(name)
    for channel, sequence, microbatch, microbatches, tensors, grads, error in items:
        for device in {t.device for t in tensors if t is not None and t.is_cuda}:
            # TensorPipe makes CUDA tensors ready on this RPC thread's current stream only;
            # the pipeline reads them on its own stream, so wait until the data is there.
            torch.cuda.current_stream(device).synchronize()
        for tensor, flag in zip(tensors, grads):
            if tensor is not None and flag:
                tensor.requires_grad_(True)
        message = Message(microbatch, microbatches, tuple(tensors), error)
        box.put(src, channel, sequence, message)


def error_line(error: BaseException) -> str:
    """The first line of an RPC error, without TensorPipe's source location."""
    line = str(error).splitlines()[0] if str(error) else type(error).__name__
    return line.split(" (this error originated at")[0]


def _here() -> bool:
    """Runs on a peer that a waiting receiver asks whether it is still there."""
    return True


def worker_names() -> dict[int, str]:
    """The RPC worker name of each worker id (the rank :func:`asyncpipe.init` gave it), as the
    running RPC agent knows them: the names given to ``asyncpipe.init(worker_map=...)``.

    Raises:
        RuntimeError: if RPC is not running.

    Example:
        >>> asyncpipe.init(rpc=True, worker_map={0: "trainer"})   # doctest: +SKIP
        >>> worker_names()                                        # doctest: +SKIP
        {0: 'trainer', 1: 'worker1'}
    """
    me = rpc.get_worker_info()  # raises if RPC is not set up
    try:  # torch has no public list of the workers; its agent has one
        from torch.distributed.rpc import api

        infos = api._get_current_rpc_agent().get_worker_infos()  # type: ignore[attr-defined]
        return {int(i.id): str(i.name) for i in sorted(infos, key=lambda i: int(i.id))}
    except (ImportError, AttributeError, RuntimeError):  # the default names, then
        world = dist.get_world_size() if dist.is_initialized() else int(me.id) + 1
        return {r: f"worker{r}" for r in range(world)}


class _Outbox:
    """The calls to one peer not known to be acknowledged (oldest first), the messages waiting
    for one of them, and whether a callback on one of them will send those."""

    def __init__(self) -> None:
        self.calls: list[Any] = []
        self.queued: list[_Item] = []
        self.waiting = False


class _MailboxRecv(PendingRecv):
    def __init__(self, transport: RPCTransport, src: int, channel: int, sequence: int) -> None:
        self.transport, self.src, self.channel, self.sequence = transport, src, channel, sequence

    def wait(self, timeout: float) -> Message:
        box, worker = self.transport._box, self.transport.worker_map[self.src]
        deadline = time.monotonic() + timeout
        probe: Any = None
        while True:
            left = max(deadline - time.monotonic(), 0.0)
            message = box.take(self.src, self.channel, self.sequence, min(left, _PROBE_S))
            if message is not None:
                return message
            if time.monotonic() >= deadline:
                raise TransportTimeout(
                    f"rank {self.transport.rank} timed out after {timeout:.1f} s waiting for a "
                    f"message from rank {self.src} (RPC worker {worker!r})"
                )
            try:  # is the sender still there? (TensorPipe fails a call to a process gone)
                if probe is not None and probe.done():
                    probe.wait()
                    probe = None
                if probe is None:
                    probe = rpc.rpc_async(worker, _here)
            except Exception as e:
                raise PeerLost(
                    f"rank {self.transport.rank} lost rank {self.src} (RPC worker {worker!r}) "
                    f"while waiting for a message: {error_line(e)}",
                    self.src,
                ) from e


class RPCTransport(Transport):
    """Messages as ``torch.distributed.rpc`` calls between the pipeline's ranks.

    Call :func:`asyncpipe.init` with ``rpc=True`` first (or ``torch.distributed.rpc.init_rpc``
    yourself with the same worker names). ``AsyncPipe(..., transport="rpc")`` builds one.

    Args:
        worker_map: the RPC worker name of each pipeline rank (default: the names of RPC
            workers 0..N-1, as ``asyncpipe.init(rpc=True, worker_map=...)`` gave them, by
            default ``"worker{rank}"``).
        name: keeps the messages of several pipelines in one job apart (one name per pipeline,
            the same on every rank). ``AsyncPipe(..., transport="rpc")`` names its transport
            ``"pipe{n}"``, ``n`` being the pipelines the process built before it on the same
            process group (compared across the ranks).

    Example:
        >>> import asyncpipe                                          # doctest: +SKIP
        >>> asyncpipe.init(rpc=True)                                  # doctest: +SKIP
        >>> pipe = asyncpipe.AsyncPipe(model, [2, 2], transport="rpc")  # doctest: +SKIP
    """

    def __init__(self, worker_map: Mapping[int, str] | None = None, name: str = "pipe") -> None:
        info = rpc.get_worker_info()  # raises if RPC is not set up
        if worker_map is None:
            worker_map = worker_names()
            if dist.is_initialized():  # the pipeline is the process group's ranks
                world = range(dist.get_world_size())
                worker_map = {r: worker_map.get(r, f"worker{r}") for r in world}
        names = dict(worker_map)
        if sorted(names) != list(range(len(names))) or info.name not in names.values():
            raise ValueError(
                f"worker_map must name the RPC worker of each pipeline rank 0..N-1, this "
                f"process ({info.name!r}) among them (got {names})"
            )
        self.worker_map = names
        self.world_size = len(names)
        self.rank = next(r for r, n in names.items() if n == info.name)
        self.name = name
        self._box = _Post.box(name)
        self._sent: dict[tuple[int, int], int] = {}
        self._posted: dict[tuple[int, int], int] = {}
        # Sending side, shared with the acknowledgements (they run on RPC threads).
        self._lock = threading.Condition()
        self._outboxes: dict[int, _Outbox] = {}
        self._futures: list[tuple[int, Any]] = []  # every call since the last flush
        self._sending = 0  # batches an acknowledgement took from an outbox, not yet sent
        self._failed: list[tuple[int, BaseException]] = []

    def send(self, dst: int, channel: int, message: Message) -> None:
        tensors = [None if t is None else t.detach() for t in message.tensors]
        grads = [t is not None and t.requires_grad for t in message.tensors]
        sequence = self._sent.get((dst, channel), 0)
        self._sent[(dst, channel)] = sequence + 1
        item: _Item = (
            channel, sequence, message.microbatch, message.microbatches, tensors, grads,
            message.error,
        )  # fmt: skip
        oldest = None
        with self._lock:
            box = self._outboxes.setdefault(dst, _Outbox())
            box.calls = [f for f in box.calls if not f.done()]
            wait = bool(box.calls) and (len(box.calls) >= _IN_FLIGHT or bool(box.queued))
            if wait:
                box.queued.append(item)
                if not box.waiting:  # the oldest call's acknowledgement sends the outbox
                    box.waiting, oldest = True, box.calls[0]
        if not wait:  # the common case: one call, and no Python runs when it is acknowledged
            self._track(dst, self._call(dst, [item]))
        elif oldest is not None:
            oldest.add_done_callback(lambda _: self._drain(dst))

    def _call(self, dst: int, items: list[_Item]) -> Any:
        """One remote call carrying ``items`` to ``dst``."""
        return rpc.rpc_async(self.worker_map[dst], _deliver, args=(self.name, self.rank, items))

    def _track(self, dst: int, future: Any) -> None:
        with self._lock:
            self._outboxes[dst].calls.append(future)
            self._futures.append((dst, future))

    def _drain(self, dst: int) -> None:
        """Runs when a call to ``dst`` ended (on an RPC thread): send what waits for it as one
        call, and have that call's end send what comes meanwhile."""
        with self._lock:
            box = self._outboxes[dst]
            box.waiting = False
            batch, box.queued = box.queued[:_BATCH], box.queued[_BATCH:]
            self._sending += 1 if batch else 0
        if not batch:
            return
        try:
            future = self._call(dst, batch)
        except Exception as e:  # e.g. RPC shut down: the next flush reports it
            with self._lock:
                self._failed.append((dst, e))
                self._sending -= 1
                box.queued = []
                self._lock.notify_all()
            return
        with self._lock:
            box.calls.append(future)
            self._futures.append((dst, future))
            self._sending -= 1
            more = bool(box.queued) and not box.waiting
            box.waiting = box.waiting or more
            self._lock.notify_all()
        if more:
            future.add_done_callback(lambda _: self._drain(dst))

    def recv(self, src: int, channel: int, slot: int = 0) -> PendingRecv:
        sequence = self._posted.get((src, channel), 0)
        self._posted[(src, channel)] = sequence + 1
        return _MailboxRecv(self, src, channel, sequence)

    def flush(self, timeout: float) -> None:
        with self._lock:  # what waits in outboxes goes now: flush waits for everything anyway
            self._lock.wait_for(lambda: self._sending == 0, timeout)
            waiting = {dst: box.queued for dst, box in self._outboxes.items() if box.queued}
            for dst in waiting:
                self._outboxes[dst].queued = []
        for dst, items in waiting.items():
            for start in range(0, len(items), _BATCH):
                self._track(dst, self._call(dst, items[start : start + _BATCH]))
        with self._lock:
            futures, self._futures = self._futures, []
            failed, self._failed = self._failed, []
        if failed:
            dst, e = failed[0]
            raise self._undelivered(dst, e) from e
        if not futures:
            return
        delivered = threading.Event()
        torch.futures.collect_all([f for _, f in futures]).then(lambda _: delivered.set())
        if not delivered.wait(timeout):
            late = sorted({dst for dst, f in futures if not f.done()})
            raise TransportTimeout(
                f"rank {self.rank} could not deliver its messages to ranks {late} (RPC workers "
                f"{[self.worker_map[d] for d in late]}) within {timeout:.1f} s"
            )
        for dst, future in futures:
            try:
                future.wait()
            except Exception as e:
                raise self._undelivered(dst, e) from e

    def _undelivered(self, dst: int, error: BaseException) -> TransportTimeout:
        text = str(error).splitlines()[0] if str(error) else repr(error)
        return TransportTimeout(
            f"rank {self.rank} could not deliver a message to rank {dst} (RPC worker "
            f"{self.worker_map[dst]!r}): {text}"
        )

    def close(self) -> None:
        """Remove this transport's mailbox (``AsyncPipe.close()`` calls it for the transport it
        built); a message still arriving for it later makes a new one, dropped with the
        process."""
        _Post.remove(self.name)


def device_maps(
    rank: int,
    world_size: int,
    local_world_size: int,
    worker_map: Mapping[int, str],
    gpus: int | None = None,
) -> dict[str, dict[int, int]]:
    """TensorPipe device maps so CUDA tensors go device to device: rank ``r`` computes on GPU
    ``(r % local_world_size) % gpus`` of its node (one process per GPU when ``gpus`` is
    ``local_world_size``, the default; processes share GPUs when there are fewer).

    Example:
        >>> device_maps(0, 2, 2, {0: "worker0", 1: "worker1"})
        {'worker1': {0: 1}}
        >>> device_maps(0, 2, 2, {0: "worker0", 1: "worker1"}, gpus=1)
        {'worker1': {0: 0}}
    """
    gpus = gpus or local_world_size
    mine = rank % local_world_size % gpus
    return {
        worker_map[r]: {mine: r % local_world_size % gpus} for r in range(world_size) if r != rank
    }
