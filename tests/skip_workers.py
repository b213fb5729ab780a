"""Worker functions for the multi-process skip tests (run in spawned processes)."""

from __future__ import annotations

from typing import Any

import torch
from gloo_workers import _diff, errors
from models import bn_reference, reference
from skip_models import crossing, three, with_batch_norm
from torch import nn

from asyncpipe import AsyncPipe

mse = nn.functional.mse_loss


def _model(name: str) -> nn.Sequential:
    if name == "three":
        return three(seed=1)
    if name == "crossing":
        return crossing(seed=2)
    model = crossing(seed=3)  # six layers, for two model chunks on each of three ranks
    model.append(nn.Linear(8, 8))
    return model


def skips(
    rank: int,
    world: int,
    cases: list[tuple[str, list[int], str, str, int]],
    transport: str = "p2p",
) -> dict[str, tuple[float, float]]:
    """Loss and gradient errors against the plain model for (model, balance, schedule,
    policy, chunks) cases."""
    out = {}
    for name, balance, schedule, policy, chunks in cases:
        key = f"{name}-{balance}-{schedule}-{policy}-{chunks}"
        virtual = len(balance) // world
        out[key] = errors(
            _model(name), balance, chunks, policy, schedule, virtual, 12, 11, transport
        )
    return out


def skips_forward(rank: int, world: int) -> Any:
    """fairscale-style pipe(x) + back_helper, and inference, with skips across processes."""
    model = crossing(seed=4)
    torch.manual_seed(12)
    x, y = torch.randn(6, 8), torch.randn(6, 8)
    want_loss, grads = reference(model, x, y, 1, mse)
    pipe = AsyncPipe(model, [2, 1, 2], chunks=3, timeout=30)
    out = pipe(x if pipe.is_first_stage else None)
    if pipe.is_last_stage:
        # the gathered output is the whole batch, so one loss on it matches chunks=1
        mse(out, y).backward()
    else:
        pipe.back_helper(out)
    error = _diff(pipe, dict(enumerate(grads)), model)
    with torch.no_grad():
        inferred = pipe(x if pipe.is_first_stage else None)
        want = model(x)
    inference_error = float((inferred - want).abs().max()) if pipe.is_last_stage else 0.0
    return error, inference_error


def skips_batch_norm(rank: int, world: int, schedule: str) -> tuple[float, float]:
    """Largest gradient and running-statistics errors of a model whose skip crosses deferred
    BatchNorm layers and stages, against the reference."""
    model = with_batch_norm(seed=5)
    torch.manual_seed(13)
    x, y = torch.randn(12, 8), torch.randn(12, 8)
    want_grads, want_stats = bn_reference(model, x, y, 4, steps=2)
    pipe = AsyncPipe(
        model, [2, 2], chunks=4, schedule=schedule, deferred_batch_norm=True, timeout=30
    )
    for _ in range(2):
        pipe.zero_grad()
        pipe.step(x if pipe.is_first_stage else None, y if pipe.is_last_stage else None, mse)
    grad_error = _diff(pipe, dict(enumerate(want_grads)), model)
    state = model.state_dict()
    mine = {f"{n}." for n in range(2 * rank, 2 * rank + 2)}
    stat_error = max(
        float((state[k] - v).abs().max()) for k, v in want_stats.items() if k[:2] in mine
    )
    return grad_error, stat_error
