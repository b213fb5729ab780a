"""Property-based tests: random arguments and inputs thrown at the constructor and ``step``.

Each run must give the plain model's result or a clear error: a ValueError or TypeError for a
bad argument, or a StageFailure naming the stage for an error the model itself raised (the plain
model raises it too); never a hang, an internal assertion, or a message about internals.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from models import mlp
from threads import run_threads
from torch import nn

from asyncpipe import AsyncPipe, StageFailure
from asyncpipe.transport import InProcessHub, Transport

mse = nn.functional.mse_loss
SETTINGS = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
INTERNALS = ("AssertionError", "Traceback", "object at 0x", "work.", "self.", "Failed(", "KeyError")


def clear(error: BaseException) -> None:
    """The error is of an allowed type, with no internal assertion in its chain."""
    assert isinstance(error, (ValueError, TypeError, StageFailure)), repr(error)
    cause: BaseException | None = error
    while cause is not None:
        assert not isinstance(cause, AssertionError), repr(error)
        cause = cause.__cause__ or cause.__context__
    text = str(error)
    assert text and not any(word in text for word in INTERNALS), text


weird = st.one_of(
    st.integers(-3, 6),
    st.floats(-1, 4, allow_nan=False),
    st.booleans(),
    st.none(),
    st.text(max_size=3),
)


@SETTINGS
@given(
    balance=st.one_of(st.lists(weird, max_size=5), weird),
    chunks=weird,
    checkpoint=st.sampled_from(["always", "except_last", "never", "", "sometimes"]),
    schedule=st.sampled_from(["gpipe", "1f1b", "interleaved", "zero_bubble", "bogus"]),
    virtual=st.integers(0, 3),
    layers=st.integers(0, 6),
    world=st.integers(1, 4),
)
def test_constructor_builds_or_explains(
    balance: Any, chunks: Any, checkpoint: str, schedule: str, virtual: int, layers: int, world: int
) -> None:
    try:
        pipe = AsyncPipe(
            mlp(layers),
            balance,
            chunks=chunks,
            checkpoint=checkpoint,
            schedule=schedule,
            virtual_stages=virtual,
            transport=InProcessHub(world).transport(0),
        )
    except (ValueError, TypeError) as e:
        clear(e)
        return
    assert sum(balance) == layers and len(balance) == world * virtual
    assert len(pipe.layer_names) == layers


def balances(layers: int, world: int) -> st.SearchStrategy[list[int]]:
    """Every way to cut ``layers`` into ``world`` non-empty stages."""
    if world == 1:
        return st.just([layers])
    cuts = st.lists(st.integers(1, layers - 1), min_size=world - 1, max_size=world - 1, unique=True)
    return cuts.map(lambda c: [b - a for a, b in zip([0, *sorted(c)], [*sorted(c), layers])])


@st.composite
def batches(draw: st.DrawFn) -> dict[str, Any]:
    world = draw(st.integers(1, 3))
    layers = draw(st.integers(world, 4))
    rows = draw(st.integers(0, 9))
    dtype = draw(st.sampled_from([torch.float32, torch.float32, torch.float64, torch.int64]))
    x = (torch.arange(rows * 8).reshape(rows, 8) % 7).to(dtype)
    shapes = ["tensor", "tuple", "list", "pair", "nested", "dict", "none", "floats"]
    shape = draw(st.sampled_from(shapes))
    inputs: Any = {
        "tensor": x,
        "tuple": (x,),
        "list": [x],
        "pair": (x, x),
        "nested": ((x,), x),
        "dict": {"x": x},
        "none": None,
        "floats": x.tolist(),
    }[shape]
    target_rows = draw(st.sampled_from([rows, rows, rows + 1, max(rows - 1, 0), 1]))
    target: Any = torch.ones(target_rows, 8)
    if draw(st.booleans()) and draw(st.booleans()):
        target = draw(st.sampled_from([None, "y", (target, target), [1.0]]))
    return {
        "world": world,
        "layers": layers,
        "balance": draw(balances(layers, world)),
        "chunks": draw(st.integers(1, 5)),
        "policy": draw(st.sampled_from(["always", "except_last", "never"])),
        "schedule": draw(st.sampled_from(["gpipe", "1f1b"])),
        "input": inputs,
        "target": target,
    }


def plain_loss(model: nn.Module, case: dict[str, Any]) -> float | BaseException:
    """What the plain model gives for the case: its mean micro-batch loss, or its error."""
    x, y, chunks = case["input"], case["target"], case["chunks"]
    if isinstance(x, (tuple, list)) and len(x) == 1 and isinstance(x[0], torch.Tensor):
        x = x[0]  # a tuple of one tensor reaches the first layer as that tensor
    try:
        if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
            raise TypeError("input and target must be tensors here")
        if x.shape[0] != y.shape[0] or x.shape[0] == 0:
            raise ValueError("input and target must have the same, non-zero batch size")
        pieces = list(zip(x.chunk(chunks), y.chunk(chunks)))
        with torch.no_grad():
            return sum(float(mse(model(a), b)) for a, b in pieces) / len(pieces)
    except Exception as e:
        return e


@SETTINGS
@given(case=batches())
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_step_gives_the_plain_result_or_a_clear_error(case: dict[str, Any]) -> None:
    model = mlp(case["layers"], seed=case["layers"])
    want = plain_loss(copy.deepcopy(model), case)

    def fn(rank: int, transport: Transport) -> float:
        pipe = AsyncPipe(
            model,
            case["balance"],
            chunks=case["chunks"],
            checkpoint=case["policy"],
            schedule=case["schedule"],
            transport=transport,
            timeout=5,
        )
        return pipe.step(case["input"], case["target"], mse)

    results = run_threads(fn, case["world"], timeout=60)  # asserts that no rank hangs
    errors = [value for status, value in results if status == "error"]
    for error in errors:
        clear(error)
    if isinstance(want, float):
        assert not errors, errors
        for _, loss in results:
            assert loss == pytest.approx(want, rel=1e-5, abs=1e-6)
        return
    assert errors, (case, results)  # the plain model fails, so must the pipeline


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_target_that_broadcasts_is_still_refused_on_every_rank() -> None:
    # 7 input rows and 8 target rows both split into 4 micro-batches; the last has 1 output
    # row and 2 target rows, which mse_loss broadcasts without an error
    model = mlp(2)

    def fn(rank: int, transport: Transport) -> float:
        pipe = AsyncPipe(model, [1, 1], chunks=4, transport=transport, timeout=5)
        return pipe.step(torch.ones(7, 8), torch.ones(8, 8), mse)

    for status, error in run_threads(fn, 2):
        assert status == "error" and isinstance(error, ValueError), error
        assert "same batch size (input: 7 rows, target: 8 rows)" in str(error)
