"""Schedules by name: what ``AsyncPipe(schedule=...)`` and the command line accept."""

from __future__ import annotations

from .action import Plan
from .generate import gpipe, one_f_one_b

__all__: list[str] = []

NAMES = ("gpipe", "1f1b", "interleaved", "zero_bubble", "2bw")


def build(
    name: str, stages: int, microbatches: int, virtual_stages: int = 1, lookahead: int = 1
) -> Plan:
    """The plan of schedule ``name`` for ``stages`` ranks and ``microbatches`` micro-batches.

    ``"2bw"`` (PipeDream-2BW) gives three mini-batches of ``microbatches`` each, one stream
    with no flush between them (see :func:`~asyncpipe.schedule.two_bw`).

    ``lookahead``: for ``"2bw"``, the micro-batches each rank's forwards run ahead of the
    next rank's (see :func:`~asyncpipe.schedule.two_bw`).

    ``virtual_stages`` is the number of model chunks per rank (only ``"interleaved"`` takes more
    than one); the plan then has ``stages * virtual_stages`` stages, stage ``k`` on rank
    ``k % stages``.

    Example:
        >>> from asyncpipe.schedule import build, format_plan
        >>> print(format_plan(build("1f1b", 2, 2)))
        rank 0: 0F0 0F1 0B0 0B1
        rank 1: 1F0 1B0 1F1 1B1
    """
    if name not in NAMES:
        raise ValueError(f"schedule must be one of {', '.join(NAMES)} (got {name!r})")
    if virtual_stages != 1 and name != "interleaved":
        raise ValueError(
            f"virtual_stages={virtual_stages} needs schedule='interleaved' (got {name!r}); "
            f"pass virtual_stages=1 or choose the interleaved schedule"
        )
    if lookahead != 1 and name != "2bw":
        raise ValueError(f"lookahead={lookahead} needs schedule '2bw' (got {name!r})")
    if name == "gpipe":
        return gpipe(stages, microbatches)
    if name == "1f1b":
        return one_f_one_b(stages, microbatches)
    if name == "2bw":
        from .two_bw import two_bw

        return two_bw(stages, microbatches, lookahead=lookahead)
    if name == "interleaved":
        from .interleaved import interleaved

        return interleaved(stages, microbatches, virtual_stages)
    from .zero_bubble import zero_bubble

    return zero_bubble(stages, microbatches)
