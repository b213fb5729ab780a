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

What tracing alone would lose is kept: code that reads ``self.training`` is traced in both
modes (a segment whose code differs holds one graph per mode and runs the one of its own
mode), operations run under ``torch.no_grad()`` in ``forward`` run without gradients in the
segments too, and a use of a cut point's argument after the cut uses the cut point's value
(the same object, so it crosses once and an in-place change after the cut is seen by both).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx
from torch import Tensor, nn

from .cutpoint import (
    CutPoint,
    all_in_mode,
    buffers_kept,
    fixed_arguments,
    is_cut,
    node_line,
    trace_graph,
)
from .recompute import forked_rng

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["CutSegment", "sequentialize"]


def _arity(value: object) -> int | None:
    """None for a tensor, n for a tuple of n tensors; raises TypeError for anything else."""
    if isinstance(value, Tensor):
        return None
    if isinstance(value, (tuple, list)) and all(isinstance(v, Tensor) for v in value):
        return len(value)
    raise TypeError(type(value).__name__)


def _describe(value: object) -> str:
    if isinstance(value, (tuple, list)):
        kind = "tuple" if isinstance(value, tuple) else "list"
        return f"{kind} of ({', '.join(type(v).__name__ for v in value)})"
    return "dict" if isinstance(value, dict) else type(value).__name__


@dataclasses.dataclass(frozen=True)
class _Code:
    """A segment's code in one mode (training or eval): its graph and what crosses."""

    graph: fx.Graph
    in_spec: tuple[int | None, ...]
    out_spec: tuple[int | None, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    single_output: bool


class CutSegment(nn.Module):
    """The part of a model between two cut points, as one pipeline layer.

    It takes the values that cross its first cut and returns those that cross its last (a
    tensor, or a flat tuple of tensors); a value that is a tuple of tensors travels flattened.
    ``module`` is the ``torch.fx.GraphModule`` that computes it; ``inputs`` and ``outputs`` name
    the values that cross in and out. Where the model's code reads ``self.training`` (say
    ``F.dropout(h, p, self.training)``) and the segment's code differs between the modes, the
    segment holds one graph per mode, and ``module`` runs the one of the segment's own mode
    (``train()`` / ``eval()``, as ``pipe.train()`` and ``pipe.eval()`` set it).
    """

    def __init__(
        self, module: fx.GraphModule, training: _Code, evaluation: _Code | None = None
    ) -> None:
        super().__init__()
        self.module = module
        self._codes = {True: training, False: training if evaluation is None else evaluation}

    def _select(self, training: bool) -> _Code:
        code = self._codes[training]
        if self.module.graph is not code.graph:
            self.module.graph = code.graph  # recompiles the module's forward
        return code

    def train(self, mode: bool = True) -> Self:
        """Set the mode, as ``nn.Module.train`` does, and pick the mode's graph."""
        super().train(mode)
        self._select(mode)
        return self

    @property
    def in_spec(self) -> tuple[int | None, ...]:
        """Per input value: None for a tensor, n for a tuple of n tensors."""
        return self._codes[self.training].in_spec

    @property
    def out_spec(self) -> tuple[int | None, ...]:
        """Per output value: None for a tensor, n for a tuple of n tensors."""
        return self._codes[self.training].out_spec

    @property
    def inputs(self) -> tuple[str, ...]:
        """The names of the values that cross into this segment."""
        return self._codes[self.training].inputs

    @property
    def outputs(self) -> tuple[str, ...]:
        """The names of the values that cross out of it (``output`` for the model's)."""
        return self._codes[self.training].outputs

    @property
    def single_output(self) -> bool:
        """Whether this is the last segment: it returns the model's output as it is."""
        return self._codes[self.training].single_output

    def forward(self, value: Any) -> Any:
        code = self._select(self.training)
        flat = [value] if isinstance(value, Tensor) else list(value)
        args: list[Any] = []
        for arity in code.in_spec:
            if arity is None:
                args.append(flat.pop(0))
            else:
                args.append(tuple(flat[:arity]))
                del flat[:arity]
        result = self.module(*args)
        if code.single_output:
            return result
        out: list[Tensor] = []
        for arity, item in zip(code.out_spec, result):
            out.extend([item] if arity is None else item)
        return out[0] if len(out) == 1 else tuple(out)

    def named_model_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """This segment's parameters under their names in the original model (tied ones too)."""
        return list(self.module.named_parameters(remove_duplicate=False))

    def extra_repr(self) -> str:
        per_mode = ", one graph per mode" if self._codes[True] is not self._codes[False] else ""
        return f"inputs={list(self.inputs)}, outputs={list(self.outputs)}{per_mode}"


# ----- tracing -----------------------------------------------------------------------------


def _resolve(root: nn.Module, target: str) -> Any:
    value: Any = root
    for atom in target.split("."):
        value = getattr(value, atom)
    return value


def _same(a: nn.Module, graph_a: fx.Graph, b: nn.Module, graph_b: fx.Graph) -> bool:
    """Whether two traces are the same code on the same objects (or equal constants)."""
    if graph_a.python_code("self").src != graph_b.python_code("self").src:
        return False
    for node in graph_a.nodes:
        if node.op == "get_attr":
            x, y = _resolve(a, str(node.target)), _resolve(b, str(node.target))
            if x is y:
                continue
            if not (
                isinstance(x, Tensor)
                and isinstance(y, Tensor)
                and (x.dtype, x.shape, x.device) == (y.dtype, y.shape, y.device)
                and torch.equal(x, y)
            ):
                return False
    return True


def _move_constants(model: nn.Module, source: nn.Module, graph: fx.Graph, root: nn.Module) -> None:
    """Give the attributes tracing put on ``source`` (constants, functions) to ``root``."""
    made = set(vars(source)) - set(vars(model))
    names: dict[str, str] = {}
    for node in graph.nodes:
        if node.op == "get_attr" and node.target in made:
            target = str(node.target)
            value = getattr(source, target)
            if target not in names and getattr(root, target, None) is value:
                names[target] = target
            elif target not in names:
                prefix, n = target.rstrip("0123456789"), 0
                while hasattr(root, f"{prefix}{n}"):
                    n += 1
                names[target] = f"{prefix}{n}"
                setattr(root, names[target], value)
            node.target = names[target]


def _values(root: nn.Module, graph: fx.Graph, args: tuple[Any, ...]) -> dict[fx.Node, Any]:
    """Every node's value when ``graph`` runs on ``args`` (gradients off; RNG, buffers kept)."""
    gm = fx.GraphModule(root, graph)
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


@dataclasses.dataclass
class _Plan:
    """One traced graph, split: each node's segment and what crosses into each segment."""

    nodes: list[fx.Node]
    cuts: list[str]
    segment: dict[fx.Node, int]
    crossing: list[list[fx.Node]]
    values: dict[fx.Node, Any]
    output: fx.Node


def _plan(
    root: nn.Module, graph: fx.Graph, args: tuple[Any, ...], cut_names: Iterable[str], mode: str
) -> _Plan:
    nodes = list(graph.nodes)
    calls: dict[str, list[fx.Node]] = {}
    for node in nodes:
        if is_cut(root, node):
            calls.setdefault(str(node.target), []).append(node)
    problems = []
    for target, used in calls.items():
        if len(used) > 1:
            lines = "; ".join(node_line(n) or n.name for n in used)
            problems.append(
                f"cut point {target!r} runs {len(used)} times in one forward{mode} ({lines}); "
                f"create one CutPoint per place (e.g. an nn.ModuleList of them for a loop)"
            )
    never = sorted(name for name in cut_names if name not in calls)
    if never:
        problems.append(
            f"cut points {never} never ran in forward{mode}; call each where a stage boundary "
            f"may go, or delete it (a cut point inside a module passed in leaves=(...) is not "
            f"seen)"
        )
    if problems:
        raise ValueError("; ".join(problems))
    placeholders = [n for n in nodes if n.op == "placeholder"]
    if len(placeholders) != len(args):
        raise TypeError(
            f"example_input must hold one tensor per positional argument of forward "
            f"(forward takes {len(placeholders)}: {[n.name for n in placeholders]}, got "
            f"{len(args)}); pass a tuple of tensors for several arguments (trailing arguments "
            f"with a default may be left out, or given as None)"
        )
    values = _values(root, graph, args)

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
                line = node_line(node)
                bad.append(
                    f"{node.name!r} ({_describe(values[node])}) crosses cut {k - 1}"
                    + (f", made at {line}" if line else "")
                )
    if bad:
        raise TypeError(
            f"only tensors or tuples of tensors may cross a cut point{mode}, but "
            + "; ".join(bad)
            + "; compute such values after the cut, or turn them into tensors"
        )
    try:
        _arity(values[output])
    except TypeError:
        raise TypeError(
            f"the model's output must be a tensor or a tuple of tensors to leave the pipeline"
            f"{mode} (got {_describe(values[output])}); return a tensor, or a tuple of tensors"
        ) from None
    cuts = [str(n.target) for n in nodes if n.op == "call_module" and str(n.target) in calls]
    return _Plan(nodes, cuts, segment, crossing, values, output)


def sequentialize(
    model: nn.Module,
    example_input: Tensor | tuple[Tensor | None, ...],
    *,
    leaves: Sequence[type[nn.Module]] = (),
) -> nn.Sequential:
    """Split ``model`` at its :class:`CutPoint` calls into an ``nn.Sequential`` of segments.

    ``example_input`` is the model's positional argument (a tensor) or arguments (a tuple of
    tensors); the traced model runs once on it to learn what crosses each cut (gradients off,
    RNG state and buffers restored). Trailing parameters of ``forward`` with a default may be
    left out, or given as ``None``: they are fixed at that value while tracing (a branch on them
    is taken once), and the pipeline's input holds the arguments before them. Segment ``k`` runs
    the code between cut ``k - 1`` and cut ``k`` in call order; ``AsyncPipe(sequentialize(model,
    x), balance=...)`` then counts segments. The model is not changed and the segments hold its
    own parameters and buffers.

    ``forward`` is traced in training and in eval mode; where the code differs (it reads
    ``self.training``), a segment runs the code of its own mode. Operations run under
    ``torch.no_grad()`` in ``forward`` run without gradients in the segments too.

    Args:
        model: any module whose ``forward`` calls each of its cut points once.
        example_input: a sample of the input, as the pipeline will get it.
        leaves: module types to keep opaque while tracing (e.g. one with a data-dependent
            branch inside); a cut point inside such a module is not seen.

    Raises:
        TypeError: forward cannot be traced (with the user's line), a value that is not a
            tensor or a tuple of tensors crosses a cut or is the output, or ``example_input``
            does not fit forward's parameters.
        ValueError: a cut point runs more than once or never, or the cut points run in a
            different order in training and in eval mode.

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
    given = example_input if isinstance(example_input, tuple) else (example_input,)
    args, concrete = fixed_arguments(model, given)
    cut_names = [n for n, m in model.named_modules() if isinstance(m, CutPoint)]
    functions: dict[Callable[..., Any], str] = {}
    # Trace shallow copies: fx puts the tensor constants of forward on the traced root.
    current = model.training
    root, other_root = copy.copy(model), copy.copy(model)
    with buffers_kept(model):
        graphs = {current: trace_graph(root, tuple(leaves), concrete, len(args), functions)}
        with all_in_mode(other_root, not current):
            other = trace_graph(other_root, tuple(leaves), concrete, len(args), functions)
    if not _same(root, graphs[current], other_root, other):
        _move_constants(model, other_root, other, root)
        graphs[not current] = other
    plans: dict[bool, _Plan] = {}
    for training, graph in graphs.items():
        mode = "" if len(graphs) == 1 else f" (in {'training' if training else 'eval'} mode)"
        with all_in_mode(root, training) if training != current else contextlib.nullcontext():
            plans[training] = _plan(root, graph, args, cut_names, mode)
    if len(plans) == 2 and plans[True].cuts != plans[False].cuts:
        raise ValueError(
            f"forward runs its cut points in a different order in training mode "
            f"({plans[True].cuts}) and in eval mode ({plans[False].cuts}); run the same cut "
            f"points in the same order in both"
        )
    segments = [_segment(root, plans, k, current) for k in range(len(plans[current].cuts) + 1)]
    seq = nn.Sequential(*segments)
    seq.training = current
    return seq


def _segment(root: nn.Module, plans: dict[bool, _Plan], k: int, current: bool) -> CutSegment:
    """Segment ``k``, in the mode the model is in (``current``); with its other mode's code
    where the plans of the two modes differ."""
    codes = {training: _build(plan, k) for training, plan in plans.items()}
    two = len(codes) == 2 and _differ(codes[True], codes[False])
    if two:  # each graph names all attributes: the module holds both modes' own
        for code, other in ((codes[True], codes[False]), (codes[False], codes[True])):
            have = {n.target for n in code.graph.nodes if n.op in ("get_attr", "call_module")}
            output = next(n for n in code.graph.nodes if n.op == "output")
            for node in other.graph.nodes:
                if node.op in ("get_attr", "call_module") and node.target not in have:
                    have.add(node.target)
                    with code.graph.inserting_before(output):
                        code.graph.get_attr(str(node.target))
    module = fx.GraphModule(root, codes[current].graph, f"Segment{k}")
    if two:
        segment = CutSegment(module, codes[True], codes[False])
    else:
        segment = CutSegment(module, codes[current])
    segment.training = module.training = current
    return segment


def _differ(a: _Code, b: _Code) -> bool:
    """Whether two modes' codes of a segment differ (the same source reads the same root)."""
    if dataclasses.replace(a, graph=b.graph) != b:
        return True
    return bool(a.graph.python_code("self").src != b.graph.python_code("self").src)


def _build(plan: _Plan, k: int) -> _Code:
    nodes, segment, crossing, values = plan.nodes, plan.segment, plan.crossing, plan.values
    last = k == len(crossing) - 1
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
    if last:
        graph.output(fx.map_arg(plan.output.args[0], lookup))
        outputs = [plan.output.name]
        out_spec: list[int | None] = [_arity(values[plan.output])]
    else:
        sent = crossing[k + 1]
        graph.output(tuple(lookup(n) for n in sent))
        outputs = [n.name for n in sent]
        out_spec = [_arity(values[n]) for n in sent]
    graph.lint()
    in_spec = [_arity(values[n]) for n in crossing[k]]
    inputs = [n.name for n in crossing[k]]
    return _Code(graph, tuple(in_spec), tuple(out_spec), tuple(inputs), tuple(outputs), last)
