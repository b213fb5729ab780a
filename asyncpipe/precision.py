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

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

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

    def settle(
        self,
        parameters: list[nn.Parameter],
        exchange: Callable[[Sequence[float]], list[list[float]]],
        replicas: Callable[[float], float] | None = None,
    ) -> bool:
        """After a step: agree with every rank (``exchange``) and replica (``replicas``, the
        largest value over them) whether any gradient overflowed; drop this rank's gradients if
        so, else unscale them; update the scale. Returns whether the step overflowed."""
        table = exchange([0.0 if all_finite(parameters) else 1.0])
        overflow = any(row[0] for row in table)
        if replicas is not None:  # replicas agree (their averaged gradients do anyway)
            overflow = replicas(float(overflow)) > 0
        if overflow:
            drop_(parameters)
        else:
            unscale_(parameters, self.scale)
        self.update(overflow)
        return overflow

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


def clip_norm(
    grads: list[Tensor],
    exchange: Callable[[Sequence[float]], list[list[float]]],
    max_norm: float,
    norm_type: float,
) -> Tensor:
    """Clip ``grads`` (this rank's) by the norm over every rank, found with one ``exchange``
    of each rank's partial sum; returns that norm."""
    if not (isinstance(max_norm, (int, float)) and max_norm > 0):
        raise ValueError(f"max_norm must be a positive number (got {max_norm!r})")
    norm_type = float(norm_type)
    inf = norm_type == math.inf
    if not grads:
        local = 0.0
    elif inf:
        local = float(max(g.abs().max() for g in grads))
    else:
        local = float(sum(g.double().norm(norm_type) ** norm_type for g in grads))
    table = exchange([local])
    values = [row[0] for row in table]
    total = max(values) if inf else sum(values) ** (1.0 / norm_type)
    coefficient = min(max_norm / (total + 1e-6), 1.0)
    for g in grads:
        g.mul_(coefficient)
    return torch.tensor(total)
