"""Skip routes: which segment stashes each skip, which pops it, and what crosses between them.

A stash and its pop in one segment stay inside that segment's autograd graph and cost nothing.
A skip between two segments travels directly from one to the other (never through the
segments in between): by message when the segments are on different ranks, by hand-over when
they share one. Its gradient travels back along the same edge::

    segment 0 ──F: activations──> segment 1 ──F──> segment 2
        └──────────── F: skip 'x' (one message per micro-batch) ──────┘
        ┌──────────── B: gradient of 'x' ─────────────────────────────┘
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from torch import nn

from ..partition import Segment
from .namespace import SkipKey
from .verify import declarations, probe, skippable_inside, verify_skippables

__all__: list[str] = []


@dataclass(frozen=True)
class SkipRoutes:
    """Per segment: the skips it sends to and takes from other segments.

    ``outgoing[s][t]`` lists (in a fixed order) the keys stashed in segment ``s`` and popped in
    segment ``t != s``; ``incoming[t][s]`` is the same list seen from ``t``.
    """

    outgoing: dict[int, dict[int, tuple[SkipKey, ...]]] = field(default_factory=dict)
    incoming: dict[int, dict[int, tuple[SkipKey, ...]]] = field(default_factory=dict)
    leaving: dict[int, frozenset[SkipKey]] = field(default_factory=dict)
    """Per segment, every key it stashes for another segment (what :meth:`crossing` returns)."""

    def crossing(self, segment: int) -> frozenset[SkipKey]:
        """The keys stashed in ``segment`` that other segments pop."""
        return self.leaving.get(segment, frozenset())

    def edges(self) -> set[tuple[int, int]]:
        """Every (stashing segment, popping segment) pair with at least one skip."""
        return {(s, t) for s, out in self.outgoing.items() for t in out}

    def __bool__(self) -> bool:
        return bool(self.outgoing)


def skip_routes(layers: Sequence[object], segment_of: Sequence[int]) -> SkipRoutes:
    """The routes of the skips of ``layers`` (in call order) where position ``p`` runs in
    segment ``segment_of[p]``. Assumes the skips passed :func:`verify_skippables`."""
    stashed_at: dict[SkipKey, int] = {}
    pairs: dict[tuple[int, int], list[SkipKey]] = {}
    for position, layer in enumerate(layers):
        stashes, pops = declarations(layer)
        for key in pops:
            source = segment_of[stashed_at[key]]
            if source != segment_of[position]:
                pairs.setdefault((source, segment_of[position]), []).append(key)
        for key in stashes:
            stashed_at[key] = position
    routes = SkipRoutes()
    for (s, t), keys in sorted(pairs.items()):
        # The same order on every rank: by the position of the stash, then by name.
        ordered = tuple(sorted(keys, key=lambda k: (stashed_at[k], k[1])))
        routes.outgoing.setdefault(s, {})[t] = ordered
        routes.incoming.setdefault(t, {})[s] = ordered
        routes.leaving[s] = routes.leaving.get(s, frozenset()) | set(ordered)
    return routes


def has_skips(layers: Sequence[object], built: Sequence[nn.Module]) -> bool:
    """Whether this rank sees a skippable layer: one of the modules in ``layers`` (every rank
    holds those) or of its own ``built`` layers. No LazyModule's function runs here: every
    LazyModule is some rank's own, so the ranks' answers together cover the whole model."""
    return any(skippable_inside(layer) for layer in [*layers, *built])


def find_routes(layers: Sequence[object], segments: Sequence[Segment]) -> SkipRoutes:
    """Check the model's skip connections and find which cross between segments.

    Reads the declarations of every layer: a LazyModule built here is its own, another is
    built on the meta device (see :func:`~asyncpipe.skip.verify.probe`)."""
    segment_of = [0] * len(layers)
    owner = [0] * len(layers)
    for segment in segments:
        for invocation in segment.invocations:
            segment_of[invocation.order] = segment.index
            owner[invocation.order] = invocation.this.stage
    views = [probe(layer, n, owner[n]) for n, layer in enumerate(layers)]
    if not any(skippable_inside(v) for v in views):
        return SkipRoutes()
    positions: dict[int, list[int]] = {}
    for n, layer in enumerate(layers):
        positions.setdefault(id(layer), []).append(n)
    reused = [p for p in positions.values() if len(p) > 1 and skippable_inside(views[p[0]])]
    if reused:
        raise ValueError(
            f"a skippable layer may appear at one position only (positions {reused} reuse one); "
            f"use separate instances, each with its own Namespace via .isolate(Namespace())"
        )
    verify_skippables(views)
    return skip_routes(views, segment_of)


def describe_routes(routes: SkipRoutes) -> str:
    """The routes in a form that is the same in every process for the same skips: segments and
    skip names (namespaces are objects of one process), e.g. ``"0->2: 'x', 'y'"``."""
    return "; ".join(
        f"{s}->{t}: " + ", ".join(repr(name) for _, name in keys)
        for s, out in sorted(routes.outgoing.items())
        for t, keys in sorted(out.items())
    )
