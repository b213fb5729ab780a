"""The reference workload: sleeping affine layers, the model builder and per-stage calibration."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = [
    "BUSY",
    "FEATURES",
    "RSS",
    "SHAPES",
    "BusyClock",
    "LayerCosts",
    "PACER",
    "Pacer",
    "RssProbe",
    "SleepAffine",
    "StageCosts",
    "build_model",
    "calibrate",
    "calibrate_layer",
    "check_split",
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
    """Seconds this process has spent inside the reference layers' forward and backward.

    ``slept`` adds up the sleeps the layers asked for (exact, unlike the wall time), so a check
    can tell how much simulated work a forward, backward, B or W ran.
    """

    def __init__(self) -> None:
        self.seconds = 0.0
        self.slept = 0.0

    def reset(self) -> None:
        self.seconds = 0.0
        self.slept = 0.0

    def add(self, seconds: float) -> None:
        self.seconds += seconds


BUSY = BusyClock()
"""The process-wide clock every :class:`SleepAffine` layer adds its compute time to."""


def _statm_pages() -> int:
    """Resident pages of this process, from ``/proc/self/statm`` (0 where there is none)."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1])
    except (OSError, IndexError, ValueError):
        return 0


class RssProbe:
    """Peak resident memory of this process, sampled by the layers while ``enabled``.

    Every :class:`SleepAffine` forward and backward half samples ``/proc/self/statm`` on entry
    and exit, so the peak between :meth:`reset` and :attr:`peak_bytes` is the process's RSS at
    the busiest moment the layers saw (a transfer buffer alive only between two layer calls can
    be missed). Off by default: the benchmark turns it on only for its memory runs.
    """

    def __init__(self) -> None:
        self.enabled = False
        self.page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
        self.start_pages = 0
        self.peak_pages = 0

    def reset(self) -> None:
        """Start a new window: the current RSS becomes both the start and the peak."""
        self.start_pages = self.peak_pages = _statm_pages()

    def sample(self) -> None:
        if self.enabled:
            self.peak_pages = max(self.peak_pages, _statm_pages())

    @property
    def start_bytes(self) -> int:
        return self.start_pages * self.page

    @property
    def peak_bytes(self) -> int:
        return self.peak_pages * self.page


RSS = RssProbe()
"""The process-wide RSS probe the layers sample (when enabled)."""


class Pacer:
    """Paces the reference layers: each part of a layer costs F in all, not F plus overheads.

    ``time.sleep`` overshoots by 0.1-0.3 ms per call on this kind of virtual machine, and a
    layer's own Python work (the real op, autograd's bookkeeping) adds as much again, so a layer
    that did its op and then slept F would cost ~8 % more than F, and every schedule would look
    that much slower than its ideal for reasons that have nothing to do with the pipeline. So:

    - a part sleeps *until* a deadline (its start plus F: its real op is inside), waking
      ``early`` seconds ahead of it, ``early`` following the overshoot measured after each sleep
      (a step of ``gain`` of the error, within ``[0, limit]``);
    - a forward's deadline comes ``tail`` before its end: the time the forward takes after its
      sleep (autograd wrapping the output, the sum of the value and the zero term), learnt the
      same way (:meth:`learn_tail`);
    - in one backward pass (one autograd graph task), a part counts its F from the previous
      part's deadline, so autograd's hand-over between two parts (up to ``cap`` seconds)
      overlaps the simulated work as it would overlap an accelerator's kernels. The first part
      of a pass counts from its own start: the cost of entering a backward stays in.

    Nothing spins: the CPU stays free for the other stages. ``clock``, ``sleep`` and
    ``graph_task`` are ``time.perf_counter``, ``time.sleep`` and autograd's current graph task
    id (-1 outside a backward), replaceable in tests.
    """

    def __init__(
        self,
        gain: float = 0.2,
        limit: float = 0.002,
        cap: float = 0.0005,
        clock: Callable[[], float] = time.perf_counter,
        sleep: Callable[[float], None] = time.sleep,
        graph_task: Callable[[], int] = torch._C._current_graph_task_id,
    ) -> None:
        self.gain, self.limit, self.cap = gain, limit, cap
        self.clock, self.sleep, self.graph_task = clock, sleep, graph_task
        self.early = 0.0
        """Seconds :meth:`until` wakes ahead of its deadline."""
        self.tail = 0.0
        """Seconds a forward takes after its sleep (see :meth:`learn_tail`)."""
        self.woke = 0.0
        """When the last :meth:`until` returned."""
        self.task = -2
        """The graph task of the last backward part (-2: none, or a forward came since)."""
        self.deadline = 0.0
        """The deadline of the last backward part."""

    def until(self, deadline: float) -> None:
        """Sleep until ``deadline`` (a ``clock`` reading)."""
        left = deadline - self.clock() - self.early
        if left > 0:
            self.sleep(left)
            over = self.clock() - deadline
            self.early = min(max(self.early + self.gain * over, 0.0), self.limit)
        self.woke = self.clock()

    def forward(self, seconds: float, start: float) -> None:
        """The simulated work of a forward that began at ``start``."""
        self.until(start + seconds - self.tail)

    def learn_tail(self, seconds: float) -> None:
        """A forward took ``seconds`` after its sleep; it also breaks a chain of backward parts
        (a checkpointed forward recomputed inside a backward pass)."""
        self.tail = min(max(self.tail + self.gain * (seconds - self.tail), 0.0), self.limit)
        self.task = -2

    def backward(self, seconds: float, start: float) -> None:
        """The simulated work of a backward part that began at ``start``."""
        task = self.graph_task()
        base = start
        if task >= 0 and task == self.task:
            base = max(self.deadline, start - self.cap)
        self.task = task
        self.deadline = base + seconds
        self.until(self.deadline)


PACER = Pacer()
"""The process-wide pacer of every :class:`SleepAffine` layer."""


def _sleep(seconds: float, start: float) -> None:
    """Simulated work of a forward that began at ``start`` (a ``time.perf_counter()``)."""
    BUSY.slept += seconds
    PACER.forward(seconds, start)


def _sleep_backward(seconds: float, start: float) -> None:
    """Simulated work of a backward part that began at ``start``."""
    BUSY.slept += seconds
    PACER.backward(seconds, start)


class _InputPart(torch.autograd.Function):
    """The layer's value ``x * w + b``; its backward gives only the input gradient ``g * w``.

    Takes the weight and bias detached, plus ``anchor`` (a scalar leaf that requires grad and
    gets no gradient): the anchor keeps this node in a plain backward even where ``x`` needs no
    gradient (the model's first layer), so a plain backward costs 2F there as everywhere, while
    ``torch.autograd.backward(..., inputs=params)`` (W) never reaches this node.
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor,
        anchor: torch.Tensor,
        f_s: float,
        start: float,
    ) -> torch.Tensor:
        RSS.sample()
        y = torch.addcmul(bias, x, weight)
        ctx.save_for_backward(weight)
        ctx.f_s = f_s
        RSS.sample()
        _sleep(f_s, start)  # F from the layer's start: the layer's forward costs F in all
        BUSY.add(time.perf_counter() - start)
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None, None]:
        start = time.perf_counter()
        RSS.sample()
        (weight,) = ctx.saved_tensors
        # Input gradient: the real product, then "accelerator work" up to F in all.
        grad_x = grad * weight
        RSS.sample()
        _sleep_backward(ctx.f_s, start)
        BUSY.add(time.perf_counter() - start)
        return grad_x, None, None, None, None, None


class _WeightPart(torch.autograd.Function):
    """Zero-valued; its backward gives only the weight and bias gradients of ``x * w + b``.

    Takes ``x`` detached, so nothing asking for input gradients (B) runs it.
    """

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, f_s: float
    ) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.f_s = f_s
        # A broadcast zero, not a buffer: adding it to the value costs no memory.
        return x.new_zeros(()).expand(x.shape)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor, torch.Tensor, None]:
        start = time.perf_counter()
        RSS.sample()
        (x,) = ctx.saved_tensors
        # Weight gradient: the real reduction over every leading dim, then up to F in all.
        flat_grad = grad.reshape(-1, grad.shape[-1])
        grad_w = (flat_grad * x.reshape(-1, x.shape[-1])).sum(0)
        grad_b = flat_grad.sum(0)
        RSS.sample()
        _sleep_backward(ctx.f_s, start)
        BUSY.add(time.perf_counter() - start)
        return None, grad_w, grad_b, None


class SleepAffine(nn.Module):
    """One reference layer: an element-wise affine map over the last dim, plus simulated work.

    Forward costs ``f_ms`` milliseconds; backward ``f_ms`` for the input gradient and ``f_ms``
    for the weight gradient, so one layer costs ``3 * f_ms`` per micro-batch. Each part does
    its real op, then sleeps until ``f_ms`` after it began (see :class:`Pacer`). Sleep stands
    in for accelerator work: it frees the CPU, so four stages share two cores fairly.

    The value is computed by one autograd node and the weight gradient by another (a zero-valued
    term added to it), so a backward split into input gradients (``torch.autograd.grad`` with
    respect to the input: B) and weight gradients (``torch.autograd.backward(...,
    inputs=params)``: W) runs each half once, F each; a plain backward runs both, 2F.
    """

    def __init__(self, f_ms: float, features: int = FEATURES) -> None:
        super().__init__()
        self.f_s = f_ms / 1000.0
        self.weight = nn.Parameter(1.0 + 0.01 * torch.randn(features))
        self.bias = nn.Parameter(torch.zeros(features))
        self.anchor = torch.zeros((), requires_grad=True)
        """Not a parameter: see :class:`_InputPart`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        zero: torch.Tensor = _WeightPart.apply(  # type: ignore[no-untyped-call]
            x.detach(), self.weight, self.bias, self.f_s
        )
        value: torch.Tensor = _InputPart.apply(  # type: ignore[no-untyped-call]
            x, self.weight.detach(), self.bias.detach(), self.anchor, self.f_s, start
        )
        out = value + zero
        PACER.learn_tail(time.perf_counter() - PACER.woke)
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


def nominal_ideal_s(stages: int, chunks: int, layers_per_stage: int, f_ms: float) -> float:
    """GPipe's ideal step time with exact sleeps: ``(M + S - 1) * 3F * L`` seconds."""
    return (chunks + stages - 1) * 3 * (f_ms / 1000.0) * layers_per_stage


def calibrated_ideal_s(stages: int, chunks: int, costs: StageCosts) -> float:
    """GPipe's ideal step time with the measured per-stage costs, from the plan simulator."""
    from asyncpipe.schedule import Costs, gpipe, simulate

    plan = gpipe(stages, chunks)
    return simulate(plan, Costs(forward=costs.forward_s, backward=costs.backward_s)).makespan


def main() -> int:
    """``python -m benchmarks.workload``: run :func:`check_split` and a short calibration."""
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
