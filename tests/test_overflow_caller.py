"""float16 overflow and the caller's own layers before the pipeline (``step(embed(x), ...)``)."""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
from threads import run_threads, values
from torch import Tensor, nn

from asyncpipe import AsyncPipe
from asyncpipe.transport import Transport

mse = nn.functional.mse_loss


class _InfGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, poison: bool) -> Tensor:
        ctx.poison = poison
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return (grad * math.inf if ctx.poison else grad), None


class Blow(nn.Module):
    """Identity whose input gradient becomes inf on demand (an injected overflow)."""

    def __init__(self) -> None:
        super().__init__()
        self.poison = False

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = _InfGrad.apply(x, self.poison)  # type: ignore[no-untyped-call]
        return out


def _job(first: bool) -> tuple[Blow, nn.Linear, nn.Sequential, Tensor, Tensor]:
    """The caller's layer ``embed``, a model with a :class:`Blow` (first in stage 0 if
    ``first``, else first in stage 1 of balance [3, 2]) and a batch."""
    torch.manual_seed(9)
    blow = Blow()
    embed = nn.Linear(8, 8)
    a, b = nn.Linear(8, 8), nn.Linear(8, 8)
    layers = [blow, a, nn.Tanh(), b, nn.Tanh()] if first else [a, nn.Tanh(), blow, b, nn.Tanh()]
    return blow, embed, nn.Sequential(*layers), torch.randn(8, 8), torch.randn(8, 8)


def _train(
    blow: Blow, embed: nn.Linear, model: nn.Sequential, x: Tensor, y: Tensor, poisons: list[bool]
) -> list[Any]:
    """Train ``embed`` (stage 0's caller layer) and the pipeline, one step per poison flag;
    per rank and step: (overflow, scale, embed's gradient or None, embed's weight after)."""

    def run(rank: int, transport: Transport) -> list[Any]:
        pipe = AsyncPipe(
            model, [3, 2], transport=transport, timeout=10, chunks=2, autocast=torch.float16
        )
        own = list(embed.parameters()) if pipe.is_first_stage else []
        optimizer = torch.optim.SGD(list(pipe.parameters()) + own, lr=0.1)
        out = []
        for poison in poisons:
            blow.poison = poison  # the same flag on every rank
            optimizer.zero_grad()
            pipe.step(embed(x) if pipe.is_first_stage else None, y, mse)
            grad = embed.weight.grad
            grad = None if grad is None or not pipe.is_first_stage else grad.clone()
            optimizer.step()
            assert pipe.scaler is not None
            out.append((pipe.overflow, pipe.scaler.scale, grad, embed.weight.detach().clone()))
        return out

    return values(run_threads(run, 2))


def test_an_overflow_on_a_later_stage_leaves_the_callers_layers_untouched() -> None:
    # embed.weight.grad was inf after the step and optimizer.step() made its weight inf
    blow, embed, model, x, y = _job(first=False)
    before = embed.weight.detach().clone()
    for rank, steps in enumerate(_train(blow, embed, model, x, y, [True])):
        [(overflow, scale, grad, weight)] = steps
        assert overflow and scale == 2.0**15, rank
        assert grad is None, rank  # no gradient from an overflowed step, as GradScaler skips
        assert torch.equal(weight, before), rank


def test_the_callers_layers_train_like_the_plain_model_with_grad_scaler() -> None:
    # an overflowed step corrupted embed, so the clean steps after it trained on inf/NaN
    blow, embed, model, x, y = _job(first=False)
    plain_embed, plain, plain_blow = copy.deepcopy(embed), copy.deepcopy(model), Blow()
    plain[2] = plain_blow
    params = list(plain_embed.parameters()) + list(plain.parameters())
    optimizer = torch.optim.SGD(params, lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    poisons = [False, True, False]
    want = []
    for poison in poisons:
        plain_blow.poison = poison
        optimizer.zero_grad()
        hidden = plain_embed(x)
        loss = torch.zeros(())
        for px, py in zip(hidden.chunk(2), y.chunk(2)):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = loss + mse(plain(px), py) / 2
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        grad = None if plain_embed.weight.grad is None else plain_embed.weight.grad.clone()
        skipped = not all(torch.isfinite(p.grad).all() for p in params if p.grad is not None)
        scaler.step(optimizer)
        scaler.update()
        want.append((skipped, scaler.get_scale(), grad, plain_embed.weight.detach().clone()))

    steps = _train(blow, embed, model, x, y, poisons)[0]  # stage 0's rank holds embed
    for n, ((overflow, scale, grad, weight), (skipped, s, g, w)) in enumerate(zip(steps, want)):
        assert (overflow, scale) == (skipped, s), n
        if overflow:
            assert grad is None and torch.equal(weight, steps[n - 1][3]), n
        else:
            assert grad is not None and g is not None, n
            torch.testing.assert_close(grad, g, atol=1e-3, rtol=1e-2)
        torch.testing.assert_close(weight, w, atol=1e-4, rtol=1e-3)
    for got, expected in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(got.detach(), expected.detach(), atol=1e-4, rtol=1e-3)


def test_an_overflow_only_in_the_callers_input_gradient_is_detected_on_every_rank() -> None:
    # settle checked only the pipeline's parameters: no overflow, and embed got inf gradients
    blow, embed, model, x, y = _job(first=True)
    before = embed.weight.detach().clone()
    for rank, steps in enumerate(_train(blow, embed, model, x, y, [True, False])):
        (o1, s1, g1, w1), (o2, s2, g2, w2) = steps
        assert o1 and s1 == 2.0**15, rank
        assert not o2 and s2 == 2.0**15, rank
        if rank == 0:
            assert g1 is None and torch.equal(w1, before)
            assert g2 is not None and torch.isfinite(g2).all() and torch.isfinite(w2).all()
