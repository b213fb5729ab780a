"""A small deterministic training job shared by the checkpoint, graceful-stop and elastic tests:
the same model, data and optimizer wherever it runs (threads, spawned processes, torchrun)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from asyncpipe import AsyncPipe

__all__ = ["LAYERS", "batch", "model", "optimizer", "train_step"]

LAYERS = 8
mse = nn.functional.mse_loss


def model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for n in range(LAYERS // 2):
        layers += [nn.Linear(8, 8), nn.Tanh() if n % 2 else nn.LayerNorm(8)]
    return nn.Sequential(*layers)


def batch(step: int) -> tuple[Tensor, Tensor]:
    """The mini-batch of a step: the same on every rank and in every run."""
    generator = torch.Generator().manual_seed(1000 + step)
    return torch.randn(8, 8, generator=generator), torch.randn(8, 8, generator=generator)


def optimizer(params: object) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=0.01)  # type: ignore[arg-type]


def train_step(pipe: AsyncPipe, opt: torch.optim.Optimizer, step: int) -> float:
    x, y = batch(step)
    loss = pipe.step(x, y, mse)
    opt.step()
    opt.zero_grad()
    return loss
