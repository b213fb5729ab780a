"""Profiles: each layer's forward and backward time and its memory, measured on a sample.

The layers run one after another in this process, each on a detached copy of the previous
layer's output, so every layer's backward is timed on its own. The model is left as it was:
gradients, buffers (e.g. BatchNorm statistics), the training flag and the RNG state are restored.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..lazy import LazyModule
from ..recompute import forked_rng

__all__ = ["LayerProfile", "Profile", "profile"]


@dataclass(frozen=True)
class LayerProfile:
    """One layer at one micro-batch size: seconds and bytes."""

    forward: float
    backward: float
    params: int
    """Bytes of the layer's parameters."""
    activations: int
    """Bytes the forward keeps for the backward (tensors saved by autograd, parameters not
    counted)."""
    output: int
    """Bytes of the layer's output: what crosses to the next stage."""


@dataclass(frozen=True)
class Profile:
    """Per-layer measurements at one or more micro-batch sizes (``rows``, ascending).

    :meth:`at` estimates a layer at any size by a straight line through the two nearest
    measurements (a fixed cost per call plus a cost per row), so a profile taken at two sizes
    predicts every micro-batch size a plan considers.
    """

    rows: tuple[int, ...]
    layers: tuple[tuple[LayerProfile, ...], ...]
    """``layers[n][k]``: layer ``n`` measured at ``rows[k]`` rows."""

    def at(self, rows: float) -> list[LayerProfile]:
        """Every layer's estimate at ``rows`` rows per micro-batch."""
        if len(self.rows) == 1:
            scale = rows / self.rows[0]
            return [
                LayerProfile(
                    m[0].forward * scale,
                    m[0].backward * scale,
                    m[0].params,
                    round(m[0].activations * scale),
                    round(m[0].output * scale),
                )
                for m in self.layers
            ]
        k = 1
        while k < len(self.rows) - 1 and self.rows[k] < rows:
            k += 1
        r0, r1 = self.rows[k - 1], self.rows[k]
        t = (rows - r0) / (r1 - r0)

        def line(a: float, b: float) -> float:
            return max(0.0, a + (b - a) * t)

        return [
            LayerProfile(
                line(m[k - 1].forward, m[k].forward),
                line(m[k - 1].backward, m[k].backward),
                m[k].params,
                round(line(m[k - 1].activations, m[k].activations)),
                round(line(m[k - 1].output, m[k].output)),
            )
            for m in self.layers
        ]


def _tensors(value: object) -> list[Tensor]:
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [v for v in value if isinstance(v, Tensor)]
    return []


def _fresh(value: object) -> object:
    def leaf(t: Tensor) -> Tensor:
        t = t.detach()
        return t.requires_grad_(True) if t.is_floating_point() or t.is_complex() else t

    if isinstance(value, Tensor):
        return leaf(value)
    if isinstance(value, (tuple, list)):
        return type(value)(leaf(v) if isinstance(v, Tensor) else v for v in value)
    return value


def _rows(value: object, rows: int) -> object:
    if isinstance(value, Tensor):
        return value[:rows]
    return tuple(t[:rows] for t in value)  # type: ignore[attr-defined]


@contextmanager
def unchanged(layers: Sequence[nn.Module]) -> Iterator[None]:
    """Restore the layers' gradients, buffers and training flags, and the RNG, on exit."""
    params = {id(p): p for layer in layers for p in layer.parameters()}
    grads = {key: p.grad for key, p in params.items()}
    buffers = [(b, b.detach().clone()) for layer in layers for b in layer.buffers()]
    modes = [(m, m.training) for layer in layers for m in layer.modules()]
    with forked_rng():
        try:
            for p in params.values():
                p.grad = None
            yield
        finally:
            with torch.no_grad():
                for b, value in buffers:
                    b.copy_(value)
            for key, p in params.items():
                p.grad = grads[key]
            for m, mode in modes:
                m.train(mode)


class _Saved:
    """Bytes of the tensors autograd saves, by storage, leaving out the parameters."""

    def __init__(self, params: set[int]) -> None:
        self.params = params
        self.seen: dict[int, int] = {}

    def pack(self, t: Tensor) -> Tensor:
        if t.data_ptr() not in self.params:
            self.seen[t.data_ptr()] = t.numel() * t.element_size()
        return t


def _measure(layers: Sequence[nn.Module], sample: object, repeat: int) -> list[LayerProfile]:
    times: list[list[tuple[float, float]]] = [[] for _ in layers]
    saved_bytes = [0] * len(layers)
    output_bytes = [0] * len(layers)
    for run in range(repeat + 1):  # the first run warms up and is not timed
        value = sample
        for n, layer in enumerate(layers):
            inp = _fresh(value)
            saved = _Saved({p.data_ptr() for p in layer.parameters()})
            start = time.perf_counter()
            with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
                out = layer(inp)
            middle = time.perf_counter()
            roots = [t for t in _tensors(out) if t.requires_grad]
            if roots:
                torch.autograd.backward(roots, [torch.ones_like(t) for t in roots])
            end = time.perf_counter()
            if run:
                times[n].append((middle - start, end - middle))
            saved_bytes[n] = sum(saved.seen.values())
            output_bytes[n] = sum(t.numel() * t.element_size() for t in _tensors(out))
            value = out
    return [
        LayerProfile(
            statistics.median(f for f, _ in times[n]),
            statistics.median(b for _, b in times[n]),
            sum(p.numel() * p.element_size() for p in layer.parameters()),
            saved_bytes[n],
            output_bytes[n],
        )
        for n, layer in enumerate(layers)
    ]


def profile(
    module: nn.Sequential | Sequence[nn.Module],
    sample: Tensor | tuple[Tensor, ...],
    *,
    rows: Sequence[int] | None = None,
    repeat: int = 3,
) -> Profile:
    """Measure every layer's forward and backward time and memory on ``sample``.

    Args:
        module: an ``nn.Sequential`` or a list of built layers (a cut model after
            :func:`asyncpipe.sequentialize`).
        sample: one micro-batch of input (a tensor or a tuple of tensors, batch in dim 0).
        rows: micro-batch sizes to measure (each at most the sample's rows); default: the
            sample's rows and a quarter of them, so :meth:`Profile.at` can tell the fixed cost
            of a call from its cost per row.
        repeat: timed runs per size (after one warm-up run); each time is the median.

    Example:
        >>> import torch
        >>> from asyncpipe.balance import profile
        >>> p = profile(torch.nn.Sequential(torch.nn.Linear(4, 4)), torch.randn(8, 4))
        >>> p.rows, p.layers[0][0].params
        ((2, 8), 80)
    """
    layers = list(module)
    lazy = [n for n, layer in enumerate(layers) if isinstance(layer, LazyModule)]
    if lazy:
        raise TypeError(
            f"profiling runs every layer, but layers {lazy} are LazyModules that are not built; "
            f"pass balance as a list, or build the layers first"
        )
    total = _tensors(sample)[0].shape[0] if _tensors(sample) else 0
    if rows is None:
        rows = sorted({max(1, total // 4), total})
    rows = sorted(set(rows))
    if not rows or rows[0] < 1 or rows[-1] > total or repeat < 1:
        raise ValueError(
            f"rows must be sizes from 1 to the sample's {total} rows and repeat at least 1 "
            f"(got rows={list(rows)}, repeat={repeat})"
        )
    with unchanged(layers):
        measured = [_measure(layers, _rows(sample, r), repeat) for r in rows]
    return Profile(tuple(rows), tuple(tuple(m[n] for m in measured) for n in range(len(layers))))
