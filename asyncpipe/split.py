"""Backward split in two: input gradients now (B), weight gradients later (W).

Zero-bubble schedules send the input gradient upstream as soon as it is known and compute the
weight gradients when the rank would otherwise wait. Each layer of the segment runs on detached
leaves of its input, so every layer's graph stands alone and both halves touch it once::

    forward   x ─┬─> layer 0 ─> o0 ┊ o0' ─> layer 1 ─> o1        (┊: detach, o0' a fresh leaf)
    B         g(o1) ─grad wrt o0'─> g(o0) ─grad wrt x─> g(x)     weights skipped, graph kept
    W         per layer: backward(o_l, g(o_l), inputs=its weights: every leaf that requires
              grad its graph reached in its first B (its parameters, one read through a
              closure, a plain tensor attribute), but for its own input leaves)

A value is cut where torch's pytree sees all of it: a tensor, or tuples, lists, dicts and
named tuples, nested, of tensors and constants. Any other object may hold tensors out of
sight, so the layers on both sides of it stay one graph (one run, cut at its ends). A run
whose graph cannot be differentiated for chosen tensors only (a reentrant checkpoint, a
compiled backward with donated buffers) runs its whole backward in B, weights included, and
has no W. Built-in operators compute only the gradients asked for, so B does no weight work
and W no input work; a custom autograd function that always computes both does its work twice.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from .alias import alias, differentiable
from .skip.namespace import SkipKey
from .skip.tracker import SkipTracker

__all__: list[str] = []

_CONSTANTS: tuple[type, ...] = (
    *(type(None), bool, int, float, complex, str, bytes, slice, type(Ellipsis), enum.Enum),
    *(torch.dtype, torch.device, torch.layout, torch.memory_format),
)
"""What a value may hold besides tensors and still be cut: nothing in these carries a graph."""


def flatten(value: object) -> list[Tensor]:
    """The tensors of a layer's value, in pytree order (depth first, as ``cut`` meets them)."""
    if isinstance(value, Tensor):
        return [value]
    return [v for v in pytree.tree_leaves(value) if isinstance(v, Tensor)]


def separable(value: object) -> bool:
    """Whether every tensor of ``value`` is in sight: pytree flattens it to tensors and
    constants only (a dataclass, or a dict subclass pytree does not know, could hide one)."""
    if isinstance(value, Tensor):
        return True
    return all(isinstance(v, (Tensor, *_CONSTANTS)) for v in pytree.tree_leaves(value))


def cut(value: object) -> tuple[object, list[Tensor]]:
    """``value`` with every tensor that carries gradients replaced by an alias of a fresh leaf
    (a layer may modify it in place, see ``alias``), and the tensors the gradients are taken
    for: those leaves, and the other tensors of ``value``, in the order of :func:`flatten`."""
    found: list[Tensor] = []

    def leaf(t: object) -> object:
        if not isinstance(t, Tensor):
            return t
        if t.requires_grad and differentiable(t):
            fresh = t.detach().requires_grad_(True)
            found.append(fresh)
            return alias(fresh)
        found.append(t)
        return t

    if isinstance(value, Tensor):
        return leaf(value), found
    return pytree.tree_map(leaf, value), found


@dataclass
class LayerRun:
    """One run: consecutive layers called on fresh leaves (one layer, unless a value between
    them could not be cut), its input leaves and outputs.

    Skip tensors join the ends of the lists: ``inputs`` ends with the leaves the layers popped
    (keys in ``pops``) and ``outputs`` with the tensors they stashed (keys in ``stashes``).
    ``weights``: the leaves W accumulates, set by B (see :class:`Reach`).
    """

    layers: list[object]
    inputs: list[Tensor]
    outputs: list[Tensor]
    pops: list[SkipKey] = field(default_factory=list)
    stashes: list[SkipKey] = field(default_factory=list)
    weights: Sequence[Tensor] = ()


@dataclass(frozen=True)
class Reach:
    """What a run's backward needs from its graph, learned in its first B and kept by the
    caller (see ``input_backward``).

    ``weights``: the layers' parameters and every other leaf that requires grad the graph
    reached, but for the run's input leaves (a plain backward accumulates them all).
    ``whole``: the graph holds a reentrant checkpoint, which refuses a backward restricted to
    chosen tensors: B runs the whole backward.
    """

    weights: tuple[Tensor, ...]
    whole: bool


Reaches = dict[tuple[int, ...], Reach]
"""By the ids of a run's layers (which the caller holds for as long as these): its reach."""


def run_cut(
    layers: Sequence[object], value: object, tracker: SkipTracker | None = None
) -> tuple[object, list[LayerRun]]:
    """Run ``layers`` in order, each on fresh leaves of its input where that input can be cut
    (see :func:`separable`), else as part of the run before; keep every run's tensors.

    With a ``tracker`` in cut mode, what each run pops and stashes is kept with it.
    """
    runs: list[LayerRun] = []
    for layer in layers:
        if runs and not separable(value):
            runs[-1].layers.append(layer)  # a tensor may be out of sight: no cut here
        else:
            if runs:
                _close(runs[-1], value, tracker)
            value, inputs = cut(value)
            runs.append(LayerRun([layer], inputs, []))
        assert callable(layer)
        value = layer(value)
    if runs:
        _close(runs[-1], value, tracker)
    return value, runs


def _close(run: LayerRun, value: object, tracker: SkipTracker | None) -> None:
    """Give ``run`` its outputs, ``value``'s tensors, and the skips its layers popped and
    stashed (a skip both stashed and popped inside the run stays in its graph)."""
    run.outputs = flatten(value)
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
    reaches: Reaches | None = None,
) -> tuple[list[Tensor | None], list[tuple[LayerRun, list[Tensor | None]]]]:
    """B: gradients of the segment's input from those of its output, run by run.

    ``skip_grads`` holds the gradients of the skips the segment stashes for other segments; on
    return it holds those of the skips the segment popped from other segments. ``reaches``
    keeps what each run's first B learned from its graph for the next (without it, every B
    learns it again).

    Returns the input gradients (aligned with the first run's input tensors) and, for W, each
    run with the gradients of its outputs.
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
        if pairs:
            reach = _reach(run, runs, reaches)
            run.weights = reach.weights
            outputs, given = [t for t, _ in pairs], [g for _, g in pairs]
            result: Sequence[Tensor | None] = ()
            whole = reach.whole
            if not whole and wanted:
                try:
                    result = torch.autograd.grad(
                        outputs, wanted, given, retain_graph=True, allow_unused=True
                    )
                except RuntimeError as e:
                    # a compiled layer's backward, with donated buffers, or a reentrant
                    # checkpoint the first B did not meet
                    if "donated buffer" not in str(e) and "use_reentrant" not in str(e):
                        raise
                    whole = True
            if whole:
                result = _whole_backward(outputs, given, wanted)
            found = {id(t): g for t, g in zip(wanted, result)}
        if not whole:
            pending.append((run, grads))
        grads = [_arrived(t, found.get(id(t))) for t in run.inputs]
        first_pop = len(run.inputs) - len(run.pops)
        for key, grad in zip(run.pops, grads[first_pop:]):
            skips[key] = grad
        grads = grads[:first_pop]
    return grads, pending


def _arrived(leaf: Tensor, grad: Tensor | None) -> Tensor | None:
    """``grad`` plus what the loss's own backward left in ``leaf.grad`` (where the loss read a
    tensor a layer kept, see ``Compute.backward``), which it takes out."""
    if not (leaf.requires_grad and leaf.is_leaf) or leaf.grad is None:
        return grad
    early, leaf.grad = leaf.grad, None
    return early if grad is None else grad + early


def _whole_backward(
    outputs: list[Tensor], grads: list[Tensor], wanted: list[Tensor]
) -> list[Tensor | None]:
    """The input gradients of a run whose backward cannot keep its graph for a later W (a
    ``torch.compile``'d layer: AOTAutograd's compiled backward, with donated buffers, refuses
    ``retain_graph``) or be restricted to chosen tensors (a reentrant checkpoint): one plain
    backward, which accumulates every weight gradient now, as W would have. ``wanted`` are
    fresh leaves of this run's call."""
    torch.autograd.backward(outputs, grads)
    result = []
    for leaf in wanted:
        result.append(leaf.grad)
        leaf.grad = None
    return result


def _reach(run: LayerRun, runs: list[LayerRun], reaches: Reaches | None) -> Reach:
    """``run``'s reach, kept in ``reaches``, or learned from its graph (``runs``: the others
    of its call)."""
    key = tuple(map(id, run.layers))
    reach = None if reaches is None else reaches.get(key)
    if reach is None:
        reach = _learn(run, runs)
        if reaches is not None:
            reaches[key] = reach
    return reach


def _learn(run: LayerRun, runs: list[LayerRun]) -> Reach:
    """Walk ``run``'s graph from its outputs to the leaves that end it: its weights (its
    layers' parameters first) and whether it holds a reentrant checkpoint. A leaf of another
    run of the call means a layer reads an earlier one's tensor past the cut (kept in an
    attribute): that gradient would be lost, so it is refused."""
    own = [p for layer in run.layers if isinstance(layer, nn.Module) for p in layer.parameters()]
    found: dict[int, Tensor] = {id(p): p for p in own}
    inputs = {id(t) for t in run.inputs}
    others = {id(t) for r in runs if r is not run for t in r.inputs if t.requires_grad}
    whole = False
    seen: set[int] = set()
    stack: list[Any] = [t.grad_fn for t in run.outputs if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        variable = getattr(node, "variable", None)  # an AccumulateGrad: a leaf's end
        if variable is not None:
            if id(variable) in others:
                raise RuntimeError(_past_the_cut(run, runs))
            if variable.requires_grad and id(variable) not in inputs:
                found.setdefault(id(variable), variable)
            continue
        whole = whole or type(node).__name__ == "CheckpointFunctionBackward"
        stack.extend(next_node for next_node, _ in node.next_functions)
    return Reach(tuple(found.values()), whole)


def _past_the_cut(run: LayerRun, runs: list[LayerRun]) -> str:
    names = [type(layer).__name__ for r in runs for layer in r.layers]
    at = sum(len(r.layers) for r in runs[: runs.index(run)])
    which = " or ".join(f"{at + k} ({names[at + k]})" for k in range(len(run.layers)))
    return (
        f"a split backward (zero_bubble) cuts a stage's graph between its layers, so a layer "
        f"may read an earlier layer's tensors only through its input: layer {which} of the "
        f"stage ({', '.join(names)}) reached an earlier layer's graph another way (a tensor "
        f"kept in an attribute or a closure), and that gradient would be lost; pass the "
        f"tensor on in the value the layers return, or use another schedule"
    )


def weight_backward(pending: list[tuple[LayerRun, list[Tensor | None]]]) -> None:
    """W: accumulate every run's weight gradients from the gradients of its outputs."""
    for run, grads in pending:
        weights = [w for w in run.weights if w.requires_grad]
        pairs = _pairs(run.outputs, grads)
        if weights and pairs:
            try:
                torch.autograd.backward(
                    [t for t, _ in pairs], [g for _, g in pairs], inputs=weights
                )
            except RuntimeError as e:
                if "use_reentrant" not in str(e):
                    raise
                raise RuntimeError(
                    "a split backward (zero_bubble) runs a layer's weight gradients on their own, "
                    "which torch.utils.checkpoint(use_reentrant=True) refuses; a layer began "
                    "using one after its first backward (B runs the whole backward of a layer "
                    "that used one there): pass use_reentrant=False, or use another schedule"
                ) from e
