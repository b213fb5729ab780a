"""Deferred BatchNorm inside pipelines: micro-batch normalisation, whole-batch running stats."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from models import bn_reference as reference
from threads import run_threads, values
from torch import nn

from asyncpipe import AsyncPipe, DeferredBatchNorm, LazyModule
from asyncpipe.transport import Transport

mse = nn.functional.mse_loss


def bn_model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Tanh(),
        nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8, momentum=None)), nn.Tanh(),
        nn.Linear(8, 8),
    )  # fmt: skip


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zero_bubble"])
@pytest.mark.parametrize("policy", ["always", "except_last", "never"])
@pytest.mark.parametrize("chunks", [1, 3, 4])
def test_deferred_batch_norm_matches_micro_batch_gradients_and_whole_batch_stats(
    schedule: str, policy: str, chunks: int
) -> None:
    model = bn_model()
    torch.manual_seed(1)
    x, y = torch.randn(12, 8), torch.randn(12, 8)
    want_grads, want_stats = reference(model, x, y, chunks, steps=2)

    def fn(rank: int, transport: Transport) -> AsyncPipe:
        pipe = AsyncPipe(
            model,
            [3, 3],
            chunks=chunks,
            checkpoint=policy,
            schedule=schedule,
            deferred_batch_norm=True,
            transport=transport,
            timeout=10,
        )
        for _ in range(2):
            pipe.zero_grad()
            pipe.step(x, y, mse)
        return pipe

    pipes = values(run_threads(fn, 2))
    assert isinstance(pipes[0][1], DeferredBatchNorm)
    assert isinstance(pipes[1][0][1], DeferredBatchNorm)  # nested inside the caller's layer
    got = [p.grad for pipe in pipes for p in pipe.parameters()]
    for g, w in zip(got, want_grads):
        torch.testing.assert_close(g, w)
    stats = {}
    for pipe, offset in zip(pipes, (0, 3)):
        for key, value in pipe.layers.state_dict().items():
            index, rest = key.split(".", 1)
            stats[f"{int(index) + offset}.{rest}"] = value
    for key, value in want_stats.items():
        torch.testing.assert_close(stats[key], value, msg=key)


def test_lazy_modules_with_deferred_batch_norm() -> None:
    plain = bn_model()
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    want_grads, want_stats = reference(plain, x, y, 4, steps=1)

    def fn(rank: int, transport: Transport) -> AsyncPipe:
        layers = [LazyModule(lambda layer=layer: copy.deepcopy(layer)) for layer in plain]
        pipe = AsyncPipe(
            layers, [2, 4], chunks=4, deferred_batch_norm=True, transport=transport, timeout=10
        )
        pipe.step(x, y, mse)
        return pipe

    pipes = values(run_threads(fn, 2))
    torch.testing.assert_close(pipes[0][1].running_mean, want_stats["1.running_mean"])
    torch.testing.assert_close(pipes[1][1][1].running_var, want_stats["3.1.running_var"])
    got = [p.grad for pipe in pipes for p in pipe.parameters()]
    for g, w in zip(got, want_grads):
        torch.testing.assert_close(g, w)


def test_eval_uses_running_statistics() -> None:
    model = bn_model()
    x = torch.randn(6, 8)

    def fn(rank: int, transport: Transport) -> Any:
        pipe = AsyncPipe(
            model, [3, 3], chunks=3, deferred_batch_norm=True, transport=transport, timeout=10
        )
        pipe.eval()
        return pipe(x if rank == 0 else None)

    out = values(run_threads(fn, 2))[1]
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(out, model(x))


@pytest.mark.parametrize("schedule", ["gpipe", "zero_bubble"])
@pytest.mark.parametrize("policy", ["always", "except_last", "never"])
def test_plain_batch_norm_statistics_do_not_depend_on_the_checkpoint_policy(
    schedule: str, policy: str
) -> None:
    """Without deferred_batch_norm, the running statistics are the plain model's run micro-batch
    by micro-batch: a recompute in backward does not update them a second time."""
    model = bn_model()
    torch.manual_seed(2)
    x, y = torch.randn(12, 8), torch.randn(12, 8)
    plain = copy.deepcopy(model)
    for _ in range(2):
        for px, py in zip(x.chunk(4), y.chunk(4)):
            (mse(plain(px), py) / 4).backward()
    want = {k: v for k, v in plain.state_dict().items() if "running" in k or "num_batches" in k}

    def fn(rank: int, transport: Transport) -> AsyncPipe:
        pipe = AsyncPipe(
            model, [3, 3], chunks=4, checkpoint=policy, schedule=schedule, transport=transport,
            timeout=10,
        )  # fmt: skip
        for _ in range(2):
            pipe.step(x, y, mse)
        return pipe

    got = {}
    for pipe in values(run_threads(fn, 2)):
        got.update(pipe.state_dict())
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, msg=key)
