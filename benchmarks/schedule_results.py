"""The schedule benchmark's results: rows, their aggregation and the simulated ideals."""

from __future__ import annotations

import argparse
import re
import statistics
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .calibration import LayerCosts
from .schedule_worker import OURS

if TYPE_CHECKING:
    from asyncpipe.schedule import Simulation

__all__ = [
    "BREAKDOWN",
    "MATCH",
    "MEMORY_ENV",
    "MemoryRow",
    "Row",
    "aggregate",
    "average_costs",
    "simulate_rows",
    "simulate_schedule",
    "simulate_torch_plan",
]

MATCH = {
    "torch-gpipe": "asyncpipe-gpipe",
    "torch-1f1b": "asyncpipe-1f1b",
    "torch-interleaved": "asyncpipe-interleaved",
    "torch-zero_bubble": "asyncpipe-zero_bubble",
}
"""Each peer and the asyncpipe system that runs the same kind of schedule."""

MEMORY_ENV = {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
"""glibc: serve every block of 128 KiB or more by mmap and give it back on free (a fixed
threshold also stops glibc from raising it), so the RSS follows the live tensors."""


# ----- the simulated ideal ---------------------------------------------------------------


def simulate_schedule(
    system: str, ranks: int, chunks: int, layers: int, virtual: int, costs: LayerCosts
) -> Simulation:
    """The :class:`asyncpipe.schedule.Simulation` of ``system``'s plan, per-stage costs being
    the calibrated per-layer costs times the layers of the stage.

    zero_bubble's B is the input gradient and W the weight gradient. On the first stage the
    model's input needs no gradient, so asyncpipe's runtime skips the first layer's B there.
    """
    from asyncpipe.schedule import Costs, build, simulate

    name = OURS[system]
    v = virtual if name == "interleaved" else 1
    per = layers // (ranks * v)
    plan = build(name, ranks, chunks, v)
    if name == "zero_bubble":
        backward = {s: per * costs.input_s for s in range(ranks)}
        backward[0] = (per - 1) * costs.input_s
        sim_costs = Costs(
            forward=per * costs.forward_s, backward=backward, weight=per * costs.weight_s
        )
    else:
        sim_costs = Costs(forward=per * costs.forward_s, backward=per * costs.backward_s)
    return simulate(plan, sim_costs)


_TORCH_ACTION = re.compile(r"^(\d+)([FIBW])(\d+)$")


def simulate_torch_plan(
    order: dict[str, list[str | None]], layers: int, costs: LayerCosts
) -> Simulation:
    """Simulate a torch.distributed.pipelining ``pipeline_order`` (its compute actions, by
    rank) with asyncpipe's simulator and the calibrated per-layer costs.

    ``I`` (input gradient) becomes a B action, ``W`` stays W and a full backward ``B`` is B. As
    torch runs them: the first stage skips its ``I`` and runs a full backward in ``W``.
    """
    from asyncpipe.schedule import Action, Costs, Kind, Plan, simulate

    plan: Plan = {}
    split = False
    for rank, row in order.items():
        actions: list[Action | None] = []
        for text in row:
            match = None if text is None else _TORCH_ACTION.match(text)
            if match is None:
                continue  # idle slots; the simulator waits by itself
            stage, kind, microbatch = match.groups()
            split = split or kind in "IW"
            kinds = {"F": Kind.FORWARD, "I": Kind.BACKWARD, "B": Kind.BACKWARD, "W": Kind.WEIGHT}
            actions.append(Action(int(stage), kinds[kind], int(microbatch)))
        plan[int(rank)] = actions
    stages = 1 + max(a.stage for row in plan.values() for a in row if a is not None)
    per = layers // stages
    if split:
        backward = {s: per * costs.input_s for s in range(stages)}
        weight = {s: per * costs.weight_s for s in range(stages)}
        backward[0], weight[0] = 0.0, per * costs.backward_s
        sim_costs = Costs(forward=per * costs.forward_s, backward=backward, weight=weight)
    else:
        sim_costs = Costs(forward=per * costs.forward_s, backward=per * costs.backward_s)
    return simulate(plan, sim_costs)


# ----- results -----------------------------------------------------------------------------


@dataclass
class Row:
    """One (system, chunks) result, over every round, rank and timed step."""

    system: str
    chunks: int
    simulated_s: float | None = None
    simulated_bubble: float | None = None
    """Mean over ranks of the simulated idle fraction."""
    simulated_peak: list[int] = field(default_factory=list)
    step_s: float | None = None
    """Median over all timed steps (of all rounds) of the slowest rank's step time."""
    round_s: list[float] = field(default_factory=list)
    """The median step time of each round."""
    idle: list[float] = field(default_factory=list)
    """Per rank: mean over steps of 1 - (time inside the reference layers) / (step time)."""
    peak_activations: list[int] = field(default_factory=list)
    """Per rank, asyncpipe only: the largest ``pipe.last_step.peak_activations`` seen."""
    breakdown: list[dict[str, float]] = field(default_factory=list)
    """Per rank, asyncpipe only: mean seconds per step of compute, send, receive, ..."""
    hop_s: float | None = None
    """asyncpipe only: median time from a send action's start to the end of the matching
    receive, over the messages whose receiver was already waiting (last step of each round)."""
    memory: list[float] = field(default_factory=list)
    """Per rank, when the workers sampled memory: the largest over steps of what a step added
    (the RSS the layers saw at their peak less the RSS at the step's start), or on a GPU the
    allocator's peak (``torch.cuda.max_memory_allocated``), bytes."""
    plan: dict[str, list[str | None]] | None = field(default=None, repr=False)
    """Peers: rank 0's record of the schedule's ``pipeline_order`` (compute actions by rank)."""
    error: str | None = None

    @property
    def vs_simulated(self) -> float | None:
        if self.step_s is None or not self.simulated_s:
            return None
        return self.step_s / self.simulated_s


@dataclass
class MemoryRow:
    """Memory of one rank in one asyncpipe schedule's own process group."""

    system: str
    rank: int
    peak_activations: int | None = None
    simulated_peak: int | None = None
    rss_growth: float | None = None
    """Median over steps of (the RSS peak inside the step) - (the RSS at its start), bytes."""
    rss_start: float | None = None
    max_rss: float | None = None
    """``ru_maxrss`` after the steps, bytes."""
    max_rss_before: float | None = None
    """``ru_maxrss`` after building the pipe, before the first step, bytes."""
    step_s: float | None = None
    error: str | None = None


BREAKDOWN = ("compute_s", "send_s", "recv_s", "head_s", "gap_s", "tail_s")
"""The keys of a worker's per-step time breakdown, in table order."""


def aggregate(row: Row, runs_per_rank: list[list[dict[str, Any]]]) -> None:
    """Fill ``row`` from each rank's runs of it (one run per round)."""
    rounds = min(len(runs) for runs in runs_per_rank)
    per_step: list[float] = []
    idle: list[list[float]] = [[] for _ in runs_per_rank]
    for r in range(rounds):
        runs = [rank_runs[r] for rank_runs in runs_per_rank]
        steps = min(len(run["seconds"]) for run in runs)
        slowest = [max(run["seconds"][i] for run in runs) for i in range(steps)]
        if not slowest:
            continue
        row.round_s.append(statistics.median(slowest))
        per_step += slowest
        for rank, run in enumerate(runs):
            idle[rank] += [1.0 - run["busy"][i] / slowest[i] for i in range(steps)]
    if not per_step:
        return
    row.step_s = statistics.median(per_step)
    row.idle = [statistics.fmean(values) for values in idle]
    if all("peak_activations" in run for runs in runs_per_rank for run in runs):
        row.peak_activations = [
            max(max(run["peak_activations"]) for run in runs) for runs in runs_per_rank
        ]
    if all(key in run for runs in runs_per_rank for run in runs for key in BREAKDOWN):
        row.breakdown = [
            {key: statistics.fmean(v for run in runs for v in run[key]) for key in BREAKDOWN}
            for runs in runs_per_rank
        ]
        for parts, runs in zip(row.breakdown, runs_per_rank, strict=True):
            parts["layers_s"] = statistics.fmean(v for run in runs for v in run["busy"])
    memory = [_memory(runs) for runs in runs_per_rank]
    row.memory = [m for m in memory if m is not None] if None not in memory else []
    hops = [
        hop for r in range(rounds) for hop in _hops([rank_runs[r] for rank_runs in runs_per_rank])
    ]
    row.hop_s = statistics.median(hops) if hops else None


def _memory(runs: list[dict[str, Any]]) -> float | None:
    """One rank's peak memory over its runs (see :attr:`Row.memory`), or None if not sampled."""
    if all("cuda_peak" in run for run in runs):
        return float(max(max(run["cuda_peak"]) for run in runs))
    if all("rss_peak" in run for run in runs):
        return float(max(p - s for run in runs for p, s in zip(run["rss_peak"], run["rss_start"])))
    return None


def _hops(runs: list[dict[str, Any]]) -> list[float]:
    """Send start to receive end of every message of one step whose receive began first."""
    from asyncpipe.schedule import Action

    sends: dict[tuple[int, str, int, int], float] = {}
    recvs: dict[tuple[int, str, int, int], tuple[float, float]] = {}
    for run in runs:
        if "last_events" not in run or "last_events_start" not in run:
            return []
        base = run["last_events_start"]
        for text, began, ended in run["last_events"]:
            action = Action.parse(text)
            if action.peer is None:
                continue
            direction = "F" if action.kind.value.endswith("F") else "B"
            if action.kind.is_send:
                key = (action.stage, direction, action.microbatch, action.peer)
                sends[key] = base + began
            else:
                key = (action.peer, direction, action.microbatch, action.stage)
                recvs[key] = (base + began, base + ended)
    return [
        recvs[key][1] - sent
        for key, sent in sends.items()
        if key in recvs and recvs[key][0] <= sent
    ]


# ----- the simulated ideals of rows ------------------------------------------------------


def simulate_rows(rows: list[Row], args: argparse.Namespace, costs: LayerCosts) -> None:
    """Fill in every row's simulated ideal with ``costs``.

    asyncpipe: its plan. A peer: its own recorded ``pipeline_order``; for ScheduleGPipe and
    Schedule1F1B, which run their own loop (Schedule1F1B's ``pipeline_order`` is for display
    and in torch 2.13 names the last rank's micro-batches off by one), asyncpipe's plan of the
    same schedule. An asyncpipe schedule whose plan cannot be built is marked failed.
    """
    for row in rows:
        try:
            if row.system in OURS or row.system in ("torch-gpipe", "torch-1f1b"):
                system = MATCH.get(row.system, row.system)
                sim = simulate_schedule(
                    system, args.ranks, row.chunks, args.layers, args.virtual_stages, costs
                )
            elif row.plan is not None:
                sim = simulate_torch_plan(row.plan, args.layers, costs)
            else:
                continue
        except Exception as exc:  # a generator that is not there yet, a plan we cannot read
            if row.system in OURS:
                row.error = f"no plan: {type(exc).__name__}: {exc}"
            else:
                print(f"  cannot simulate {row.system}: {type(exc).__name__}: {exc}")
            continue
        row.simulated_s = sim.makespan
        row.simulated_bubble = statistics.fmean(sim.bubble.values())
        if row.system in OURS:
            row.simulated_peak = [sim.peak_activations[r] for r in sorted(sim.busy)]


def average_costs(first: LayerCosts, second: LayerCosts) -> LayerCosts:
    """The mean of two calibrations (taken before and after the runs)."""
    return LayerCosts(
        (first.forward_s + second.forward_s) / 2,
        (first.backward_s + second.backward_s) / 2,
        (first.input_s + second.input_s) / 2,
        (first.weight_s + second.weight_s) / 2,
        first.repeats + second.repeats,
    )
