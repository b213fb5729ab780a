"""Where a benchmark rank computes: the CPU, its own GPU over NCCL, or a GPU shared over gloo.

With one process per GPU the ranks talk over NCCL and asyncpipe's transports carry CUDA tensors
device to device. NCCL refuses two ranks on one GPU ("Duplicate GPU detected"), and gloo's
point-to-point send reads the tensor's memory from the host, so a CUDA tensor given to it
aborts the process (``writev ... Bad address``): asyncpipe's ``p2p`` transport over gloo only
carries host tensors. When processes share GPUs, the ranks therefore talk over gloo and
:class:`HostStaged` moves every message through host memory: a copy to the host before the
send, a copy to the GPU after the receive. The stage's compute stays on the GPU.
torch.distributed.pipelining and fairscale move CUDA tensors with their own sends and cannot be
staged this way, so on a shared GPU they are reported as not run (:data:`SHARED_GPU_PEERS`).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch

from asyncpipe.transport import Message, PendingRecv, Transport

__all__ = ["SHARED_GPU_PEERS", "HostStaged", "Placement", "placement", "synchronize"]

SHARED_GPU_PEERS = (
    "not run: processes share a GPU, NCCL refuses two ranks on one GPU and gloo cannot send "
    "CUDA tensors (run one process per GPU for this peer)"
)
"""Why a peer is not run when processes share GPUs."""


@dataclass(frozen=True)
class Placement:
    """Where this rank computes and how it talks to the others."""

    device: torch.device
    backend: str
    """``"gloo"`` or ``"nccl"``."""
    staged: bool
    """Messages cross through host memory (:class:`HostStaged`): processes share a GPU."""

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def describe(self, world: int) -> str:
        """One line for a report: the device and the backend."""
        if not self.cuda:
            return f"CPU, {world} processes, gloo on loopback"
        name = torch.cuda.get_device_name(self.device)
        count = torch.cuda.device_count()
        if self.staged:
            return (
                f"{name} ({count} GPU(s) shared by {world} processes), gloo on loopback, "
                f"messages staged through host memory"
            )
        return f"{name}, {world} processes, one GPU each, NCCL"


def placement(device: str, world: int, rank: int | None = None) -> Placement:
    """The placement of ``rank`` (default: ``LOCAL_RANK``) in a group of ``world`` processes.

    ``device`` is ``"cpu"``, ``"cuda"`` or ``"auto"`` (CUDA when there is a GPU). With CUDA,
    NCCL when there is a GPU for every process, else gloo with the processes spread over the
    GPUs round-robin and messages staged through host memory.

    Raises:
        RuntimeError: ``device="cuda"`` and CUDA is not available.
    """
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        return Placement(torch.device("cpu"), "gloo", False)
    if not torch.cuda.is_available():
        raise RuntimeError("--device cuda was asked for, but torch.cuda.is_available() is False")
    local = int(os.environ.get("LOCAL_RANK", "0")) if rank is None else rank
    count = torch.cuda.device_count()
    shared = world > count
    return Placement(torch.device("cuda", local % count), "gloo" if shared else "nccl", shared)


def synchronize(where: Placement | torch.device) -> None:
    """Wait for the GPU's queued work (nothing on the CPU): call before reading a clock."""
    device = where.device if isinstance(where, Placement) else where
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _StagedRecv(PendingRecv):
    def __init__(self, inner: PendingRecv, device: torch.device) -> None:
        self.inner, self.device = inner, device

    def wait(self, timeout: float) -> Message:
        message = self.inner.wait(timeout)
        return dataclasses.replace(message, tensors=_moved(message.tensors, self.device))


def _moved(
    tensors: tuple[torch.Tensor | None, ...], device: torch.device
) -> tuple[torch.Tensor | None, ...]:
    """Copies on ``device``, each a leaf that requires grad exactly where the original did."""
    out: list[torch.Tensor | None] = []
    for tensor in tensors:
        if tensor is None:
            out.append(None)
            continue
        moved = tensor.detach().to(device)
        out.append(
            moved.requires_grad_(tensor.requires_grad) if moved.is_floating_point() else moved
        )
    return tuple(out)


class HostStaged(Transport):
    """A transport that carries CUDA tensors over one that only moves host tensors.

    Every tensor is copied to the host before ``inner`` sends it and to ``device`` after
    ``inner`` receives it, so ranks that share a GPU can run a CUDA pipeline over gloo.

    Args:
        inner: the transport that moves the bytes (asyncpipe's ``P2PTransport`` over gloo, or
            its ``RPCTransport`` without device maps).
        device: where received tensors go.
    """

    def __init__(self, inner: Transport, device: torch.device) -> None:
        self.inner, self.device = inner, device
        self.rank, self.world_size = inner.rank, inner.world_size
        self.early_receives = inner.early_receives

    def send(self, dst: int, channel: int, message: Message) -> None:
        host = dataclasses.replace(message, tensors=_moved(message.tensors, torch.device("cpu")))
        self.inner.send(dst, channel, host)

    def recv(self, src: int, channel: int, slot: int = 0) -> PendingRecv:
        return _StagedRecv(self.inner.recv(src, channel, slot), self.device)

    def settle(self, dst: int, channel: int, slot: int, timeout: float) -> None:
        self.inner.settle(dst, channel, slot, timeout)

    def flush(self, timeout: float) -> None:
        self.inner.flush(timeout)

    def close(self) -> None:
        self.inner.close()
