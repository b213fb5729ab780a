"""CUDA tests: run where a GPU is at hand, skipped elsewhere."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from models import mlp
from spawn import run_ranks
from threads import run_threads, values
from torch import nn

from asyncpipe import AsyncPipe
from asyncpipe.transport import Transport

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
mse = nn.functional.mse_loss


@cuda
@pytest.mark.parametrize("policy", ["always", "except_last", "never"])
def test_in_process_ranks_on_cuda_match_the_plain_model(policy: str) -> None:
    device = torch.device("cuda", 0)
    model = nn.Sequential(
        *[nn.Sequential(nn.Linear(32, 32), nn.Dropout(0.0), nn.Tanh()) for _ in range(4)]
    ).to(device)
    plain = copy.deepcopy(model)
    x, y = torch.randn(8, 32, device=device), torch.randn(8, 32, device=device)
    for xc, yc in zip(x.chunk(4), y.chunk(4)):
        (mse(plain(xc), yc) / 4).backward()

    def fn(rank: int, transport: Transport) -> float:
        pipe = AsyncPipe(
            model,
            [2, 2],
            chunks=4,
            checkpoint=policy,
            transport=transport,
            timeout=30,
            device=device,
        )
        return pipe.step(x, y, mse)

    values(run_threads(fn, 2))
    for got, want in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(got.grad, want.grad)


def _nccl_worker(rank: int, world: int) -> Any:
    device = torch.device("cuda", rank)
    model = mlp(4, width=16, seed=0).to(device)
    plain = copy.deepcopy(model)
    torch.manual_seed(1)
    x, y = torch.randn(8, 16, device=device), torch.randn(8, 16, device=device)
    for xc, yc in zip(x.chunk(4), y.chunk(4)):
        (mse(plain(xc), yc) / 4).backward()
    pipe = AsyncPipe(model, [2, 2], chunks=4, timeout=60, device=device)
    pipe.step(x, y, mse)
    ids = {id(p): n for n, p in enumerate(model.parameters())}
    want = list(plain.parameters())
    return max(float((p.grad - want[ids[id(p)]].grad).abs().max()) for p in pipe.parameters())


@two_gpus
@pytest.mark.slow
def test_nccl_two_processes_match_the_plain_model() -> None:
    for error in run_ranks(_nccl_worker, 2, timeout=300, backend="nccl"):
        assert error < 1e-5
