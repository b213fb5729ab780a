"""Worker functions for the data-parallel x pipeline tests (run in spawned processes)."""

from __future__ import annotations

import copy
from typing import Any

import torch
from models import mlp
from torch import nn

from asyncpipe import AsyncPipe

mse = nn.functional.mse_loss


def two_by_two(rank: int, world: int, schedule: str, transport: str) -> dict[str, Any]:
    """2 stages x 2 replicas: each replica steps on its half of the batch; the averaged
    gradients, clipped over all stages, must equal the plain model's on the whole batch."""
    if transport == "rpc":
        import asyncpipe

        asyncpipe.init(rpc=True)
    model = mlp(4, seed=31)
    torch.manual_seed(32)
    x, y = torch.randn(16, 8), torch.randn(16, 8)
    chunks = 4
    plain = copy.deepcopy(model)
    for px, py in zip(x.chunk(2 * chunks), y.chunk(2 * chunks)):
        (mse(plain(px), py) / (2 * chunks)).backward()
    want_norm = float(torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.1))
    virtual = 2 if schedule == "interleaved" else 1
    pipe = AsyncPipe(
        model,
        [1] * 4 if virtual == 2 else [2, 2],
        chunks=chunks,
        schedule=schedule,
        virtual_stages=virtual,
        data_parallel_size=2,
        transport=transport,
        timeout=30,
    )
    half = slice(8 * pipe.data_parallel_rank, 8 * pipe.data_parallel_rank + 8)
    pipe.step(
        x[half] if pipe.is_first_stage else None, y[half] if pipe.is_last_stage else None, mse
    )
    norm = float(pipe.clip_grad_norm_(0.1))
    ids = {id(p): n for n, p in enumerate(model.parameters())}
    want = [p.grad for p in plain.parameters()]
    error = max(float((p.grad - want[ids[id(p)]]).abs().max()) for p in pipe.parameters())
    averager = pipe._averager
    assert averager is not None
    backend = averager._group()._get_backend(torch.device("cpu"))
    out = {
        "stage": pipe.stage,
        "replica": pipe.data_parallel_rank,
        "size": pipe.data_parallel_size,
        "grad_error": error,
        "norm_error": abs(norm - want_norm),
        "group_timeout": backend.options._timeout.total_seconds(),
    }
    if transport == "rpc":
        import asyncpipe

        asyncpipe.shutdown()
    return out


def bf16_replicas(rank: int, world: int) -> list[float]:
    """2 x 2 training in bfloat16: the loss curve of each rank."""
    model = mlp(4, seed=33)
    torch.manual_seed(34)
    x = torch.randn(32, 8)
    y = torch.tanh(x @ torch.randn(8, 8))
    pipe = AsyncPipe(
        model, [2, 2], chunks=4, data_parallel_size=2, autocast=torch.bfloat16, timeout=30
    )
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.5)
    half = slice(16 * pipe.data_parallel_rank, 16 * pipe.data_parallel_rank + 16)
    losses = []
    for _ in range(40):
        optimizer.zero_grad()
        losses.append(pipe.step(x[half], y[half], mse))
        optimizer.step()
    return losses


def groups_released(rank: int, world: int) -> Any:
    """Two pipelines of two stages (data parallelism) take a step; then the process groups are
    destroyed with the pipe still alive: none of them may outlive that (a group kept alive ran
    its threads into the interpreter's exit, which could abort the process), and a step after
    it is a clear error."""
    import gc
    import weakref

    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.ReLU())
    pipe = AsyncPipe(model, [2, 2], chunks=2, data_parallel_size=2, timeout=30)
    x, y = torch.randn(4, 4), torch.randn(4, 4)

    def step() -> None:
        pipe.step(x if pipe.is_first_stage else None, y if pipe.is_last_stage else None, mse)

    step()
    groups = [weakref.ref(g) for g in distributed_c10d._world.pg_map]
    dist.destroy_process_group()
    gc.collect()
    alive = sum(ref() is not None for ref in groups)
    try:
        step()
        after = ""
    except RuntimeError as e:
        after = str(e)
    return {"groups": len(groups), "alive": alive, "after": after}


def saved_replicas(rank: int, world: int, directory: str) -> dict[str, Any]:
    """2 stages x 2 replicas save three times into one directory on every rank, as
    ``checkpoint.save`` asks; then a one-replica pipeline of the same ranks' layout loads it."""
    from asyncpipe import checkpoint

    model = mlp(4, seed=35)
    torch.manual_seed(36)
    x, y = torch.randn(16, 8), torch.randn(16, 8)
    pipe = AsyncPipe(model, [2, 2], chunks=2, data_parallel_size=2, timeout=30)
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    half = slice(8 * pipe.data_parallel_rank, 8 * pipe.data_parallel_rank + 8)
    outcomes = []
    for step in range(1, 4):
        pipe.step(x[half], y[half], mse, optimizer=optimizer)
        try:
            checkpoint.save(pipe, optimizer, directory, step=step)
            outcomes.append("saved")
        except Exception as e:
            outcomes.append(f"{type(e).__name__}: {e}")
    state = {k: v.clone() for k, v in pipe.state_dict().items()}
    fresh = AsyncPipe(mlp(4, seed=99), [2, 2], chunks=2, data_parallel_size=2, timeout=30)
    step = checkpoint.load(fresh, None, directory).step
    error = max(float((fresh.state_dict()[k] - v).abs().max()) for k, v in state.items())
    return {"outcomes": outcomes, "step": step, "error": error}


def replica_fails(rank: int, world: int, mode: str) -> tuple[str, str, int]:
    """2 stages x 2 replicas where replica 1's input is too narrow, so its stage 0 fails in
    the forward: in ``step()`` (``mode="step"``) or in ``pipe(x)`` (``"manual"``, fairscale's
    style, with ``back_helper``); ``"absent"``: replica 1 builds the pipeline but takes no
    step. The failed replica's ranks stay alive a while after their error (as a script that
    catches it would), so that the others cannot learn it from closed connections. Returns
    (error type, text, the error's stage) per rank."""
    import time

    timeout = 2 if mode == "absent" else 20
    pipe = AsyncPipe(mlp(4, seed=31), [2, 2], chunks=2, data_parallel_size=2, timeout=timeout)
    torch.manual_seed(pipe.data_parallel_rank)
    x = torch.randn(8, 8 if pipe.data_parallel_rank == 0 else 5)
    y = torch.randn(8, 8)
    seen: tuple[str, str, int] = ("no error", "", -1)
    try:
        if mode == "absent" and pipe.data_parallel_rank == 1:
            pass
        elif mode in ("step", "absent"):
            pipe.step(x if pipe.is_first_stage else None, y if pipe.is_last_stage else None, mse)
        else:
            out = pipe(x if pipe.is_first_stage else None)
            if pipe.is_last_stage:
                mse(out, y).backward()
            else:
                pipe.back_helper(out)
    except Exception as e:
        seen = (type(e).__name__, str(e), getattr(e, "stage", -1))
    if pipe.data_parallel_rank == 1:
        time.sleep(8 if mode == "absent" else 6)
    return seen


def replica_stops(rank: int, world: int) -> bool:
    """2 stages x 2 replicas where only rank 3 (replica 1) asks to stop: every rank agrees."""
    pipe = AsyncPipe(mlp(4, seed=31), [2, 2], chunks=2, data_parallel_size=2, timeout=20)
    if rank == 3:
        pipe.request_stop()
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    pipe.step(x if pipe.is_first_stage else None, y if pipe.is_last_stage else None, mse)
    return pipe.stop_agreed


def replicas_differ(rank: int, world: int) -> Any:
    """Rank 1 alone asks for two replicas (and a balance for one pipeline rank each): every
    rank is told at once, naming each rank's data_parallel_size. Before, rank 1 waited in the
    creation of the replicas' groups and the other for its messages, each until a timeout."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    replicas, balance = (2, [2]) if rank == 1 else (1, [1, 1])
    try:
        AsyncPipe(model, balance, data_parallel_size=replicas, timeout=60)
    except ValueError as e:
        return "ValueError", str(e)
    return "no error", ""


def replica_arguments_differ(rank: int, world: int) -> Any:
    """Replica 1 (ranks 2, 3) builds with another loss_scale: every rank is told in the
    constructor. Before, nothing compared arguments across replicas: the replicas averaged
    gradients scaled by different factors and drifted apart (another balance or autocast made
    gloo abort the processes)."""
    model = mlp(4, seed=31)
    scale = 2.0**16 if rank < 2 else 2.0**8
    try:
        AsyncPipe(
            model, [2, 2], data_parallel_size=2, autocast=torch.float16, loss_scale=scale,
            timeout=30,
        )  # fmt: skip
    except ValueError as e:
        return "ValueError", str(e)
    return "no error", ""


class _Spare(nn.Module):
    """A Linear and a spare one the forward never uses."""

    def __init__(self) -> None:
        super().__init__()
        self.used, self.spare = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.used(x))


def unused_parameters(rank: int, world: int) -> Any:
    """2 stages x 2 replicas with parameters no forward uses, and AdamW's weight decay: they
    must keep no gradient and not move, as in the plain model. Before, the averaging gave
    them zero gradients, which the weight decay then applied."""
    torch.manual_seed(0)
    model = nn.Sequential(_Spare(), _Spare(), _Spare(), _Spare())
    spares = [layer.spare.weight.detach().clone() for layer in model]
    pipe = AsyncPipe(model, [2, 2], chunks=2, data_parallel_size=2, timeout=30)
    opt = torch.optim.AdamW(pipe.parameters(), lr=0.1, weight_decay=0.5)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    pipe.step(x if pipe.is_first_stage else None, y if pipe.is_last_stage else None, mse)
    mine = [
        n
        for n, layer in enumerate(model)
        if any(p is layer.spare.weight for p in pipe.parameters())
    ]
    grads = [model[n].spare.weight.grad for n in mine]
    used = [model[n].used.weight.grad is not None for n in mine]
    opt.step()
    moved = [float((model[n].spare.weight - spares[n]).abs().max()) for n in mine]
    return [g is None for g in grads], used, moved
