"""The shm transport's receive buffers: reused for fixed shapes, within a budget for varying ones,
and never handed out while a message's tensors (or another peer's frame) still use them."""

from __future__ import annotations

import sys
import time
from typing import Any

import pytest
import torch
from spawn import run_ranks
from torch import Tensor

from asyncpipe.transport import ring

linux = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="the shm transport runs on Linux"
)
reuses = pytest.mark.skipif(
    getattr(torch._C, "_storage_Use_Count", None) is None,
    reason="this torch cannot tell when a buffer is free",
)

BUDGET = 2**21
"""The budget the two-process job sets (the transport's own is 64 MiB)."""
SIZES = [4 * (8192 + 16 * k) for k in range(300)]
"""Bytes of the varying messages' tensors: 32 to 51 KiB, 12 MiB in all."""
HELD = 3
"""Received messages the receiver keeps referring to, as a user holding activations would."""


def _counted(buffers: Any) -> int:
    return sum(b.numel() for kept in buffers.values() for b in kept)


@reuses
def test_buffers_of_many_sizes_stay_within_their_budget() -> None:
    buffers = ring.Buffers(2**20, 64)
    held: list[Tensor] = []
    for n in range(2000):
        size = 1000 + 37 * (n % 997)  # a size of its own for every message of a while
        held = [*held[-HELD:], buffers.take(size)[:10]]  # a view, as a message's tensors are
        assert buffers.bytes == _counted(buffers) <= 2**20, n
    assert buffers.bytes > 2**20 - 40_000  # it does keep some
    assert len(buffers) < 2**20 // 1000


@reuses
def test_fixed_sizes_reuse_their_buffers_and_a_buffer_in_use_is_never_handed_out() -> None:
    buffers = ring.Buffers(2**20, 64)
    seen: set[int] = set()
    held: list[Tensor] = []
    for _ in range(500):
        for size in (4096, 512):  # activations and some small control message
            buffer = buffers.take(size)
            assert all(buffer.data_ptr() != h.data_ptr() for h in held)
            seen.add(buffer.data_ptr())
            held = [*held[-HELD:], buffer[1:]]
    assert len(seen) <= HELD + 3  # one each beyond those held, allocated once
    assert sorted(buffers) == [512, 4096]
    # a buffer another frame is being copied into is busy, though nothing else holds it
    first = buffers.take(100)
    assert buffers.take(100, [first]) is not first
    assert buffers.take(100) is first


@reuses
def test_one_size_larger_than_the_budget_allows_keeps_the_other_sizes() -> None:
    """Activations held that need more than the budget: the buffers beyond it are new at every
    step, but the ones kept, and the small messages' buffers, are reused."""
    buffers = ring.Buffers(10_000, 64)
    small = buffers.take(100)
    ptrs: list[set[int]] = []
    for _ in range(5):
        step = [buffers.take(3000)[:] for _ in range(5)]  # 15,000 bytes in flight
        assert buffers.take(100) is small
        ptrs.append({t.data_ptr() for t in step})
        assert buffers.bytes == _counted(buffers) <= 10_000
        del step
    assert sorted(buffers) == [100, 3000] and len(buffers[3000]) == 3
    assert all(len(ptrs[0] & later) >= 3 for later in ptrs[1:])
    huge = buffers.take(20_000)  # larger than the budget: never kept
    assert 20_000 not in buffers and buffers.take(20_000) is not huge


def _values(message: Any) -> Tensor:
    tensor: Tensor = message.tensors[0]
    return tensor


def traffic(rank: int, world: int) -> Any:
    """Three ranks over 64 KiB rings. First, ranks 0 and 2 each send rank 1 four messages of
    the same size, four rings' worth each, while rank 1 sleeps: its first look at the rings
    leaves rank 0's first frame half copied and starts rank 2's, which must not go into the
    same buffer. Then rank 0 sends rank 1 300 messages of as many sizes, then 200 of one size,
    while rank 1 keeps referring to the last three it got: each must arrive as sent and stay
    so, the buffers kept stay within the budget (2 MiB here), and the fixed size reuses its
    few buffers."""
    import torch.distributed as dist

    from asyncpipe.transport import Message, ShmTransport, shm

    shm._BUFFER_BYTES = BUDGET
    transport = ShmTransport(ring_bytes=2**16)
    result: dict[str, Any] = {"wrong": []}
    if rank != 1:
        for n in range(4):
            transport.send(1, 1, Message(n, 4, (torch.full((2**16,), float(10 * rank + n)),)))
        transport.flush(30)
    else:
        time.sleep(0.5)  # both senders fill their rings
        pending = {src: [transport.recv(src, 1) for _ in range(4)] for src in (0, 2)}
        for n in range(4):
            for src in (0, 2):
                got = _values(pending[src][n].wait(30))
                if bool((got != 10 * src + n).any()):
                    result["wrong"].append(("same size", src, n))
    dist.barrier()
    fixed = 4 * 8192
    if rank == 0:
        for n, size in enumerate(SIZES + [fixed] * 200):
            transport.send(1, 2, Message(0, 1, (torch.full((size // 4,), float(n)),)))
        transport.flush(60)
    elif rank == 1:
        held: list[tuple[int, Tensor]] = []
        kept, fixed_buffers = [], set()
        for n in range(len(SIZES) + 200):
            got = _values(transport.recv(0, 2).wait(60))
            held = [*held[-HELD:], (n, got)]
            for m, tensor in held:
                if tensor.numel() != (SIZES[m] if m < len(SIZES) else fixed) // 4:
                    result["wrong"].append(("shape", m))
                elif bool((tensor != m).any()):
                    result["wrong"].append(("value", m, n))
            if n >= len(SIZES):
                fixed_buffers.add(got.untyped_storage().data_ptr())
            if n % 10 == 9:
                buffers = transport._buffers
                kept.append((_counted(buffers), getattr(buffers, "bytes", None), len(buffers)))
        result.update(kept=kept, fixed_buffers=len(fixed_buffers))
    dist.barrier()
    transport.close()
    return result


@linux
@reuses
@pytest.mark.slow
def test_receive_buffers_are_reused_bounded_and_never_shared_by_messages_in_use() -> None:
    """Receive buffers were kept per size (up to 64 each), without bound on the sizes: a model
    whose shapes vary kept a buffer of every size it ever received (320 MiB of them after 300
    steps of random sequence lengths, and growing); and a buffer half filled with one peer's
    frame could be handed to another peer's frame of the same size."""
    results = run_ranks(traffic, 3, timeout=120)
    assert [r["wrong"] for r in results] == [[], [], []]
    kept = results[1]["kept"]
    assert all(counted == known <= BUDGET for counted, known, _ in kept), kept
    assert max(counted for counted, _, _ in kept) > BUDGET - 60 * 1024  # it does keep some
    assert max(sizes for _, _, sizes in kept) <= BUDGET // SIZES[0]
    assert results[1]["fixed_buffers"] <= 2 * HELD + 4, results[1]["fixed_buffers"]
