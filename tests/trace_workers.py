"""Workers of the multi-process trace tests (spawned processes), and literal runs for the rest."""

from __future__ import annotations

import functools
import time
from pathlib import Path
from typing import Any

import torch
from models import mlp
from threads import run_threads, values
from torch import Tensor, nn

import asyncpipe
import asyncpipe.rpc
from asyncpipe import AsyncPipe
from asyncpipe.schedule import build, lower
from asyncpipe.trace import RankStep, StepTrace, TraceWriter
from asyncpipe.transport import Transport

FORWARD_SECONDS = 0.01


class _Sleep(torch.autograd.Function):
    """Sleeps F in forward and 2F in backward: a workload whose timing the simulator knows."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        time.sleep(FORWARD_SECONDS)
        return x * 1.0

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        time.sleep(2 * FORWARD_SECONDS)
        return grad


class Sleep(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x: Tensor) -> Tensor:
        return _Sleep.apply(x * self.scale)  # type: ignore[no-untyped-call]


def traced_run(rank: int, world: int, directory: str, steps: int, every: int, chunks: int) -> Any:
    """``steps`` steps of a sleep workload (one layer per rank, GPipe) traced into
    ``directory``, an optimizer step in a trace span; returns the losses."""
    torch.manual_seed(0)
    model = nn.Sequential(*[Sleep() for _ in range(world)])
    pipe = AsyncPipe(
        model, [1] * world, chunks=chunks, checkpoint="never", timeout=60,
        trace=directory, trace_every=every,
    )  # fmt: skip
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.01)
    x, y = torch.randn(2 * chunks, 4), torch.randn(2 * chunks, 4)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        losses.append(pipe.step(x, y, nn.functional.mse_loss))
        with pipe.trace_span("optimizer"):
            optimizer.step()
    pipe.close()
    return losses


def traced_two_bw(
    rank: int, world: int, directory: str, steps: int, every: int, lookahead: int = 1
) -> Any:
    """``steps`` steps of the sleep workload under ``schedule="2bw"`` with ``lookahead`` (one
    layer per rank, chunks 4) traced into ``directory``, then ``close()`` (which drains);
    returns what every step and the drain returned."""
    torch.manual_seed(0)
    model = nn.Sequential(*[Sleep() for _ in range(world)])
    pipe = AsyncPipe(
        model, [1] * world, chunks=4, checkpoint="never", timeout=60, schedule="2bw",
        lookahead=lookahead, trace=directory, trace_every=every,
    )  # fmt: skip
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x, y = torch.randn(8, 4, generator=generator), torch.randn(8, 4, generator=generator)
        losses.append(pipe.step(x, y, nn.functional.mse_loss, optimizer=optimizer))
    losses.append(pipe.flush())
    pipe.close()
    return losses


class _FailsOnCall(nn.Module):
    """A linear layer whose forward raises on call ``when`` (counting from 1)."""

    def __init__(self, when: int) -> None:
        super().__init__()
        self.linear, self.when, self.calls = nn.Linear(8, 8), when, 0

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        if self.calls == self.when:
            raise ValueError("boom")
        return self.linear(x)


def traced_failure(rank: int, world: int, directory: str, good_steps: int) -> Any:
    """``good_steps`` traced steps over two stages (chunks 2), then one whose forward fails on
    the last stage; returns the losses, the failure and how long ``close()`` took."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), _FailsOnCall(2 * good_steps + 1))
    pipe = AsyncPipe(model, [1, 1], chunks=2, checkpoint="never", timeout=20, trace=directory)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    losses: list[float] = []
    failure = ""
    try:
        for _ in range(good_steps + 1):
            losses.append(pipe.step(x, y, nn.functional.mse_loss))
    except Exception as e:
        failure = f"{type(e).__name__}: {e}"
    began = time.monotonic()
    pipe.close()
    return losses, failure, time.monotonic() - began


def traced_replicas(rank: int, world: int, directory: str, steps: int) -> Any:
    """Two replicas of a two-stage pipeline traced through one ``TraceWriter(directory)``;
    returns the replica, its trace directory, the writer's directory and the losses."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
    writer = TraceWriter(directory, every=1)
    pipe = AsyncPipe(
        model, [2, 2], chunks=2, timeout=30, trace=writer, data_parallel_size=world // 2
    )
    generator = torch.Generator().manual_seed(pipe.data_parallel_rank)
    losses = []
    for _ in range(steps):
        x, y = torch.randn(4, 8, generator=generator), torch.randn(4, 8, generator=generator)
        losses.append(pipe.step(x, y, nn.functional.mse_loss))
    pipe.close()
    return pipe.data_parallel_rank, str(pipe.trace_directory), str(writer.directory), losses


def traced_remote(rank: int, world: int, directory: str, steps: int, close: bool) -> Any:
    """Single-controller mode traced into ``directory``: rank 0 drives ``steps`` steps of a
    ``RemotePipe`` (one stage per rank), then ``close()`` if ``close``, then ``shutdown()``;
    returns the losses on rank 0."""
    asyncpipe.init(rpc=True)
    if rank != 0:
        asyncpipe.rpc.serve()
        return None
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(2 * world)])
    pipe = asyncpipe.rpc.RemotePipe(
        model, [2] * world, chunks=2, timeout=30, trace=directory, trace_every=1,
        optimizer=functools.partial(torch.optim.SGD, lr=0.1),
    )  # fmt: skip
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    losses = []
    for _ in range(steps):
        pipe.zero_grad()
        losses.append(pipe.step(x, y, nn.functional.mse_loss))
        pipe.optimizer_step()
    if close:
        pipe.close()
    pipe.shutdown()
    return losses


def literal_step() -> StepTrace:
    """Step 7 of two ranks, written out by hand."""
    ranks = {
        0: RankStep(0.0, 4.0, (("0F0", 0.0, 1.0), ("0SEND_F0->1", 1.0, 1.1), ("0B0", 3.0, 4.0))),
        1: RankStep(0.5, 3.5, (("wait", 0.5, 1.1), ("1F0", 1.1, 2.0), ("1B0", 2.0, 3.0))),
    }
    return StepTrace(7, 100.0, 0.5, 8, ranks)


def written_run(directory: Path, steps: int) -> Path:
    """A run of ``steps`` literal steps written by a TraceWriter; returns its events.jsonl."""
    writer = TraceWriter(directory, tensorboard=False, images=False)
    writer.open({"chunks": 1})
    writer.add_plan("1/train", lower(build("gpipe", 2, 1)))
    for n in range(steps):
        writer.write(StepTrace(n, 100.0, 0.5, 8, literal_step().ranks, "1/train"))
    writer.close()
    return directory / "events.jsonl"


def threaded_run(directory: Path, schedule: str, steps: int) -> None:
    """``steps`` steps of two stages as threads of this process, traced into ``directory``
    (timelines every 2 steps), then ``close()``."""
    model = mlp(4)

    def fn(rank: int, transport: Transport) -> None:
        pipe = AsyncPipe(
            model, [2, 2], chunks=4, transport=transport, timeout=20, trace=directory,
            schedule=schedule, trace_every=2,
        )  # fmt: skip
        for _ in range(steps):
            pipe.step(torch.randn(8, 8), torch.randn(8, 8), nn.functional.mse_loss)
        pipe.close()

    values(run_threads(fn, 2))
