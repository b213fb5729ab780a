"""Lowering: add the SEND/RECV actions that move tensors between ranks to a compute plan."""

from __future__ import annotations

from collections.abc import Iterable

from .action import Action, Kind, Plan

__all__: list[str] = []


def stage_owners(plan: Plan) -> dict[int, int]:
    """Map every stage that appears in ``plan`` to the rank that runs its compute actions.

    Raises:
        ValueError: if one stage's compute actions sit on more than one rank.
    """
    owners: dict[int, int] = {}
    clashes = []
    for rank in sorted(plan):
        for action in plan[rank]:
            if action is None or not action.kind.is_compute:
                continue
            other = owners.setdefault(action.stage, rank)
            if other != rank:
                clashes.append(f"stage {action.stage} on ranks {other} and {rank}")
    if clashes:
        raise ValueError(
            "every stage must run on exactly one rank (" + "; ".join(sorted(set(clashes))) + ")"
        )
    return owners


def lower(plan: Plan, skips: Iterable[tuple[int, int]] = ()) -> Plan:
    """Insert a RECV before and a SEND after each compute action whose neighbour stage is on
    another rank. Neighbour stages on the same rank hand tensors over without a message.

    ``skips`` adds edges between stages that are not neighbours, as ``(source, dest)`` pairs
    with ``source < dest`` (skip connections): the forward of ``dest`` also receives from
    ``source`` and the backward of ``source`` also receives from ``dest``. An edge between
    neighbours travels in the neighbours' one message.

    Example:
        >>> from asyncpipe.schedule import gpipe, lower, format_plan
        >>> print(format_plan(lower(gpipe(2, 1))))
        rank 0: 0F0 0SEND_F0->1 0RECV_B0->1 0B0
        rank 1: 1RECV_F0->0 1F0 1B0 1SEND_B0->0
    """
    owners = stage_owners(plan)
    last = max(owners) if owners else -1
    before: dict[int, list[int]] = {s: [s - 1] if s > 0 else [] for s in owners}
    after: dict[int, list[int]] = {s: [s + 1] if s < last else [] for s in owners}
    for source, dest in sorted(set(skips)):
        if not 0 <= source < dest <= last:
            raise ValueError(
                f"a skip edge goes from an earlier stage to a later one within 0..{last} "
                f"(got {source} -> {dest})"
            )
        if dest not in after[source]:
            after[source].append(dest)
            before[dest].append(source)
    lowered: Plan = {}
    for rank in sorted(plan):
        row: list[Action | None] = []
        for action in plan[rank]:
            if action is None or not action.kind.is_compute:
                row.append(action)
                continue
            s, i = action.stage, action.microbatch
            sources = [p for p in before.get(s, []) if owners.get(p, rank) != rank]
            dests = [p for p in after.get(s, []) if owners.get(p, rank) != rank]
            if action.kind is Kind.FORWARD:
                row.extend(Action(s, Kind.RECV_F, i, p) for p in sources)
                row.append(action)
                row.extend(Action(s, Kind.SEND_F, i, p) for p in dests)
            elif action.kind is Kind.BACKWARD:
                row.extend(Action(s, Kind.RECV_B, i, p) for p in dests)
                row.append(action)
                row.extend(Action(s, Kind.SEND_B, i, p) for p in sources)
            else:
                row.append(action)
        lowered[rank] = row
    return lowered
