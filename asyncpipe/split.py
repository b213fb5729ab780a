"""Backward split in two: input gradients now (B), weight gradients later (W).

Zero-bubble schedules send the input gradient upstream as soon as it is known and compute the
weight gradients when the rank would otherwise wait. Each layer of the segment runs on detached
leaves of its input, so every layer's graph stands alone and both halves touch it once::

    forward   x ─┬─> layer 0 ─> o0 ┊ o0' ─> layer 1 ─> o1        (┊: detach, o0' a fresh leaf)
    B         g(o1) ─grad wrt o0'─> g(o0) ─grad wrt x─> g(x)     params skipped, graph kept
    W         per layer: backward(o_l, g(o_l), inputs=params of layer l)

Built-in operators compute only the gradients asked for, so B does no weight work and W no
input work; a custom autograd function that always computes both does its work twice.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

__all__: list[str] = []


def flatten(value: object) -> list[Tensor]:
    """The tensors of a layer's value (a tensor or a tuple), in order."""
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [v for v in value if isinstance(v, Tensor)]
    return []


def cut(value: object) -> tuple[object, list[Tensor]]:
    """``value`` with every tensor that carries gradients replaced by a fresh leaf."""

    def leaf(t: Tensor) -> Tensor:
        if t.requires_grad and t.is_floating_point():
            return t.detach().requires_grad_(True)
        return t

    if isinstance(value, Tensor):
        new: object = leaf(value)
    elif isinstance(value, (tuple, list)):
        new = type(value)(leaf(v) if isinstance(v, Tensor) else v for v in value)
    else:
        new = value
    return new, flatten(new)


@dataclass
class LayerRun:
    """One layer's call: its module, input leaves and outputs."""

    layer: object
    inputs: list[Tensor]
    outputs: list[Tensor]


def run_cut(layers: Sequence[object], value: object) -> tuple[object, list[LayerRun]]:
    """Run ``layers`` in order, each on fresh leaves of its input; keep every call's tensors."""
    runs = []
    for layer in layers:
        value, inputs = cut(value)
        assert callable(layer)
        value = layer(value)
        runs.append(LayerRun(layer, inputs, flatten(value)))
    return value, runs


def _pairs(
    tensors: Sequence[Tensor], grads: Sequence[Tensor | None]
) -> list[tuple[Tensor, Tensor]]:
    return [(t, g) for t, g in zip(tensors, grads) if g is not None and t.requires_grad]


def input_backward(
    runs: list[LayerRun], output_grads: Sequence[Tensor | None]
) -> tuple[list[Tensor | None], list[tuple[LayerRun, list[Tensor | None]]]]:
    """B: gradients of the segment's input from those of its output, layer by layer.

    Returns the input gradients (aligned with the first layer's input tensors) and, for W, each
    layer with the gradients of its outputs.
    """
    grads: list[Tensor | None] = list(output_grads)
    pending = []
    for run in reversed(runs):
        pending.append((run, grads))
        pairs = _pairs(run.outputs, grads)
        wanted = [t for t in run.inputs if t.requires_grad]
        found: dict[int, Tensor | None] = {}
        if pairs and wanted:
            result = torch.autograd.grad(
                [t for t, _ in pairs],
                wanted,
                [g for _, g in pairs],
                retain_graph=True,
                allow_unused=True,
            )
            found = {id(t): g for t, g in zip(wanted, result)}
        grads = [found.get(id(t)) for t in run.inputs]
    return grads, pending


def weight_backward(pending: list[tuple[LayerRun, list[Tensor | None]]]) -> None:
    """W: accumulate every layer's weight gradients from the gradients of its outputs."""
    for run, grads in pending:
        if not isinstance(run.layer, nn.Module):
            continue
        params = [p for p in run.layer.parameters() if p.requires_grad]
        pairs = _pairs(run.outputs, grads)
        if params and pairs:
            torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs], inputs=params)
