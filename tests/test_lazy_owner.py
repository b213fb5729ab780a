"""LazyModule: only the owner builds a layer; other ranks read its skips on meta, if any."""

from __future__ import annotations

import collections
import copy
import functools
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from lazy_workers import lazy_loads, lazy_plain
from models import grads_of, reference
from skip_models import PopAdd, Stash
from spawn import run_ranks
from threads import run_threads, values
from torch import nn

from asyncpipe import AsyncPipe, LazyModule, StageFailure
from asyncpipe.arguments import agree_routes
from asyncpipe.partition import partition
from asyncpipe.skip.routes import SkipRoutes, describe_routes, find_routes
from asyncpipe.transport import Transport

mse = nn.functional.mse_loss

Calls = collections.Counter[tuple[int, int, str]]


class Counted:
    """Factories that count their calls by (position, rank, device type they ran under)."""

    def __init__(self) -> None:
        self.calls: Calls = collections.Counter()
        self._lock = threading.Lock()

    def factory(self, position: int, rank: int, make: Callable[[], nn.Module]) -> LazyModule:
        def counted() -> nn.Module:
            with self._lock:
                self.calls[(position, rank, torch.empty(0).device.type)] += 1
            return make()

        return LazyModule(counted)


def orthogonal() -> nn.Module:
    """A valid layer whose construction cannot run on the meta device (torch's own
    parametrization computes with the weight's values)."""
    return nn.utils.parametrizations.orthogonal(nn.Linear(8, 8))


def checked(layer: nn.Module) -> nn.Module:
    """``layer``, after a check of its weights' values (impossible on the meta device)."""
    if not all(bool(torch.isfinite(p).all()) for p in layer.parameters()):
        raise ValueError("a weight is not finite")
    return layer


def test_without_skips_each_factory_runs_once_on_its_owner_only() -> None:
    counted = Counted()
    torch.manual_seed(0)
    plain = [nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(6)]

    def fn(rank: int, transport: Transport) -> list[bool]:
        mine = [counted.factory(n, rank, lambda n=n: copy.deepcopy(plain[n])) for n in range(6)]
        AsyncPipe(mine, [2, 2, 2], chunks=2, transport=transport, timeout=10)
        return [m.built for m in mine]

    built = values(run_threads(fn, 3))
    assert built == [[n // 2 == r for n in range(6)] for r in range(3)]
    assert counted.calls == {(n, n // 2, "cpu"): 1 for n in range(6)}, counted.calls


def test_with_skips_the_owner_builds_once_and_the_others_probe_on_meta() -> None:
    counted = Counted()
    torch.manual_seed(1)
    plain = nn.Sequential(Stash(), nn.Sequential(nn.Linear(8, 8), nn.Tanh()), PopAdd())
    x, y = torch.randn(6, 8), torch.randn(6, 8)

    def fn(rank: int, transport: Transport) -> tuple[float, list[torch.Tensor], Any]:
        mine = [counted.factory(n, rank, lambda n=n: copy.deepcopy(plain[n])) for n in range(3)]
        pipe = AsyncPipe(mine, [1, 1, 1], chunks=2, transport=transport, timeout=10)
        loss = pipe.step(x, y, mse)
        return loss, grads_of(list(pipe.parameters())), pipe.skip_routes

    results = values(run_threads(fn, 3))
    # ranks 0 and 2 saw a skip in their own layer; rank 1 learnt of them in the exchange
    want = {(n, n, "cpu"): 1 for n in range(3)}
    want.update({(n, r, "meta"): 1 for n in range(3) for r in range(3) if r != n})
    assert counted.calls == want, counted.calls
    want_loss, want_grads = reference(plain, x, y, 2, mse)
    assert all(loss == pytest.approx(want_loss, rel=1e-6) for loss, _, _ in results)
    for got, expected in zip([g for _, grads, _ in results for g in grads], want_grads):
        torch.testing.assert_close(got, expected)
    assert all(describe_routes(routes) == "0->2: 'skip'" for _, _, routes in results)


@pytest.mark.parametrize("world", [1, 2])
def test_a_factory_that_cannot_run_on_meta_trains_like_the_plain_model(world: int) -> None:
    # two ranks: a model without skips; one rank: with skips, all of them its own
    torch.manual_seed(2)
    skips = world == 1
    plain = nn.Sequential(*[orthogonal() for _ in range(4)])
    if skips:
        plain = nn.Sequential(Stash(), plain[0], plain[1], PopAdd())
    states = [layer.state_dict() for layer in plain]
    x, y = torch.randn(8, 8), torch.randn(8, 8)

    def make(n: int) -> nn.Module:
        layer = orthogonal() if not skips or n in (1, 2) else copy.deepcopy(plain[n])
        layer.load_state_dict(states[n])
        return checked(layer)

    def fn(rank: int, transport: Transport) -> tuple[float, list[torch.Tensor], Any]:
        mine = [LazyModule(functools.partial(make, n)) for n in range(4)]
        pipe = AsyncPipe(mine, [4 // world] * world, chunks=4, transport=transport, timeout=10)
        loss = pipe.step(x, y, mse)
        pipe.eval()
        with torch.no_grad():
            out = pipe(x)
        return loss, grads_of(list(pipe.parameters())), out

    results = values(run_threads(fn, world))
    want_loss, want_grads = reference(plain, x, y, 4, mse)
    assert all(loss == pytest.approx(want_loss, rel=1e-6) for loss, _, _ in results)
    for got, expected in zip([g for _, grads, _ in results for g in grads], want_grads):
        torch.testing.assert_close(got, expected)
    with torch.no_grad():
        torch.testing.assert_close(results[-1][2], plain(x))


def missing_file() -> nn.Module:
    layer = nn.Linear(8, 8)
    layer.load_state_dict(torch.load("/nonexistent/asyncpipe/layer2.pt", map_location="cpu"))
    return layer


def test_a_factory_that_raises_on_its_owner_is_its_own_error_there_and_named_elsewhere() -> None:
    def fn(rank: int, transport: Transport) -> None:
        layers: list[nn.Module | LazyModule] = [nn.Linear(8, 8), nn.Tanh()]
        layers += [LazyModule(missing_file), nn.Tanh(), nn.Linear(8, 8), nn.Tanh()]  # 2: rank 1's
        AsyncPipe(layers, [2, 2, 2], chunks=2, transport=transport, timeout=60)

    began = time.monotonic()
    results = run_threads(fn, 3)
    assert time.monotonic() - began < 20, "a rank waited for its timeout"
    status, error = results[1]
    assert status == "error" and type(error) is FileNotFoundError, error
    for rank in (0, 2):
        status, error = results[rank]
        assert status == "error" and isinstance(error, StageFailure), (rank, error)
        assert error.rank == 1, (rank, error)
        text = str(error)
        assert "its constructor failed on rank 1 (stage 1) with FileNotFoundError" in text, text
        assert "skip declarations" not in text, text


def meta_hostile_pop() -> nn.Module:
    return checked(PopAdd())


def meta_hostile_linear() -> nn.Module:
    return checked(nn.Linear(8, 8))


@pytest.mark.parametrize("when", ["seen-here", "told-in-the-exchange"])
def test_a_layer_that_cannot_be_probed_reaches_every_rank_naming_it(when: str) -> None:
    """``seen-here``: the ranks that probe rank 1's layer hold skippable modules themselves;
    ``told-in-the-exchange``: the only rank that probes it learns of the skips from rank 1."""
    if when == "seen-here":
        world, balance, hostile = 3, [1, 1, 1], meta_hostile_linear
    else:
        world, balance, hostile = 2, [1, 2], meta_hostile_pop

    def fn(rank: int, transport: Transport) -> None:
        if when == "seen-here":
            layers: list[nn.Module | LazyModule] = [Stash(), LazyModule(hostile), PopAdd()]
        else:
            layers = [LazyModule(nn.Tanh), LazyModule(Stash), LazyModule(hostile)]
        AsyncPipe(layers, balance, chunks=2, transport=transport, timeout=60)

    began = time.monotonic()
    results = run_threads(fn, world)
    assert time.monotonic() - began < 20, "a rank waited for its timeout"
    position = 1 if when == "seen-here" else 2
    probers = [r for r in range(world) if r != 1]
    for rank in probers:
        status, error = results[rank]
        assert status == "error" and type(error) is ValueError, (rank, error)
        text = str(error)
        for part in (
            f"LazyModule at position {position} (built for real by rank 1, stage 1)",
            "this model has skip connections, so every rank builds the other ranks' "
            "LazyModules on the meta device",
            "(RuntimeError: ",
            "make the function runnable on the meta device",
            "or pass that layer as a module",
        ):
            assert part in text, (rank, text)
    status, error = results[1]
    assert status == "error" and isinstance(error, StageFailure), error
    assert error.rank in probers, error
    text = str(error)
    assert f"its constructor failed on rank {error.rank} (stage {error.rank})" in text, text
    assert f"LazyModule at position {position}" in text, text


def test_ranks_that_found_other_skip_routes_are_refused() -> None:
    layers = [Stash(), nn.Linear(8, 8), PopAdd()]
    _, segments = partition(layers, [1, 1, 1], 3)
    routes = find_routes(layers, segments)
    assert describe_routes(routes) == "0->2: 'skip'"
    assert describe_routes(SkipRoutes()) == ""

    def other(mine: list[float]) -> list[list[float]]:
        return [mine, [mine[0] + 1, mine[1]], mine]

    with pytest.raises(ValueError) as raised:
        agree_routes(other, 0, routes, lambda: routes, lambda text: None)
    text = str(raised.value)
    assert "every rank of the pipeline must find the same skip connections" in text, text
    assert "skip routes (here: \"0->2: 'skip'\"; other on rank 1)" in text, text
    assert "when its owner builds it and when the other ranks build it on the meta" in text, text


@pytest.mark.slow
def test_processes_read_only_the_weights_of_their_own_layers(tmp_path: Any) -> None:
    torch.manual_seed(3)
    for n in range(4):
        torch.save(nn.Linear(8, 8).state_dict(), tmp_path / f"layer{n}.pt")
    model, x, y = lazy_plain(str(tmp_path), 4)
    want_loss, _ = reference(model, x, y, 2, mse)
    results = run_ranks(lazy_loads, 2, str(tmp_path), 4, timeout=120)
    for rank, (loaded, loss) in enumerate(results):
        assert loaded == [f"layer{n}.pt" for n in (2 * rank, 2 * rank + 1)], (rank, loaded)
        assert loss == pytest.approx(want_loss, rel=1e-6), (rank, loss, want_loss)
