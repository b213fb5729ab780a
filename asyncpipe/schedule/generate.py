"""Plan generators: pure functions from (stages, micro-batches) to a plan of compute actions."""

from __future__ import annotations

from collections.abc import Sequence

from .action import Action, Kind, Plan

__all__: list[str] = []


def _check_counts(stages: int, microbatches: int) -> None:
    problems = []
    if not isinstance(stages, int) or isinstance(stages, bool) or stages < 1:
        problems.append(f"stages must be a positive int (got {stages!r})")
    if not isinstance(microbatches, int) or isinstance(microbatches, bool) or microbatches < 1:
        problems.append(f"microbatches must be a positive int (got {microbatches!r})")
    if problems:
        raise ValueError("; ".join(problems))


def stage_ranks(stages: int, ranks: Sequence[int] | None) -> list[int]:
    """The rank of every stage: ``ranks`` checked, or stage ``s`` on rank ``s`` by default."""
    if ranks is None:
        return list(range(stages))
    ranks = list(ranks)
    if len(ranks) != stages:
        raise ValueError(
            f"ranks must give one rank per stage (stages: {stages}, ranks: {ranks}); "
            f"pass a list of {stages} ints"
        )
    if sorted(set(ranks)) != list(range(len(set(ranks)))):
        raise ValueError(f"ranks must use every rank from 0 up without gaps (ranks: {ranks})")
    return ranks


def gpipe(stages: int, microbatches: int, *, ranks: Sequence[int] | None = None) -> Plan:
    """Fill-drain (GPipe): every forward, then every backward.

    A rank that holds several stages (``ranks`` maps stage -> rank) runs the forwards of its
    stages in stage order and the backwards in reverse stage order.

    Example:
        >>> from asyncpipe.schedule import gpipe, format_plan
        >>> print(format_plan(gpipe(2, 2)))
        rank 0: 0F0 0F1 0B0 0B1
        rank 1: 1F0 1F1 1B0 1B1
    """
    _check_counts(stages, microbatches)
    owner = stage_ranks(stages, ranks)
    plan: Plan = {}
    for rank in sorted(set(owner)):
        mine = [s for s in range(stages) if owner[s] == rank]
        row: list[Action | None] = []
        row += [Action(s, Kind.FORWARD, i) for s in mine for i in range(microbatches)]
        row += [Action(s, Kind.BACKWARD, i) for s in reversed(mine) for i in range(microbatches)]
        plan[rank] = row
    return plan


def one_f_one_b(stages: int, microbatches: int) -> Plan:
    """PipeDream-Flush (1F1B): warm-up forwards, then one forward and one backward in turn, then
    the remaining backwards. Stage ``s`` runs ``min(stages - s - 1, microbatches)`` warm-up
    forwards, so at most ``stages - s`` micro-batches are in flight on it at any time: activation
    memory is bounded by the number of stages, not of micro-batches.

    Example:
        >>> from asyncpipe.schedule import one_f_one_b, format_plan
        >>> print(format_plan(one_f_one_b(2, 3)))
        rank 0: 0F0 0F1 0B0 0F2 0B1 0B2
        rank 1: 1F0 1B0 1F1 1B1 1F2 1B2
    """
    _check_counts(stages, microbatches)
    plan: Plan = {}
    for s in range(stages):
        warmup = min(stages - s - 1, microbatches)
        row: list[Action | None] = [Action(s, Kind.FORWARD, i) for i in range(warmup)]
        backward = 0
        for i in range(warmup, microbatches):
            row.append(Action(s, Kind.FORWARD, i))
            row.append(Action(s, Kind.BACKWARD, backward))
            backward += 1
        row += [Action(s, Kind.BACKWARD, i) for i in range(backward, microbatches)]
        plan[s] = row
    return plan


def forward_only(plan: Plan) -> Plan:
    """The same plan with every backward, weight-gradient and gradient message removed."""
    keep = (Kind.FORWARD, Kind.SEND_F, Kind.RECV_F)
    return {
        rank: [a for a in row if a is not None and a.kind in keep] for rank, row in plan.items()
    }
