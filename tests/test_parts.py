"""Partitioning, micro-batches and the transport header, in one process."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from asyncpipe.microbatch import gather, scatter
from asyncpipe.partition import Invocation, Location, partition
from asyncpipe.transport import Message
from asyncpipe.transport.frame import (
    decode_header,
    encode_header,
    layout,
    pack,
    read_fields,
    unpack,
)
from asyncpipe.transport.p2p_recv import _completed


def test_partition_without_reuse() -> None:
    layers = [nn.Linear(2, 2) for _ in range(5)]
    parts, segments = partition(layers, [2, 3])
    assert parts[0].layers == tuple(layers[:2]) and parts[1].layers == tuple(layers[2:])
    assert [s.stage for s in segments] == [0, 1]
    assert parts[1].invocations[0] == Invocation(2, Location(1, 0), Location(0, 1), Location(1, 1))
    assert parts[0].invocations[0].source is None and parts[1].invocations[-1].dest is None


def test_partition_with_reuse_across_stages_makes_invocation_chains() -> None:
    a, b, c = nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2)
    parts, segments = partition([a, b, c, a, b], [2, 3])
    assert parts[0].layers == (a, b) and parts[1].layers == (c,)
    chain = [
        inv.this
        for inv in sorted(parts[0].invocations + parts[1].invocations, key=lambda inv: inv.order)
    ]
    assert chain == [Location(0, 0), Location(0, 1), Location(1, 0), Location(0, 0), Location(0, 1)]
    third = next(inv for inv in parts[0].invocations if inv.order == 3)
    assert third == Invocation(3, Location(0, 0), Location(1, 0), Location(0, 1))
    assert [(s.stage, len(s.invocations)) for s in segments] == [(0, 2), (1, 1), (0, 2)]


def test_reuse_inside_one_stage_adds_no_segment() -> None:
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    parts, segments = partition([a, a, b], [2, 1])
    assert parts[0].layers == (a,) and len(parts[0].invocations) == 2
    assert len(segments) == 2


def test_scatter_uneven_and_small_batches() -> None:
    x = torch.arange(10).view(10, 1)
    assert [p[0].shape[0] for p in scatter((x,), 4)] == [3, 3, 3, 1]
    assert len(scatter((x[:3],), 8)) == 3
    pieces = scatter((x, x * 2), 3)
    assert torch.equal(gather(pieces)[1], x * 2)


def test_scatter_rejects_scalars_and_empty() -> None:
    with pytest.raises(ValueError, match="batch dimension"):
        scatter((torch.tensor(1.0),), 2)
    with pytest.raises(ValueError, match="empty"):
        scatter((torch.zeros(0, 3),), 2)


def test_header_round_trip() -> None:
    a = torch.zeros(3, 4, requires_grad=True)
    b = torch.zeros(5, dtype=torch.int64)
    fields = encode_header(Message(2, 8, (a, None, b)), [a, None, b])
    kind, microbatch, microbatches, total, specs = decode_header(fields)
    assert (kind, microbatch, microbatches) == (0, 2, 8)
    assert specs == [(0, True, [3, 4]), (-1, False, []), (4, False, [5])]
    offsets, size = layout(len(fields), specs)
    assert size == total and all(o % 64 == 0 for o in offsets)
    assert offsets[2] - offsets[0] >= 3 * 4 * 4 and total - offsets[2] >= 5 * 8


def test_packed_message_round_trip() -> None:
    """Every kind of tensor a stage may send comes out of a packed message bit for bit:
    strided views, zero elements, lazily conjugated complex, bool, bf16, scalars, None."""
    base = torch.randn(6, 5)
    payload: list[torch.Tensor | None] = [
        torch.randn(3, 4, requires_grad=True),
        base.t(),  # not contiguous
        base[1:4, 2],  # a strided slice
        torch.empty(0, 7),
        torch.randn(4, dtype=torch.complex64).conj(),  # conjugate bit set, data not conjugated
        torch.tensor([True, False, True]),
        torch.randn(5).to(torch.bfloat16),
        torch.tensor(7, dtype=torch.int64),
        None,
    ]
    message = Message(3, 8, tuple(payload))
    fields = encode_header(message, payload)
    offsets, total = layout(len(fields), decode_header(fields)[4])
    buffer = pack(fields, offsets, payload)
    assert buffer.numel() == total
    assert read_fields(buffer) == fields
    for sent, got in zip(payload, unpack(buffer, fields)):
        if sent is None:
            assert got is None
            continue
        assert got is not None
        assert got.dtype == sent.dtype and got.shape == sent.shape
        assert torch.equal(got, sent.detach().resolve_conj())


def test_packed_message_with_known_sizes_matches_the_general_packing() -> None:
    """The p2p transport passes the tensors' sizes where no tensor is complex: one memmove
    per contiguous host tensor, torch's copy for the rest; the bytes are the same."""
    base = torch.randn(6, 5)
    payload: list[torch.Tensor | None] = [
        torch.randn(3, 4, requires_grad=True),
        base.t(),  # not contiguous: copied by torch
        base[1:4, 2],
        torch.empty(0, 7),
        torch.tensor([True, False, True]),
        None,
    ]
    message = Message(1, 4, tuple(payload))
    fields = encode_header(message, payload)
    offsets, total = layout(len(fields), decode_header(fields)[4])
    sizes = [0 if t is None else t.nbytes for t in payload]
    general = pack(fields, offsets, payload, torch.zeros(total, dtype=torch.uint8))
    known = pack(fields, offsets, payload, torch.zeros(total, dtype=torch.uint8), sizes)
    assert torch.equal(known, general)
    for sent, got in zip(payload, unpack(known, fields)):
        assert (got is None) if sent is None else torch.equal(got, sent.detach())


def test_header_rejects_too_many_tensors() -> None:
    many = [torch.zeros(1, 1, 1, 1) for _ in range(60)]
    with pytest.raises(ValueError, match="too many tensors"):
        encode_header(Message(0, 1, tuple(many)), many)


def test_header_rejects_sparse_tensors_with_the_fix() -> None:
    # before: "nbytes is not defined for sparse tensors", from the p2p and shm transports
    sparse = torch.eye(3).to_sparse()
    with pytest.raises(TypeError, match=r"sparse_coo tensor .* \(.to_dense\(\)\), or use"):
        encode_header(Message(0, 1, (sparse,)), [sparse])


def test_a_receive_on_the_gpu_is_awaited_on_the_host_with_a_timeout() -> None:
    class Work:
        def __init__(self, after: int) -> None:
            self.calls, self.after = 0, after

        def is_completed(self) -> bool:
            self.calls += 1
            return self.calls > self.after

    done = Work(after=5)
    _completed(done, timeout=5.0)  # type: ignore[arg-type]
    assert done.calls == 6
    with pytest.raises(RuntimeError, match="Timed out after 0.1 s"):
        _completed(Work(after=10**9), timeout=0.1)  # type: ignore[arg-type]
