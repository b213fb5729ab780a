"""Cut points: mark where a stage boundary may go in any model, then split it into segments.

The user creates :class:`CutPoint` modules in ``__init__`` and calls them on activations in
``forward``; on its own a cut point is the identity. :func:`sequentialize` traces the model with
``torch.fx`` (cut points stay opaque calls), runs the traced graph once on an example input to
learn what every value is, and splits the graph at the cut points into an ``nn.Sequential`` of
segments. A value made before a cut and still needed after it (a residual, an attention mask,
one of the model's inputs) crosses the cut with the activation::

    forward(x, mask):  h = emb(x) ──cut0──> h = blk(h, mask) ──cut1──> head(h)
    segments:          0: (x, mask) -> (h, mask)   1: (h, mask) -> h   2: h -> head(h)

Each segment takes and returns a tensor or a flat tuple of tensors, as AsyncPipe's layers do;
its parameters are the model's own objects (no copies), under their names in the model.
"""

from __future__ import annotations

import linecache
import os
import re
import traceback
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import Tensor, nn

from .recompute import forked_rng

__all__ = ["CutPoint", "CutSegment", "sequentialize"]

_TORCH_DIR = os.path.dirname(torch.__file__)


class CutPoint(nn.Module):
    """A place in ``forward`` where :func:`sequentialize` may put a stage boundary.

    Called on a tensor or a tuple of tensors, it returns its argument unchanged. Create one
    instance per place (an instance may run only once per forward).

    Example:
        >>> import torch
        >>> from torch import nn
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


def _user_line(tb: Any) -> str:
    """``file:line: code`` of the innermost frame of ``tb`` outside torch (or '')."""
    found = ""
    for frame in traceback.extract_tb(tb):
        if not frame.filename.startswith(_TORCH_DIR) and frame.filename != __file__:
            code = frame.line or linecache.getline(frame.filename, frame.lineno or 0).strip()
            found = f"{frame.filename}:{frame.lineno}: {code}"
    return found


def _node_line(node: fx.Node) -> str:
    """The user's line that made ``node``, from the stack recorded while tracing."""
    trace = (node.stack_trace or "").strip().splitlines()
    found = ""
    for n, line in enumerate(trace):
        match = re.match(r'\s*File "(.*)", line (\d+)', line)
        if match and not match.group(1).startswith(_TORCH_DIR):
            code = trace[n + 1].strip() if n + 1 < len(trace) else ""
            found = f"{match.group(1)}:{match.group(2)}: {code}"
    return found


def _arity(value: object) -> int | None:
    """None for a tensor, n for a tuple of n tensors; raises TypeError for anything else."""
    if isinstance(value, Tensor):
        return None
    if isinstance(value, (tuple, list)) and all(isinstance(v, Tensor) for v in value):
        return len(value)
    raise TypeError(type(value).__name__)


def _describe(value: object) -> str:
    if isinstance(value, (tuple, list)):
        return f"{type(value).__name__} of ({', '.join(type(v).__name__ for v in value)})"
    return type(value).__name__


class CutSegment(nn.Module):
    """The part of a model between two cut points, as one pipeline layer.

    It takes the values that cross its first cut and returns those that cross its last (a
    tensor, or a flat tuple of tensors); a value that is a tuple of tensors travels flattened.
    ``module`` is the ``torch.fx.GraphModule`` that computes it; ``inputs`` and ``outputs`` name
    the values that cross in and out.
    """

    def __init__(
        self,
        module: fx.GraphModule,
        in_spec: Sequence[int | None],
        out_spec: Sequence[int | None],
        inputs: Sequence[str],
        outputs: Sequence[str],
        single_output: bool,
    ) -> None:
        super().__init__()
        self.module = module
        self.in_spec = tuple(in_spec)
        self.out_spec = tuple(out_spec)
        self.inputs = tuple(inputs)
        self.outputs = tuple(outputs)
        self.single_output = single_output

    def forward(self, value: Any) -> Any:
        flat = [value] if isinstance(value, Tensor) else list(value)
        args: list[Any] = []
        for arity in self.in_spec:
            if arity is None:
                args.append(flat.pop(0))
            else:
                args.append(tuple(flat[:arity]))
                del flat[:arity]
        result = self.module(*args)
        if self.single_output:
            return result
        out: list[Tensor] = []
        for arity, item in zip(self.out_spec, result):
            out.extend([item] if arity is None else item)
        return out[0] if len(out) == 1 else tuple(out)

    def named_model_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """This segment's parameters under their names in the original model (tied ones too)."""
        return list(self.module.named_parameters(remove_duplicate=False))

    def extra_repr(self) -> str:
        return f"inputs={list(self.inputs)}, outputs={list(self.outputs)}"


def _trace(model: nn.Module, leaves: tuple[type[nn.Module], ...]) -> fx.GraphModule:
    tracer = _Tracer(leaves)
    try:
        graph = tracer.trace(model)
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
    return fx.GraphModule(model, graph, type(model).__name__)


def _values(gm: fx.GraphModule, args: tuple[Any, ...]) -> dict[fx.Node, Any]:
    """Every node's value when ``gm`` runs on ``args`` (gradients off; RNG, buffers kept)."""
    seen: dict[fx.Node, Any] = {}

    class Recorder(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            value = super().run_node(n)
            seen[n] = value
            return value

    buffers = [(b, b.detach().clone()) for b in gm.buffers()]
    with forked_rng(), torch.no_grad():
        try:
            Recorder(gm).run(*args)
        finally:
            for b, value in buffers:  # e.g. BatchNorm statistics
                b.copy_(value)
    return seen


def sequentialize(
    model: nn.Module,
    example_input: Tensor | tuple[Tensor, ...],
    *,
    leaves: Sequence[type[nn.Module]] = (),
) -> nn.Sequential:
    """Split ``model`` at its :class:`CutPoint` calls into an ``nn.Sequential`` of segments.

    ``example_input`` is the model's positional argument (a tensor) or arguments (a tuple of
    tensors); the traced model runs once on it to learn what crosses each cut (gradients off,
    RNG state and buffers restored). Segment ``k`` runs the code between cut ``k - 1`` and cut
    ``k`` in call order; ``AsyncPipe(sequentialize(model, x), balance=...)`` then counts
    segments. The model is not changed and the segments hold its own parameters and buffers.

    Args:
        model: any module whose ``forward`` calls each of its cut points once.
        example_input: a sample of the input, as the pipeline will get it.
        leaves: module types to keep opaque while tracing (e.g. one with a data-dependent
            branch inside); a cut point inside such a module is not seen.

    Raises:
        TypeError: forward cannot be traced (with the user's line), or a value that is not a
            tensor or a tuple of tensors crosses a cut.
        ValueError: a cut point runs more than once or never.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> class Net(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        ...         self.cut = CutPoint()
        ...     def forward(self, x):
        ...         h = self.cut(self.a(x))
        ...         return self.b(h) + x            # x crosses the cut with h
        >>> net, x = Net(), torch.randn(3, 4)
        >>> seq = sequentialize(net, x)
        >>> [list(s.inputs) for s in seq]
        [['x'], ['x', 'cut']]
        >>> torch.allclose(seq(x), net(x))
        True
    """
    gm = _trace(model, tuple(leaves))
    args = example_input if isinstance(example_input, tuple) else (example_input,)
    nodes = list(gm.graph.nodes)
    names = {m: n for n, m in model.named_modules() if isinstance(m, CutPoint)}
    calls: dict[str, list[fx.Node]] = {}
    for node in nodes:
        if node.op == "call_module" and isinstance(gm.get_submodule(str(node.target)), CutPoint):
            calls.setdefault(str(node.target), []).append(node)
    problems = []
    for target, used in calls.items():
        if len(used) > 1:
            lines = "; ".join(_node_line(n) or n.name for n in used)
            problems.append(
                f"cut point {target!r} runs {len(used)} times in one forward ({lines}); create "
                f"one CutPoint per place (e.g. an nn.ModuleList of them for a loop)"
            )
    never = sorted(name for name in names.values() if name not in calls)
    if never:
        problems.append(
            f"cut points {never} never ran in forward; call each where a stage boundary may go, "
            f"or delete it (a cut point inside a module passed in leaves=(...) is not seen)"
        )
    if problems:
        raise ValueError("; ".join(problems))
    placeholders = [n for n in nodes if n.op == "placeholder"]
    if len(placeholders) != len(args):
        raise TypeError(
            f"example_input must hold one tensor per positional argument of forward "
            f"(forward takes {len(placeholders)}: {[n.name for n in placeholders]}, got "
            f"{len(args)}); pass a tuple of tensors for several arguments"
        )
    values = _values(gm, args)

    # Segment of each node: cut points seen before it (a cut point ends its segment).
    segment: dict[fx.Node, int] = {}
    count = 0
    for node in nodes:
        segment[node] = count
        if node.op == "call_module" and str(node.target) in calls:
            count += 1
    segments = count + 1
    output = next(n for n in nodes if n.op == "output")
    segment[output] = segments - 1

    # What crosses into each segment: values made earlier and used here or later.
    crossing: list[list[fx.Node]] = [placeholders] + [[] for _ in range(segments - 1)]
    for node in nodes:
        if node.op in ("get_attr", "output"):
            continue
        last = max((segment[user] for user in node.users), default=segment[node])
        for k in range(segment[node] + 1, last + 1):
            crossing[k].append(node)
    bad = []
    for k in range(1, segments):
        for node in crossing[k]:
            try:
                _arity(values[node])
            except TypeError:
                line = _node_line(node)
                bad.append(
                    f"{node.name!r} ({_describe(values[node])}) crosses cut {k - 1}"
                    + (f", made at {line}" if line else "")
                )
    if bad:
        raise TypeError(
            "only tensors or tuples of tensors may cross a cut point, but "
            + "; ".join(bad)
            + "; compute such values after the cut, or turn them into tensors"
        )
    result = values[output.args[0]] if output.args else None
    try:
        _arity(result)
    except TypeError:
        raise TypeError(
            f"the model's output must be a tensor or a tuple of tensors to leave the pipeline "
            f"(got {_describe(result)}); return a tensor, or a tuple of tensors"
        ) from None
    return nn.Sequential(
        *[_build(gm, nodes, segment, crossing, values, k, segments) for k in range(segments)]
    )


def _build(
    gm: fx.GraphModule,
    nodes: list[fx.Node],
    segment: dict[fx.Node, int],
    crossing: list[list[fx.Node]],
    values: dict[fx.Node, Any],
    k: int,
    segments: int,
) -> CutSegment:
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in crossing[k]:
        env[node] = graph.placeholder(node.name)

    def lookup(n: fx.Node) -> fx.Node:
        if n not in env:  # a parameter or buffer read in an earlier segment: read it again
            assert n.op == "get_attr", n
            env[n] = graph.node_copy(n, lookup)
        return env[n]

    for node in nodes:
        if segment[node] != k or node.op in ("placeholder", "output"):
            continue
        if node.op == "get_attr" and all(segment[u] != k for u in node.users):
            continue
        env[node] = graph.node_copy(node, lookup)
    if k == segments - 1:
        out = next(n for n in nodes if n.op == "output")
        graph.output(fx.map_arg(out.args[0], lookup))
        result = values[out.args[0]]  # type: ignore[index]
        outputs = [out.name]
        out_spec: list[int | None] = [_arity(result)]
        single = True
    else:
        sent = crossing[k + 1]
        graph.output(tuple(lookup(n) for n in sent))
        outputs = [n.name for n in sent]
        out_spec = [_arity(values[n]) for n in sent]
        single = False
    graph.lint()
    module = fx.GraphModule(gm, graph, f"Segment{k}")
    in_spec = [_arity(values[n]) for n in crossing[k]]
    return CutSegment(module, in_spec, out_spec, [n.name for n in crossing[k]], outputs, single)
