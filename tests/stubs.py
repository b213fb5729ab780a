"""A transport for tests that look at one part of the runtime without moving messages."""

from __future__ import annotations

from typing import Any

from asyncpipe.transport import Transport


class Unused(Transport):
    """Rank ``rank`` of ``world``: sending or receiving fails the test; flushing does nothing
    (subclasses change what they look at)."""

    def __init__(self, rank: int = 0, world: int = 2) -> None:
        self.rank, self.world_size = rank, world

    def send(self, dst: int, channel: int, message: Any) -> None:
        raise AssertionError("not used")

    def recv(self, src: int, channel: int, slot: int = 0) -> Any:
        raise AssertionError("not used")

    def flush(self, timeout: float) -> None:
        return None
