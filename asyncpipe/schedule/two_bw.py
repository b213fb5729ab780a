"""PipeDream-2BW as data: 1F1B over a stream of mini-batches, cut into one window per step.

2BW never drains the pipeline between mini-batches: the micro-batches of consecutive
mini-batches form one stream, micro-batch ``i`` of mini-batch ``t`` numbered ``t * M + i``, and
every rank runs 1F1B over that stream. Each call of ``step()`` runs one *window* of the stream
on every rank: the forwards of its own mini-batch, paired with the backwards that 1F1B puts
beside them (the last ``w`` micro-batches of the previous mini-batch, then the first ``M - w``
of this one, ``w = lookahead * (stages - rank - 1)``). A final *drain* runs the backwards
still owed::

    rank 0 of 2, M = 2:   window 0: 0F0 0F1 0B0 | window 1: 0F2 0B1 0F3 0B2 | drain: 0B3
    rank 1 of 2, M = 2:   window 0: 1F0 1B0 1F1 1B1 | window 1: 1F2 1B2 1F3 1B3 | drain: -

The optimizer step of mini-batch ``t - 1`` lands at the end of window ``t``, after the
forwards of mini-batch ``t``: every micro-batch runs forward and backward on one weight
version, and a rank holds at most two versions (the one it forwards with, and the one its
backwards of the previous mini-batch still need).
"""

from __future__ import annotations

from .action import Action, Kind, Plan
from .generate import _check_counts
from .simulate import Costs, Simulation, simulate

__all__: list[str] = []


def _warmup(stages: int, stage: int, lookahead: int = 1) -> int:
    return lookahead * (stages - stage - 1)


def check_two_bw(stages: int, microbatches: int, lookahead: int = 1) -> None:
    """2BW keeps two weight versions only if a mini-batch has at least ``lookahead * (stages -
    1)`` micro-batches (rank 0 owes that many backwards of a mini-batch when the next begins).
    """
    _check_counts(stages, microbatches)
    if not isinstance(lookahead, int) or isinstance(lookahead, bool) or lookahead < 1:
        raise ValueError(
            f"lookahead must be a positive int: how many micro-batches each rank's forwards run "
            f"ahead of the next rank's (got {lookahead!r}); pass 1 (1F1B's spacing) or 2"
        )
    need = lookahead * (stages - 1)
    if microbatches < need:
        raise ValueError(
            f"schedule '2bw' needs at least lookahead * (stages - 1) micro-batches per "
            f"mini-batch, so each rank holds at most two weight versions (stages: {stages}, "
            f"lookahead: {lookahead}, micro-batches: {microbatches}); pass chunks >= {need}"
            + (" or a smaller lookahead" if lookahead > 1 else "")
        )


def window_of(
    stages: int, microbatches: int, stage: int, batches: int, lookahead: int = 1
) -> dict[Action, int]:
    """The window of every compute action of ``stage`` in a stream of ``batches`` mini-batches:
    ``t`` for the step of mini-batch ``t``, ``batches`` for the drain."""
    m, w = microbatches, _warmup(stages, stage, lookahead)
    out: dict[Action, int] = {}
    for g in range(batches * m):
        out[Action(stage, Kind.FORWARD, g)] = g // m
        out[Action(stage, Kind.BACKWARD, g)] = min((g + w) // m, batches)
    return out


def two_bw(stages: int, microbatches: int, batches: int = 3, lookahead: int = 1) -> Plan:
    """PipeDream-2BW over ``batches`` mini-batches of ``microbatches`` each, without a flush
    between them: the 1F1B plan of the whole stream, micro-batch ``i`` of mini-batch ``t``
    numbered ``t * microbatches + i``. :func:`~asyncpipe.schedule.two_bw.windows` cuts it into
    the part each step runs.

    ``lookahead``: rank ``r`` runs ``lookahead * (stages - r - 1)`` warm-up forwards, then one
    forward and one backward in turn (``lookahead * (stages - r - 1) + 1`` forwards before its
    first backward), so each rank's forwards run ``lookahead`` micro-batches ahead of the next
    rank's. 1 is 1F1B's spacing: least activation memory (``stages - r`` micro-batches in
    flight on rank ``r``), but in the steady state each pair of neighbours waits for every
    message's latency twice per micro-batch. 2 gives each rank a micro-batch of its own work
    to do while a message travels (up to ``2 * (stages - r) - 1`` micro-batches in flight).

    Example:
        >>> from asyncpipe.schedule import two_bw, format_plan
        >>> print(format_plan(two_bw(2, 2, batches=2)))
        rank 0: 0F0 0F1 0B0 0F2 0B1 0F3 0B2 0B3
        rank 1: 1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3
        >>> print(format_plan(two_bw(2, 2, batches=2, lookahead=2)))
        rank 0: 0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3
        rank 1: 1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3
    """
    check_two_bw(stages, microbatches, lookahead)
    if not isinstance(batches, int) or isinstance(batches, bool) or batches < 1:
        raise ValueError(f"batches must be a positive int (got {batches!r})")
    total = batches * microbatches
    plan: Plan = {}
    for s in range(stages):
        w = min(_warmup(stages, s, lookahead), total)
        row: list[Action | None] = [Action(s, Kind.FORWARD, g) for g in range(w)]
        for g in range(w, total):
            row += [Action(s, Kind.FORWARD, g), Action(s, Kind.BACKWARD, g - w)]
        row += [Action(s, Kind.BACKWARD, g) for g in range(total - w, total)]
        plan[s] = row
    return plan


def windows(
    plan: Plan, stages: int, microbatches: int, batches: int, lookahead: int = 1
) -> dict[int, list[list[Action]]]:
    """Cut each rank's row of a (lowered or not) :func:`~asyncpipe.schedule.two_bw` plan into
    ``batches + 1`` windows: one per mini-batch, then the drain. A receive goes with the compute
    action after it, a send with the one before it (where :func:`~asyncpipe.schedule.lower`
    puts them).
    ``lookahead``: the one ``plan`` was made with.

    Example:
        >>> from asyncpipe.schedule import two_bw
        >>> from asyncpipe.schedule.two_bw import windows
        >>> cut = windows(two_bw(2, 2, batches=2), 2, 2, 2)
        >>> [[str(a) for a in w] for w in cut[0]]
        [['0F0', '0F1', '0B0'], ['0F2', '0B1', '0F3', '0B2'], ['0B3']]
    """
    out: dict[int, list[list[Action]]] = {}
    for rank, row in plan.items():
        actions = [a for a in row if a is not None]
        where: dict[Action, int] = {}
        for stage in sorted({a.stage for a in actions if a.kind.is_compute}):
            where.update(window_of(stages, microbatches, stage, batches, lookahead))
        cut: list[list[Action]] = [[] for _ in range(batches + 1)]
        index = [0] * len(actions)
        last = 0
        for n, a in enumerate(actions):  # sends go with the compute action before them
            if a.kind.is_compute:
                last = where[Action(a.stage, a.kind, a.microbatch)]
            index[n] = last
        following = batches
        for n in range(len(actions) - 1, -1, -1):  # receives with the one after them
            a = actions[n]
            if a.kind.is_compute:
                following = index[n]
            elif a.kind.is_recv:
                index[n] = following
        for a, n in zip(actions, index):
            cut[n].append(a)
        out[rank] = cut
    return out


def simulate_window(
    plan: Plan,
    costs: Costs,
    microbatches: int,
    window: int,
    batches: int,
    first: int | None = None,
    lookahead: int = 1,
) -> Simulation:
    """Simulate a (lowered) :func:`two_bw` stream of ``batches`` mini-batches and keep one of
    its :func:`windows` (``batches``: the drain): every rank's actions of that window, times
    from the first of them on any rank, which is how a traced 2BW step is measured.

    ``lookahead``: the one ``plan`` was made with (see :func:`two_bw`).

    ``first``: renumber the window's micro-batches so that the lowest is ``first``: a later
    window of a longer stream has the same timing with other numbers (here the window of
    mini-batch 4, whose forwards are micro-batches 8 and 9, and rank 0's first backward is 7).

    Example:
        >>> from asyncpipe.schedule import Costs, two_bw
        >>> sim = simulate_window(two_bw(2, 2), Costs(forward=1, backward=2), 2, 1, 3, first=7)
        >>> sim.makespan, [name for name, _, _ in sim.timeline[1]]
        (7.0, ['1F8', '1B8', '1F9', '1B9'])
    """
    full = simulate(plan, costs)
    cut = windows(plan, len(plan), microbatches, batches, lookahead)
    kept: dict[int, list[tuple[Action, float, float]]] = {}
    for rank, parts in cut.items():
        begin = sum(len(part) for part in parts[:window])
        events = full.timeline[rank][begin : begin + len(parts[window])]
        kept[rank] = [(Action.parse(name), s, e) for name, s, e in events]
    computes = [(a, s, e) for row in kept.values() for a, s, e in row if a.kind.is_compute]
    origin = min((s for row in kept.values() for _, s, _ in row), default=0.0)
    shift = (
        0 if first is None or not computes else first - min(a.microbatch for a, _, _ in computes)
    )
    timeline = {
        rank: [
            (str(Action(a.stage, a.kind, a.microbatch + shift, a.peer)), s - origin, e - origin)
            for a, s, e in row
        ]
        for rank, row in kept.items()
    }
    busy = {rank: sum(e - s for a, s, e in row if a.kind.is_compute) for rank, row in kept.items()}
    end = max((e for row in timeline.values() for _, _, e in row), default=0.0)
    return Simulation(end, busy, timeline)
