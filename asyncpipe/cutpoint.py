"""The cut point, and the torch.fx trace of a model that holds cut points.

:class:`CutPoint` marks where a stage boundary may go; :func:`trace_graph` turns the model's
``forward`` into a graph in which each cut point is one opaque call, code run under
``torch.no_grad()`` runs without gradients again (fx records no grad mode), and a use of a cut
point's argument after it uses the cut's value. :func:`~asyncpipe.sequentialize` splits
that graph.
"""

from __future__ import annotations

import contextlib
import inspect
import linecache
import operator
import os
import re
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx as fx
from torch import nn

__all__ = ["CutPoint"]

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_OWN_DIR = os.path.dirname(__file__) + os.sep
"""Frames in asyncpipe itself are not the user's code."""
_NO_GRAD = "asyncpipe_no_grad"
"""``node.meta`` key: the tracer made this node while gradients were off in ``forward``."""


class CutPoint(nn.Module):
    """A place in ``forward`` where :func:`~asyncpipe.sequentialize` may put a stage boundary.

    Called on a tensor or a tuple of tensors, it returns its argument unchanged. Create one
    instance per place (an instance may run only once per forward).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from asyncpipe import sequentialize
        >>> class Net(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.a, self.cut, self.b = nn.Linear(4, 4), CutPoint(), nn.Linear(4, 4)
        ...     def forward(self, x):
        ...         return self.b(self.cut(torch.relu(self.a(x))))
        >>> len(sequentialize(Net(), torch.zeros(2, 4)))
        2
    """

    def forward(self, value: Any) -> Any:
        return value


class _Tracer(fx.Tracer):
    def __init__(self, leaves: tuple[type[nn.Module], ...]) -> None:
        super().__init__()
        self.leaves = leaves
        self.record_stack_traces = True

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if isinstance(m, (CutPoint, *self.leaves)):
            return True
        return super().is_leaf_module(m, module_qualified_name)

    def create_node(self, *args: Any, **kwargs: Any) -> fx.Node:
        node = super().create_node(*args, **kwargs)
        if not torch.is_grad_enabled():  # inside `with torch.no_grad():`, which fx drops
            node.meta[_NO_GRAD] = True
        return node


def _user_line(tb: Any) -> str:
    """``file:line: code`` of the innermost frame of ``tb`` outside torch (or '')."""
    found = ""
    for frame in traceback.extract_tb(tb):
        if not frame.filename.startswith((_TORCH_DIR, _OWN_DIR)):
            code = frame.line or linecache.getline(frame.filename, frame.lineno or 0).strip()
            found = f"{frame.filename}:{frame.lineno}: {code}"
    return found


def node_line(node: fx.Node) -> str:
    """The user's line that made ``node``, from the stack recorded while tracing."""
    trace = (node.stack_trace or "").strip().splitlines()
    found = ""
    for n, line in enumerate(trace):
        match = re.match(r'\s*File "(.*)", line (\d+)', line)
        if (
            match
            and not match.group(1).startswith(_TORCH_DIR)
            and not match.group(1).startswith(_OWN_DIR)
        ):
            code = trace[n + 1].strip() if n + 1 < len(trace) else ""
            found = f"{match.group(1)}:{match.group(2)}: {code}"
    return found


def fixed_arguments(
    model: nn.Module, given: tuple[Any, ...]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The example's arguments without its trailing ``None``s, and ``concrete_args`` for
    tracing: ``None`` for a trailing argument given as ``None``, the default for a trailing
    parameter not given (up to the first one without a default)."""
    args = list(given)
    while args and args[-1] is None:
        args.pop()
    if any(a is None for a in args):
        raise TypeError(
            "example_input holds None before a tensor; only trailing arguments of forward may "
            "be None or left out (they are fixed while tracing, and the pipeline's input holds "
            "the arguments before them)"
        )
    try:
        parameters = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return tuple(args), {}
    concrete: dict[str, Any] = {}
    for n, p in enumerate(parameters):
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            break
        if n < len(args):
            continue
        if n < len(given):
            concrete[p.name] = None
        elif p.default is not p.empty:
            concrete[p.name] = p.default
        else:
            break
    return tuple(args), concrete


@contextlib.contextmanager
def all_in_mode(root: nn.Module, training: bool) -> Iterator[None]:
    """Every module of ``root`` in ``training`` mode for a while (flags restored after)."""
    flags = [(m, m.training) for m in root.modules()]
    for m, _ in flags:
        m.training = training
    try:
        yield
    finally:
        for m, flag in flags:
            m.training = flag


def is_cut(root: nn.Module, node: fx.Node) -> bool:
    return node.op == "call_module" and isinstance(root.get_submodule(str(node.target)), CutPoint)


def _call_without_grad(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    with torch.no_grad():
        return fn(*args, **kwargs)


def _call_method_without_grad(name: str, obj: Any, *args: Any, **kwargs: Any) -> Any:
    with torch.no_grad():
        return getattr(obj, name)(*args, **kwargs)


def trace_graph(
    root: nn.Module,
    leaves: tuple[type[nn.Module], ...],
    concrete: dict[str, Any],
    given: int,
    functions: dict[Callable[..., Any], str],
) -> fx.Graph:
    """``root``'s forward as a graph: fixed arguments taken out, no-grad code kept without
    gradients, and uses of a cut point's argument after it turned into uses of the cut."""
    tracer = _Tracer(leaves)
    try:
        with torch.enable_grad():
            graph = tracer.trace(root, concrete_args=concrete or None)
    except Exception as e:
        where = _user_line(e.__traceback__)
        raise TypeError(
            f"sequentialize traces forward() with torch.fx, which cannot follow this code "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
            + (f" at {where}" if where else "")
            + "; tracing replaces tensors and their sizes by placeholders, so Python control "
            "flow on them, or a size passed where a plain int is needed, fails: move such code "
            "into a module and pass its type in leaves=(...), or write it with tensor "
            "operations (e.g. slice a precomputed buffer)"
        ) from e
    # The fixed arguments' placeholders and the checks fx adds on them go.
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    dead = set(placeholders[given : given + len(concrete)])
    for node in graph.nodes:
        if any(n in dead for n in node.all_input_nodes):
            dead.add(node)
    for node in reversed(list(graph.nodes)):
        if node in dead:
            graph.erase_node(node)
    # fx records no grad mode: what forward ran without gradients runs under no_grad again,
    # called by _call_without_grad (a function as an attribute of the root: it pickles).
    for node in list(graph.nodes):
        if not node.meta.get(_NO_GRAD) or is_cut(root, node):
            continue
        if node.op == "call_method":
            node.args = (node.target, *node.args)
            node.op, node.target = "call_function", _call_method_without_grad
        elif node.op in ("call_function", "call_module"):
            target = node.target
            if node.op == "call_function":
                target = functions.setdefault(node.target, f"_no_grad_fn{len(functions)}")
                setattr(root, target, node.target)
            with graph.inserting_before(node):
                fn = graph.get_attr(str(target))
            node.args = (fn, *node.args)
            node.op, node.target = "call_function", _call_without_grad
    # A cut point returns its argument: later uses of the argument use the cut's value.
    for cut in [n for n in graph.nodes if is_cut(root, n)]:
        order = {n: i for i, n in enumerate(graph.nodes)}
        value = cut.args[0] if cut.args else None
        items: list[tuple[fx.Node, int | None]] = []
        if isinstance(value, fx.Node):
            items = [(value, None)]
        elif isinstance(value, (tuple, list)):
            items = [(v, i) for i, v in enumerate(value) if isinstance(v, fx.Node)]
        for node, index in items:
            later = [u for u in node.users if order.get(u, -1) > order[cut]]
            if not later:
                continue
            new = cut
            if index is not None:
                with graph.inserting_after(cut):
                    new = graph.call_function(operator.getitem, (cut, index))
            for user in later:
                user.replace_input_with(node, new)
    return graph


@contextlib.contextmanager
def buffers_kept(model: nn.Module) -> Iterator[None]:
    """Restore ``model``'s buffers after tracing; raise if tracing changed one.

    fx does not trace reads of buffers: an in-place change of a buffer by constants (say
    ``self.steps.add_(1)``) runs once while tracing and is missing from the graph."""
    buffers = [(name, b) for name, b in model.named_buffers() if not b.is_meta]
    saved = [(name, b, b.detach().clone()) for name, b in buffers]
    try:
        yield
    finally:
        changed = []
        with torch.no_grad():
            for name, b, value in saved:
                same = b.shape == value.shape and bool(
                    ((b == value) | (b != b) & (value != value)).all()
                )
                if not same:
                    changed.append(name)
                    b.copy_(value)
    if changed:
        raise TypeError(
            f"forward changes buffers {changed} in place with constant arguments (say "
            f"self.steps.add_(1)); torch.fx runs such code once while tracing instead of "
            f"recording it, so the segments would skip it: do the update in a module passed in "
            f"leaves=(...), or outside forward"
        )
