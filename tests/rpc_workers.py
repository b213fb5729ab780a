"""Worker functions for the RPC transport tests (run in spawned processes)."""

from __future__ import annotations

from typing import Any

from gloo_workers import transparency
from skip_workers import skips

import asyncpipe


def rpc_transparency(rank: int, world: int, *args: Any) -> Any:
    """``transparency`` over the RPC transport."""
    asyncpipe.init(rpc=True)
    try:
        return transparency(rank, world, *args, transport="rpc")
    finally:
        asyncpipe.shutdown()


def rpc_skips(rank: int, world: int, cases: list[Any]) -> Any:
    """``skips`` over the RPC transport."""
    asyncpipe.init(rpc=True)
    try:
        return skips(rank, world, cases, "rpc")
    finally:
        asyncpipe.shutdown()
