"""Replay a plan in one process, honouring every dependency, to find deadlocks and timings."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .action import Action, Kind, Plan, format_plan
from .lower import stage_owners

__all__: list[str] = []


class PlanError(ValueError):
    """A plan that cannot run: the message holds the plan with the offending entry marked."""


@dataclass(frozen=True)
class Event:
    """An action placed on a rank: what replay orders and simulate times."""

    rank: int
    index: int
    action: Action


def _fail(plan: Plan, rule: str, mark: dict[int, int]) -> PlanError:
    return PlanError(f"{rule}\n{format_plan(plan, mark)}")


def dependencies(
    action: Action, rank: int, owners: dict[int, int], last: int, lowered: bool
) -> list[tuple[Action, bool]]:
    """What must be done before ``action`` runs on ``rank``: (action, crosses_ranks) pairs."""
    s, i = action.stage, action.microbatch
    deps: list[tuple[Action, bool]] = []
    kind = action.kind
    if kind is Kind.FORWARD and s > 0:
        remote = owners[s - 1] != rank
        if remote and lowered:
            deps.append((Action(s, Kind.RECV_F, i, s - 1), False))
        else:
            deps.append((Action(s - 1, Kind.FORWARD, i), remote))
    elif kind is Kind.BACKWARD:
        deps.append((Action(s, Kind.FORWARD, i), False))
        if s < last:
            remote = owners[s + 1] != rank
            if remote and lowered:
                deps.append((Action(s, Kind.RECV_B, i, s + 1), False))
            else:
                deps.append((Action(s + 1, Kind.BACKWARD, i), remote))
    elif kind is Kind.WEIGHT:
        deps.append((Action(s, Kind.BACKWARD, i), False))
    elif kind is Kind.SEND_F:
        deps.append((Action(s, Kind.FORWARD, i), False))
    elif kind is Kind.SEND_B:
        deps.append((Action(s, Kind.BACKWARD, i), False))
    elif kind is Kind.RECV_F:
        assert action.peer is not None
        deps.append((Action(action.peer, Kind.SEND_F, i, s), True))
    elif kind is Kind.RECV_B:
        assert action.peer is not None
        deps.append((Action(action.peer, Kind.SEND_B, i, s), True))
    return deps


def replay(plan: Plan, visit: Callable[[Event, list[tuple[Event, bool]]], None]) -> None:
    """Run ``plan`` as its ranks would, calling ``visit(event, deps)`` in an order that respects
    every dependency; deps are the events it waited for, each with whether it crossed ranks.

    Raises:
        PlanError: if some rank can never make progress (a deadlock), with the plan printed and
            the first stuck action of every rank marked.
    """
    owners = stage_owners(plan)
    last = max(owners) if owners else -1
    lowered = any(a is not None and not a.kind.is_compute for row in plan.values() for a in row)
    done: dict[Action, Event] = {}
    position = {rank: 0 for rank in plan}
    progress = True
    while progress:
        progress = False
        for rank in sorted(plan):
            row = plan[rank]
            while position[rank] < len(row):
                index = position[rank]
                action = row[index]
                if action is None:
                    position[rank] += 1
                    continue
                needed = dependencies(action, rank, owners, last, lowered)
                if not all(dep in done for dep, _ in needed):
                    break
                event = Event(rank, index, action)
                visit(event, [(done[dep], remote) for dep, remote in needed])
                done[action] = event
                position[rank] += 1
                progress = True
    stuck = {rank: p for rank, p in position.items() if p < len(plan[rank])}
    if stuck:
        raise _fail(
            plan,
            "plan deadlocks: no rank can make progress; each marked action waits for one that "
            "never runs (check that every stage's inputs are computed and sent before they are "
            "needed)",
            stuck,
        )
