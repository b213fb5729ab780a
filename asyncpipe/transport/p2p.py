"""Point-to-point transport over torch.distributed isend/irecv (gloo on CPU, NCCL on CUDA).

Each message is a fixed-size int64 header (micro-batch, shapes, dtypes, requires_grad) on tag
``2 * channel`` followed by one payload message per tensor on tag ``2 * channel + 1``, so
receivers need no shape declarations. Receives are posted as early as the runtime likes; the
payload receives are posted as soon as the header is read.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from .base import Message, PendingRecv, Transport, TransportTimeout

__all__: list[str] = []

HEADER_SIZE = 256
_MAGIC = 0x41505031
_DATA, _ERROR = 0, 1
_DTYPES: list[torch.dtype] = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
]  # fmt: skip
_CODES = {dtype: code for code, dtype in enumerate(_DTYPES)}


def encode_header(message: Message, payload: Sequence[Tensor | None]) -> Tensor:
    """Describe ``message`` in a fixed-size int64 tensor."""
    fields = [_MAGIC, _ERROR if message.error else _DATA, message.microbatch, message.microbatches]
    fields.append(len(payload))
    for tensor in payload:
        if tensor is None:
            fields += [-1, 0, 0]
            continue
        if tensor.dtype not in _CODES:
            raise TypeError(
                f"cannot send a tensor of dtype {tensor.dtype} between stages; supported: "
                + ", ".join(str(d) for d in _DTYPES)
            )
        fields += [_CODES[tensor.dtype], int(tensor.requires_grad), tensor.dim(), *tensor.shape]
    if len(fields) > HEADER_SIZE:
        raise ValueError(
            f"too many tensors or dimensions cross one stage boundary for a message header "
            f"({len(payload)} tensors need {len(fields)} header fields, at most {HEADER_SIZE}); "
            f"stack tensors together before the boundary"
        )
    header = torch.zeros(HEADER_SIZE, dtype=torch.int64)
    header[: len(fields)] = torch.tensor(fields, dtype=torch.int64)
    return header


def decode_header(header: Tensor) -> tuple[int, int, int, list[tuple[int, bool, list[int]]]]:
    """Read (kind, microbatch, microbatches, [(dtype code, requires_grad, shape), ...])."""
    fields = header.tolist()
    if fields[0] != _MAGIC:
        raise RuntimeError(
            "received a message that is not an asyncpipe header: are two pipelines (or other "
            "point-to-point traffic) sharing the same process group and tags?"
        )
    kind, microbatch, microbatches, count = fields[1:5]
    specs, n = [], 5
    for _ in range(count):
        code, requires_grad, ndim = fields[n : n + 3]
        specs.append((code, bool(requires_grad), fields[n + 3 : n + 3 + ndim]))
        n += 3 + ndim
    return kind, microbatch, microbatches, specs


class _P2PRecv(PendingRecv):
    def __init__(self, transport: P2PTransport, src: int, channel: int) -> None:
        self.transport, self.src, self.channel = transport, src, channel
        self.header = torch.empty(HEADER_SIZE, dtype=torch.int64, device=transport.device)
        self.work = dist.irecv(
            self.header, transport.global_rank(src), group=transport.group, tag=2 * channel
        )

    def _wait(self, work: dist.Work | None, timeout: float, what: str) -> None:
        assert work is not None  # point-to-point operations always return a Work
        try:
            work.wait(datetime.timedelta(seconds=max(timeout, 0.001)))
        except RuntimeError as e:
            text = str(e)
            me = self.transport.rank
            if "Timed out" in text or "timeout" in text.lower():
                raise TransportTimeout(
                    f"rank {me} timed out after {timeout:.1f} s waiting for {what} from rank "
                    f"{self.src}; that rank is slow, stuck or gone (raise the pipeline's timeout "
                    f"if its work really takes longer)"
                ) from e
            raise ConnectionError(
                f"rank {me} lost rank {self.src} while waiting for {what}: {text.splitlines()[0]}"
            ) from e

    def wait(self, timeout: float) -> Message:
        self._wait(self.work, timeout, "a message header")
        kind, microbatch, microbatches, specs = decode_header(self.header.cpu())
        tensors: list[Tensor | None] = []
        works = []
        for code, _, shape in specs:
            if code < 0:
                tensors.append(None)
                continue
            buffer = torch.empty(shape, dtype=_DTYPES[code], device=self.transport.device)
            works.append(
                dist.irecv(
                    buffer,
                    self.transport.global_rank(self.src),
                    group=self.transport.group,
                    tag=2 * self.channel + 1,
                )
            )
            tensors.append(buffer)
        for work in works:
            self._wait(work, timeout, f"the tensors of micro-batch {microbatch}")
        for tensor, (_, requires_grad, _) in zip(tensors, specs):
            if tensor is not None and requires_grad:
                tensor.requires_grad_(True)
        if kind == _ERROR:
            data = tensors[0] if tensors else None
            text = bytes(data.tolist()).decode("utf-8", "replace") if data is not None else ""
            return Message(microbatch, microbatches, (), error=text or "unknown failure")
        return Message(microbatch, microbatches, tuple(tensors))


class P2PTransport(Transport):
    """Messages over ``torch.distributed`` point-to-point operations.

    Args:
        group: the process group of the pipeline (default: the whole world); pipeline rank
            ``r`` is the ``r``-th rank of the group.
        device: where received tensors are placed (a CUDA device with NCCL).

    Example:
        >>> transport = P2PTransport()  # doctest: +SKIP
    """

    def __init__(
        self, group: dist.ProcessGroup | None = None, device: torch.device | None = None
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError(
                "the p2p transport needs torch.distributed: call asyncpipe.init() first and "
                "launch with torchrun, e.g. torchrun --standalone --nproc-per-node=2 train.py"
            )
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self._ranks = [
            dist.get_global_rank(group, r) if group else r for r in range(self.world_size)
        ]
        self.device = device or torch.device("cpu")
        self.early_receives = dist.get_backend(group) != "nccl"
        self._pending: list[tuple[dist.Work | None, list[Tensor]]] = []

    def global_rank(self, rank: int) -> int:
        return self._ranks[rank]

    def send(self, dst: int, channel: int, message: Message) -> None:
        if message.error is not None:
            data = torch.tensor(list(message.error.encode("utf-8")), dtype=torch.uint8)
            payload: list[Tensor | None] = [data.to(self.device)]
        else:
            payload = [None if t is None else t.detach().contiguous() for t in message.tensors]
            for tensor, original in zip(payload, message.tensors):
                if tensor is not None and original is not None and original.requires_grad:
                    tensor.requires_grad_(True)
        header = encode_header(message, payload).to(self.device)
        peer = self.global_rank(dst)
        keep = [header]
        self._pending = [(w, k) for w, k in self._pending if w is not None and not w.is_completed()]
        self._pending.append((dist.isend(header, peer, group=self.group, tag=2 * channel), keep))
        for tensor in payload:
            if tensor is not None:
                plain = tensor.detach()
                work = dist.isend(plain, peer, group=self.group, tag=2 * channel + 1)
                self._pending.append((work, [plain]))

    def recv(self, src: int, channel: int) -> PendingRecv:
        return _P2PRecv(self, src, channel)

    def flush(self, timeout: float) -> None:
        pending, self._pending = self._pending, []
        for work, _ in pending:
            if work is None:
                continue
            try:
                work.wait(datetime.timedelta(seconds=max(timeout, 0.001)))
            except RuntimeError as e:
                raise TransportTimeout(
                    f"rank {self.rank} could not finish its sends within {timeout:.1f} s: "
                    f"{str(e).splitlines()[0]}"
                ) from e

    def exchange(self, values: list[float], timeout: float) -> list[list[float]]:
        local = torch.tensor(values, dtype=torch.float64, device=self.device)
        out = [torch.empty_like(local) for _ in range(self.world_size)]
        work = dist.all_gather(out, local, group=self.group, async_op=True)
        assert work is not None
        try:
            work.wait(datetime.timedelta(seconds=max(timeout, 0.001)))
        except RuntimeError as e:
            raise TransportTimeout(
                f"rank {self.rank} timed out after {timeout:.1f} s waiting for the other ranks "
                f"to finish the step: {str(e).splitlines()[0]}"
            ) from e
        return [t.cpu().tolist() for t in out]
