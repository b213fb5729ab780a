"""The reference workload: sleeping affine layers, the model builder and the batches (their
calibration is :mod:`benchmarks.calibration`)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

__all__ = [
    "BUSY",
    "FEATURES",
    "RSS",
    "SHAPES",
    "BusyClock",
    "PACER",
    "Pacer",
    "RssProbe",
    "SleepAffine",
    "build_model",
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


def nominal_ideal_s(stages: int, chunks: int, layers_per_stage: int, f_ms: float) -> float:
    """GPipe's ideal step time with exact sleeps: ``(M + S - 1) * 3F * L`` seconds."""
    return (chunks + stages - 1) * 3 * (f_ms / 1000.0) * layers_per_stage
