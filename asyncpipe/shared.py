"""Shared weights: parameters that must stay equal on different stages, like a tied embedding.

Each stage that uses one of a group's parameters keeps its own copy. The copies start equal
(the lowest owning rank broadcasts them when the pipeline is built) and stay equal because,
after each backward, every owner adds this step's gradient of all copies::

    stage 0: tok.weight  grad g0 ─┐
                                  ├─ all-reduce(sum) ─> both grads += g0 + g3 (this step's part)
    stage 3: head.weight grad g3 ─┘

so an optimizer step sees the gradient of the tied model on every copy. Only this step's part
is summed, so gradients accumulated over several steps are not counted twice.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .group import GroupRef, new_group
from .lazy import LazyModule
from .partition import Layer, Partition

__all__: list[str] = []


def layer_parameter_names(position: int, layer: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Names a parameter of ``layer`` at ``position`` answers to: ``"<position>.<name>"`` as in
    the ``nn.Sequential``, and the name in the original model for a cut segment."""
    original = getattr(layer, "named_model_parameters", None)
    names: list[tuple[str, nn.Parameter]] = list(original()) if callable(original) else []
    return names + [
        (f"{position}.{name}", p) for name, p in layer.named_parameters(remove_duplicate=False)
    ]


@dataclass
class _Group:
    names: tuple[str, ...]
    owners: tuple[int, ...]
    local: list[nn.Parameter]
    group: GroupRef | None
    """The owners' process group (held weakly: torch.distributed owns it)."""


@dataclass
class SharedGroup:
    """A group of ``shared_weights`` as found in the model: its names, the stages that own
    any of its parameters, and this rank's copies."""

    names: tuple[str, ...]
    owners: tuple[int, ...]
    local: list[nn.Parameter]


def find_shared(
    groups: Sequence[Sequence[str] | str],
    layers: Sequence[Layer],
    partitions: Sequence[Partition],
    rank: int,
    built: Mapping[int, nn.Module],
) -> list[SharedGroup]:
    """Find the parameters ``groups`` name, and check them: every name exists, a group's
    shapes agree, and every parameter used on several stages is named.

    ``built`` holds this rank's built layer at each of its positions. A ``LazyModule`` is
    built on its owner only, so elsewhere a name ``"<position>.<name>"`` of one is taken on
    trust (its owner checks it) and parameters it shares with other stages cannot be seen.
    Raises ValueError on this rank alone where only it can see the problem: call it where a
    failure reaches the other ranks (the constructor's first exchange)."""
    owner = {id(layer): p.stage for p in partitions for layer in p.layers}
    found: dict[str, list[tuple[int, nn.Parameter]]] = {}
    by_object: dict[int, set[int]] = {}
    param_names: dict[int, str] = {}
    unbuilt: dict[str, int] = {}  # position of a LazyModule built elsewhere -> its stage
    for position, layer in enumerate(layers):
        stage = owner[id(layer)]
        module: nn.Module | None = layer if not isinstance(layer, LazyModule) else None
        if module is None:
            module = built.get(position)
            if module is None:
                unbuilt[str(position)] = stage
                continue
        for name, p in layer_parameter_names(position, module):
            found.setdefault(name, []).append((stage, p))
            by_object.setdefault(id(p), set()).add(stage)
            param_names.setdefault(id(p), name)

    def elsewhere(name: str) -> int | None:
        """The stage of the LazyModule built elsewhere that ``name`` names, if any."""
        return unbuilt.get(name.split(".", 1)[0]) if "." in name else None

    problems = []
    named: set[int] = set()
    tuples = [(group,) if isinstance(group, str) else tuple(group) for group in groups]
    for group in tuples:
        if not group or not all(isinstance(n, str) for n in group):
            problems.append(
                f"each entry of shared_weights must be a parameter name or a tuple of them "
                f"(got {group!r}); e.g. shared_weights=[('tok.weight', 'head.weight')]"
            )
            continue
        missing = [n for n in group if n not in found and elsewhere(n) is None]
        if missing:
            known = sorted(found)
            problems.append(
                f"shared_weights names parameters that no layer has: {missing} (known: "
                f"{known[:8]}{' ...' if len(known) > 8 else ''}); use names from the "
                f"original model or '<position>.<name>' in the nn.Sequential (a LazyModule's "
                f"only as '<position>.<name>')"
            )
            continue
        shapes = {n: tuple(found[n][0][1].shape) for n in group if n in found}
        if len(set(shapes.values())) > 1:
            problems.append(f"shared weights must have the same shape (got {shapes})")
        named.update(id(p) for n in group for _, p in found.get(n, []))
    spread = {
        param_names[key]: sorted(stages)
        for key, stages in by_object.items()
        if len(stages) > 1 and key not in named
    }
    if spread:
        problems.append(
            f"parameters used on several stages must be named in shared_weights so their "
            f"copies stay equal (used on: {spread}); pass shared_weights="
            f"{[*map(tuple, tuples), *[(n,) for n in spread]]!r}"
        )
    if problems:
        raise ValueError("; ".join(problems))
    everywhere = [pair for pairs in found.values() for pair in pairs]
    out = []
    for group in tuples:
        objects = {id(p) for n in group for _, p in found.get(n, [])}
        stages = {stage for key in objects for stage in by_object[key]}
        stages.update(s for s in map(elsewhere, group) if s is not None)
        local: list[nn.Parameter] = []
        for stage, p in everywhere:
            if stage == rank and id(p) in objects and all(p is not q for q in local):
                local.append(p)
        out.append(SharedGroup(tuple(group), tuple(sorted(stages)), local))
    return out


class SharedWeights:
    """Keeps each group of named parameters equal across the stages that own them.

    Built on every rank with the groups :func:`find_shared` found there (it creates one
    process group per group that spans ranks, in the order given, which
    ``torch.distributed.new_group`` requires).
    """

    def __init__(
        self,
        groups: Sequence[SharedGroup],
        rank: int,
        global_rank: dict[int, int] | None,
        timeout: float = 300.0,
    ) -> None:
        self.groups: list[_Group] = []
        self.created: list[weakref.ref[dist.ProcessGroup]] = []
        """The process groups created here that this rank belongs to, in order of creation."""
        for found in groups:
            process_group = None
            if len(found.owners) > 1:
                if global_rank is None:
                    raise ValueError(
                        f"shared weights on several stages ({list(found.names)} on stages "
                        f"{list(found.owners)}) are kept equal over torch.distributed: pass "
                        f"transport='p2p' or 'shm' (not 'rpc' or an in-process transport)"
                    )
                process_group = new_group(
                    [global_rank[s] for s in found.owners], timeout=timedelta(seconds=timeout)
                )
            # ranks outside ``owners`` get a placeholder from new_group, and no local copies
            member = isinstance(process_group, dist.ProcessGroup)
            held = GroupRef(process_group) if member else None
            self.groups.append(_Group(found.names, found.owners, found.local, held))
            if isinstance(process_group, dist.ProcessGroup):  # for the pipeline's close()
                self.created.append(weakref.ref(process_group))
        self.rank = rank
        self._global = global_rank or {}
        self._copy_first()

    def _copy_first(self) -> None:
        """Make every copy equal to the lowest owner's."""
        with torch.no_grad():
            for g in self.groups:
                if not g.local:
                    continue
                value = g.local[0].detach().clone()
                if g.group is not None:
                    dist.broadcast(value, self._global[g.owners[0]], group=g.group())
                for p in g.local:
                    p.copy_(value)

    def repeated(self) -> set[int]:
        """The ids of this rank's copies that a norm over every stage leaves out so that each
        group counts once, as the tied parameter does in the plain model: all copies but the
        lowest owner's first."""
        left_out: set[int] = set()
        for g in self.groups:
            first = 1 if g.owners and g.owners[0] == self.rank else 0
            left_out.update(id(p) for p in g.local[first:])
        return left_out

    def snapshot(self) -> list[list[Tensor | None]]:
        """The local gradients before a backward, to find what it adds."""
        return [
            [None if p.grad is None else p.grad.detach().clone() for p in g.local]
            for g in self.groups
        ]

    def reduce(self, before: list[list[Tensor | None]]) -> None:
        """Add every copy's gradient of the last backward to every copy of its group."""
        with torch.no_grad():
            for g, old in zip(self.groups, before):
                if not g.local:
                    continue
                added = torch.zeros_like(g.local[0])
                for p, was in zip(g.local, old):
                    if p.grad is not None:
                        added += p.grad if was is None else p.grad - was
                if g.group is not None:
                    try:
                        dist.all_reduce(added, group=g.group())
                    except RuntimeError as e:
                        raise RuntimeError(
                            f"stage {self.rank} could not sum the gradients of shared weights "
                            f"{list(g.names)} with stages {list(g.owners)} (a stage failed or "
                            f"did not run this step within the timeout): {e}"
                        ) from e
                for p, was in zip(g.local, old):
                    p.grad = added.clone() if was is None else was + added
