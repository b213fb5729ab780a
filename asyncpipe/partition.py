"""Partitioning: which stage owns which layer, and the order in which layers are invoked.

A model is a list of layer positions. ``balance`` splits the positions into consecutive stages
(one stage per pipeline rank). A layer object that appears at several positions (weight reuse)
is *owned* by the stage of its first position and every invocation of it runs there, so its
weights exist once. Consecutive invocations on one stage form a *segment*: the unit that the
schedule calls a stage. With no reuse across stages, segment ``s`` is stage ``s``; a reused layer
invoked inside another stage's range adds segments that run on its owner::

    layers  [A, B, C, A]   balance [2, 2]   owners  A->0  B->0  C->1
    positions 0 1 | 2 3    invocations  A@0 B@0 | C@1 | A@0
    segments     0: [A, B] on rank 0   1: [C] on rank 1   2: [A] on rank 0
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from .lazy import LazyModule

__all__ = ["Invocation", "Location", "Partition", "Segment", "partition"]

Layer = nn.Module | LazyModule


@dataclass(frozen=True)
class Location:
    """Where a layer lives: the ``index``-th layer owned by ``stage``."""

    stage: int
    index: int


@dataclass(frozen=True)
class Invocation:
    """The ``order``-th call of the model: the layer at ``this``, after ``source``, before
    ``dest`` (``None`` at the ends of the model)."""

    order: int
    this: Location
    source: Location | None
    dest: Location | None


@dataclass(frozen=True)
class Partition:
    """What one stage owns: its layers (by ``Location.index``) and the invocations it runs."""

    stage: int
    layers: tuple[Layer, ...]
    invocations: tuple[Invocation, ...]


@dataclass(frozen=True)
class Segment:
    """A run of consecutive invocations on one stage: what the schedule calls a stage."""

    index: int
    stage: int
    invocations: tuple[Invocation, ...]


def partition(
    layers: Sequence[Layer], balance: Sequence[int], ranks: int | None = None
) -> tuple[list[Partition], list[Segment]]:
    """Split ``layers`` by ``balance`` into per-rank partitions and the segments to schedule.

    ``balance`` counts positions in ``layers``, so a layer reused at two positions counts twice.
    Entry ``k`` of ``balance`` (a model stage) runs on rank ``k % ranks``; with ``ranks`` equal to
    ``len(balance)`` (the default) every rank has one entry, and with ``len(balance) = V * ranks``
    every rank holds V non-adjacent model chunks (interleaved schedules). A segment is a run of
    consecutive positions in one entry on one rank. Each rank must own at least one layer.
    Inputs are assumed checked (see ``AsyncPipe``).

    Example:
        >>> from torch import nn
        >>> a, b, c = nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2)
        >>> parts, segments = partition([a, b, c, a], [2, 2])
        >>> [len(p.layers) for p in parts], [s.stage for s in segments]
        ([2, 1], [0, 1, 0])
    """
    ranks = len(balance) if ranks is None else ranks
    entry_of = [entry for entry, count in enumerate(balance) for _ in range(count)]
    owned: dict[int, Location] = {}
    owned_layers: list[list[Layer]] = [[] for _ in range(ranks)]
    where: list[Location] = []
    for position, layer in enumerate(layers):
        location = owned.get(id(layer))
        if location is None:
            stage = entry_of[position] % ranks
            location = Location(stage, len(owned_layers[stage]))
            owned[id(layer)] = location
            owned_layers[stage].append(layer)
        where.append(location)
    empty = [stage for stage, mine in enumerate(owned_layers) if not mine]
    if empty:
        raise ValueError(
            f"every stage must own at least one layer, but stages {empty} only reuse layers "
            f"owned by earlier stages (balance: {list(balance)}); move those positions into the "
            f"stage before them or change balance"
        )
    invocations = [
        Invocation(
            order=n,
            this=location,
            source=where[n - 1] if n > 0 else None,
            dest=where[n + 1] if n + 1 < len(where) else None,
        )
        for n, location in enumerate(where)
    ]
    partitions = [
        Partition(
            stage,
            tuple(owned_layers[stage]),
            tuple(inv for inv in invocations if inv.this.stage == stage),
        )
        for stage in range(ranks)
    ]
    segments: list[Segment] = []
    run: list[Invocation] = []
    for inv in invocations:
        if run and (
            run[-1].this.stage != inv.this.stage or entry_of[run[-1].order] != entry_of[inv.order]
        ):
            segments.append(Segment(len(segments), run[0].this.stage, tuple(run)))
            run = []
        run.append(inv)
    if run:
        segments.append(Segment(len(segments), run[0].this.stage, tuple(run)))
    return partitions, segments
