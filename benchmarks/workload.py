"""The reference workload: sleeping affine layers, the model builder and per-stage calibration."""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = [
    "BUSY",
    "FEATURES",
    "SHAPES",
    "BusyClock",
    "SleepAffine",
    "StageCosts",
    "build_model",
    "calibrate",
    "calibrated_ideal_s",
    "make_batch",
    "nominal_ideal_s",
    "stage_module",
]

FEATURES = 1024
"""Width of every activation and of each layer's weight vector."""

SHAPES: dict[str, tuple[int, ...]] = {"small": (FEATURES,), "large": (256, FEATURES)}
"""Activation shape after the micro-batch dimension, per ``--shape``."""


class BusyClock:
    """Seconds this process has spent inside the reference layers' forward and backward."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def reset(self) -> None:
        self.seconds = 0.0

    def add(self, seconds: float) -> None:
        self.seconds += seconds


BUSY = BusyClock()
"""The process-wide clock every :class:`SleepAffine` layer adds its compute time to."""


class _SleepAffineFn(torch.autograd.Function):
    """y = x * w + b that sleeps ``f`` seconds in forward and ``2 f`` in backward."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, f_s: float
    ) -> torch.Tensor:
        start = time.perf_counter()
        time.sleep(f_s)
        y = torch.addcmul(bias, x, weight)
        ctx.save_for_backward(x, weight)
        ctx.f_s = f_s
        BUSY.add(time.perf_counter() - start)
        return y

    @staticmethod
    def backward(
        ctx: Any, grad: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None]:
        start = time.perf_counter()
        x, weight = ctx.saved_tensors
        # Input gradient: F seconds of "accelerator work" plus the real product.
        time.sleep(ctx.f_s)
        grad_x = grad * weight
        # Weight gradient: another F seconds plus the real reduction over every leading dim.
        time.sleep(ctx.f_s)
        flat_grad = grad.reshape(-1, grad.shape[-1])
        grad_w = (flat_grad * x.reshape(-1, x.shape[-1])).sum(0)
        grad_b = flat_grad.sum(0)
        BUSY.add(time.perf_counter() - start)
        return grad_x, grad_w, grad_b, None


class SleepAffine(nn.Module):
    """One reference layer: an element-wise affine map over the last dim, plus simulated work.

    Forward sleeps ``f_ms`` milliseconds; backward sleeps ``f_ms`` for the input gradient and
    ``f_ms`` for the weight gradient, so one layer costs ``3 * f_ms`` per micro-batch. Sleep
    stands in for accelerator work: it frees the CPU, so four stages share two cores fairly.
    """

    def __init__(self, f_ms: float, features: int = FEATURES) -> None:
        super().__init__()
        self.f_s = f_ms / 1000.0
        self.weight = nn.Parameter(1.0 + 0.01 * torch.randn(features))
        self.bias = nn.Parameter(torch.zeros(features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = _SleepAffineFn.apply(x, self.weight, self.bias, self.f_s)  # type: ignore[no-untyped-call]
        return out

    def extra_repr(self) -> str:
        return f"features={self.weight.numel()}, f_ms={self.f_s * 1000:g}"


def build_model(f_ms: float, layers: int = 8, seed: int = 0) -> nn.Sequential:
    """The reference model: ``layers`` identical :class:`SleepAffine` layers, seeded init."""
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        return nn.Sequential(*(SleepAffine(f_ms) for _ in range(layers)))
    finally:
        torch.random.set_rng_state(generator_state)


def stage_module(model: nn.Sequential, balance: Sequence[int], stage: int) -> nn.Sequential:
    """The layers of ``stage`` under ``balance`` (layer counts per stage), as a new Sequential."""
    if sum(balance) != len(model):
        raise ValueError(f"balance {list(balance)} does not sum to the {len(model)} layers")
    start = sum(balance[:stage])
    return nn.Sequential(*(model[i] for i in range(start, start + balance[stage])))


def make_batch(
    chunks: int, micro_batch: int, shape: str, seed: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """An (input, target) mini-batch of ``chunks * micro_batch`` samples of the given shape."""
    generator = torch.Generator().manual_seed(seed)
    batch = chunks * micro_batch
    x = torch.randn(batch, *SHAPES[shape], generator=generator)
    y = torch.randn(batch, 1, generator=generator)
    return x, y


@dataclass(frozen=True)
class StageCosts:
    """Measured seconds of one stage's forward and backward for one micro-batch (medians)."""

    forward_s: float
    backward_s: float
    repeats: int


def calibrate(
    f_ms: float,
    micro_batch: int,
    shape: str,
    layers_per_stage: int,
    repeats: int = 30,
    warmup: int = 3,
) -> StageCosts:
    """Time one stage (``layers_per_stage`` layers) forward and backward on one micro-batch.

    Runs in the calling process with one intra-op thread (like each benchmark worker), the
    input requiring grad as on a middle stage; returns the median forward and backward times.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        stage = build_model(f_ms, layers_per_stage)
        x = torch.randn(micro_batch, *SHAPES[shape])
        forward: list[float] = []
        backward: list[float] = []
        for i in range(warmup + repeats):
            inp = x.detach().requires_grad_(True)
            t0 = time.perf_counter()
            out = stage(inp)
            t1 = time.perf_counter()
            torch.autograd.backward(out, torch.ones_like(out))
            t2 = time.perf_counter()
            if i >= warmup:
                forward.append(t1 - t0)
                backward.append(t2 - t1)
        return StageCosts(statistics.median(forward), statistics.median(backward), repeats)
    finally:
        torch.set_num_threads(threads)


def nominal_ideal_s(stages: int, chunks: int, layers_per_stage: int, f_ms: float) -> float:
    """GPipe's ideal step time with exact sleeps: ``(M + S - 1) * 3F * L`` seconds."""
    return (chunks + stages - 1) * 3 * (f_ms / 1000.0) * layers_per_stage


def calibrated_ideal_s(stages: int, chunks: int, costs: StageCosts) -> float:
    """GPipe's ideal step time with the measured per-stage costs, from the plan simulator."""
    from asyncpipe.schedule import Costs, gpipe, simulate

    plan = gpipe(stages, chunks)
    return simulate(plan, Costs(forward=costs.forward_s, backward=costs.backward_s)).makespan
