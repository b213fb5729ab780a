"""Multi-process workers for the LazyModule tests: factories that load each layer from a file."""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
from torch import nn

from asyncpipe import AsyncPipe, LazyModule

LOADED: list[str] = []
"""The files this process's factories read, in order (one process per rank)."""


def load_layer(path: str) -> nn.Module:
    """A layer whose weights come from ``path`` (read with ``torch.load`` on the CPU)."""
    LOADED.append(os.path.basename(path))
    layer = nn.Linear(8, 8)
    layer.load_state_dict(torch.load(path, map_location="cpu"))
    return layer


def lazy_loads(rank: int, world: int, directory: str, layers: int) -> tuple[list[str], float]:
    """A pipeline of ``layers`` LazyModules, each loading its weights from ``directory``, one
    per rank: the files this rank read, and its loss of one step on a seeded batch."""
    files = [os.path.join(directory, f"layer{n}.pt") for n in range(layers)]
    lazy = [LazyModule(functools.partial(load_layer, path)) for path in files]
    pipe = AsyncPipe(lazy, [layers // world] * world, chunks=2, timeout=60)
    torch.manual_seed(0)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    loss = pipe.step(x, y, nn.functional.mse_loss)
    return list(LOADED), loss


def lazy_plain(directory: str, layers: int) -> Any:
    """The plain model :func:`lazy_loads` splits, and its seeded batch."""
    model = nn.Sequential(
        *[load_layer(os.path.join(directory, f"layer{n}.pt")) for n in range(layers)]
    )
    LOADED.clear()
    torch.manual_seed(0)
    return model, torch.randn(4, 8), torch.randn(4, 8)
