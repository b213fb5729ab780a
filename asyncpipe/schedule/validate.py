"""Validation of a plan before it runs: shape of the rows, completeness, order and deadlocks."""

from __future__ import annotations

from .action import Action, Kind, Plan
from .lower import stage_owners
from .replay import PlanError, _fail, replay

__all__: list[str] = []


def validate(plan: Plan) -> Plan:
    """Check that ``plan`` can run and computes every micro-batch of every stage exactly once.

    Rules: rows are lists of ``Action`` or ``None`` keyed by ranks 0..R-1; each stage runs on one
    rank; every (stage, micro-batch) has exactly one forward; backwards are either absent
    (inference) or present for every forward, after it; weight-gradient actions, where used,
    follow their backward; sends and receives pair up in the same order; nothing deadlocks.

    Returns:
        the plan itself, so ``run(validate(plan))`` reads naturally.

    Raises:
        PlanError: naming the rule and printing the plan with the offending entry marked.

    Example:
        >>> from asyncpipe.schedule import Action, validate
        >>> plan = {0: [Action.parse("0F0"), Action.parse("0B0")]}
        >>> validate(plan) is plan
        True
    """
    if not isinstance(plan, dict) or not plan:
        raise PlanError(f"a plan is a non-empty dict {{rank: [Action | None, ...]}} (got {plan!r})")
    if sorted(plan) != list(range(len(plan))):
        raise PlanError(f"plan ranks must be 0..{len(plan) - 1} (got {sorted(plan)})")
    for rank, row in plan.items():
        if not isinstance(row, list):
            raise PlanError(f"row of rank {rank} must be a list (got {type(row).__name__})")
        for index, action in enumerate(row):
            if action is not None and not isinstance(action, Action):
                raise _fail(
                    plan,
                    f"plan entries must be Action or None (rank {rank}, position {index}: "
                    f"{action!r}); build them with Action.parse('0F0')",
                    {rank: index},
                )
    try:
        owners = stage_owners(plan)
    except ValueError as e:
        raise PlanError(str(e)) from e
    if sorted(owners) != list(range(len(owners))):
        raise PlanError(f"stages must be numbered 0..S-1 without gaps (got {sorted(owners)})")

    seen: dict[Action, tuple[int, int]] = {}
    for rank, row in plan.items():
        for index, action in enumerate(row):
            if action is None:
                continue
            if action in seen:
                raise _fail(plan, f"action {action} appears twice", {rank: index})
            seen[action] = (rank, index)
    if not seen:
        raise PlanError(
            "the plan has no actions: every stage needs a forward (and a backward, to train) for "
            "each micro-batch, e.g. asyncpipe.schedule.build('1f1b', stages, chunks)"
        )
    microbatches = 1 + max(a.microbatch for a in seen)
    has_backward = any(a.kind is Kind.BACKWARD for a in seen)
    for stage in owners:
        for i in range(microbatches):
            wanted = [Action(stage, Kind.FORWARD, i)]
            if has_backward:
                wanted.append(Action(stage, Kind.BACKWARD, i))
            for action in wanted:
                if action not in seen:
                    raise _fail(
                        plan,
                        f"plan misses {action}: every stage needs a forward"
                        + (" and a backward" if has_backward else "")
                        + f" for each of the {microbatches} micro-batches",
                        {},
                    )
    for action, (rank, index) in seen.items():
        if action.kind in (Kind.BACKWARD, Kind.WEIGHT):
            before = Kind.FORWARD if action.kind is Kind.BACKWARD else Kind.BACKWARD
            pre = seen.get(Action(action.stage, before, action.microbatch))
            if pre is None or pre[1] > index or pre[0] != rank:
                raise _fail(
                    plan,
                    f"{action} must come after {action.stage}{before.value}{action.microbatch} "
                    "on the same rank",
                    {rank: index},
                )

    _check_channels(plan)
    replay(plan, lambda event, deps: None)
    return plan


def _check_channels(plan: Plan) -> None:
    """Sends and receives between two stages must pair up one to one, in the same order."""
    sends: dict[tuple[int, int, str], list[tuple[int, int, int]]] = {}
    recvs: dict[tuple[int, int, str], list[tuple[int, int, int]]] = {}
    for rank, row in plan.items():
        for index, action in enumerate(row):
            if action is None or action.kind.is_compute:
                continue
            assert action.peer is not None
            direction = "F" if action.kind in (Kind.SEND_F, Kind.RECV_F) else "B"
            if action.kind.is_send:
                key = (action.stage, action.peer, direction)
                sends.setdefault(key, []).append((action.microbatch, rank, index))
            else:
                key = (action.peer, action.stage, direction)
                recvs.setdefault(key, []).append((action.microbatch, rank, index))
    for key in sorted(set(sends) | set(recvs)):
        out, into = sends.get(key, []), recvs.get(key, [])
        for n in range(max(len(out), len(into))):
            a = out[n] if n < len(out) else None
            b = into[n] if n < len(into) else None
            if a is None or b is None or a[0] != b[0]:
                where = a if b is None else b
                assert where is not None
                src, dst, direction = key
                raise _fail(
                    plan,
                    f"messages from stage {src} to stage {dst} ({direction}) must be received in "
                    f"the order they are sent (sent: {[m for m, _, _ in out]}, received: "
                    f"{[m for m, _, _ in into]})",
                    {where[1]: where[2]},
                )
