"""Mixed precision: autocast per stage, and a loss scale shared by every stage for float16.

With float16 the last stage multiplies each micro-batch loss by the scale before its backward,
so small gradients survive; after the step every stage checks its own gradients and the ranks
exchange one flag. An overflow anywhere skips the step everywhere::

    last stage: backward(loss * scale)  ──gradients (scaled)──> every stage
    every stage: finite = all(isfinite(grad))  ──exchange──> any overflow?
        yes: grads = None on every stage (optimizer.step() skips them), scale *= backoff
        no:  grads /= scale; after growth_interval clean steps, scale *= growth
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

__all__: list[str] = []

DTYPES = (torch.bfloat16, torch.float16)


@dataclass
class LossScaler:
    """A dynamic loss scale (float16 training). Same on every rank: each rank applies the same
    update from the same exchanged overflow flag."""

    scale: float = 2.0**16
    growth: float = 2.0
    backoff: float = 0.5
    growth_interval: int = 2000
    clean_steps: int = 0

    def update(self, overflow: bool) -> None:
        if overflow:
            self.scale *= self.backoff
            self.clean_steps = 0
            return
        self.clean_steps += 1
        if self.clean_steps >= self.growth_interval:
            self.scale *= self.growth
            self.clean_steps = 0


def all_finite(parameters: Iterable[nn.Parameter]) -> bool:
    """Whether every gradient of ``parameters`` is free of inf and NaN."""
    checks = [torch.isfinite(p.grad).all() for p in parameters if p.grad is not None]
    return bool(torch.stack(checks).all()) if checks else True


def unscale_(parameters: Iterable[nn.Parameter], scale: float) -> None:
    """Divide every gradient by ``scale`` in place."""
    for p in parameters:
        if p.grad is not None:
            p.grad.div_(scale)


def drop_(parameters: Iterable[nn.Parameter]) -> None:
    """Forget every gradient, so the optimizer skips this step."""
    for p in parameters:
        p.grad = None
