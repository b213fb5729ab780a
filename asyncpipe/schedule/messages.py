"""Facts about a lowered plan's messages between two ranks: their order, and when one is taken."""

from __future__ import annotations

from .action import Action, Kind, Plan
from .lower import stage_owners

__all__: list[str] = []

_MATCH = {Kind.SEND_F: Kind.RECV_F, Kind.SEND_B: Kind.RECV_B}


def _direction(action: Action) -> str:
    return "F" if action.kind in (Kind.SEND_F, Kind.RECV_F) else "B"


def misordered_pair(plan: Plan) -> tuple[int, int] | None:
    """The first (sender, receiver) pair of ranks whose messages the receiver takes in another
    order than they are sent, across all channels; ``None`` if there is none. A transport that
    matches messages in posting order (NCCL) cannot run such a plan."""
    owners = stage_owners(plan)
    sent: dict[tuple[int, int], list[tuple[int, int, str]]] = {}
    taken: dict[tuple[int, int], list[tuple[int, int, str]]] = {}
    for rank, row in plan.items():
        for a in row:
            if a is None or a.kind.is_compute:
                continue
            assert a.peer is not None
            if a.kind.is_send:
                sent.setdefault((rank, owners[a.peer]), []).append(
                    (a.stage, a.microbatch, _direction(a))
                )
            else:
                taken.setdefault((owners[a.peer], rank), []).append(
                    (a.peer, a.microbatch, _direction(a))
                )
    for pair, order in sent.items():
        if taken.get(pair) != order:
            return pair
    return None


def crossed_pair(plan: Plan) -> tuple[int, int] | None:
    """The first pair of ranks (lower rank first) that both send to each other before either
    receives what the other sent; ``None`` if there is none.

    A transport whose sends may wait until the peer posts the matching receive, and which runs
    each pair's operations in the order they were issued (NCCL: one stream per pair of ranks)
    can deadlock on such a pair: a send it cannot buffer waits for a receive stuck behind the
    peer's own send. The p2p transport's ordered mode therefore sends each direction in a group
    of its own.

    Example:
        >>> from asyncpipe.schedule import gpipe, one_f_one_b, lower
        >>> crossed_pair(lower(gpipe(2, 4))), crossed_pair(lower(one_f_one_b(2, 4)))
        (None, (0, 1))
    """
    owners = stage_owners(plan)
    ops: dict[tuple[int, int], list[tuple[bool, int, int, int]]] = {}
    for rank, row in plan.items():
        for a in row:
            if a is None or a.kind.is_compute:
                continue
            assert a.peer is not None
            low, high = sorted((a.stage, a.peer))
            ops.setdefault((rank, owners[a.peer]), []).append(
                (a.kind.is_send, low, high, a.microbatch)
            )
    for (one, other), mine in sorted(ops.items()):
        if one > other:
            continue
        theirs = ops.get((other, one), [])
        for (sends, *what), (peer_sends, *peer_what) in zip(mine, theirs):
            if sends and peer_sends:
                return one, other
            if sends == peer_sends or what != peer_what:
                break  # misordered: misordered_pair tells
    return None


def settle_points(plan: Plan, rank: int) -> dict[Action, list[Action]]:
    """For each receive of ``rank``, the sends of ``rank`` that it proves taken.

    A peer runs its row in order: once ``rank`` receives what the peer sent after taking one of
    its messages, that message is taken and its buffers can go. Found from the plan alone, so a
    rank never waits on a send that might still be in flight.

    Example:
        >>> from asyncpipe.schedule import gpipe, lower
        >>> points = settle_points(lower(gpipe(2, 2)), 0)
        >>> {str(k): [str(a) for a in v] for k, v in points.items()}
        {'0RECV_B0->1': ['0SEND_F0->1', '0SEND_F1->1']}
    """
    owners = stage_owners(plan)
    position = {a: n for row in plan.values() for n, a in enumerate(row) if a is not None}
    mine = [a for a in plan[rank] if a is not None]
    points: dict[Action, list[Action]] = {}
    for send in (a for a in mine if a.kind.is_send):
        assert send.peer is not None
        taken = position[Action(send.peer, _MATCH[send.kind], send.microbatch, send.stage)]
        peer = owners[send.peer]
        for recv in (a for a in mine if a.kind.is_recv):
            assert recv.peer is not None
            if owners[recv.peer] != peer:
                continue
            back = Kind.SEND_F if recv.kind is Kind.RECV_F else Kind.SEND_B
            if position[Action(recv.peer, back, recv.microbatch, recv.stage)] > taken:
                points.setdefault(recv, []).append(send)
                break
    return points
