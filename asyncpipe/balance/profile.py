"""Profiles: each layer's forward and backward time and its memory, measured on a sample.

The layers run one after another in this process, each on a detached copy of the previous
layer's output (gradients on, also when the caller turned them off), so every layer's backward is
timed on its own. A layer gets its input as the pipeline gives it: an alias of a leaf, which it
may modify in place (``nn.ReLU(inplace=True)``); the caller's sample is never modified. The model
is left as it was: parameters a layer changes in place (``nn.Embedding(max_norm=...)``
renormalises rows in forward) get their values back after each call, and gradients, buffers (e.g.
BatchNorm statistics, also those a layer replaces by a new tensor), the training flag and the RNG
state are restored at the end.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn.modules.lazy import LazyModuleMixin

from ..alias import alias
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
    """A copy of ``value`` as a layer of the pipeline gets it: each floating-point tensor a new
    leaf that asks for gradients, passed as its alias (see :mod:`asyncpipe.alias`), so that a
    layer may modify it in place; copied, so that the caller's sample (or an output measured
    before) is never modified."""

    def leaf(t: Tensor) -> Tensor:
        t = t.detach().clone()
        if t.is_floating_point() or t.is_complex():
            return alias(t.requires_grad_(True))
        return t

    if isinstance(value, Tensor):
        return leaf(value)
    if isinstance(value, (tuple, list)):
        return type(value)(leaf(v) if isinstance(v, Tensor) else v for v in value)
    return value


def _rows(value: object, rows: int) -> object:
    if isinstance(value, Tensor):
        return value[:rows]
    if isinstance(value, (tuple, list)):
        return tuple(t[:rows] if isinstance(t, Tensor) else t for t in value)
    return value


def sample_rows(sample: object) -> int:
    """The rows of ``sample`` (one micro-batch: a tensor or a tuple of tensors, batch in dim 0).

    Raises:
        ValueError: a tensor of the sample has no dim 0 (a 0-dim tensor), or it holds none.
    """
    tensors = _tensors(sample)
    flat = [n for n, t in enumerate(tensors) if t.dim() == 0]
    if not tensors or flat:
        got = (
            f"tensor {flat[0]} of it is 0-dim, shape {tuple(tensors[flat[0]].shape)}"
            if flat
            else f"got {type(sample).__name__}"
        )
        raise ValueError(
            f"sample must be one micro-batch of input, a tensor or a tuple of tensors with the "
            f"rows in dim 0 ({got}); add the batch dimension, e.g. sample=x.unsqueeze(0)"
        )
    return int(tensors[0].shape[0])


@contextmanager
def unchanged(layers: Sequence[nn.Module]) -> Iterator[None]:
    """Restore the layers' gradients, buffers and training flags, and the RNG, on exit.

    A buffer is restored as the module's entry and its value: a layer that replaces its buffer
    by a new tensor (``self.calls = self.calls + 1``) gets the original tensor object back, and
    so does one that replaces a parameter. (Parameter values changed in place are restored
    after each call, by :func:`_measure`.)"""
    params = {id(p): p for layer in layers for p in layer.parameters()}
    grads = {key: p.grad for key, p in params.items()}
    modules = list({id(m): m for layer in layers for m in layer.modules()}.values())
    entries = [(m, dict(m._buffers), dict(m._parameters)) for m in modules]
    values = {
        id(b): b.detach().clone()
        for _, buffers, _ in entries
        for b in buffers.values()
        if b is not None
    }
    modes = [(m, m.training) for m in modules]
    with forked_rng():
        try:
            for p in params.values():
                p.grad = None
            yield
        finally:
            with torch.no_grad():
                for m, buffers, parameters in entries:
                    for name in [n for n in m._buffers if n not in buffers]:
                        del m._buffers[name]
                    m._buffers.update(buffers)
                    for name in [n for n in m._parameters if n not in parameters]:
                        del m._parameters[name]
                    m._parameters.update(parameters)
                    for b in buffers.values():
                        if b is not None:
                            b.copy_(values[id(b)])
            for key, p in params.items():
                p.grad = grads[key]
            for m, mode in modes:
                m.train(mode)


@contextmanager
def _kept(layer: nn.Module) -> Iterator[None]:
    """Put back the values of ``layer``'s parameters that the body changed in place (a layer
    may: ``nn.Embedding(max_norm=...)`` renormalises the rows it looks up), so that every call
    sees the model's weights and the model keeps them. A copy of the layer's parameters lives
    for the call only."""
    params = list({id(p): p for p in layer.parameters()}.values())
    before = [(p, p._version, p.detach().clone()) for p in params]
    try:
        yield
    finally:
        with torch.no_grad():
            for p, version, value in before:
                if p._version != version:
                    p.copy_(value)


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
            with _kept(layer):
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
    unbuilt = [
        f"{n} ({type(layer).__name__})"
        for n, layer in enumerate(layers)
        if any(
            isinstance(m, LazyModuleMixin) and m.has_uninitialized_params() for m in layer.modules()
        )
    ]
    if unbuilt:
        raise ValueError(
            f"profiling runs every layer and measures its parameters, but layers "
            f"{', '.join(unbuilt)} hold uninitialised parameters (torch's lazy modules, e.g. "
            f"nn.LazyLinear): run one forward through the model first so that they know their "
            f"sizes, or pass balance as a list"
        )
    total = sample_rows(sample)
    if rows is None:
        rows = sorted({max(1, total // 4), total})
    rows = sorted(set(rows))
    if not rows or rows[0] < 1 or rows[-1] > total or repeat < 1:
        raise ValueError(
            f"rows must be sizes from 1 to the sample's {total} rows and repeat at least 1 "
            f"(got rows={list(rows)}, repeat={repeat})"
        )
    with unchanged(layers), torch.enable_grad():  # a backward to time, under no_grad() too
        measured = [_measure(layers, _rows(sample, r), repeat) for r in rows]
    return Profile(tuple(rows), tuple(tuple(m[n] for m in measured) for n in range(len(layers))))
