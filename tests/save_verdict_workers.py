"""Worker functions for the tests of the verdict rank 0 gives on a checkpoint that a rank
stuck elsewhere never took part in."""

from __future__ import annotations

import time
from typing import Any

import torch.distributed as dist
from torch import nn

from asyncpipe import AsyncPipe, checkpoint

TIMEOUT = 3.0
"""The pipeline's timeout: rank 0 waits this long for the stuck rank."""


def stuck_rank(rank: int, world: int, directory: str, what: str) -> Any:
    """Rank 1 is stuck (sleeps) instead of calling ``checkpoint.save`` (``what="save"``) or
    ``checkpoint.load`` (``"load"``, of a checkpoint every rank saved before); rank 0 comes to
    it 1 s after rank 2, so that rank 2 has waited 1 s longer when rank 0 gives up on rank 1.
    Every rank but 1 returns what it raised, and after how long."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4))
    # built and saved with a long timeout (a loaded machine once took over 3 s for that save),
    # then the checkpoint under test waits TIMEOUT
    pipe = AsyncPipe(model, [1, 1, 1], chunks=2, transport="shm", timeout=60.0)
    if what == "load":
        checkpoint.save(pipe, None, directory, step=1)
    dist.barrier()
    pipe.timeout = TIMEOUT
    if rank == 1:
        time.sleep(4 * TIMEOUT)  # until the others are done: stuck, but still running
        return None
    if rank == 0:
        time.sleep(1.0)
    began = time.monotonic()
    try:
        if what == "save":
            checkpoint.save(pipe, None, directory, step=2)
        else:
            checkpoint.load(pipe, None, directory)
    except Exception as e:
        return type(e).__name__, str(e), time.monotonic() - began
    return "no error", "", time.monotonic() - began
