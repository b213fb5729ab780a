"""Gradient norms over stages against ``torch.nn.utils.clip_grad_norm_``: complex gradients and
NaN, in pure unit tests of the norm parts and over the in-process transport."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
from threads import run_threads, values
from torch import Tensor, nn

from asyncpipe import AsyncPipe
from asyncpipe.precision import partial_norm, total_norm
from asyncpipe.transport import Transport

mse = nn.functional.mse_loss
nan = float("nan")


class ComplexLinear(nn.Module):
    """``x @ w`` with a complex ``w`` (a real ``x`` is made complex first)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8, dtype=torch.cfloat) * 0.3)

    def forward(self, x: Tensor) -> Tensor:
        return (x if x.is_complex() else x.to(torch.cfloat)) @ self.w


class Abs(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x.abs()


def complex_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(ComplexLinear(), ComplexLinear(), ComplexLinear(), Abs())


def real_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh())


def data() -> tuple[Tensor, Tensor]:
    torch.manual_seed(1)
    return torch.randn(8, 8), torch.randn(8, 8)


def plain_grads(model: nn.Sequential, x: Tensor, y: Tensor, chunks: int) -> nn.Sequential:
    """A copy of ``model`` holding the gradients the pipeline computes."""
    plain = copy.deepcopy(model)
    for px, py in zip(x.chunk(chunks), y.chunk(chunks)):
        (mse(plain(px), py) / chunks).backward()
    return plain


def clip_on_pipes(model: nn.Sequential, balance: list[int], fn: Any, chunks: int) -> list[float]:
    def run(rank: int, transport: Transport) -> float:
        pipe = AsyncPipe(model, balance, chunks=chunks, transport=transport, timeout=10)
        return float(fn(pipe))

    return values(run_threads(run, len(balance)))


def assert_grads_equal(model: nn.Module, plain: nn.Module) -> None:
    for got, want in zip(model.parameters(), plain.parameters()):
        assert got.grad is not None and want.grad is not None
        torch.testing.assert_close(got.grad, want.grad, equal_nan=True)


# Each test loops over the cases torch's clip_grad_norm_ accepts and asyncpipe takes (positive
# norm types and math.inf), so that each fails on the defect it names; the cases that were right
# (the infinity norm of complex gradients, a NaN in the 2-norm, inf gradients) ride along.
NORM_TYPES = [1.0, 2.0, 3.0, 0.5, math.inf]


# --- the parts of the norm, one rank's and over every rank -----------------------------------


def test_partial_norm_counts_the_imaginary_part() -> None:
    """``g.double()`` dropped the imaginary part of a complex gradient (only the infinity norm,
    which took ``abs()`` first, was right)."""
    torch.manual_seed(2)
    grads: list[Tensor | None] = [
        torch.randn(4, 5, dtype=torch.cfloat),
        None,
        torch.randn(3, dtype=torch.cdouble),
    ]
    for norm_type in NORM_TYPES:
        want = torch.nn.utils.get_total_norm([g for g in grads if g is not None], norm_type)
        parts = [partial_norm(grads, norm_type), partial_norm([None], norm_type)]
        got = total_norm(parts, norm_type)  # the second rank has no gradient
        assert got == pytest.approx(float(want), rel=1e-6), f"norm_type={norm_type}"


def test_partial_norm_is_nan_where_any_gradient_is() -> None:
    """Python's ``max()`` over the tensors' largest entries kept a NaN only when it came first
    (the infinity norm; the sums of the others kept it)."""
    for where in range(3):
        grads = [torch.ones(3), torch.full((2,), 5.0), torch.ones(4)]
        grads[where][0] = nan
        for norm_type in NORM_TYPES:
            assert math.isnan(float(torch.nn.utils.get_total_norm(grads, norm_type)))
            got = partial_norm(grads, norm_type)
            assert math.isnan(got), f"NaN in tensor {where}, norm_type={norm_type}: {got}"


def test_total_norm_is_nan_where_any_rank_part_is() -> None:
    """Python's ``max()`` over the ranks' parts kept a NaN only when rank 0 sent it."""
    for rank in range(3):
        parts = [1.0, 2.0, 0.0]
        parts[rank] = nan
        for norm_type in NORM_TYPES:
            got = total_norm(parts, norm_type)
            assert math.isnan(got), f"NaN from rank {rank}, norm_type={norm_type}: {got}"


# --- over stages, against torch on the plain model --------------------------------------------


@pytest.mark.parametrize("balance", [[2, 2], [3, 1]])  # [3, 1]: the last rank has no gradient
def test_clip_grad_norm_of_complex_gradients_equals_torch(balance: list[int]) -> None:
    x, y = data()
    for norm_type in NORM_TYPES:
        model = complex_model()
        plain = plain_grads(model, x, y, 4)
        want = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.01, norm_type)
        assert want > 0.01  # the clip bites

        def fn(pipe: AsyncPipe, norm_type: float = norm_type) -> Tensor:
            pipe.step(x, y, mse)
            return pipe.clip_grad_norm_(0.01, norm_type)

        norms = clip_on_pipes(model, balance, fn, 4)
        assert norms == [pytest.approx(float(want), rel=1e-5)] * len(balance), (
            f"norm_type={norm_type}"
        )
        assert_grads_equal(model, plain)


def test_clip_grad_norm_with_a_non_finite_gradient_on_a_later_stage_equals_torch() -> None:
    """A NaN in the second stage's second weight: the infinity norm was that of the finite
    gradients (torch's is NaN, and it makes every gradient NaN)."""
    x, y = data()
    for value in (nan, math.inf):
        for norm_type in (math.inf, 2.0):
            model = real_model()
            plain = plain_grads(model, x, y, 2)
            assert plain[2].weight.grad is not None
            plain[2].weight.grad[0, 0] = value
            want = torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0, norm_type)

            def fn(
                pipe: AsyncPipe,
                model: nn.Sequential = model,
                value: float = value,
                kind: float = norm_type,
            ) -> Tensor:
                pipe.step(x, y, mse)
                if pipe.stage == 1:
                    grad = model[2].weight.grad
                    assert grad is not None
                    grad[0, 0] = value
                return pipe.clip_grad_norm_(1.0, kind)

            norms = clip_on_pipes(model, [2, 2], fn, 2)
            case = f"gradient {value} on stage 1, norm_type={norm_type}"
            assert norms == [pytest.approx(float(want), nan_ok=True)] * 2, case
            assert_grads_equal(model, plain)


def test_two_bw_max_norm_of_complex_gradients_equals_torch() -> None:
    """2BW's norm exchange (``SpreadNorm``) sends the same parts: its ``grad_norm`` after the
    flush that applies mini-batch 0 is torch's norm of that gradient."""
    model = complex_model()
    x, y = data()
    want = torch.nn.utils.clip_grad_norm_(plain_grads(model, x, y, 4).parameters(), 0.01)

    def run(rank: int, transport: Transport) -> float:
        pipe = AsyncPipe(
            copy.deepcopy(model), [2, 2], chunks=4, schedule="2bw", transport=transport, timeout=10
        )
        optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
        pipe.step(x, y, mse, optimizer=optimizer, max_norm=0.01)
        pipe.flush()
        return pipe.grad_norm

    norms = values(run_threads(run, 2))
    assert norms == [pytest.approx(float(want), rel=1e-5)] * 2
