"""Block partition: split a row of costs into consecutive blocks with the smallest maximum."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

__all__ = ["blocks"]

_SLACK = 1e-9
"""Relative tolerance of the comparisons: the costs are scaled to a largest cost of 1 first, so
that costs in seconds (1e-5 per layer) and in bytes compare alike."""


def blocks(
    costs: Sequence[float], stages: int, *, layers: Sequence[Hashable] | None = None
) -> list[int]:
    """Sizes of ``stages`` consecutive non-empty blocks of ``costs`` with the smallest maximum sum.

    Among the splits with that maximum it takes the one whose block sums are closest to equal
    (smallest sum of squares); a remaining tie goes to the split whose later blocks are longer,
    so the same costs always give the same answer. Both comparisons are relative (the costs are
    scaled to a largest cost of 1), so costs in seconds, milliseconds or bytes split alike.

    ``layers`` (one entry per cost, e.g. the layer objects) says which positions hold the same
    layer: as in :func:`asyncpipe.partition.partition`, a layer listed at several positions is
    owned by the block of its first position and runs there at every one. A block's sum is then
    the cost of every position whose layer it owns (a later position in another block counts in
    the owner's block, not in its own), and every block must own a layer (one of only repeated
    positions is refused by ``partition``). Both stay exact: the sum of a block from position
    ``i`` to ``j`` is that of the positions whose layer first appears in ``i .. j - 1``, a
    consecutive run of "first appearances", so the same dynamic programme runs over the costs
    gathered at each layer's first position, taking only blocks that hold a first appearance.

    Raises:
        ValueError: fewer costs than stages (or fewer distinct ``layers``), a negative or
            non-finite cost, ``layers`` of another length than ``costs``, or stages < 1.

    Example:
        >>> blocks([1, 1, 1, 4, 1, 1, 1, 1], 4)
        [3, 1, 2, 2]
        >>> blocks([1, 2, 3, 4], 2)
        [3, 1]
        >>> blocks([4, 1, 1, 4], 2, layers=["a", "b", "c", "a"])  # "a" twice, on the first block
        [1, 3]
    """
    costs = [float(c) for c in costs]
    problems = []
    keys = list(layers) if layers is not None else None
    if keys is not None and len(keys) != len(costs):
        problems.append(
            f"layers must name the layer of every cost (costs: {len(costs)}, layers: {len(keys)})"
        )
        keys = None
    first: dict[Hashable, int] = {}
    owner = [first.setdefault(key, n) for n, key in enumerate(keys)] if keys else None
    distinct = len(first) if keys else len(costs)
    if not isinstance(stages, int) or stages < 1:
        problems.append(f"stages must be a positive int (got {stages!r})")
    elif len(costs) < stages:
        problems.append(
            f"every stage needs at least one layer (layers: {len(costs)}, stages: {stages}); use "
            f"at most {len(costs)} stages or add cut points"
        )
    elif distinct < stages:
        problems.append(
            f"every stage must own a layer, and a layer listed at several positions is owned by "
            f"the stage of its first one (distinct layers: {distinct}, positions: {len(costs)}, "
            f"stages: {stages}); use at most {distinct} stages"
        )
    bad = [f"{n}: {c}" for n, c in enumerate(costs) if not (c >= 0 and c < float("inf"))]
    if bad:
        problems.append(f"costs must be finite and not negative (bad: {', '.join(bad)})")
    if problems:
        raise ValueError("; ".join(problems))
    n = len(costs)
    scale = max(costs, default=0.0) or 1.0
    own = [0.0] * n  # each position's cost, gathered at the first position of its layer
    for position, c in enumerate(costs):
        own[owner[position] if owner else position] += c / scale
    prefix = [0.0]
    firsts = [0]  # first appearances among positions 0 .. j - 1
    for position, c in enumerate(own):
        prefix.append(prefix[-1] + c)
        firsts.append(firsts[-1] + (not owner or owner[position] == position))

    def span(i: int, j: int) -> float:
        return prefix[j] - prefix[i]

    def owns(i: int, j: int) -> bool:
        return firsts[j] > firsts[i]

    inf = float("inf")
    # best[k][j]: smallest maximum block sum splitting costs[:j] into k blocks.
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for j in range(k, n - (stages - k) + 1):
            best[k][j] = min(
                (
                    max(best[k - 1][i], span(i, j))
                    for i in range(k - 1, j)
                    if best[k - 1][i] < inf and owns(i, j)
                ),
                default=inf,
            )
    limit = best[stages][n] * (1 + _SLACK) + _SLACK
    # Among splits within the limit, smallest sum of squares; ties go to the earliest cut.
    square = [[inf] * (n + 1) for _ in range(stages + 1)]
    choice = [[-1] * (n + 1) for _ in range(stages + 1)]
    square[0][0] = 0.0
    for k in range(1, stages + 1):
        for j in range(k, n - (stages - k) + 1):
            for i in range(k - 1, j):
                if square[k - 1][i] == inf or span(i, j) > limit or not owns(i, j):
                    continue
                value = square[k - 1][i] + span(i, j) ** 2
                if value < square[k][j] * (1 - _SLACK) - _SLACK:
                    square[k][j], choice[k][j] = value, i
    sizes = []
    j = n
    for k in range(stages, 0, -1):
        i = choice[k][j]
        sizes.append(j - i)
        j = i
    return sizes[::-1]
