"""A recorded step: every rank's events on one clock, and what follows from them."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from statistics import mean

from ..schedule import Action, Costs, Kind, Plan, Simulation, simulate, stage_owners
from ..schedule.two_bw import simulate_window

__all__: list[str] = []

Event = tuple[str, float, float]
"""``(name, start, end)``: an action string (``"2F0"``) or ``"wait"``, ``"sync"`` or a name
given to :meth:`~asyncpipe.AsyncPipe.trace_span`; seconds since the step's origin."""

WAIT, SYNC = "wait", "sync"

STREAM_BATCHES = 3
"""A traced 2BW step is a window of the 2BW stream of this many mini-batches: its plan in the
trace, which the simulated ideal cuts the same window from."""
WINDOWS = {"-first": 0, "": 1, "-drain": STREAM_BATCHES}
"""The 2BW windows a step's plan key names by its ending (``"8/2bw"``: a window after another,
with 8 micro-batches; ``"8/2bw-first"``; ``"8/2bw-drain"``), and their index in the stream of
``STREAM_BATCHES`` mini-batches. A lookahead above 1 comes before the ending:
``"8/2bw-lookahead2-first"``."""

_WINDOW = re.compile(r"2bw(?:-lookahead([1-9][0-9]*))?(-first|-drain)?")


def window_name(window: str, lookahead: int = 1) -> str:
    """The plan key's name of a 2BW step: ``window`` is ``"first"``, ``"steady"`` or
    ``"drain"``.

    Example:
        >>> window_name("first"), window_name("steady", 2)
        ('2bw-first', '2bw-lookahead2')
    """
    ending = {"first": "-first", "steady": "", "drain": "-drain"}[window]
    return "2bw" + (f"-lookahead{lookahead}" if lookahead != 1 else "") + ending


def plan_kind(key: str) -> str:
    """A plan key without its revision: a run into a directory that holds an earlier run
    whose plan under the same key differs records its own as ``key#2`` (``#3``, ...).

    Example:
        >>> plan_kind("8/train#2"), plan_kind("8/eval")
        ('8/train', '8/eval')
    """
    return key.partition("#")[0]


def stream_window(key: str) -> tuple[int, int, int] | None:
    """(micro-batches, window, lookahead) of a 2BW step's plan key, or None for a step that
    runs its whole plan.

    Example:
        >>> stream_window("8/2bw"), stream_window("8/2bw-drain"), stream_window("8/train")
        ((8, 1, 1), (8, 3, 1), None)
        >>> stream_window("8/2bw-lookahead2-first#2")
        (8, 0, 2)
    """
    count, _, name = plan_kind(key).partition("/")
    found = _WINDOW.fullmatch(name)
    if found is None or not count.isdigit():
        return None
    lookahead, ending = found.groups()
    return int(count), WINDOWS[ending or ""], int(lookahead or 1)


@lru_cache(maxsize=4096)
def kind_of(name: str) -> str:
    """``"compute"`` (F, B, W), ``"comm"`` (send, receive), ``"wait"`` (the first receive, before
    any action), ``"sync"`` (the end-of-step exchange) or ``"user"`` (a :meth:`trace_span`)."""
    if name in (WAIT, SYNC):
        return name
    try:
        action = Action.parse(name)
    except ValueError:
        return "user"
    return "compute" if action.kind.is_compute else "comm"


@dataclass(frozen=True)
class RankStep:
    """One rank's part of a step."""

    start: float
    """When this rank began the step, in seconds after the step's origin."""
    seconds: float
    events: tuple[Event, ...]
    peak_memory: int = 0
    """Peak bytes of this process so far: the CUDA allocator's on GPU, else the resident set."""

    @property
    def end(self) -> float:
        return self.start + self.seconds

    @cached_property
    def _totals(self) -> dict[str, float]:
        totals: dict[str, float] = {}
        for name, start, end in self.events:
            kind = kind_of(name)
            totals[kind] = totals.get(kind, 0.0) + end - start
        return totals

    def total(self, kind: str) -> float:
        """Seconds spent in events of one :func:`kind_of`."""
        return self._totals.get(kind, 0.0)


@dataclass(frozen=True)
class StepTrace:
    """Every rank's events of one step, on rank 0's clock.

    Example:
        >>> s = StepTrace(0, 0.0, 1.0, 8, {0: RankStep(0.0, 2.0, (("0F0", 0.0, 1.0),))})
        >>> s.makespan, s.bubble
        (2.0, 0.5)
    """

    step: int
    origin: float
    """``time.perf_counter()`` on rank 0 when the first rank began the step."""
    loss: float | None
    samples: int
    ranks: dict[int, RankStep]
    plan: str = ""
    """Key of the step's lowered plan in the run's ``plans.json`` (micro-batches and phase)."""
    extra: tuple[tuple[int, str, float, float], ...] = field(default=())
    """``(rank, name, start, end)`` of spans recorded between steps (e.g. the optimizer)."""

    @property
    def makespan(self) -> float:
        """When the last rank ended the step, in seconds from the step's origin."""
        return max((r.end for r in self.ranks.values()), default=0.0)

    def idle(self, rank: int) -> float:
        """Fraction of the makespan this rank spent not computing."""
        span = self.makespan
        return 0.0 if span <= 0 else max(0.0, 1.0 - self.ranks[rank].total("compute") / span)

    @property
    def bubble(self) -> float:
        """Fraction of all ranks' time (makespan times ranks) spent not computing."""
        span = self.makespan
        if span <= 0 or not self.ranks:
            return 0.0
        busy = sum(r.total("compute") for r in self.ranks.values())
        return max(0.0, 1.0 - busy / (span * len(self.ranks)))

    def simulation(self) -> Simulation:
        """The measured step in the shape of a simulation (actions only), to draw it."""
        timeline = {
            rank: [e for e in r.events if kind_of(e[0]) in ("compute", "comm")]
            for rank, r in sorted(self.ranks.items())
        }
        busy = {rank: r.total("compute") for rank, r in self.ranks.items()}
        return Simulation(self.makespan, busy, timeline)

    def costs(self, stages: Iterable[int] = ()) -> Costs:
        """Mean measured seconds of forward, backward and weight gradient, per stage (0 for
        what this step did not run, for every stage it ran and every one of ``stages``)."""
        spans: dict[tuple[Kind, int], list[float]] = {}
        for r in self.ranks.values():
            for name, start, end in r.events:
                if kind_of(name) == "compute":
                    action = Action.parse(name)
                    spans.setdefault((action.kind, action.stage), []).append(end - start)

        def per(kind: Kind) -> dict[int, float]:
            return {stage: mean(v) for (k, stage), v in spans.items() if k is kind}

        stages = {stage for _, stage in spans} | set(stages)
        forward, backward, weight = per(Kind.FORWARD), per(Kind.BACKWARD), per(Kind.WEIGHT)
        return Costs(
            forward={s: forward.get(s, 0.0) for s in stages},
            backward={s: backward.get(s, 0.0) for s in stages},
            weight={s: weight.get(s, 0.0) for s in stages},
        )

    def ideal(self, plan: Plan) -> Simulation:
        """``plan`` (this step's lowered plan) simulated with this step's measured compute
        costs and free messages: the schedule's limit for this run. For a 2BW step, ``plan``
        is the stream it is a window of, and the ideal is that window of its simulation,
        numbered as the step's own actions."""
        window = stream_window(self.plan)
        if window is None:
            return simulate(plan, self.costs())
        numbers = [
            Action.parse(name).microbatch
            for r in self.ranks.values()
            for name, _, _ in r.events
            if kind_of(name) == "compute"
        ]
        first = min(numbers, default=None)
        costs = self.costs(stage_owners(plan))  # a window may not run every stage (the drain)
        microbatches, index, lookahead = window
        return simulate_window(
            plan, costs, microbatches, index, STREAM_BATCHES, first=first, lookahead=lookahead
        )

    def to_json(self) -> str:
        ranks = {
            str(rank): {
                "start": r.start,
                "seconds": r.seconds,
                "peak_memory": r.peak_memory,
                "events": [list(e) for e in r.events],
            }
            for rank, r in sorted(self.ranks.items())
        }
        record = {
            "step": self.step,
            "origin": self.origin,
            "loss": self.loss,
            "samples": self.samples,
            "plan": self.plan,
            "ranks": ranks,
            "extra": [list(e) for e in self.extra],
        }
        return json.dumps(record, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> StepTrace:
        record = json.loads(text)
        ranks = {
            int(rank): RankStep(
                float(r["start"]),
                float(r["seconds"]),
                tuple((str(n), float(s), float(e)) for n, s, e in r["events"]),
                int(r.get("peak_memory", 0)),
            )
            for rank, r in record["ranks"].items()
        }
        extra = tuple((int(k), str(n), float(s), float(e)) for k, n, s, e in record["extra"])
        loss = record["loss"]
        return cls(
            int(record["step"]),
            float(record["origin"]),
            None if loss is None else float(loss),
            int(record["samples"]),
            ranks,
            str(record.get("plan", "")),
            extra,
        )


@dataclass(frozen=True)
class StageSummary:
    """One rank's time over several steps, as fractions of the steps' makespans."""

    rank: int
    busy: float
    communication: float
    idle: float
    peak_memory: int


def summarize(steps: Sequence[StepTrace]) -> list[StageSummary]:
    """Per rank: the shares of compute, communication (sends, receives, waits and the end of
    step exchange) and idle time (everything but compute) over ``steps``."""
    ranks = sorted({rank for s in steps for rank in s.ranks})
    total = sum(s.makespan for s in steps) or 1.0
    out = []
    for rank in ranks:
        mine = [s.ranks[rank] for s in steps if rank in s.ranks]
        busy = sum(r.total("compute") for r in mine)
        comm = sum(r.total(k) for r in mine for k in ("comm", WAIT, SYNC))
        memory = max((r.peak_memory for r in mine), default=0)
        out.append(StageSummary(rank, busy / total, comm / total, 1 - busy / total, memory))
    return out


def steady(steps: Iterable[StepTrace]) -> list[StepTrace]:
    """The steps without the first one (it pays for warm-up), unless it is the only one."""
    steps = list(steps)
    return steps[1:] if len(steps) > 1 else steps
