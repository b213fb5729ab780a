"""Worker functions for the multi-process cut point, shared weight and balance tests."""

from __future__ import annotations

import copy
import functools
import time
from typing import Any

import torch
from cut_models import ManyCuts, MaskResidual, TiedLM, lm_loss
from models import reference
from torch import nn

from asyncpipe import AsyncPipe, LazyModule, StageFailure, sequentialize

mse = nn.functional.mse_loss


def _worst(pipe: AsyncPipe, model: nn.Module, want: list[torch.Tensor]) -> float:
    """Largest gradient error of this rank's parameters against the plain model's."""
    index = {id(p): n for n, p in enumerate(model.parameters())}
    worst = 0.0
    for p in pipe.parameters():
        got = p.grad if p.grad is not None else torch.zeros_like(p)
        worst = max(worst, float((got - want[index[id(p)]]).abs().max()))
    return worst


class Splat(nn.Module):
    """Calls the wrapped model with a tuple's items as positional arguments."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, value: Any) -> Any:
        return self.model(*value)


def cut_transparency(rank: int, world: int, schedule: str) -> Any:
    """Loss, output and gradient errors of cut models against the un-split model."""
    out: dict[str, Any] = {}
    torch.manual_seed(0)
    many = ManyCuts()
    x, y = torch.randn(12, 8), torch.randn(12, 8)
    seq = sequentialize(many, x[:3])
    balance = [8 // world] * world
    want_loss, grads = reference(many, x, y, 4, mse)
    pipe = AsyncPipe(seq, balance, chunks=4, schedule=schedule, timeout=30)
    loss = pipe.step(x if pipe.is_first_stage else None, y if pipe.is_last_stage else None, mse)
    out["many"] = (abs(loss - want_loss), _worst(pipe, many, grads))

    torch.manual_seed(1)
    model = MaskResidual()
    x, y = torch.randn(12, 8), torch.randn(12, 8)
    mask = torch.rand(12, 8) > 0.3
    seq = sequentialize(model, (x[:3], mask[:3]))
    balance = [2, 1, 1, 1] if world == 4 else [3, 2]
    want_loss, grads = reference(Splat(model), (x, mask), y, 3, mse)
    pipe = AsyncPipe(
        seq, balance, chunks=3, schedule=schedule, timeout=30, shared_weights=["scale"]
    )
    first, last = pipe.is_first_stage, pipe.is_last_stage
    loss = pipe.step((x, mask) if first else None, y if last else None, mse)
    out["mask"] = (abs(loss - want_loss), _worst(pipe, model, grads))
    with torch.no_grad():
        pipe.eval()
        got = pipe((x, mask) if first else None)
        if last:
            out["output"] = float((got - model(x, mask)).abs().max())
    return out


def tied(rank: int, world: int, steps: int) -> Any:
    """Tied embedding/head on two stages: gradients, then copies after many Adam steps."""
    torch.manual_seed(3)
    model = TiedLM()
    plain = copy.deepcopy(model)
    ids = torch.randint(0, 11, (8, 6))
    targets = torch.randint(0, 11, (8, 6))
    seq = sequentialize(model, ids[:2])
    pipe = AsyncPipe(
        seq, [2, 3], chunks=2, timeout=30, shared_weights=[("tok.weight", "head.weight")]
    )
    first, last = pipe.is_first_stage, pipe.is_last_stage
    pipe.step(ids if first else None, targets if last else None, lm_loss)
    _, grads = reference(plain, ids, targets, 2, lm_loss)
    tied_grad = dict(zip([n for n, _ in plain.named_parameters()], grads))["tok.weight"]
    mine = model.tok.weight.grad
    result: dict[str, Any] = {"grad": float((mine - tied_grad).abs().max())}
    want = dict(zip([n for n, _ in plain.named_parameters()], grads))
    result["others"] = max(
        float((p.grad - want[n]).abs().max())
        for n, p in model.named_parameters()
        if p.grad is not None
    )
    # the norm over every stage counts the tied weight once, as the plain model does
    plain_norm = float(torch.stack([g.norm() for g in grads]).norm())
    result["norm"] = abs(float(pipe.clip_grad_norm_(1e9)) - plain_norm)
    model.zero_grad()  # the fairscale-style forward and backward sum them too
    out = pipe(ids if first else None)
    if last:
        lm_loss(out, targets).backward()
    else:
        pipe.back_helper(out)
    result["forward_grad"] = float((model.tok.weight.grad - tied_grad).abs().max())
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    plain_opt = torch.optim.Adam(plain.parameters(), lr=0.05)
    for step in range(steps):
        optimizer.zero_grad()
        plain_opt.zero_grad()
        batch = torch.randint(0, 11, (8, 6), generator=torch.Generator().manual_seed(step))
        pipe.step(batch if first else None, batch.roll(1, 1) if last else None, lm_loss)
        reference_step(plain, batch, plain_opt)
        optimizer.step()
    result["weight"] = model.tok.weight.detach().clone()
    result["plain"] = float((model.tok.weight - plain.tok.weight).abs().max())
    return result


def _lm_part(position: int) -> nn.Module:
    """Layer ``position`` of a small language model (embedding, two linears, head), the
    same in every process: a LazyModule's factory."""
    torch.manual_seed(5)
    parts = [nn.Embedding(11, 8), nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 11, bias=False)]
    return parts[position]


def lazy_tied(rank: int, world: int, steps: int) -> Any:
    """A LazyModule list whose embedding (stage 0) and head (stage 1) are tied with
    shared_weights=[("0.weight", "3.weight")] (refused before: "no layer has" them), trained
    with SGD beside the plain model with the head's weight tied to the embedding's. Returns
    the largest loss difference and the tied weight's difference after the steps."""
    plain = nn.Sequential(*[_lm_part(n) for n in range(4)])
    plain[3].weight = plain[0].weight
    layers = [LazyModule(functools.partial(_lm_part, n)) for n in range(4)]
    pipe = AsyncPipe(
        layers, [2, 2], chunks=2, timeout=30, shared_weights=[("0.weight", "3.weight")]
    )
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.5)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.5)
    first, last = pipe.is_first_stage, pipe.is_last_stage
    worst = 0.0
    for step in range(steps):
        batch = torch.randint(0, 11, (8, 6), generator=torch.Generator().manual_seed(step))
        optimizer.zero_grad()
        plain_opt.zero_grad()
        loss = pipe.step(batch if first else None, batch.roll(1, 1) if last else None, lm_loss)
        with torch.no_grad():
            want = float(lm_loss(plain(batch), batch.roll(1, 1)))
        reference_step(plain, batch, plain_opt)
        optimizer.step()
        worst = max(worst, abs(loss - want))
    tied = pipe.layers[0 if first else 1].weight  # the embedding's, or the head's copy
    return worst, float((tied - plain[0].weight).abs().max())


def reference_step(model: nn.Module, batch: torch.Tensor, optimizer: Any) -> None:
    for ids, target in zip(batch.chunk(2), batch.roll(1, 1).chunk(2)):
        (lm_loss(model(ids), target) / 2).backward()
    optimizer.step()


def auto(rank: int, world: int) -> Any:
    """balance='auto' gives every rank the same balance, and training still matches."""
    torch.manual_seed(0)
    many = ManyCuts()
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    seq = sequentialize(many, x[:2])
    want_loss, grads = reference(many, x, y, 4, mse)
    pipe = AsyncPipe(seq, "auto", chunks=4, sample=x[:2], timeout=30)
    loss = pipe.step(x if pipe.is_first_stage else None, y if pipe.is_last_stage else None, mse)
    return pipe.balance, abs(loss - want_loss), _worst(pipe, many, grads)


def auto_refused(rank: int, world: int, who: int) -> Any:
    """balance='auto' where rank ``who`` passes no sample, then a good balance='auto' pipeline
    in the same processes. Returns (error type, text, the error's rank or -1, the good step's
    loss minus the plain model's)."""
    torch.manual_seed(0)
    many = ManyCuts()
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    seq = sequentialize(many, x[:2])
    want_loss, _ = reference(many, x, y, 4, mse)
    seen: tuple[str, str, int] = ("no error", "", -1)
    try:
        AsyncPipe(seq, "auto", chunks=4, sample=None if rank == who else x[:2], timeout=60)
    except StageFailure as e:
        seen = ("StageFailure", str(e), e.rank)
    except Exception as e:
        seen = (type(e).__name__, str(e), -1)
    pipe = AsyncPipe(seq, "auto", chunks=4, sample=x[:2], timeout=60)
    loss = pipe.step(x if pipe.is_first_stage else None, y if pipe.is_last_stage else None, mse)
    return (*seen, abs(loss - want_loss))


def auto_alone(rank: int, world: int) -> Any:
    """balance='auto' on rank 0 only (rank 1 builds no pipeline): rank 0's error."""
    if rank != 0:
        time.sleep(8)  # alive past rank 0's timeout
        return None
    seq = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    try:
        AsyncPipe(seq, "auto", sample=torch.randn(2, 4), timeout=2)
    except Exception as e:
        return type(e).__name__, str(e)
    return "no error", ""


class _Refuses(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("this layer takes no input: naïve")


def auto_profile_fails(rank: int, world: int) -> Any:
    """balance='auto' whose profiling on rank 0 fails: every rank's error."""
    seq = nn.Sequential(nn.Linear(4, 4), _Refuses())
    try:
        AsyncPipe(seq, "auto", sample=torch.randn(2, 4), timeout=30)
    except Exception as e:
        return type(e).__name__, str(e)
    return "no error", ""


def auto_replicas(rank: int, world: int) -> Any:
    """balance='auto' with data-parallel replicas: one entry per pipeline rank, not per
    process; every replica gets the same batch, so averaged gradients equal the plain ones."""
    torch.manual_seed(0)
    many = ManyCuts()
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    seq = sequentialize(many, x[:2])
    want_loss, grads = reference(many, x, y, 4, mse)
    pipe = AsyncPipe(seq, "auto", chunks=4, sample=x[:2], data_parallel_size=2, timeout=30)
    loss = pipe.step(x if pipe.is_first_stage else None, y if pipe.is_last_stage else None, mse)
    return pipe.balance, abs(loss - want_loss), _worst(pipe, many, grads)
