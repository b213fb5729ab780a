"""Single-controller mode: what the driver refuses before it sends anything, and what it sends
to each rank (the loss function to the last stage alone)."""

from __future__ import annotations

import functools
import threading

import pytest
import torch
from models import mlp
from rpc_workers import driver_refusals
from spawn import run_ranks
from torch import nn

from asyncpipe import LazyModule
from asyncpipe.rpc.checks import check_batch, check_remote


def _linear() -> nn.Module:
    return nn.Linear(8, 8)


def _refusal(*args: object, **kwargs: object) -> tuple[str, str]:
    try:
        check_remote(*args, **kwargs)  # type: ignore[arg-type]
    except (TypeError, ValueError) as e:
        return type(e).__name__, str(e)
    return "accepted", ""


def test_balance_must_be_a_list_of_positive_ints_and_auto_says_how_to_find_one() -> None:
    model = mlp(4)
    kind, text = _refusal(model, "auto", {}, None, 2)
    assert kind == "ValueError", text
    assert "got 'auto'" in text and "asyncpipe.balance.by_time(model, sample, 2)" in text, text
    assert "AsyncPipe(..., balance='auto', sample=...) on every rank" in text, text
    kind, text = _refusal(model, "auto", {"virtual_stages": 2}, None, 2)
    assert "by_time(model, sample, 4)" in text, text  # one entry per model chunk
    for balance in (2, None, []):
        kind, text = _refusal(model, balance, {}, None, 2)
        assert kind == "TypeError", (balance, text)
        assert "non-empty list of positive ints" in text and f"(got {balance!r})" in text, text
    kind, text = _refusal(model, [2, 0, True], {}, None, 2)
    assert kind == "ValueError" and "bad entries: 1: 0, 2: True" in text, text
    assert _refusal(model, [2, 2], {}, None, 2) == ("accepted", "")


def test_shared_weights_are_refused_across_stages_only() -> None:
    model = mlp(4)
    spread = {"shared_weights": [("0.0.weight", "3.0.weight")]}
    kind, text = _refusal(model, [2, 2], spread, None, 2)
    assert kind == "ValueError", text
    assert text.startswith(
        "RemotePipe cannot keep shared weights equal across stages (['0.0.weight', "
        "'3.0.weight'] on stages [0, 1])"
    ), text
    assert "transport='p2p' or 'shm') on every rank" in text, text
    # on one stage they are kept equal there, as AsyncPipe does over any transport
    one = {"shared_weights": [("0.0.weight", "1.0.weight")]}
    assert _refusal(model, [2, 2], one, None, 2) == ("accepted", "")
    # AsyncPipe's own checks of the names come before anything is sent, too
    kind, text = _refusal(model, [2, 2], {"shared_weights": [("0.0.weight", "9.x")]}, None, 2)
    assert kind == "ValueError" and "no layer has: ['9.x']" in text, text


def test_what_cannot_be_pickled_is_named_by_position_and_argument() -> None:
    layers: list[nn.Module | LazyModule] = [
        nn.Linear(8, 8),
        LazyModule(lambda: nn.Linear(8, 8)),
        LazyModule(functools.partial(_linear)),
        LazyModule(lambda: nn.Linear(8, 8)),
    ]
    kind, text = _refusal(layers, [2, 2], {}, None, 2)
    assert kind == "TypeError", text
    assert text.startswith("every layer is sent to the workers, so it must be picklable"), text
    assert "position 1, a LazyModule (" in text and "position 3, a LazyModule (" in text, text
    assert "position 2" not in text and "position 0" not in text, text
    # one process sends nothing; a picklable list is accepted
    assert _refusal(layers, [2, 2], {}, None, 1) == ("accepted", "")
    picklable = [layers[0], layers[2], nn.Linear(8, 8), LazyModule(_linear)]
    assert _refusal(picklable, [2, 2], {}, None, 2) == ("accepted", "")
    # the container's own hooks, and keyword arguments, by name
    model = mlp(2)
    model.register_forward_hook(lambda *args: None)
    kind, text = _refusal(model, [1, 1], {}, None, 2)
    assert text.startswith("the module is sent to the workers, so it must be picklable"), text
    kind, text = _refusal(mlp(2), [1, 1], {"trace": threading.Lock()}, None, 2)
    assert text.startswith("the argument trace= is sent to the workers"), text


def test_every_problem_is_listed_at_once() -> None:
    layers = [LazyModule(lambda: nn.Linear(8, 8)), nn.Linear(8, 8)]
    kind, text = _refusal(layers, "auto", {"transport": "rpc", "schedule": "2bw"}, lambda p: p, 2)
    assert kind == "ValueError", text
    lines = text.splitlines()
    assert lines[0] == "invalid RemotePipe arguments:", text
    assert len(lines) == 6, text  # transport, 2bw, balance, the layer, the optimizer factory
    assert "position 0, a LazyModule" in text and "the optimizer factory is sent" in text, text


def test_a_batch_the_stages_could_not_split_is_refused_by_the_driver() -> None:
    x, y = torch.randn(8, 2), torch.randn(8, 2)
    check_batch(x, y, 4)
    check_batch((x, x), None, 4)  # the target may be None: loss_fn gets None
    check_batch([x], (y,), 4)
    cases = [
        ([1.0, 2.0], y, TypeError, "the input must be a tensor or a tuple of tensors"),
        ((), y, TypeError, "the input must be a tensor or a tuple of tensors (got an empty"),
        (None, y, ValueError, "the input is needed"),
        (torch.tensor(1.0), y, ValueError, "every tensor of the input needs a batch dimension"),
        (x, [1], TypeError, "the target must be a tensor or a tuple of tensors"),
        (x, y[:6], ValueError, "the target splits into 3 micro-batches but the input into 4"),
    ]
    for input, target, kind, text in cases:
        with pytest.raises(kind) as caught:
            check_batch(input, target, 4)
        assert str(caught.value).startswith(text), (text, caught.value)


@pytest.mark.slow
def test_the_driver_refuses_before_sending_and_sends_the_loss_to_the_last_stage_only() -> None:
    seen = run_ranks(driver_refusals, 2, timeout=180)[0]
    want = seen["want"]
    # the last stage is the driver's: a lambda loss_fn never has to be pickled
    assert seen["last_rank"] == 0
    kind, loss, _ = seen["lambda"]
    assert kind == "returned" and abs(loss - want) < 1e-6, seen["lambda"]
    # refused on the driver, before any remote call, with RemotePipe's own words
    refusals = {
        "auto": ("ValueError", "RemotePipe takes balance as a list of layer counts"),
        "int": ("TypeError", "balance must be a non-empty list of positive ints"),
        "none": ("TypeError", "balance must be a non-empty list of positive ints"),
        "shared": ("ValueError", "RemotePipe cannot keep shared weights equal across stages"),
        "lazy": ("TypeError", "every layer is sent to the workers, so it must be picklable"),
        "list": ("TypeError", "the input must be a tensor or a tuple of tensors"),
        "rows": ("ValueError", "the target splits into 1 micro-batch but the input into 2"),
        "forward": ("TypeError", "the input must be a tensor or a tuple of tensors"),
    }
    for case, (kind, start) in refusals.items():
        assert seen[case][0] == kind and seen[case][1].startswith(start), (case, seen[case])
        assert seen[case][2] == 0, (case, seen[case])  # no remote call
    assert "position 1, a LazyModule" in seen["lazy"][1], seen["lazy"]
    # a refused batch leaves the pipeline usable
    kind, loss, _ = seen["after"]
    assert kind == "returned" and abs(loss - want) < 1e-6, seen["after"]
    assert seen["tied"], "shared weights on one stage stay equal"
