"""The steady-state step of PipeDream-2BW: the time per mini-batch once its stream repeats.

2BW never drains between mini-batches, so one step of it is one *window* of a stream (see
:func:`asyncpipe.schedule.two_bw.windows`), not a whole plan: its makespan would count the
fill and the drain of the stream, which the steps in between never pay. Every window after
the first holds the same actions on every rank (only the micro-batch numbers move on by
``M``), and the actions of window ``t + 1`` wait only on those of windows ``t`` and ``t + 1``
(a backward waits at most one window back for its gradient). So once window ``t + c`` runs
exactly as window ``t`` did, shifted by ``D`` seconds on every rank, every later window repeats
the same way, and the stream advances by exactly ``D / c`` seconds per mini-batch for ever:
that is the step. Usually ``c`` is 1 and window 2 already repeats window 1; a fill that settles
slowly, or ranks that settle into a rhythm of two windows (``c = 2``, steps alternately a
little longer and shorter), need a few more.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..schedule import Action, Costs, Simulation, simulate, two_bw
from ..schedule.two_bw import window_of

__all__: list[str] = []

_STREAMS = (4, 8, 16, 32)
"""Stream lengths (mini-batches) tried in turn until two of their windows repeat."""


@dataclass(frozen=True)
class Steady:
    """What a 2BW stream does per mini-batch once it repeats."""

    seconds: float
    """Time per mini-batch: the step."""
    busy: dict[int, float]
    """Compute per mini-batch on each rank."""
    peak_activations: dict[int, int]
    """Most micro-batches each rank holds at once, over the whole stream."""
    repeats: bool = True
    """False when no two windows of the longest stream tried ran alike; ``seconds`` is then
    the mean step over the second half of that stream."""

    @property
    def bubble(self) -> float:
        """Fraction of all ranks' time per mini-batch without compute."""
        if self.seconds <= 0 or not self.busy:
            return 0.0
        return 1.0 - sum(self.busy.values()) / (self.seconds * len(self.busy))


def _windows(
    sim: Simulation, stages: int, microbatches: int, batches: int, lookahead: int
) -> dict[int, list[list[tuple[float, float]]]]:
    """Each rank's (start, end) times, window by window (the drain last)."""
    out: dict[int, list[list[tuple[float, float]]]] = {}
    for rank, events in sim.timeline.items():
        where = window_of(stages, microbatches, rank, batches, lookahead)
        cut: list[list[tuple[float, float]]] = [[] for _ in range(batches + 1)]
        for name, start, end in events:
            cut[where[Action.parse(name)]].append((start, end))
        out[rank] = cut
    return out


def _shift(
    times: dict[int, list[list[tuple[float, float]]]], early: int, late: int, tolerance: float
) -> float | None:
    """``D`` if window ``late`` runs as window ``early`` does, ``D`` seconds later, on every
    rank; else None."""
    shift: float | None = None
    for cut in times.values():
        a, b = cut[early], cut[late]
        if len(a) != len(b):
            return None
        for (s0, e0), (s1, e1) in zip(a, b):
            if shift is None:
                shift = s1 - s0
            if abs(s1 - s0 - shift) > tolerance or abs(e1 - e0 - shift) > tolerance:
                return None
    return shift


def steady_step(stages: int, microbatches: int, costs: Costs, lookahead: int = 1) -> Steady:
    """The step of a :func:`~asyncpipe.schedule.two_bw` stream once it repeats: ``D / c``
    where window ``t + c`` runs as window ``t`` (``t >= 1``), ``D`` seconds later, on every
    rank (see the module docstring for why that is exact). Streams of 4, 8, 16 and 32
    mini-batches are simulated in turn until two windows repeat.

    Raises ValueError where :func:`~asyncpipe.schedule.two_bw` does (too few micro-batches for
    the stages and ``lookahead``).

    Example:
        >>> from asyncpipe.schedule import Costs
        >>> steady_step(4, 8, Costs(forward=1, backward=2)).seconds  # 8 x (1 + 2): no bubble
        24.0
    """
    for batches in _STREAMS:
        sim = simulate(two_bw(stages, microbatches, batches, lookahead), costs)
        times = _windows(sim, stages, microbatches, batches, lookahead)
        tolerance = 1e-9 * max(sim.makespan, 1e-30)
        for late in range(2, batches):  # window `batches` is the drain
            for period in range(1, late):
                shift = _shift(times, late - period, late, tolerance)
                if shift is not None:
                    return Steady(shift / period, _busy(times, late), dict(sim.peak_activations))
    half = batches // 2
    begin = min(cut[half][0][0] for cut in times.values() if cut[half])
    end = min(cut[batches - 1][0][0] for cut in times.values() if cut[batches - 1])
    seconds = (end - begin) / (batches - 1 - half)
    return Steady(seconds, _busy(times, half), dict(sim.peak_activations), repeats=False)


def _busy(times: dict[int, list[list[tuple[float, float]]]], window: int) -> dict[int, float]:
    return {rank: sum(e - s for s, e in cut[window]) for rank, cut in times.items()}
