"""Chrome trace (Perfetto, chrome://tracing) of recorded steps: one track per rank."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .run import StepTrace, kind_of

__all__: list[str] = []

RUN_GAP = 1.0
"""Seconds left between the end of one run and a later run recorded on an earlier clock."""


def chrome_trace(steps: Sequence[StepTrace]) -> dict[str, Any]:
    """The steps as a Chrome trace document (``json.dump`` it), times on rank 0's clock.

    Steps are laid out in the order given. A step whose origin lies before the previous
    step's (a later run appended to the directory by processes on another host's clock, or
    after a reboot) is moved, with the steps after it, to begin ``RUN_GAP`` seconds after the
    latest end so far, so that runs never overlap on the timeline.

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

    shift, latest, previous = 0.0, float("-inf"), float("-inf")
    for s in steps:
        if s.origin < previous:  # the clock went back: a run recorded on another clock
            shift = latest + RUN_GAP - s.origin
        previous = s.origin
        origin = s.origin + shift
        ends = [end for part in s.ranks.values() for _, _, end in part.events]
        ends += [s.makespan, *(end for *_, end in s.extra)]
        latest = max(latest, origin + max(ends))
        for rank, part in sorted(s.ranks.items()):
            for name, start, end in part.events:
                add(rank, name, start, end, origin, s.step)
        for rank, name, start, end in s.extra:
            add(rank, name, start, end, origin, s.step)
    return {"traceEvents": events, "displayTimeUnit": "ms"}
