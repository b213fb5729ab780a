"""Run a function on several in-process ranks (threads) sharing an InProcessHub."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from asyncpipe.transport import InProcessHub, Transport

HubFactory = Callable[[int], Any]

__all__ = ["run_pipes", "run_threads", "values"]


def run_threads(
    fn: Callable[[int, Transport], Any],
    world: int,
    timeout: float = 60,
    hub_type: HubFactory = InProcessHub,
) -> list[tuple[str, Any]]:
    """``fn(rank, transport)`` on ``world`` threads; ``("ok", value)`` or ``("error", exc)``.
    ``hub_type(world)`` hands out the transports (default: in-process queues)."""
    hub = hub_type(world)
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


def run_pipes(
    model: Any,
    balance: list[int],
    chunks: int,
    policy: str,
    schedule: Any,
    rows: int,
    virtual_stages: int = 1,
    world: int | None = None,
    seed: int = 3,
    hub_type: HubFactory = InProcessHub,
    batch: tuple[Any, Any] | None = None,
    loss_fn: Any = None,
) -> tuple[list[float], list[Any], Any, Any]:
    """One ``step`` of ``AsyncPipe(model, ...)`` on in-process ranks, on ``batch`` (default: a
    seeded (rows, 8) one) with ``loss_fn`` (default: mse); returns each rank's loss and pipe,
    and the batch."""
    import torch
    from torch import nn

    from asyncpipe import AsyncPipe

    if batch is None:
        torch.manual_seed(seed)
        batch = torch.randn(rows, 8), torch.randn(rows, 8)
    x, y = batch
    loss_fn = loss_fn or nn.functional.mse_loss

    def fn(rank: int, transport: Transport) -> tuple[float, AsyncPipe]:
        pipe = AsyncPipe(
            model,
            balance,
            chunks=chunks,
            checkpoint=policy,
            schedule=schedule,
            virtual_stages=virtual_stages,
            transport=transport,
            timeout=10,
        )
        return pipe.step(x, y, loss_fn), pipe

    results = values(run_threads(fn, world or len(balance), hub_type=hub_type))
    return [r[0] for r in results], [r[1] for r in results], x, y
