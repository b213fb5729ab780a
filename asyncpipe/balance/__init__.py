"""Balancing: find how many layers each stage gets, and which pipeline configuration to run.

``by_time`` and ``by_size`` profile a model on a sample and split its layers into consecutive
stages with the smallest slowest (or largest) stage; ``plan`` ranks (stages, chunks, schedule)
choices by the simulator's predicted step time.

Example:
    >>> import torch
    >>> from asyncpipe import balance
    >>> model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(6)])
    >>> sum(balance.by_size(model, torch.randn(4, 8), 3))
    6
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor, nn

from .blocks import blocks
from .plan import Candidate, Link, Ranking, plan
from .profile import LayerProfile, Profile, profile, sample_rows

__all__ = [
    "Candidate",
    "LayerProfile",
    "Link",
    "Profile",
    "Ranking",
    "blocks",
    "by_size",
    "by_time",
    "plan",
    "profile",
]


def by_time(
    module: nn.Sequential | Sequence[nn.Module],
    sample: Tensor | tuple[Tensor, ...],
    stages: int,
    *,
    repeat: int = 3,
) -> list[int]:
    """A balance that minimises the slowest stage's forward plus backward time on ``sample``.

    ``sample`` should be one micro-batch. Each layer runs ``repeat`` timed times (after a
    warm-up) and its median time counts; the model is left unchanged. A layer object listed at
    several positions runs on the stage of its first position at every one (see
    :mod:`asyncpipe.partition`), so its time counts there, and every stage owns a layer.

    Example:
        >>> import torch
        >>> from asyncpipe import balance
        >>> model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
        >>> len(balance.by_time(model, torch.randn(4, 8), 2))
        2
    """
    layers = list(module)
    measured = profile(layers, sample, rows=[sample_rows(sample)], repeat=repeat)
    return blocks([m[0].forward + m[0].backward for m in measured.layers], stages, layers=layers)


def by_size(
    module: nn.Sequential | Sequence[nn.Module],
    sample: Tensor | tuple[Tensor, ...],
    stages: int,
) -> list[int]:
    """A balance that minimises the largest stage's memory: parameter bytes plus the bytes its
    forward keeps for the backward on ``sample`` (one micro-batch). A layer object listed at
    several positions lives on the stage of its first position: its parameters count once,
    there, and so do the activations of every position.

    Example:
        >>> import torch
        >>> from asyncpipe import balance
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Linear(64, 8))
        >>> balance.by_size(model, torch.randn(4, 8), 2)
        [1, 1]
    """
    layers = list(module)
    measured = profile(layers, sample, rows=[sample_rows(sample)], repeat=1)
    seen: set[int] = set()
    costs = []
    for layer, m in zip(layers, measured.layers):
        costs.append((0 if id(layer) in seen else m[0].params) + m[0].activations)
        seen.add(id(layer))
    return blocks(costs, stages, layers=layers)
