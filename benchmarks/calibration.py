"""Calibration of the reference workload: the measured costs of a layer and of a stage, the
ideals computed from them, and a check of the layers' backward split. ``python -m
benchmarks.calibration`` runs the check and a short calibration."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from .workload import BUSY, FEATURES, SHAPES, SleepAffine, build_model

__all__ = [
    "LayerCosts",
    "StageCosts",
    "calibrate",
    "calibrate_layer",
    "calibrated_ideal_s",
    "check_split",
]


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


@dataclass(frozen=True)
class LayerCosts:
    """Measured seconds of one layer on one micro-batch (medians): forward, plain backward, and
    the backward split into B (input gradient) and W (weight and bias gradients)."""

    forward_s: float
    backward_s: float
    input_s: float
    weight_s: float
    repeats: int


def calibrate_layer(
    f_ms: float, micro_batch: int, shape: str, repeats: int = 30, warmup: int = 3
) -> LayerCosts:
    """Time one :class:`SleepAffine` layer on one micro-batch, its input requiring grad.

    Per repeat: a forward and a plain ``torch.autograd.backward``; then another forward, B as
    ``torch.autograd.grad`` with respect to the input (graph kept) and W as
    ``torch.autograd.backward(..., inputs=[weight, bias])``, the calls asyncpipe's runtime makes
    for a split backward. One intra-op thread, like each worker; medians of ``repeats``.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        layer = SleepAffine(f_ms)
        params = [layer.weight, layer.bias]
        x = torch.randn(micro_batch, *SHAPES[shape])
        grad = torch.ones_like(x)
        samples: dict[str, list[float]] = {"F": [], "B": [], "Bi": [], "W": []}
        for i in range(warmup + repeats):
            inp = x.detach().requires_grad_(True)
            t0 = time.perf_counter()
            out = layer(inp)
            t1 = time.perf_counter()
            torch.autograd.backward(out, grad)
            t2 = time.perf_counter()
            out = layer(inp)
            t3 = time.perf_counter()
            torch.autograd.grad(out, inp, grad, retain_graph=True)
            t4 = time.perf_counter()
            torch.autograd.backward(out, grad, inputs=params)
            t5 = time.perf_counter()
            if i >= warmup:
                samples["F"] += [t1 - t0, t3 - t2]
                samples["B"].append(t2 - t1)
                samples["Bi"].append(t4 - t3)
                samples["W"].append(t5 - t4)
        median = {key: statistics.median(values) for key, values in samples.items()}
        return LayerCosts(median["F"], median["B"], median["Bi"], median["W"], repeats)
    finally:
        torch.set_num_threads(threads)


def check_split(f_ms: float = 5.0, micro_batch: int = 4) -> list[str]:
    """Check :class:`SleepAffine`'s costs and gradients in this process; returns the problems.

    Counts the sleeps the layer asks for (``BUSY.slept``, exact): forward F; a plain backward
    2F, also where the input needs no gradient; B (``torch.autograd.grad`` with respect to the
    input) F; W (``torch.autograd.backward(..., inputs=[weight, bias])``) F. The value must equal
    ``torch.addcmul(b, x, w)`` and the gradients ``g * w``, ``sum(g * x)`` and ``sum(g)``.
    """
    f_s = f_ms / 1000.0
    problems: list[str] = []

    def expect(what: str, slept: float, units: int) -> None:
        if abs(slept - units * f_s) > 1e-9:
            problems.append(f"{what} slept {slept * 1000:g} ms, expected {units * f_ms:g} ms")

    layer = SleepAffine(f_ms)
    with torch.no_grad():
        layer.bias.normal_()
    params = [layer.weight, layer.bias]
    x = torch.randn(micro_batch, FEATURES)
    g = torch.randn(micro_batch, FEATURES)
    want_x = g * layer.weight.detach()
    want_w = (g * x).sum(0)
    want_b = g.sum(0)

    def run(
        label: str, needs_x: bool, backward: str, units: int
    ) -> tuple[torch.Tensor, tuple[torch.Tensor | None, ...]]:
        layer.zero_grad(set_to_none=True)
        inp = x.detach().requires_grad_(needs_x)
        BUSY.reset()
        out = layer(inp)
        expect(f"{label}: forward", BUSY.slept, 1)
        if not torch.equal(out, torch.addcmul(layer.bias, inp, layer.weight)):
            problems.append(f"{label}: the value differs from x * w + b")
        BUSY.reset()
        found: tuple[torch.Tensor | None, ...] = ()
        if backward == "plain":
            torch.autograd.backward(out, g)
            found = (inp.grad, layer.weight.grad, layer.bias.grad)
        elif backward == "input":
            found = (torch.autograd.grad(out, inp, g)[0], layer.weight.grad, layer.bias.grad)
        else:
            torch.autograd.backward(out, g, inputs=params)
            found = (inp.grad, layer.weight.grad, layer.bias.grad)
        expect(f"{label}: {backward} backward", BUSY.slept, units)
        return out, found

    def same(label: str, got: torch.Tensor | None, want: torch.Tensor | None) -> None:
        if (got is None) != (want is None) or (
            got is not None and want is not None and not torch.allclose(got, want)
        ):
            problems.append(f"{label} differs from the formula")

    _, (gx, gw, gb) = run("input needs grad", True, "plain", 2)
    same("plain backward: input gradient", gx, want_x)
    same("plain backward: weight gradient", gw, want_w)
    same("plain backward: bias gradient", gb, want_b)
    _, (gx, gw, gb) = run("first layer", False, "plain", 2)
    same("first layer: weight gradient", gw, want_w)
    same("first layer: bias gradient", gb, want_b)
    _, (gx, gw, gb) = run("B", True, "input", 1)
    same("B: input gradient", gx, want_x)
    same("B: weight gradient (none expected)", gw, None)
    _, (gx, gw, gb) = run("W", True, "weight", 1)
    same("W: input gradient (none expected)", gx, None)
    same("W: weight gradient", gw, want_w)
    same("W: bias gradient", gb, want_b)
    _, (gx, gw, gb) = run("W, first layer", False, "weight", 1)
    same("W, first layer: weight gradient", gw, want_w)

    # A stage of two layers, split as asyncpipe's runtime and torch.distributed.pipelining
    # split it: each runs B for the stage, then W for its parameters.
    from torch.distributed.pipelining._backward import (
        stage_backward_input,
        stage_backward_weight,
    )

    from asyncpipe.split import input_backward, run_cut, weight_backward

    model = build_model(f_ms, 2)
    inp = x.detach().requires_grad_(True)
    value, runs = run_cut(list(model), inp)
    BUSY.reset()
    (grad_in,), pending = input_backward(runs, [g])
    expect("asyncpipe split, two layers: B", BUSY.slept, 2)
    BUSY.reset()
    weight_backward(pending)
    expect("asyncpipe split, two layers: W", BUSY.slept, 2)
    reference = build_model(f_ms, 2)
    ref_in = x.detach().requires_grad_(True)
    torch.autograd.backward(reference(ref_in), g)
    same("asyncpipe split: input gradient", grad_in, ref_in.grad)
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        same("asyncpipe split: a parameter's gradient", got.grad, want.grad)

    model = build_model(f_ms, 2)
    inp = x.detach().requires_grad_(True)
    out = model(inp)
    BUSY.reset()
    (grad_in,), groups = stage_backward_input([out], [g], [inp], iter(model.parameters()))
    expect("torch split, two layers: B", BUSY.slept, 2)
    BUSY.reset()
    stage_backward_weight(iter(model.parameters()), groups)
    expect("torch split, two layers: W", BUSY.slept, 2)
    same("torch split: input gradient", grad_in, ref_in.grad)
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        same("torch split: a parameter's gradient", got.grad, want.grad)
    return problems


def calibrated_ideal_s(stages: int, chunks: int, costs: StageCosts) -> float:
    """GPipe's ideal step time with the measured per-stage costs, from the plan simulator."""
    from asyncpipe.schedule import Costs, gpipe, simulate

    plan = gpipe(stages, chunks)
    return simulate(plan, Costs(forward=costs.forward_s, backward=costs.backward_s)).makespan


def main() -> int:
    """``python -m benchmarks.calibration``: run :func:`check_split` and a short calibration."""
    problems = check_split()
    for line in problems:
        print(f"FAIL: {line}")
    costs = calibrate_layer(5.0, 4, "small", repeats=10)
    print(
        f"one layer, F = 5 ms, small shape: forward {costs.forward_s * 1000:.2f} ms, backward "
        f"{costs.backward_s * 1000:.2f} ms, B {costs.input_s * 1000:.2f} ms, W "
        f"{costs.weight_s * 1000:.2f} ms"
    )
    print("split check: " + ("FAILED" if problems else "ok"))
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
