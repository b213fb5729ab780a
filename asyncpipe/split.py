"""Backward split in two: input gradients now (B), weight gradients later (W).

Zero-bubble schedules send the input gradient upstream as soon as it is known and compute the
weight gradients when the rank would otherwise wait. Each layer of the segment runs on detached
leaves of its input, so every layer's graph stands alone and both halves touch it once::

    forward   x ─┬─> layer 0 ─> o0 ┊ o0' ─> layer 1 ─> o1        (┊: detach, o0' a fresh leaf)
    B         g(o1) ─grad wrt o0'─> g(o0) ─grad wrt x─> g(x)     params skipped, graph kept
    W         per layer: backward(o_l, g(o_l), inputs=params of layer l, and any other
              parameter its graph reached the first time, e.g. one read through a closure)

Built-in operators compute only the gradients asked for, so B does no weight work and W no
input work; a custom autograd function that always computes both does its work twice.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from .alias import alias, differentiable
from .skip.namespace import SkipKey
from .skip.tracker import SkipTracker

__all__: list[str] = []


def flatten(value: object) -> list[Tensor]:
    """The tensors of a layer's value (a tensor or a tuple), in order."""
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [v for v in value if isinstance(v, Tensor)]
    return []


def cut(value: object) -> tuple[object, list[Tensor]]:
    """``value`` with every tensor that carries gradients replaced by an alias of a fresh leaf
    (a layer may modify it in place, see ``alias``), and the tensors the gradients are taken
    for: those leaves, and the other tensors of ``value``."""
    found: list[Tensor] = []

    def leaf(t: Tensor) -> Tensor:
        if t.requires_grad and differentiable(t):
            fresh = t.detach().requires_grad_(True)
            found.append(fresh)
            return alias(fresh)
        found.append(t)
        return t

    if isinstance(value, Tensor):
        new: object = leaf(value)
    elif isinstance(value, (tuple, list)):
        new = type(value)(leaf(v) if isinstance(v, Tensor) else v for v in value)
    else:
        new = value
    return new, found


@dataclass
class LayerRun:
    """One layer's call: its module, input leaves and outputs.

    Skip tensors join the ends of the lists: ``inputs`` ends with the leaves the layer popped
    (keys in ``pops``) and ``outputs`` with the tensors it stashed (keys in ``stashes``).
    """

    layer: object
    inputs: list[Tensor]
    outputs: list[Tensor]
    pops: list[SkipKey] = field(default_factory=list)
    stashes: list[SkipKey] = field(default_factory=list)


def run_cut(
    layers: Sequence[object], value: object, tracker: SkipTracker | None = None
) -> tuple[object, list[LayerRun]]:
    """Run ``layers`` in order, each on fresh leaves of its input; keep every call's tensors.

    With a ``tracker`` in cut mode, what each layer pops and stashes is kept with its call.
    """
    runs = []
    for layer in layers:
        value, inputs = cut(value)
        assert callable(layer)
        value = layer(value)
        run = LayerRun(layer, inputs, flatten(value))
        if tracker is not None:
            stashed, popped = tracker.take_log()
            for key, tensor in popped:
                if tensor is not None:
                    run.inputs.append(tensor)
                    run.pops.append(key)
            for key, tensor in stashed:
                if tensor is not None:
                    run.outputs.append(tensor)
                    run.stashes.append(key)
        runs.append(run)
    return value, runs


def _pairs(
    tensors: Sequence[Tensor], grads: Sequence[Tensor | None]
) -> list[tuple[Tensor, Tensor]]:
    return [
        (t, g if g.dtype == t.dtype else g.to(t.dtype))
        for t, g in zip(tensors, grads)
        if g is not None and t.requires_grad
    ]


def input_backward(
    runs: list[LayerRun],
    output_grads: Sequence[Tensor | None],
    skip_grads: dict[SkipKey, Tensor | None] | None = None,
) -> tuple[list[Tensor | None], list[tuple[LayerRun, list[Tensor | None]]]]:
    """B: gradients of the segment's input from those of its output, layer by layer.

    ``skip_grads`` holds the gradients of the skips the segment stashes for other segments; on
    return it holds those of the skips the segment popped from other segments.

    Returns the input gradients (aligned with the first layer's input tensors) and, for W, each
    layer with the gradients of its outputs.
    """
    skips = {} if skip_grads is None else skip_grads
    grads: list[Tensor | None] = list(output_grads)
    pending = []
    for run in reversed(runs):
        main = len(run.outputs) - len(run.stashes)
        grads = (
            grads[:main] + [None] * (main - len(grads)) + [skips.pop(k, None) for k in run.stashes]
        )
        pairs = _pairs(run.outputs, grads)
        wanted = [t for t in run.inputs if t.requires_grad]
        found: dict[int, Tensor | None] = {}
        whole = False
        if pairs and wanted:
            outputs, given = [t for t, _ in pairs], [g for _, g in pairs]
            result: Sequence[Tensor | None]
            try:
                result = torch.autograd.grad(
                    outputs, wanted, given, retain_graph=True, allow_unused=True
                )
            except RuntimeError as e:
                if "donated buffer" not in str(e):
                    raise
                whole = True  # a compiled layer: its backward runs whole, here
                result = _whole_backward(run.layer, outputs, given, wanted)
            found = {id(t): g for t, g in zip(wanted, result)}
        if not whole:
            pending.append((run, grads))
        grads = [found.get(id(t)) for t in run.inputs]
        first_pop = len(run.inputs) - len(run.pops)
        for key, grad in zip(run.pops, grads[first_pop:]):
            skips[key] = grad
        grads = grads[:first_pop]
    return grads, pending


def _whole_backward(
    layer: object, outputs: list[Tensor], grads: list[Tensor], wanted: list[Tensor]
) -> list[Tensor | None]:
    """The input gradients of a layer whose backward cannot keep its graph for a later W (a
    ``torch.compile``'d layer: AOTAutograd's compiled backward, with donated buffers, refuses
    ``retain_graph``): one backward for its inputs and weights at once, which accumulates the
    weight gradients now, as W would have. ``wanted`` are fresh leaves of this layer's call."""
    params = (
        [p for p in layer.parameters() if p.requires_grad] if isinstance(layer, nn.Module) else []
    )
    torch.autograd.backward(outputs, grads, inputs=[*wanted, *params])
    result = []
    for leaf in wanted:
        result.append(leaf.grad)
        leaf.grad = None
    return result


_WEIGHTS: weakref.WeakKeyDictionary[object, list[nn.Parameter]] = weakref.WeakKeyDictionary()
"""By layer: the parameters its W accumulates (see :func:`_weights_of`)."""


def reached_parameters(tensors: Sequence[Tensor]) -> list[nn.Parameter]:
    """The parameters that ``tensors``' autograd graph accumulates gradients into."""
    found: list[nn.Parameter] = []
    seen: set[int] = set()
    stack: list[Any] = [t.grad_fn for t in tensors if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        variable = getattr(node, "variable", None)  # an AccumulateGrad: a leaf's end
        if variable is not None:
            if isinstance(variable, nn.Parameter) and all(variable is not p for p in found):
                found.append(variable)
            continue
        stack.extend(next_node for next_node, _ in node.next_functions)
    return found


def _weights_of(run: LayerRun) -> list[nn.Parameter]:
    """The parameters W accumulates for ``run``'s layer: its own, and any other that its graph
    reached the first time (one it reads without registering it, through a closure or an
    attribute autograd sees but ``parameters()`` does not), as a plain backward would."""
    try:
        params = _WEIGHTS.get(run.layer)
    except TypeError:  # a layer no weak reference can point at (a built-in function)
        params = None
    if params is None:
        own = list(run.layer.parameters()) if isinstance(run.layer, nn.Module) else []
        reached = reached_parameters(run.outputs)
        params = own + [p for p in reached if all(p is not q for q in own)]
        with contextlib.suppress(TypeError):
            _WEIGHTS[run.layer] = params
    return [p for p in params if p.requires_grad]


def weight_backward(pending: list[tuple[LayerRun, list[Tensor | None]]]) -> None:
    """W: accumulate every layer's weight gradients from the gradients of its outputs."""
    for run, grads in pending:
        params = _weights_of(run)
        pairs = _pairs(run.outputs, grads)
        if params and pairs:
            torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs], inputs=params)
