"""Worker functions for the shared-memory transport's multi-process tests."""

from __future__ import annotations

import copy
import os
import socket
import time
from typing import Any

import torch
from torch import Tensor, nn

from asyncpipe import AsyncPipe
from asyncpipe.transport import Message, ShmTransport, TransportTimeout, shm

mse = nn.functional.mse_loss


def _names(transport: ShmTransport) -> list[str]:
    """Entries of /dev/shm that carry this transport's rings or doorbells."""
    token = next(iter(transport._in.values())).name.split("-")[1]
    return sorted(name for name in os.listdir("/dev/shm") if token in name)


def _summary(message: Message) -> tuple[Any, ...]:
    tensors = [
        None if t is None else (t.dtype, tuple(t.shape), t.requires_grad, t.clone())
        for t in message.tensors
    ]
    return message.microbatch, message.microbatches, message.error, tensors


def messages(rank: int, world: int) -> Any:
    """Rank 0 sends a variety of messages through a small ring (64 KiB): small, larger than
    the ring, many dtypes, None, empty, strided, an error; rank 1 posts its receives first
    and waits for them out of order, while rank 0 is still sending."""
    transport = ShmTransport(ring_bytes=2**16)
    names = _names(transport)
    generator = torch.Generator().manual_seed(3)
    big = torch.randn(300, 257, generator=generator)  # 300 KiB: over four rings' worth
    payloads: list[tuple[Tensor | None, ...]] = [
        (torch.arange(6.0).reshape(2, 3).requires_grad_(),),
        (big, None, torch.tensor([True, False])),
        (torch.zeros(0, 4), torch.arange(5, dtype=torch.int64)),
        (big.t()[:7, ::3],),  # not contiguous
        (torch.randn(4, 4, dtype=torch.complex64, generator=generator).conj(),),
        (torch.randn(3, dtype=torch.float64, generator=generator).half(),),
    ]
    if rank == 0:
        for n, payload in enumerate(payloads):
            transport.send(1, 2 + n % 2, Message(n, len(payloads), payload))
        transport.send(1, 2, Message(9, 9, (), error="stage 0 failed in 0F9"))
        transport.flush(30)
        done = transport.recv(1, 5).wait(30)
        return {"names": names, "done": done.microbatch}
    pending = [transport.recv(0, 2 + n % 2) for n in range(len(payloads))]
    error = transport.recv(0, 2)
    order = [5, 0, 3, 1, 4, 2]  # out of posting order, across both channels
    got = {n: _summary(pending[n].wait(30)) for n in order}
    got["error"] = _summary(error.wait(30))
    transport.send(0, 5, Message(1, 1, ()))
    transport.flush(30)
    sent = [
        [None if t is None else (t.detach().clone(), t.requires_grad) for t in p] for p in payloads
    ]
    return {"names": names, "got": got, "sent": sent}


def spill(rank: int, world: int) -> Any:
    """A sender keeps sending while its receiver is busy: what does not fit its ring waits in
    the sender's queue, the sends return at once, and everything arrives in order; a deferred
    send is left out of the flush; a wait for a message that never comes times out naming
    the peer."""
    transport = ShmTransport(ring_bytes=2**16)
    block = torch.ones(64, 1024)  # 256 KiB each: four rings' worth
    if rank == 0:
        began = time.monotonic()
        for n in range(4):
            transport.send(1, 1, Message(n, 4, (block * n,)))
        sending = time.monotonic() - began
        queued = sum(p.size for q in transport._spill.values() for p in q)
        transport.recv(1, 2).wait(30)  # rank 1 took them all: the queue drained meanwhile
        transport.flush(30)
        # a deferred message to a receiver that does not read: flush leaves it out (the
        # small one before it fits the ring)
        transport.send(1, 3, Message(0, 1, (torch.ones(16),)))
        transport.send(1, 3, Message(1, 1, (torch.ones(2**15),)))
        transport.defer(1, 3, 1)
        flushed = True
        try:
            transport.flush(1.0)
        except TransportTimeout:
            flushed = False
        transport.recv(1, 4).wait(30)
        transport.flush(30)
        try:
            transport.recv(1, 6).wait(0.5)
            timeout = ""
        except TransportTimeout as e:
            timeout = str(e)
        transport.send(1, 5, Message(0, 1, ()))
        transport.flush(30)
        return {"sending": sending, "queued": queued, "flushed": flushed, "timeout": timeout}
    time.sleep(1.0)  # busy: the sender must not wait for this rank
    got = [transport.recv(0, 1).wait(30) for _ in range(4)]
    values = [float(m.tensors[0].mean()) for m in got]  # type: ignore[union-attr]
    transport.send(0, 2, Message(0, 1, ()))
    transport.flush(30)
    time.sleep(2.0)  # rank 0 flushes with its deferred message still queued
    late = [transport.recv(0, 3).wait(30) for _ in range(2)]
    transport.send(0, 4, Message(0, 1, ()))
    transport.recv(0, 5).wait(30)
    return {"values": values, "late": [m.microbatch for m in late]}


def peer_dies(rank: int, world: int, hidden: bool = False) -> Any:
    """Rank 1 dies (no exception, no goodbye) while rank 0 waits for it. ``hidden``: rank 1
    gives a start time that its process id does not have here (as a process of another PID
    namespace would), so rank 0 cannot watch it and waits for its timeout instead."""
    if hidden and rank == 1:
        shm.started = lambda pid: -1
    transport = ShmTransport()
    if rank == 1:
        time.sleep(0.5)
        os._exit(3)
    began = time.monotonic()
    try:
        transport.recv(1, 0).wait(4 if hidden else 60)
    except (ConnectionError, TransportTimeout) as e:
        return (str(e), time.monotonic() - began)
    return ("no error", time.monotonic() - began)


def set_up_errors(rank: int, world: int, case: str) -> Any:
    """A transport that cannot be built fails on every rank with the same explanation."""
    if case == "hosts" and rank == 1:
        socket.gethostname = lambda: "elsewhere"  # type: ignore[assignment]
    ring = 2**50 if case == "memory" else 2**16
    try:
        ShmTransport(ring_bytes=ring)
    except (ValueError, RuntimeError) as e:
        return type(e).__name__, str(e)
    return "no error", ""


def transports_differ(rank: int, world: int) -> Any:
    """Rank 0 builds its pipeline over shm, rank 1 over p2p: both are told at once (well within
    the timeout), naming each rank's transport."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    began = time.monotonic()
    try:
        AsyncPipe(model, [1, 1], transport="shm" if rank == 0 else "p2p", timeout=20)
    except (ConnectionError, TransportTimeout, RuntimeError, ValueError) as e:
        return type(e).__name__, str(e), time.monotonic() - began
    return "no error", "", time.monotonic() - began


def two_bw(rank: int, world: int, plain: nn.Module, data: list[Any], chunks: int) -> Any:
    """2BW over shm for the given batches with a flush after the last: what step() and
    flush() return, and this rank's weights."""
    pipe = AsyncPipe(
        copy.deepcopy(plain),
        [len(plain) // world] * world,
        chunks=chunks,
        checkpoint="always" if world == 2 else "except_last",
        schedule="2bw",
        transport="shm",
        timeout=30,
    )
    opt = torch.optim.Adam(pipe.parameters(), lr=0.02)
    out = [pipe.step(x, y, mse, optimizer=opt) for x, y in data]
    out.append(pipe.flush())
    return out, {k: v.clone() for k, v in pipe.state_dict().items()}


def after_shutdown(rank: int, world: int) -> Any:
    """A pipeline over shm steps, then ``asyncpipe.shutdown()`` destroys its process group: the
    next step fails as over p2p (before, the rings still carried it and it ran)."""
    import asyncpipe

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    pipe = AsyncPipe(model, [1, 1], chunks=2, transport="shm", timeout=20)
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    pipe.step(x, y, mse)
    asyncpipe.shutdown()
    try:
        pipe.step(x, y, mse)
    except RuntimeError as e:
        return type(e).__name__, str(e)
    return "no error", ""
