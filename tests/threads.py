"""Run a function on several in-process ranks (threads) sharing an InProcessHub."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from asyncpipe.transport import InProcessHub, Transport

__all__ = ["run_threads"]


def run_threads(
    fn: Callable[[int, Transport], Any], world: int, timeout: float = 60
) -> list[tuple[str, Any]]:
    """``fn(rank, transport)`` on ``world`` threads; ``("ok", value)`` or ``("error", exc)``."""
    hub = InProcessHub(world)
    results: list[tuple[str, Any]] = [("missing", None)] * world

    def target(rank: int) -> None:
        try:
            results[rank] = ("ok", fn(rank, hub.transport(rank)))
        except BaseException as e:
            results[rank] = ("error", e)

    threads = [threading.Thread(target=target, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    hung = [r for r, t in enumerate(threads) if t.is_alive()]
    assert not hung, f"ranks {hung} did not finish within {timeout} s (a hang)"
    return results


def values(results: list[tuple[str, Any]]) -> list[Any]:
    """The values of a run where every rank must have succeeded."""
    for rank, (status, value) in enumerate(results):
        if status != "ok":
            raise AssertionError(f"rank {rank} failed") from value
    return [value for _, value in results]
