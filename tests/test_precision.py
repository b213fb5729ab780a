"""Mixed precision and gradient clipping across stages, over the in-process transport."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
from models import grads_of, mlp, reference
from threads import run_threads, values
from torch import nn

from asyncpipe import AsyncPipe
from asyncpipe.transport import Transport

mse = nn.functional.mse_loss


def _pipes(model: nn.Module, balance: list[int], fn: Any, **kwargs: Any) -> list[Any]:
    def run(rank: int, transport: Transport) -> Any:
        pipe = AsyncPipe(model, balance, transport=transport, timeout=10, **kwargs)
        return fn(pipe)

    return values(run_threads(run, len(balance)))


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
@pytest.mark.parametrize("schedule,balance", [("gpipe", [2, 2]), ("1f1b", [1, 2, 1])])
def test_clip_grad_norm_equals_torch_on_the_plain_model(
    norm_type: float, schedule: str, balance: list[int]
) -> None:
    model = mlp(4, seed=3)
    torch.manual_seed(4)
    x, y = torch.randn(8, 8) * 10, torch.randn(8, 8)
    plain = copy.deepcopy(model)
    for px, py in zip(x.chunk(4), y.chunk(4)):
        (mse(plain(px), py) / 4).backward()
    want_norm = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.05, norm_type)
    assert want_norm > 0.05  # the clip bites

    def fn(pipe: AsyncPipe) -> float:
        pipe.step(x, y, mse)
        return float(pipe.clip_grad_norm_(0.05, norm_type))

    norms = _pipes(model, balance, fn, chunks=4, schedule=schedule)
    assert all(n == pytest.approx(float(want_norm), rel=1e-5) for n in norms)
    for got, want in zip(grads_of(list(model.parameters())), grads_of(list(plain.parameters()))):
        torch.testing.assert_close(got, want)


def _error(model: nn.Module, fn: Any, **kwargs: Any) -> BaseException:
    def run(rank: int, transport: Transport) -> Any:
        return fn(AsyncPipe(model, [2], transport=transport, timeout=10, **kwargs))

    [(status, error)] = run_threads(run, 1)
    assert status == "error"
    return error


def test_clip_grad_norm_rejects_bad_max_norm() -> None:
    error = _error(mlp(2), lambda pipe: pipe.clip_grad_norm_(0))
    assert isinstance(error, ValueError)
    assert "max_norm must be a positive number (got 0)" in str(error)
    for norm_type in (0, -1, float("nan")):  # 0 was a ZeroDivisionError from the total norm
        error = _error(mlp(2), lambda pipe, kind=norm_type: pipe.clip_grad_norm_(1.0, kind))
        assert isinstance(error, ValueError) and "norm_type must be a positive" in str(error)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zero_bubble"])
def test_reduced_precision_gradients_are_close_to_float32(
    dtype: torch.dtype, schedule: str
) -> None:
    model = mlp(4, seed=5)
    torch.manual_seed(6)
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    want_loss, want_grads = reference(model, x, y, 4, mse)

    def fn(pipe: AsyncPipe) -> tuple[float, bool, float]:
        loss = pipe.step(x, y, mse)
        return loss, pipe.overflow, pipe.scaler.scale if pipe.scaler else 0.0

    results = _pipes(model, [2, 2], fn, chunks=4, schedule=schedule, autocast=dtype)
    for loss, overflow, scale in results:
        assert not overflow
        assert loss == pytest.approx(want_loss, rel=0.05)
        assert scale == (2.0**16 if dtype is torch.float16 else 0.0)
    for got, want in zip(grads_of(list(model.parameters())), want_grads):
        torch.testing.assert_close(got, want, atol=0.02, rtol=0.05)
        assert got.dtype == torch.float32  # master weights and their gradients stay float32


def test_reduced_precision_trains_like_float32() -> None:
    torch.manual_seed(7)
    x = torch.randn(32, 8)
    y = torch.tanh(x @ torch.randn(8, 8))

    def train(pipe: AsyncPipe) -> list[float]:
        optimizer = torch.optim.SGD(pipe.parameters(), lr=0.5)
        losses = []
        for _ in range(30):
            optimizer.zero_grad()
            losses.append(pipe.step(x, y, mse))
            optimizer.step()
        return losses

    curves = {}
    for dtype in (None, torch.bfloat16, torch.float16):
        curves[dtype] = _pipes(mlp(4, seed=8), [2, 2], train, chunks=4, autocast=dtype)[0]
    assert curves[None][-1] < 0.6 * curves[None][0]
    for dtype in (torch.bfloat16, torch.float16):
        assert curves[dtype][-1] == pytest.approx(curves[None][-1], rel=0.1, abs=0.01)


class Poisoned(nn.Linear):
    """A linear layer whose weight gradient becomes inf on demand (an injected overflow)."""

    def __init__(self) -> None:
        super().__init__(8, 8)
        self.poison = False
        self.weight.register_hook(lambda g: g * math.inf if self.poison else g)


def poisoned_job() -> tuple[Poisoned, nn.Sequential, torch.Tensor, torch.Tensor]:
    """A model whose first layer can overflow on demand, and a batch for it."""
    torch.manual_seed(9)
    poisoned = Poisoned()
    model = nn.Sequential(poisoned, nn.Tanh(), nn.Linear(8, 8), nn.Tanh())
    return poisoned, model, torch.randn(8, 8), torch.randn(8, 8)


def test_an_overflow_on_one_stage_skips_the_step_on_every_stage() -> None:
    poisoned, model, x, y = poisoned_job()

    def fn(pipe: AsyncPipe) -> list[Any]:
        out = []
        for poison in (False, True, False):
            if pipe.stage == 0:
                poisoned.poison = poison
            pipe.zero_grad()
            pipe.step(x, y, mse)
            assert pipe.scaler is not None
            grads = [p.grad is not None for p in pipe.parameters()]
            out.append((pipe.overflow, pipe.scaler.scale, grads))
        return out

    for rank, steps in enumerate(_pipes(model, [2, 2], fn, chunks=2, autocast=torch.float16)):
        (o1, s1, g1), (o2, s2, g2), (o3, s3, g3) = steps
        assert (o1, o2, o3) == (False, True, False), rank
        assert s2 == s1 / 2 and s3 == s2, rank  # backed off once, then kept
        assert all(g1) and not any(g2) and all(g3), rank  # the overflowed step has no grads


def test_an_overflowed_step_with_an_optimizer_clips_and_applies_nothing() -> None:
    poisoned, model, x, y = poisoned_job()

    def fn(pipe: AsyncPipe) -> list[Any]:
        optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
        out = []
        for poison in (False, True):
            if pipe.stage == 0:
                poisoned.poison = poison
            before = [p.detach().clone() for p in pipe.parameters()]
            pipe.step(x, y, mse, optimizer=optimizer, max_norm=1.0)
            moved = any(not torch.equal(b, p) for b, p in zip(before, pipe.parameters()))
            out.append((pipe.overflow, pipe.grad_norm, moved))
        return out

    for rank, steps in enumerate(_pipes(model, [2, 2], fn, chunks=2, autocast=torch.float16)):
        (o1, n1, m1), (o2, n2, m2) = steps
        assert (o1, o2) == (False, True) and m1 and not m2, (rank, steps)
        assert n1 > 0 and math.isnan(n2), (rank, steps)  # was 0.0: no gradient is not norm 0


def test_clipping_after_an_overflowed_step_gives_nan_until_a_pass_computes_gradients() -> None:
    """clip_grad_norm_ after a float16 step that overflowed returned 0.0 (the dropped
    gradients), where torch's clip after GradScaler's unscale gives a norm that is not finite;
    pipe.grad_norm already said NaN. A pipe(x) pass after it computes gradients again."""
    poisoned, model, x, y = poisoned_job()

    def fn(pipe: AsyncPipe) -> list[Any]:
        if pipe.stage == 0:
            poisoned.poison = True
        pipe.step(x, y, mse)
        poisoned.poison = False
        dropped = (pipe.overflow, float(pipe.clip_grad_norm_(1e9)))
        out = pipe(x)
        if pipe.is_last_stage:
            mse(out, y).backward()
        else:
            pipe.back_helper(out)
        return [dropped, (pipe.overflow, float(pipe.clip_grad_norm_(1e9)))]

    for rank, steps in enumerate(_pipes(model, [2, 2], fn, chunks=2, autocast=torch.float16)):
        (o1, n1), (o2, n2) = steps
        assert o1 and math.isnan(n1), (rank, steps)
        assert not o2 and math.isfinite(n2) and n2 > 0, (rank, steps)


def test_autocast_must_be_a_reduced_float_type() -> None:
    error = _error(mlp(2), lambda pipe: None, autocast=torch.float64)
    assert isinstance(error, ValueError)
    assert "autocast must be None, torch.bfloat16 or torch.float16" in str(error)


@pytest.mark.parametrize("schedule", ["1f1b", "zero_bubble"])
def test_activations_can_cross_stages_in_the_reduced_dtype(schedule: str) -> None:
    from asyncpipe.runtime import STATUS_CHANNEL
    from asyncpipe.transport import InProcessHub, Message

    model = mlp(4, seed=10)
    torch.manual_seed(11)
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    want_loss, want_grads = reference(model, x, y, 4, mse)
    hub = InProcessHub(2)
    sent: list[tuple[int, int, torch.dtype]] = []

    def fn(rank: int, transport: Transport) -> float:
        transport = hub.transport(rank)
        real = transport.send

        def spy(dst: int, channel: int, message: Message) -> None:
            sent.extend((rank, channel, t.dtype) for t in message.tensors if t is not None)
            real(dst, channel, message)

        transport.send = spy  # type: ignore[method-assign]
        pipe = AsyncPipe(
            model, [2, 2], chunks=4, schedule=schedule, transport=transport, timeout=10,
            autocast=torch.bfloat16, reduce_activations=True,
        )  # fmt: skip
        return pipe.step(x, y, mse)

    losses = values(run_threads(fn, 2))
    assert all(loss == pytest.approx(want_loss, rel=0.05) for loss in losses)
    for got, want in zip(grads_of(list(model.parameters())), want_grads):
        torch.testing.assert_close(got, want, atol=0.02, rtol=0.05)
    activations = [dtype for rank, channel, dtype in sent if rank == 0 and channel < STATUS_CHANNEL]
    assert activations and set(activations) == {torch.bfloat16}  # half the bytes of float32


def test_reduce_activations_needs_autocast() -> None:
    error = _error(mlp(2), lambda pipe: None, reduce_activations=True)
    assert isinstance(error, ValueError) and "pass autocast=torch.bfloat16" in str(error)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reduced_precision_with_interleaved_and_clipping(dtype: torch.dtype) -> None:
    model = mlp(4, seed=12)
    torch.manual_seed(13)
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    want_loss, want_grads = reference(model, x, y, 4, mse)
    plain = [g.clone() for g in want_grads]
    want_norm = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in plain])))

    def fn(rank: int, transport: Transport) -> tuple[float, float]:
        pipe = AsyncPipe(
            model, [1, 1, 1, 1], chunks=4, schedule="interleaved", virtual_stages=2,
            transport=transport, timeout=10, autocast=dtype,
        )  # fmt: skip
        loss = pipe.step(x, y, mse)
        return loss, float(pipe.clip_grad_norm_(1e9))  # a bound that does not clip

    for loss, norm in values(run_threads(fn, 2)):
        assert loss == pytest.approx(want_loss, rel=0.05)
        assert norm == pytest.approx(want_norm, rel=0.05)
    for got, want in zip(grads_of(list(model.parameters())), want_grads):
        torch.testing.assert_close(got, want, atol=0.02, rtol=0.05)


@pytest.mark.parametrize("schedule", ["1f1b", "zero_bubble"])
def test_float16_gives_the_input_its_unscaled_gradient(schedule: str) -> None:
    # the input's gradient was left multiplied by the loss scale (2**16)
    model = mlp(4, seed=5)
    torch.manual_seed(6)
    x, y = torch.randn(8, 8, requires_grad=True), torch.randn(8, 8)
    plain_x = x.detach().clone().requires_grad_(True)
    plain = copy.deepcopy(model)
    for px, py in zip(plain_x.chunk(4), y.chunk(4)):
        (mse(plain(px), py) / 4).backward()

    def fn(pipe: AsyncPipe) -> bool:
        pipe.step(x, y, mse)
        return pipe.overflow

    overflows = _pipes(model, [2, 2], fn, chunks=4, schedule=schedule, autocast=torch.float16)
    assert overflows == [False, False]
    assert x.grad is not None and plain_x.grad is not None
    torch.testing.assert_close(x.grad, plain_x.grad, atol=0.02, rtol=0.05)
