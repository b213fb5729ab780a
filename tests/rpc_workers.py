"""Worker functions for the RPC transport tests (run in spawned processes)."""

from __future__ import annotations

import copy
import functools
import os
import time
from typing import Any

import torch
from gloo_workers import transparency
from models import mlp, reference
from skip_workers import skips
from torch import Tensor, nn

import asyncpipe
import asyncpipe.rpc
from asyncpipe import AsyncPipe, StageFailure

mse = nn.functional.mse_loss


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


def _plain_training(model: nn.Module, batches: list[tuple[Tensor, Tensor]], chunks: int) -> Any:
    """Losses and final state of a copy of ``model`` trained with SGD on micro-batches."""
    plain = copy.deepcopy(model)
    optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
    losses = []
    for x, y in batches:
        optimizer.zero_grad()
        total = 0.0
        for px, py in zip(x.chunk(chunks), y.chunk(chunks)):
            loss = mse(plain(px), py) / chunks
            loss.backward()
            total += float(loss.detach())
        optimizer.step()
        losses.append(total)
    return losses, plain


def gradients(pipe: AsyncPipe) -> list[Tensor]:
    """Run on every stage by foreach_worker: the local gradients."""
    return [p.grad.clone() for p in pipe.parameters() if p.grad is not None]


def failing_loss(output: Tensor, target: Tensor) -> Tensor:
    raise ValueError("this loss always fails")


def driver(rank: int, world: int, schedule: str) -> Any:
    """Single-controller mode: rank 0 drives; compare with the plain model trained alike."""
    asyncpipe.init(rpc=True)
    if rank != 0:
        asyncpipe.rpc.serve()
        return None
    model = mlp(2 * world, seed=21)
    torch.manual_seed(22)
    batches = [(torch.randn(8, 8), torch.randn(8, 8)) for _ in range(3)]
    want_losses, plain = _plain_training(model, batches, 4)
    _, want_first = reference(model, *batches[0], 4, mse)
    pipe = asyncpipe.rpc.RemotePipe(
        model,
        [2] * world,
        chunks=4,
        schedule=schedule,
        optimizer=functools.partial(torch.optim.SGD, lr=0.1),
        timeout=30,
    )
    losses, first_grads = [], None
    for n, (x, y) in enumerate(batches):
        pipe.zero_grad()
        losses.append(pipe.step(x, y, mse))
        if n == 0:
            first_grads = [g for stage in pipe.foreach_worker(gradients) for g in stage]
        pipe.optimizer_step()
    state = pipe.state_dict()
    pipe.eval()
    probe = torch.randn(5, 8)
    output = pipe(probe)
    with torch.no_grad():
        want_output = plain(probe)
    result = {
        "loss_error": max(abs(a - b) for a, b in zip(losses, want_losses)),
        "grad_error": max(
            float((a - b).abs().max()) for a, b in zip(first_grads or [], want_first)
        ),
        "grads": len(first_grads or []),
        "state_error": max(
            float((state[k] - v).abs().max()) for k, v in plain.state_dict().items()
        ),
        "state_keys": sorted(state) == sorted(plain.state_dict()),
        "output_error": float((output - want_output).abs().max()),
    }
    try:
        pipe.train()
        pipe.step(batches[0][0], batches[0][1], failing_loss)
    except StageFailure as e:
        result["failure"] = str(e)
    pipe.shutdown()
    return result


def driver_elsewhere(rank: int, world: int) -> Any:
    """Building the driver on a worker rank is an error; the real driver then shuts down."""
    asyncpipe.init(rpc=True)
    if rank == 1:
        try:
            asyncpipe.rpc.RemotePipe(mlp(2), [1, 1], chunks=1)
        except RuntimeError as e:
            message = str(e)
        asyncpipe.rpc.serve()
        return message
    pipe = asyncpipe.rpc.RemotePipe(mlp(2), [1, 1], chunks=1)
    pipe.shutdown()
    return "driver"


def driver_dies(rank: int, world: int) -> Any:
    """The driver process dies after building the pipeline; the workers must not hang."""
    asyncpipe.init(rpc=True)
    if rank == 0:
        asyncpipe.rpc.RemotePipe(mlp(2), [1, 1], chunks=1)
        os._exit(3)
    started = time.monotonic()
    try:
        asyncpipe.rpc.serve(check_every=0.5, timeout=5)
    except RuntimeError as e:
        return str(e), time.monotonic() - started
    return "served", time.monotonic() - started
