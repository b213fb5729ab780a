"""Interleaved 1F1B (Megatron-style): every rank holds several non-adjacent model chunks."""

from __future__ import annotations

from .action import Action, Kind, Plan
from .generate import _check_counts, one_f_one_b

__all__: list[str] = []


def _groups(stages: int, microbatches: int) -> list[range]:
    """Micro-batches in groups of ``stages``; the first group also takes the remainder."""
    count = max(microbatches // stages, 1)
    first = microbatches - (count - 1) * stages
    groups = [range(first)]
    groups += [range(start, start + stages) for start in range(first, microbatches, stages)]
    return groups


def interleaved(stages: int, microbatches: int, virtual_stages: int) -> Plan:
    """Interleaved 1F1B: ``stages`` ranks, ``stages * virtual_stages`` model stages, stage ``k``
    on rank ``k % stages`` (rank ``r`` holds chunks ``r, r + stages, r + 2 * stages, ...``).

    Write R = ``stages``, V = ``virtual_stages``, M = ``microbatches``. Micro-batches go through
    in groups of R. A rank's forwards visit chunk 0 for every micro-batch of a group, then chunk
    1 for the same micro-batches, and so on; its backwards visit the chunks of a group in the
    mirrored order (last chunk first). Rank ``r`` runs ``2 * (R - r - 1) + (V - 1) * G``
    warm-up forwards (G is the size of the first group, capped at the M * V forwards it has),
    then one forward and one backward in turn, then the remaining backwards. With F and B the
    costs of one chunk and M >= R, the bubble is ``(R - 1) * (F + B)``: V times smaller than
    1F1B's for the same model cut into R stages, whose F and B are V times larger. The price is
    more messages (every micro-batch crosses the R ranks V times) and more activations held
    during warm-up (rank ``r`` holds at most its warm-up forwards plus one, each 1/V of a stage).

    When M is not a multiple of R the first group takes the remainder (groups never have fewer
    than R micro-batches, so a rank never waits at a chunk boundary and the bubble stays the
    same); with M < R there is a single group. With ``virtual_stages=1`` there is nothing to
    interleave and the plan is :func:`one_f_one_b`'s (whose warm-up is ``R - r - 1``; the
    extra ``R - r - 1`` forwards here keep the ranks busy while messages travel).

    Example:
        >>> from asyncpipe.schedule import interleaved, format_plan
        >>> print(format_plan(interleaved(2, 2, 2)))
        rank 0: 0F0 0F1 2F0 2F1 2B0 2B1 0B0 0B1
        rank 1: 1F0 1F1 3F0 3B0 3F1 3B1 1B0 1B1

    Raises:
        ValueError: if an argument is not a positive int.
    """
    _check_counts(stages, microbatches)
    if (
        not isinstance(virtual_stages, int)
        or isinstance(virtual_stages, bool)
        or virtual_stages < 1
    ):
        raise ValueError(
            f"virtual_stages must be a positive int, the number of model chunks per rank "
            f"(got {virtual_stages!r}); pass 1 for plain 1F1B"
        )
    if virtual_stages == 1:
        return one_f_one_b(stages, microbatches)
    groups = _groups(stages, microbatches)
    forwards = [(c, i) for g in groups for c in range(virtual_stages) for i in g]
    backwards = [(c, i) for g in groups for c in reversed(range(virtual_stages)) for i in g]
    total = len(forwards)
    plan: Plan = {}
    for r in range(stages):
        warmup = min(2 * (stages - r - 1) + (virtual_stages - 1) * len(groups[0]), total)
        order = [(Kind.FORWARD, step) for step in forwards[:warmup]]
        for n in range(total - warmup):
            order += [(Kind.FORWARD, forwards[warmup + n]), (Kind.BACKWARD, backwards[n])]
        order += [(Kind.BACKWARD, step) for step in backwards[total - warmup :]]
        plan[r] = [Action(c * stages + r, kind, i) for kind, (c, i) in order]
    return plan
