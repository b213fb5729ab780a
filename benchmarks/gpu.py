"""Where a benchmark rank computes: the CPU, a GPU of its own over NCCL, or a GPU shared over gloo.

With a GPU for every process the ranks talk over NCCL and asyncpipe's transports carry CUDA
tensors device to device. NCCL refuses two ranks on one GPU ("Duplicate GPU detected"), so when
processes outnumber the GPUs the ranks talk over gloo, as :func:`asyncpipe.init` chooses, and
asyncpipe's ``p2p`` transport stages every message through host memory (gloo moves host memory
only: a CUDA tensor handed to gloo's send aborts the process with ``writev ... Bad address``).
torch.distributed.pipelining and fairscale's ``AsyncPipe`` send CUDA tensors over the process
group themselves, so on a shared GPU they cannot run (:data:`SHARED_GPU_PEERS`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

__all__ = ["SHARED_GPU_NOTE", "SHARED_GPU_PEERS", "Placement", "placement", "synchronize"]

SHARED_GPU_PEERS = "not run: needs a GPU per process"
"""What a peer's row says when processes share GPUs (:data:`SHARED_GPU_NOTE` says why)."""

SHARED_GPU_NOTE = (
    "Processes share a GPU: torch.distributed.pipelining and fairscale's AsyncPipe are not run, "
    "since NCCL refuses two ranks on one GPU and gloo cannot send the CUDA tensors these peers "
    "send themselves; asyncpipe's transports stage messages through host memory."
)
"""The report's note on a run whose processes share GPUs."""


@dataclass(frozen=True)
class Placement:
    """Where this rank computes and how it talks to the others."""

    device: torch.device
    backend: str
    """``"gloo"`` or ``"nccl"``."""
    staged: bool
    """Processes share a GPU: gloo between them, messages staged through host memory."""

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

    ``device`` is ``"cpu"``, ``"cuda"`` or ``"auto"`` (CUDA when there is a GPU). With CUDA:
    NCCL when there is a GPU for every process, else gloo; rank ``r`` computes on GPU
    ``r % torch.cuda.device_count()``, the device :func:`asyncpipe.init` makes current.

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
