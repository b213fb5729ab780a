"""Block partition: split a row of costs into consecutive blocks with the smallest maximum."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["blocks"]

_SLACK = 1e-9


def blocks(costs: Sequence[float], stages: int) -> list[int]:
    """Sizes of ``stages`` consecutive non-empty blocks of ``costs`` with the smallest maximum sum.

    Among the splits with that maximum it takes the one whose block sums are closest to equal
    (smallest sum of squares); a remaining tie goes to the split whose later blocks are longer,
    so the same costs always give the same answer.

    Raises:
        ValueError: fewer costs than stages, a negative or non-finite cost, or stages < 1.

    Example:
        >>> blocks([1, 1, 1, 4, 1, 1, 1, 1], 4)
        [3, 1, 2, 2]
        >>> blocks([1, 2, 3, 4], 2)
        [3, 1]
    """
    costs = [float(c) for c in costs]
    problems = []
    if not isinstance(stages, int) or stages < 1:
        problems.append(f"stages must be a positive int (got {stages!r})")
    elif len(costs) < stages:
        problems.append(
            f"every stage needs at least one layer (layers: {len(costs)}, stages: {stages}); use "
            f"at most {len(costs)} stages or add cut points"
        )
    bad = [f"{n}: {c}" for n, c in enumerate(costs) if not (c >= 0 and c < float("inf"))]
    if bad:
        problems.append(f"costs must be finite and not negative (bad: {', '.join(bad)})")
    if problems:
        raise ValueError("; ".join(problems))
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def span(i: int, j: int) -> float:
        return prefix[j] - prefix[i]

    inf = float("inf")
    # best[k][j]: smallest maximum block sum splitting costs[:j] into k blocks.
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for j in range(k, n - (stages - k) + 1):
            best[k][j] = min(
                max(best[k - 1][i], span(i, j)) for i in range(k - 1, j) if best[k - 1][i] < inf
            )
    limit = best[stages][n] * (1 + _SLACK) + _SLACK
    # Among splits within the limit, smallest sum of squares; ties go to the earliest cut.
    square = [[inf] * (n + 1) for _ in range(stages + 1)]
    choice = [[-1] * (n + 1) for _ in range(stages + 1)]
    square[0][0] = 0.0
    for k in range(1, stages + 1):
        for j in range(k, n - (stages - k) + 1):
            for i in range(k - 1, j):
                if square[k - 1][i] == inf or span(i, j) > limit:
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
