"""Worker functions for the tests of a shared-memory transport whose set-up a rank dies in."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from typing import Any

from asyncpipe.transport import ShmTransport, shm


def killed_after_create(rank: int, world: int) -> Any:
    """Rank 1 is killed (SIGKILL: no exception, no clean-up) right after it made its incoming
    rings and doorbell, before the ranks check together that every one made its own. The
    survivors return the token of the transport's names, what they raised and when."""
    made = shm.ShmTransport._create
    token: list[str] = []

    def create(self: ShmTransport, ring: Callable[[int, int], str], name: str, *a: Any) -> None:
        token.append(name)
        made(self, ring, name, *a)
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)

    shm.ShmTransport._create = create  # type: ignore[method-assign]
    began = time.monotonic()
    try:
        ShmTransport(ring_bytes=2**16)
    except Exception as e:
        return (
            token[0],
            type(e).__name__,
            str(e),
            getattr(e, "peer", None),
            time.monotonic() - began,
        )
    return token[0], "no error", "", None, time.monotonic() - began
