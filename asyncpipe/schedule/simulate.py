"""Simulation of a plan's timing in one process from per-action costs."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from .action import Kind, Plan
from .replay import Event, replay

__all__: list[str] = []


def _per_stage(value: float | Mapping[int, float], stage: int) -> float:
    return float(value[stage]) if isinstance(value, Mapping) else float(value)


@dataclass(frozen=True)
class Costs:
    """Seconds (or any unit) per action: a number for every stage, or a {stage: cost} mapping.

    ``send`` is the latency a tensor takes to cross ranks (a number, or a {stage: cost} mapping
    by the sending stage); a send or receive action itself costs
    ``post`` on its rank (the time to hand the message over).
    """

    forward: float | Mapping[int, float] = 1.0
    backward: float | Mapping[int, float] = 2.0
    weight: float | Mapping[int, float] = 0.0
    send: float | Mapping[int, float] = 0.0
    post: float = 0.0


@dataclass(frozen=True)
class Simulation:
    """The result of :func:`simulate`."""

    makespan: float
    busy: dict[int, float]
    timeline: dict[int, list[tuple[str, float, float]]] = field(repr=False)
    peak_activations: dict[int, int] = field(default_factory=dict)
    """Most micro-batches whose activations a rank holds at once (forward run, backward, or
    weight-gradient where the plan has one, not yet)."""

    @property
    def bubble(self) -> dict[int, float]:
        """Fraction of the makespan each rank spends without compute."""
        if self.makespan <= 0:
            return {rank: 0.0 for rank in self.busy}
        return {rank: 1.0 - busy / self.makespan for rank, busy in self.busy.items()}

    @property
    def total_bubble(self) -> float:
        """Fraction of all ranks' time spent without compute."""
        if self.makespan <= 0 or not self.busy:
            return 0.0
        return 1.0 - sum(self.busy.values()) / (self.makespan * len(self.busy))


def simulate(plan: Plan, costs: Costs) -> Simulation:
    """Time ``plan`` (lowered or not) with ``costs``, every rank starting at 0.

    Example:
        >>> from asyncpipe.schedule import Costs, gpipe, simulate
        >>> simulate(gpipe(2, 4), Costs(forward=1, backward=2)).makespan
        15.0
    """
    end: dict[Event, float] = {}
    clock = {rank: 0.0 for rank in plan}
    busy = {rank: 0.0 for rank in plan}
    timeline: dict[int, list[tuple[str, float, float]]] = {rank: [] for rank in plan}
    live = {rank: 0 for rank in plan}
    peak = {rank: 0 for rank in plan}
    with_weight = {
        (a.stage, a.microbatch)
        for row in plan.values()
        for a in row
        if a is not None and a.kind is Kind.WEIGHT
    }

    def visit(event: Event, deps: list[tuple[Event, bool]]) -> None:
        action = event.action
        ready = clock[event.rank]
        for dep, remote in deps:
            latency = _per_stage(costs.send, dep.action.stage) if remote else 0.0
            ready = max(ready, end[dep] + latency)
        if action.kind is Kind.FORWARD:
            cost = _per_stage(costs.forward, action.stage)
        elif action.kind is Kind.BACKWARD:
            cost = _per_stage(costs.backward, action.stage)
        elif action.kind is Kind.WEIGHT:
            cost = _per_stage(costs.weight, action.stage)
        else:
            cost = costs.post
        if action.kind.is_compute:
            busy[event.rank] += cost
        key = (action.stage, action.microbatch)
        if action.kind is Kind.FORWARD:
            live[event.rank] += 1
            peak[event.rank] = max(peak[event.rank], live[event.rank])
        elif action.kind is (Kind.WEIGHT if key in with_weight else Kind.BACKWARD):
            live[event.rank] -= 1
        end[event] = ready + cost
        clock[event.rank] = ready + cost
        timeline[event.rank].append((str(action), ready, ready + cost))

    replay(plan, visit)
    return Simulation(max(clock.values(), default=0.0), busy, timeline, peak)
