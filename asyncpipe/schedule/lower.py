"""Lowering: add the SEND/RECV actions that move tensors between ranks to a compute plan."""

from __future__ import annotations

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


def lower(plan: Plan) -> Plan:
    """Insert a RECV before and a SEND after each compute action whose neighbour stage is on
    another rank. Neighbour stages on the same rank hand tensors over without a message.

    Example:
        >>> from asyncpipe.schedule import gpipe, lower, format_plan
        >>> print(format_plan(lower(gpipe(2, 1))))
        rank 0: 0F0 0SEND_F0->1 0RECV_B0->1 0B0
        rank 1: 1RECV_F0->0 1F0 1B0 1SEND_B0->0
    """
    owners = stage_owners(plan)
    last = max(owners) if owners else -1
    lowered: Plan = {}
    for rank in sorted(plan):
        row: list[Action | None] = []
        for action in plan[rank]:
            if action is None or not action.kind.is_compute:
                row.append(action)
                continue
            s, i = action.stage, action.microbatch
            prev_remote = s > 0 and owners.get(s - 1, rank) != rank
            next_remote = s < last and owners.get(s + 1, rank) != rank
            if action.kind is Kind.FORWARD:
                if prev_remote:
                    row.append(Action(s, Kind.RECV_F, i, s - 1))
                row.append(action)
                if next_remote:
                    row.append(Action(s, Kind.SEND_F, i, s + 1))
            elif action.kind is Kind.BACKWARD:
                if next_remote:
                    row.append(Action(s, Kind.RECV_B, i, s + 1))
                row.append(action)
                if prev_remote:
                    row.append(Action(s, Kind.SEND_B, i, s - 1))
            else:
                row.append(action)
        lowered[rank] = row
    return lowered
