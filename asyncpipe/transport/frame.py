"""The bytes of a p2p message: its int64 header (micro-batch, dtypes, shapes, requires_grad)
and, for a *packed* message, its tensors after the header in one host-memory buffer::

    [ magic | field count | kind | micro-batch | micro-batches | total bytes | tensors |
      (dtype code, requires_grad, ndim, *shape) per tensor ] pad | tensor 0 | pad | tensor 1 ...

An error notice is a header alone whose fields after the seventh hold the error text.
"""

from __future__ import annotations

import ctypes
import struct
from array import array
from collections.abc import Sequence

import torch
from torch import Tensor

from .base import Message

__all__: list[str] = []

HEADER_SIZE = 256
HEADER_BYTES = 8 * HEADER_SIZE
PACK_LIMIT = 256 * 1024
KINDS = 1024
"""Layouts a transport keeps, one per kind of message (dtypes, shapes): a pipeline sends a few
kinds; a model whose shapes vary from step to step sends more, and a table of them starts
afresh when it holds this many."""
_ALIGN = 64
_MAGIC = 0x41505031
PACKED, ERROR, SEPARATE, EARLY = 0, 1, 2, 3
MICROBATCHES = struct.Struct("qq")
"""Header fields 3 and 4 (micro-batch, micro-batches), at bytes 24 to 40 of a header."""
DTYPES: list[torch.dtype] = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
]  # fmt: skip
_CODES = {dtype: code for code, dtype in enumerate(DTYPES)}

Spec = tuple[int, bool, list[int]]


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


_ITEMSIZE = [torch.empty((), dtype=dtype).element_size() for dtype in DTYPES]


def nbytes(code: int, shape: Sequence[int]) -> int:
    size = _ITEMSIZE[code]
    for d in shape:
        size *= d
    return size


def layout(fields: int, specs: Sequence[Spec]) -> tuple[list[int], int]:
    """Byte offsets of the tensors in a packed message, and its total size."""
    offset = _aligned(8 * fields)
    offsets = []
    for code, _, shape in specs:
        offsets.append(offset)
        if code >= 0:
            offset = _aligned(offset + nbytes(code, shape))
    return offsets, offset


def encode_header(message: Message, payload: Sequence[Tensor | None]) -> list[int]:
    """The header fields of ``message``: magic, field count, kind, micro-batch, micro-batches,
    total packed bytes, tensor count, then (dtype code, requires_grad, ndim, *shape) each."""
    return encode(message, payload)[0]


def kinds(tensors: Sequence[Tensor | None]) -> tuple[object, ...]:
    """What decides a message's layout: each tensor's dtype, requires_grad and shape (a
    pipeline sends the same kinds at every micro-batch, so layouts are made once per kind)."""
    return tuple(None if t is None else (t.dtype, t.requires_grad, t.shape) for t in tensors)


def encode(message: Message, payload: Sequence[Tensor | None]) -> tuple[list[int], list[int]]:
    """The header fields and the byte offset of every tensor in the packed message."""
    specs: list[int] = []
    for tensor in payload:
        if tensor is None:
            specs += [-1, 0, 0]
            continue
        if tensor.layout != torch.strided:
            raise TypeError(
                f"cannot send a {str(tensor.layout).replace('torch.', '')} tensor between stages "
                f"over this transport, which sends a tensor's memory as it lies: convert it "
                f"before the boundary (.to_dense()), or use transport='rpc'"
            )
        if tensor.dtype not in _CODES:
            raise TypeError(
                f"cannot send a tensor of dtype {tensor.dtype} between stages; supported: "
                + ", ".join(str(d) for d in DTYPES)
            )
        specs += [_CODES[tensor.dtype], int(tensor.requires_grad), tensor.dim(), *tensor.shape]
    count = 7 + len(specs)
    if count > HEADER_SIZE:
        raise ValueError(
            f"too many tensors or dimensions cross one stage boundary for a message header "
            f"({len(payload)} tensors need {count} header fields, at most {HEADER_SIZE}); "
            f"stack tensors together before the boundary"
        )
    fields = [_MAGIC, count, PACKED, message.microbatch, message.microbatches, 0, len(payload)]
    fields += specs
    offsets, fields[5] = layout(count, _specs(fields))
    return fields, offsets


def pack(
    fields: Sequence[int],
    offsets: Sequence[int],
    payload: Sequence[Tensor | None],
    buffer: Tensor | None = None,
    sizes: Sequence[int] | None = None,
) -> Tensor:
    """One host-memory message holding the header ``fields`` and the tensors at ``offsets``,
    in ``buffer`` (``fields[5]`` bytes of uint8, reused) or a new one. ``sizes``: the tensors'
    bytes, given where the caller knows them and that no tensor is complex.

    Host tensors are copied with one ``memmove`` each rather than through torch's dispatcher:
    a message of a few KiB costs a handful of microseconds instead of tens, which matters on
    the critical path of every pipeline hop. With ``sizes``, a tensor costs four calls into
    torch (``is_cpu``, ``is_contiguous``, ``is_neg``, ``data_ptr``): in a process that has
    just woken (a hop's receiver, a sender after its compute) each such call costs tens of
    microseconds, not a fraction of one."""
    if buffer is None:
        buffer = torch.empty(fields[5], dtype=torch.uint8)
    base = buffer.data_ptr()
    header = array("q", fields).tobytes()
    ctypes.memmove(base, header, len(header))
    known = sizes is not None  # and so no tensor is complex
    for n, (tensor, offset) in enumerate(zip(payload, offsets)):
        if tensor is None:
            continue
        size = sizes[n] if sizes is not None else tensor.nbytes
        if not size:
            continue
        if (
            tensor.is_cpu
            and tensor.is_contiguous()
            and (known or not tensor.is_complex())
            and not tensor.is_neg()
        ):
            ctypes.memmove(base + offset, tensor.data_ptr(), size)
        else:  # another device, a strided view, or a lazily conjugated or negated view
            flat = tensor.detach().resolve_conj().resolve_neg().contiguous()
            flat = flat.view(-1).view(torch.uint8)
            buffer[offset : offset + size].copy_(flat)
    return buffer


def unpack(buffer: Tensor, fields: Sequence[int]) -> list[Tensor | None]:
    """The tensors of a packed message (views into ``buffer``), given its header fields."""
    specs = _specs(fields)
    offsets, _ = layout(len(fields), specs)
    return views(buffer, specs, offsets, grad=False)


def views(
    buffer: Tensor, specs: Sequence[Spec], offsets: Sequence[int], grad: bool
) -> list[Tensor | None]:
    """Views into ``buffer`` of the tensors ``specs`` describes, at ``offsets``; with ``grad``,
    each requiring grad as its spec says (only where they are the tensors received: a copy to
    another device must be made from views that do not)."""
    tensors: list[Tensor | None] = []
    storage, start = buffer.untyped_storage(), int(buffer.storage_offset())
    for (code, requires_grad, shape), offset in zip(specs, offsets):
        if code < 0:
            tensors.append(None)
            continue
        dtype = DTYPES[code]
        # Each its own tensor over the buffer's memory rather than a view of the buffer: the
        # tensors of a message then count their in-place changes apart, as the plain model's
        # do (see ``alias.own_version``). Buffers start their own storage and ``layout``
        # aligns every tensor to 64 bytes, so the offset is a whole number of elements.
        strides = [1] * len(shape)
        for n in range(len(shape) - 1, 0, -1):
            strides[n - 1] = strides[n] * shape[n]
        data = torch.empty(0, dtype=dtype, device=buffer.device)
        data.set_(storage, (start + offset) // dtype.itemsize, shape, strides)
        tensors.append(data.requires_grad_(True) if grad and requires_grad else data)
    return tensors


def read_fields(buffer: Tensor) -> list[int]:
    """The header fields at the start of a received host-memory message (checked)."""
    base = buffer.data_ptr()
    head = list((ctypes.c_int64 * 2).from_address(base))
    if head[0] != _MAGIC or not 7 <= head[1] <= HEADER_SIZE:
        decode_header(head)  # raises the explanation
    return list((ctypes.c_int64 * head[1]).from_address(base))


def _specs(fields: Sequence[int]) -> list[Spec]:
    specs, n = [], 7
    for _ in range(fields[6]):
        code, requires_grad, ndim = fields[n : n + 3]
        specs.append((code, bool(requires_grad), list(fields[n + 3 : n + 3 + ndim])))
        n += 3 + ndim
    return specs


def decode_header(fields: Sequence[int]) -> tuple[int, int, int, int, list[Spec]]:
    """Read (kind, microbatch, microbatches, total bytes, specs) from header fields."""
    if fields[0] != _MAGIC:
        raise RuntimeError(
            "received a message that is not an asyncpipe header: are two pipelines (or other "
            "point-to-point traffic) sharing the same process group and tags?"
        )
    return fields[2], fields[3], fields[4], fields[5], _specs(fields)


def error_header(message: Message) -> Tensor:
    """A header-only message whose fields after the seventh hold the error text, 7 bytes each."""
    assert message.error is not None
    text = message.error.encode("utf-8")[: 7 * (HEADER_SIZE - 7)]
    chunks = [int.from_bytes(text[n : n + 7], "little") for n in range(0, len(text), 7)]
    fields = [_MAGIC, 7 + len(chunks), ERROR, message.microbatch, message.microbatches]
    fields += [len(text), 0, *chunks]
    header = torch.zeros(HEADER_SIZE, dtype=torch.int64)
    header[: len(fields)] = torch.tensor(fields)
    return header


def error_text(fields: Sequence[int]) -> str:
    size = fields[5]
    data = b"".join(v.to_bytes(7, "little") for v in fields[7:])
    return data[:size].decode("utf-8", "replace") or "unknown failure"
