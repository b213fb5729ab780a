"""Shared weights: tied copies on different stages get the tied gradient and stay equal."""

from __future__ import annotations

import functools

import pytest
import torch
from cut_models import TiedLM
from cut_workers import lazy_tied, tied
from models import reference
from spawn import run_ranks
from threads import run_threads, values
from torch import nn

from asyncpipe import AsyncPipe, LazyModule, StageFailure, sequentialize


@pytest.mark.slow
def test_tied_embedding_and_head_stay_equal_over_many_steps() -> None:
    results = run_ranks(tied, 2, 30, timeout=120)
    for rank, result in enumerate(results):
        assert result["grad"] < 1e-6, (rank, result["grad"])  # the tied model's gradient
        assert result["forward_grad"] < 1e-6, (rank, result["forward_grad"])
        assert result["others"] < 1e-6, (rank, result["others"])
        assert result["norm"] < 1e-5, (rank, result["norm"])  # the tied weight counted once
        assert result["plain"] < 1e-4, (rank, result["plain"])  # same training as the plain one
    assert torch.equal(results[0]["weight"], results[1]["weight"])


@pytest.mark.slow
def test_lazy_modules_tied_by_position_train_as_the_tied_plain_model() -> None:
    for rank, (loss, weight) in enumerate(run_ranks(lazy_tied, 2, 4, timeout=120)):
        assert loss < 1e-5 and weight < 1e-6, (rank, loss, weight)


def test_a_wrong_name_of_a_lazy_module_is_refused_by_its_owner_and_reaches_the_others() -> None:
    layers = [LazyModule(functools.partial(nn.Linear, 4, 4)) for _ in range(4)]

    def make(rank: int, transport: object) -> None:
        AsyncPipe(layers, [2, 2], transport=transport, shared_weights=[("0.weight", "3.nope")])  # type: ignore[arg-type]

    (status0, error0), (status1, error1) = run_threads(make, 2)
    assert status1 == "error" and "no layer has: ['3.nope']" in str(error1), error1
    assert status0 == "error" and isinstance(error0, StageFailure), error0
    assert "no layer has: ['3.nope']" in str(error0)


def _build(shared: object) -> list[tuple[str, object]]:
    model = TiedLM()
    seq = sequentialize(model, torch.randint(0, 11, (2, 4)))

    def make(rank: int, transport: object) -> None:
        AsyncPipe(seq, [2, 3], transport=transport, shared_weights=shared)  # type: ignore[arg-type]

    return run_threads(make, 2)


def test_an_unnamed_parameter_on_two_stages_is_refused_with_the_fix() -> None:
    status, error = _build(())[0]
    assert status == "error" and isinstance(error, ValueError)
    assert "used on: {'tok.weight': [0, 1]}" in str(error)
    assert "shared_weights=[('tok.weight',)]" in str(error)


def test_unknown_names_and_shapes_are_refused_at_once() -> None:
    status, error = _build([("tok.weight", "nope.weight"), ("norm.weight", "norm.bias", 3)])[0]
    assert status == "error" and isinstance(error, ValueError)
    assert "no layer has: ['nope.weight']" in str(error) and "(got ('norm.weight'" in str(error)


def test_shared_weights_across_stages_need_the_p2p_transport() -> None:
    status, error = _build([("tok.weight", "head.weight")])[0]
    assert status == "error" and "pass transport='p2p' or 'shm'" in str(error)


def test_a_named_object_counts_at_every_position() -> None:
    lin = nn.Linear(4, 4)
    model = nn.Sequential(lin, nn.Tanh(), nn.Linear(4, 4), nn.Linear(4, 4))
    model[3].weight = lin.weight  # also used on stage 1, where nobody named it

    def make(rank: int, transport: object) -> None:
        AsyncPipe(model, [3, 1], transport=transport, shared_weights=[("0.weight", "2.weight")])  # type: ignore[arg-type]

    status, error = run_threads(make, 2)[0]
    assert status == "error" and "stages [0, 1]" in str(error)


def test_tied_on_one_stage_keeps_the_plain_gradient() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    model = nn.Sequential(lin, nn.Tanh(), nn.Linear(4, 4), nn.Linear(4, 4))
    model[2].weight = lin.weight
    x, y = torch.randn(6, 4), torch.randn(6, 4)
    want_loss, grads = reference(model, x, y, 2, nn.functional.mse_loss)

    def run(rank: int, transport: object) -> float:
        pipe = AsyncPipe(
            model, [3, 1], chunks=2, transport=transport, shared_weights=[("0.weight", "2.weight")]
        )  # type: ignore[arg-type]
        return pipe.step(x, y, nn.functional.mse_loss)

    losses = values(run_threads(run, 2))
    assert abs(losses[0] - want_loss) < 1e-6
    for p, want in zip(model.parameters(), grads):
        assert torch.allclose(p.grad, want, atol=1e-6)
