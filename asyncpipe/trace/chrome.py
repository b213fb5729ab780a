"""Chrome trace (Perfetto, chrome://tracing) of recorded steps: one track per rank."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .run import StepTrace, kind_of

__all__: list[str] = []


def chrome_trace(steps: Sequence[StepTrace]) -> dict[str, Any]:
    """The steps as a Chrome trace document (``json.dump`` it), times on rank 0's clock.

    Each rank is a process named ``rank <r>`` with one thread; each event is a complete event
    (``"ph": "X"``) named by its action string, its category the kind of event (``compute``,
    ``comm``, ``wait``, ``sync`` or ``user``) and ``args.step`` the step.

    Example:
        >>> from asyncpipe.trace.run import RankStep, StepTrace
        >>> step = StepTrace(0, 1.0, None, 4, {0: RankStep(0.0, 1.0, (("0F0", 0.0, 0.5),))})
        >>> [e["name"] for e in chrome_trace([step])["traceEvents"] if e["ph"] == "X"]
        ['0F0']
    """
    ranks = sorted({rank for s in steps for rank in s.ranks})
    events: list[dict[str, Any]] = []
    for rank in ranks:
        events.append(
            {
                "ph": "M",
                "name": "process_name",
                "pid": rank,
                "tid": 0,
                "args": {"name": f"rank {rank}"},
            }
        )
        events.append(
            {"ph": "M", "name": "process_sort_index", "pid": rank, "args": {"sort_index": rank}}
        )

    def add(rank: int, name: str, start: float, end: float, origin: float, step: int) -> None:
        events.append(
            {
                "ph": "X",
                "name": name,
                "cat": kind_of(name),
                "pid": rank,
                "tid": 0,
                "ts": round((origin + start) * 1e6, 3),
                "dur": round(max(end - start, 0.0) * 1e6, 3),
                "args": {"step": step},
            }
        )

    for s in steps:
        for rank, part in sorted(s.ranks.items()):
            for name, start, end in part.events:
                add(rank, name, start, end, s.origin, s.step)
        for rank, name, start, end in s.extra:
            add(rank, name, start, end, s.origin, s.step)
    return {"traceEvents": events, "displayTimeUnit": "ms"}
