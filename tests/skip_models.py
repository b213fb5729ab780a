"""Models with skip connections shared by the single- and multi-process skip tests."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import Tensor, nn

from asyncpipe.skip import Namespace, pop, skippable, stash

LIVE: list[weakref.ref[Tensor]] = []  # weak references to every tensor stashed (leak checks)


@skippable(stash=["skip"])
class Stash(nn.Module):
    """Linear, then stash the result under 'skip'."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, input: Tensor) -> Any:
        out = torch.tanh(self.linear(input))
        LIVE.append(weakref.ref(out))
        yield stash("skip", out)
        return out


@skippable(pop=["skip"])
class PopAdd(nn.Module):
    """Linear of the input plus the tensor stashed under 'skip'."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, input: Tensor) -> Any:
        skip = yield pop("skip")
        return self.linear(input) * skip


@skippable(stash=["a"])
class StashA(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, input: Tensor) -> Any:
        out = torch.tanh(self.linear(input))
        yield stash("a", out * 2)
        return out


@skippable(stash=["b", "none"])
class StashB(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, input: Tensor) -> Any:
        out = torch.tanh(self.linear(input))
        yield stash("b", out)
        yield stash("none", None)
        return out


@skippable(pop=["a"])
class PopA(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, input: Tensor) -> Any:
        a = yield pop("a")
        return torch.tanh(self.linear(input) + a)


@skippable(pop=["b", "none"])
class PopB(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, input: Tensor) -> Any:
        b = yield pop("b")
        nothing = yield pop("none")
        if nothing is not None:
            raise AssertionError("a None stash must pop as None")
        return self.linear(input) - b


def three(seed: int = 0) -> nn.Sequential:
    """stash at layer 0, pop at layer 2."""
    torch.manual_seed(seed)
    return nn.Sequential(Stash(), nn.Sequential(nn.Linear(8, 8), nn.Tanh()), PopAdd())


def crossing(seed: int = 0) -> nn.Sequential:
    """Two skips that cross one another (a: 0 -> 2, b: 1 -> 4), one of them with a None."""
    torch.manual_seed(seed)
    return nn.Sequential(
        StashA(), StashB(), PopA(), nn.Sequential(nn.Linear(8, 8), nn.Tanh()), PopB()
    )


def isolated(seed: int = 0) -> nn.Sequential:
    """The same skippable classes used twice, kept apart by namespaces (nested pairs)."""
    torch.manual_seed(seed)
    outer, inner = Namespace("outer"), Namespace("inner")
    return nn.Sequential(
        Stash().isolate(outer),
        Stash().isolate(inner),
        PopAdd().isolate(inner),
        nn.Sequential(nn.Linear(8, 8), nn.Tanh()),
        PopAdd().isolate(outer),
    )


def nested(seed: int = 0) -> nn.Sequential:
    """A residual-like block whose stash and pop are inside one layer (position 1)."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(8, 8),
        nn.Sequential(Stash(), nn.Linear(8, 8), PopAdd()),
        nn.Sequential(nn.Linear(8, 8), nn.Tanh()),
    )


def nested_crossing(seed: int = 0) -> nn.Sequential:
    """A stash inside the container at position 0 and its pop inside the one at 2."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Sequential(Stash(), nn.Linear(8, 8)),
        nn.Sequential(nn.Linear(8, 8), nn.Tanh()),
        nn.Sequential(nn.Linear(8, 8), PopAdd()),
    )


def with_batch_norm(seed: int = 0) -> nn.Sequential:
    """A skip that crosses BatchNorm layers: stash at 0, pop at 3, BatchNorm at 1 and 2."""
    torch.manual_seed(seed)
    return nn.Sequential(
        Stash(),
        nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Tanh()),
        nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8, momentum=None)),
        PopAdd(),
    )
