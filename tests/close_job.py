"""Workers for test_close_releases: many pipelines built and closed in one process."""

from __future__ import annotations

import copy
import gc
import os
import threading
from typing import Any

import torch
from torch import nn

import asyncpipe
from asyncpipe import AsyncPipe

__all__: list[str] = []

PIPELINES = 8


def _counts() -> tuple[int, int, int]:
    """Open file descriptors, OS threads and Python threads of this process now."""
    gc.collect()
    return (
        len(os.listdir("/proc/self/fd")),
        len(os.listdir("/proc/self/task")),
        threading.active_count(),
    )


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)])
    with torch.no_grad():  # tied from the start (shared_weights keeps them so)
        model[3].weight.copy_(model[0].weight)
    return model


def _build(kind: str, model: nn.Sequential, **extra: Any) -> AsyncPipe:
    if kind == "data_parallel":
        return AsyncPipe(model, [4], chunks=2, timeout=30, data_parallel_size=2, **extra)
    if kind == "shared":
        return AsyncPipe(
            model, [2, 2], chunks=2, timeout=30, shared_weights=[("0.weight", "3.weight")], **extra
        )
    return AsyncPipe(model, [2, 2], chunks=2, timeout=30, transport="rpc", **extra)


def _boom(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    raise ValueError("this loss always fails")


def many_pipelines(rank: int, world: int, kind: str) -> dict[str, Any]:
    """Build, step and close :data:`PIPELINES` pipelines of ``kind`` (``"data_parallel"``,
    ``"shared"`` or ``"rpc"``), then one that fails in its step and is closed, then a last one
    compared with the plain model. Returns the resource counts after each close, what a step
    after close() raised, and the last pipeline's largest gradient error."""
    if kind == "rpc":
        asyncpipe.init(rpc=True)
    from asyncpipe.transport.rpc import _Post

    data = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 16, generator=data), torch.randn(8, 16, generator=data)
    boxes = len(_Post._boxes)
    counts = []
    closed_error = ""
    for k in range(PIPELINES):
        pipe = _build(kind, _model())
        for _ in range(2):
            pipe.step(x, y, nn.functional.mse_loss)
        pipe.close()
        if k == 0:
            pipe.close()  # twice: nothing more
            try:
                pipe.step(x, y, nn.functional.mse_loss)
            except RuntimeError as e:
                closed_error = str(e)
        del pipe
        counts.append(_counts())
    boxes_after = len(_Post._boxes)
    failed = _build(kind, _model())
    failure = ""
    try:
        failed.step(x, y, _boom)
    except Exception as e:  # a StageFailure on every rank
        failure = f"{type(e).__name__}: {e}"
    failed.close()
    del failed

    model = _model()
    plain = copy.deepcopy(model)
    pipe = _build(kind, model)
    loss = pipe.step(x, y, nn.functional.mse_loss)
    expected = nn.functional.mse_loss(plain(x), y)
    expected.backward()
    if kind == "shared":  # the tied weights' gradient is the sum of both uses, on each copy
        tied = plain[0].weight.grad + plain[3].weight.grad
        plain[0].weight.grad, plain[3].weight.grad = tied, tied.clone()
    local = {id(p) for p in pipe.parameters()}
    errors = [
        float((p.grad - q.grad).abs().max())  # type: ignore[operator]
        for p, q in zip(model.parameters(), plain.parameters())
        if id(p) in local
    ]
    pipe.close()
    if kind == "rpc":
        asyncpipe.shutdown()
    return {
        "counts": counts,
        "closed_error": closed_error,
        "failure": failure,
        "boxes": (boxes, boxes_after),
        "loss_error": abs(loss - expected.item()),
        "grad_error": max(errors, default=0.0),
        "grads": len(errors),
    }


def _broken_layer() -> nn.Module:
    raise RuntimeError("this layer cannot be built")


def refused_pipelines(rank: int, world: int) -> dict[str, Any]:
    """Build :data:`PIPELINES` data-parallel pipelines whose constructor fails after it has
    created its groups (a LazyModule that cannot be built), then one that works. Returns the
    resource counts after each failure, the errors, and the working pipeline's loss error."""
    from asyncpipe import LazyModule

    counts, errors = [], []
    for _ in range(PIPELINES):
        layers = [*_model()[:3], LazyModule(_broken_layer)]
        try:
            AsyncPipe(layers, [4], chunks=2, timeout=30, data_parallel_size=2)
        except RuntimeError as e:
            errors.append(str(e))
        counts.append(_counts())
    data = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 16, generator=data), torch.randn(8, 16, generator=data)
    model = _model()
    plain = copy.deepcopy(model)
    pipe = AsyncPipe(model, [4], chunks=2, timeout=30, data_parallel_size=2)
    loss = pipe.step(x, y, nn.functional.mse_loss)
    pipe.close()
    expected = nn.functional.mse_loss(plain(x), y).item()
    return {"counts": counts, "errors": errors, "loss_error": abs(loss - expected)}
