"""Schedule benchmark: asyncpipe's schedules against their simulated ideals and torch's peers."""

from __future__ import annotations

import argparse
import datetime
import json
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .gpipe import _read_records
from .launch import LaunchResult, launch
from .peers import FAIRSCALE
from .schedule_worker import ASYNCPIPE, PEERS, SYSTEMS
from .sections import load, machine, provenance, revision, write_section
from .workload import FEATURES, SHAPES, LayerCosts, calibrate_layer

if TYPE_CHECKING:
    from asyncpipe.schedule import Simulation

__all__ = ["MemoryRow", "Row", "main", "simulate_schedule"]

TARGET_SIMULATED = 1.10
"""Target: every asyncpipe schedule at most 1.10x its simulated ideal."""

MATCH = {
    "torch-gpipe": "asyncpipe-gpipe",
    "torch-1f1b": "asyncpipe-1f1b",
    "torch-interleaved": "asyncpipe-interleaved",
    "torch-zero_bubble": "asyncpipe-zero_bubble",
}
"""Each peer and the asyncpipe system that runs the same kind of schedule."""

LABELS = {
    "asyncpipe-gpipe": "gpipe",
    "asyncpipe-1f1b": "1f1b",
    "asyncpipe-interleaved": "interleaved (V=2)",
    "asyncpipe-zero_bubble": "zero_bubble",
    "torch-gpipe": "ScheduleGPipe",
    "torch-1f1b": "Schedule1F1B",
    "torch-interleaved": "ScheduleInterleaved1F1B (2 stages/rank)",
    "torch-zero_bubble": "ScheduleInterleavedZeroBubble (1 stage/rank)",
    "torch-zbv": "ScheduleZBVZeroBubble (2 stages/rank, V)",
    **FAIRSCALE,
}
"""How each system shows in the tables."""

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

    name = ASYNCPIPE[system]
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


_BREAKDOWN = ("compute_s", "send_s", "recv_s", "head_s", "gap_s", "tail_s")


def _aggregate(row: Row, runs_per_rank: list[list[dict[str, Any]]]) -> None:
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
    if all(key in run for runs in runs_per_rank for run in runs for key in _BREAKDOWN):
        row.breakdown = [
            {key: statistics.fmean(v for run in runs for v in run[key]) for key in _BREAKDOWN}
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


# ----- running -----------------------------------------------------------------------------


def _worker_args(
    args: argparse.Namespace, entries: str, shape: str, out: Path, memory: bool
) -> list[str]:
    # Options only the suite (python -m benchmarks.suite) sets: memory sampled in timing runs too,
    # the transport and device of asyncpipe's systems, fairscale Pipe's partitions.
    sample = memory or getattr(args, "sample_memory", False)
    extra = [
        "--transport", getattr(args, "transport", "p2p"),
        "--device", getattr(args, "device", "cpu"),
        "--pipe-stages", str(getattr(args, "pipe_stages", args.ranks)),
    ]  # fmt: skip
    return ["--memory"] * sample + extra + [
        "--entries", entries,
        "--f-ms", str(args.f_ms),
        "--micro-batch", str(args.micro_batch),
        "--shape", shape,
        "--layers", str(args.layers),
        "--virtual", str(args.virtual_stages),
        "--warmup", str(1 if memory else args.warmup),
        "--steps", str(args.memory_steps if memory else args.steps),
        "--pg-timeout", str(args.pg_timeout),
        "--out", str(out),
    ]  # fmt: skip


def _report_failure(result: LaunchResult, world: int) -> None:
    for rank in range(world):
        tail = result.log_tail(rank, 1500).strip()
        if result.returncodes[rank] not in (0, None) and tail:
            print(f"  --- rank {rank} log tail ---\n{tail}", file=sys.stderr)


def run_entries(
    args: argparse.Namespace,
    entries: list[tuple[str, int]],
    work: Path,
    timeout_s: float,
    shape: str,
    memory: bool = False,
) -> tuple[dict[int, list[dict[str, Any]]], dict[int, str]]:
    """Run ``entries`` ((system, chunks), in this order) in one group of ``args.ranks`` workers.

    Returns each finished entry's per-rank runs and each failed entry's error. A worker stops
    at its first failing entry (its peers may be stuck in a receive), so the group is relaunched
    for the entries after it; an entry that failed is not retried in a later round. After a
    timeout nothing more is run.
    """
    runs: dict[int, list[dict[str, Any]]] = {}
    errors: dict[int, str] = {}
    remaining = list(range(len(entries)))
    attempt = 0
    while remaining:
        out = work / f"group{attempt}"
        attempt += 1
        text = ",".join(f"{i}:{entries[i][0]}:{entries[i][1]}" for i in remaining)
        result = launch(
            "benchmarks.schedule_worker",
            _worker_args(args, text, shape, out, memory),
            args.ranks,
            timeout_s,
            out,
            extra_env=MEMORY_ENV if memory or getattr(args, "sample_memory", False) else None,
        )
        print(
            f"  group of {len(remaining)} entries: {result.seconds:.1f} s wall, "
            f"{result.cpu_seconds:.1f} s CPU",
            file=sys.stderr,
        )
        records = _read_records(out, args.ranks)
        for index in list(remaining):
            found = []
            for record in records:
                match = [r for r in (record or {}).get("runs", []) if r["entry"] == index]
                found.append(match[0] if match else None)
            if all(run is not None for run in found):
                runs[index] = [run for run in found if run is not None]
                remaining.remove(index)
        if result.ok or not remaining:
            break
        failed = next(
            (r["failed_entry"] for r in records if r and r.get("failed_entry") is not None),
            remaining[0],
        )
        failed = failed if failed in remaining else remaining[0]
        messages = [r["error"] for r in records if r is not None and r.get("error")]
        error = messages[0] if messages and not result.timed_out else result.failure()
        system, chunks = entries[failed]
        print(f"  {system} chunks {chunks} FAILED: {error}", file=sys.stderr)
        _report_failure(result, args.ranks)
        same = [i for i in remaining if entries[i] == entries[failed]]
        for index in same:
            errors[index] = error
        remaining = [i for i in remaining if i not in same]
        if result.timed_out:
            for index in remaining:
                errors[index] = f"not run ({system} chunks {chunks} timed out)"
            break
    return runs, errors


def timing_entries(systems: list[str], chunk_list: list[int], rounds: int) -> list[tuple[str, int]]:
    """Every (system, chunks) once per round; within a round by chunks, and the systems in
    turn in alternate directions, so no system always runs right after the same one."""
    entries = []
    for r in range(rounds):
        order = systems if r % 2 == 0 else systems[::-1]
        for chunks in chunk_list:
            entries += [(system, chunks) for system in order]
    return entries


def run_timing(args: argparse.Namespace, costs: LayerCosts, work: Path) -> list[Row]:
    """Run every system and chunk count, ``args.rounds`` times; one row per (system, chunks).

    ``costs`` only sizes the timeout here: :func:`simulate_rows` fills in the ideals.
    """
    entries = timing_entries(args.system_list, args.chunk_list, args.rounds)
    rows = {(system, c): Row(system, c) for system in args.system_list for c in args.chunk_list}
    simulate_rows(list(rows.values()), args, costs)
    entries = [e for e in entries if rows[e].error is None]
    worst = {c: max((r.simulated_s or 0.0) for r in rows.values() if r.chunks == c)
             for c in args.chunk_list}  # fmt: skip
    nominal = {c: 3 * (c + args.ranks - 1) * costs.forward_s * args.layers / args.ranks
               for c in args.chunk_list}  # fmt: skip
    timeout_s = args.timeout or 120.0 + 3.0 * (args.warmup + args.steps) * sum(
        max(worst[c], nominal[c]) for _, c in entries
    )
    print(
        f"running {len(entries)} entries ({args.rounds} round(s)) in one group of "
        f"{args.ranks}, timeout {timeout_s:.0f} s ...",
        file=sys.stderr,
    )
    runs, errors = run_entries(args, entries, work / "timing", timeout_s, args.shape)
    for key, row in rows.items():
        indices = [i for i, e in enumerate(entries) if e == key]
        done = [runs[i] for i in indices if i in runs]
        if done:
            per_rank = [[d[rank] for d in done] for rank in range(args.ranks)]
            _aggregate(row, per_rank)
            row.plan = next((d[0]["plan"] for d in done if "plan" in d[0]), None)
        failed = [errors[i] for i in indices if i in errors]
        if failed and row.error is None:
            row.error = failed[0]
        if row.step_s is None and row.error is None:
            row.error = "no result"
    return list(rows.values())


def simulate_rows(rows: list[Row], args: argparse.Namespace, costs: LayerCosts) -> None:
    """Fill in every row's simulated ideal with ``costs``.

    asyncpipe: its plan. A peer: its own recorded ``pipeline_order``; for ScheduleGPipe and
    Schedule1F1B, which run their own loop (Schedule1F1B's ``pipeline_order`` is for display
    and in torch 2.13 names the last rank's micro-batches off by one), asyncpipe's plan of the
    same schedule. An asyncpipe schedule whose plan cannot be built is marked failed.
    """
    for row in rows:
        try:
            if row.system in ASYNCPIPE or row.system in ("torch-gpipe", "torch-1f1b"):
                system = MATCH.get(row.system, row.system)
                sim = simulate_schedule(
                    system, args.ranks, row.chunks, args.layers, args.virtual_stages, costs
                )
            elif row.plan is not None:
                sim = simulate_torch_plan(row.plan, args.layers, costs)
            else:
                continue
        except Exception as exc:  # a generator that is not there yet, a plan we cannot read
            if row.system in ASYNCPIPE:
                row.error = f"no plan: {type(exc).__name__}: {exc}"
            else:
                print(f"  cannot simulate {row.system}: {type(exc).__name__}: {exc}")
            continue
        row.simulated_s = sim.makespan
        row.simulated_bubble = statistics.fmean(sim.bubble.values())
        if row.system in ASYNCPIPE:
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


def run_memory(args: argparse.Namespace, costs: LayerCosts, work: Path) -> list[MemoryRow]:
    """Each of ``args.memory_list`` alone in its own group (``ru_maxrss`` is per process), at
    ``args.memory_shape`` and ``args.memory_chunks``; RSS sampled inside every step."""
    out: list[MemoryRow] = []
    for system in args.memory_list:
        sim = simulate_schedule(
            system, args.ranks, args.memory_chunks, args.layers, args.virtual_stages, costs
        )
        timeout_s = 90.0 + 10.0 * (1 + args.memory_steps) * sim.makespan
        print(f"memory: {system}, chunks {args.memory_chunks} ...", file=sys.stderr)
        runs, errors = run_entries(
            args,
            [(system, args.memory_chunks)],
            work / f"memory-{system}",
            timeout_s,
            args.memory_shape,
            memory=True,
        )
        for rank in range(args.ranks):
            row = MemoryRow(system, rank, simulated_peak=sim.peak_activations.get(rank))
            if 0 not in runs:
                row.error = errors.get(0, "no result")
            else:
                run = runs[0][rank]
                row.peak_activations = max(run["peak_activations"])
                growth = [p - s for p, s in zip(run["rss_peak"], run["rss_start"], strict=True)]
                row.rss_growth = statistics.median(growth)
                row.rss_start = statistics.median(run["rss_start"])
                row.max_rss = run["max_rss_after"]
                row.max_rss_before = run["max_rss_before"]
                row.step_s = statistics.median(run["seconds"])
            out.append(row)
    return out


# ----- tables ------------------------------------------------------------------------------


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f}"


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value / 2**20:.1f}"


def _ints(values: Sequence[int]) -> str:
    return "-" if not values else " / ".join(str(v) for v in values)


HEADER = [
    "chunks",
    "system",
    "schedule",
    "step ms",
    "simulated ms",
    "/simulated",
    "/asyncpipe gpipe",
    "asyncpipe / this",
    "idle (measured)",
    "idle (simulated)",
    "peak activations per rank (measured; simulated)",
]


def table_cells(rows: list[Row]) -> list[list[str]]:
    """The timing table as strings, in :data:`HEADER` order."""
    step = {(r.system, r.chunks): r.step_s for r in rows}
    cells = []
    for row in rows:
        base = step.get(("asyncpipe-gpipe", row.chunks))
        ours = step.get((MATCH.get(row.system, ""), row.chunks))
        vs_gpipe = None if base is None or row.step_s is None else row.step_s / base
        versus = None if ours is None or row.step_s is None else ours / row.step_s
        peak = ""
        if row.peak_activations or row.simulated_peak:
            peak = f"{_ints(row.peak_activations)}; {_ints(row.simulated_peak)}"
        cells.append(
            [
                str(row.chunks),
                "asyncpipe" if row.system in ASYNCPIPE else "torch",
                LABELS[row.system],
                _ms(row.step_s) if row.error is None else f"FAILED: {row.error}",
                _ms(row.simulated_s),
                _x(row.vs_simulated),
                _x(vs_gpipe),
                _x(versus),
                "-" if not row.idle else f"{statistics.fmean(row.idle):.2f}",
                "-" if row.simulated_bubble is None else f"{row.simulated_bubble:.2f}",
                peak or "-",
            ]
        )
    return cells


MEMORY_HEADER = [
    "schedule",
    "rank",
    "peak activations (measured; simulated)",
    "RSS growth in step MiB",
    "RSS at step start MiB",
    "ru_maxrss MiB",
    "ru_maxrss - RSS at step start MiB",
    "step ms",
]


def memory_cells(rows: list[MemoryRow]) -> list[list[str]]:
    cells = []
    for row in rows:
        if row.error is not None:
            cells.append([LABELS[row.system], str(row.rank), f"FAILED: {row.error}"])
            cells[-1] += ["-"] * (len(MEMORY_HEADER) - 3)
            continue
        growth = None
        if row.max_rss is not None and row.rss_start is not None:
            growth = row.max_rss - row.rss_start
        cells.append(
            [
                LABELS[row.system],
                str(row.rank),
                f"{row.peak_activations}; {row.simulated_peak}",
                _mib(row.rss_growth),
                _mib(row.rss_start),
                _mib(row.max_rss),
                _mib(growth),
                _ms(row.step_s),
            ]
        )
    return cells


def _markdown(header: list[str], cells: list[list[str]]) -> str:
    def esc(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(esc(c) for c in line) + " |" for line in cells])


def _text(header: list[str], cells: list[list[str]]) -> str:
    notes: list[str] = []
    for line in cells:
        for i, cell in enumerate(line):
            if cell.startswith("FAILED") and len(cell) > 30:
                notes.append(f"[{len(notes) + 1}] {line[2]} chunks {line[0]}: {cell}")
                line[i] = f"FAILED [{len(notes)}]"
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)) for line in cells]
    return "\n".join(lines + notes)


def target_lines(rows: list[Row], chunks: int = 8) -> list[str]:
    """The three targets, each with its verdict and the numbers behind it."""
    lines = []
    ours = [r for r in rows if r.system in ASYNCPIPE]
    over = [r for r in ours if r.vs_simulated is None or r.vs_simulated > TARGET_SIMULATED]
    worst = max((r.vs_simulated for r in ours if r.vs_simulated is not None), default=None)
    verdict = "met" if ours and not over else "NOT met"
    detail = ", ".join(f"{LABELS[r.system]} chunks {r.chunks}: {_x(r.vs_simulated)}" for r in over)
    lines.append(
        f"Target (every asyncpipe schedule <= {TARGET_SIMULATED:.2f}x its simulated ideal): "
        f"{verdict} (worst {_x(worst)}" + (f"; over: {detail})" if detail else ")")
    )
    step = {(r.system, r.chunks): r.step_s for r in rows}
    base = step.get(("asyncpipe-1f1b", chunks))
    parts = []
    met = base is not None
    for system in ("asyncpipe-interleaved", "asyncpipe-zero_bubble"):
        mine = step.get((system, chunks))
        if mine is None or base is None:
            parts.append(f"{LABELS[system]}: no result")
            met = False
            continue
        parts.append(f"{LABELS[system]} {mine / base:.2f}x of 1f1b")
        met = met and mine < base
    lines.append(
        f"Target (interleaved and zero_bubble faster than 1f1b at chunks {chunks}): "
        f"{'met' if met else 'NOT met'} ({', '.join(parts)})"
    )
    parts, met = [], True
    for peer, system in MATCH.items():
        for c in sorted({r.chunks for r in rows}):
            theirs, mine = step.get((peer, c)), step.get((system, c))
            if theirs is None or mine is None:
                if (peer, c) in step and (system, c) in step:
                    parts.append(f"{LABELS[system]} chunks {c}: no comparison")
                    met = False
                continue
            if mine > theirs:
                met = False
                parts.append(f"{LABELS[system]} chunks {c}: {mine / theirs:.2f}x")
    lines.append(
        "Target (asyncpipe no slower than torch.distributed.pipelining's same schedule): "
        + ("met" if met else "NOT met")
        + (f" (slower: {', '.join(parts)})" if parts else "")
    )
    return lines


# ----- timelines ---------------------------------------------------------------------------


def write_timelines(
    directory: Path, ranks: int, chunks: int, layers: int, virtual: int, costs: LayerCosts
) -> list[Path]:
    """SVG timelines of the simulated 1f1b, zero_bubble and interleaved plans (times in ms)."""
    try:
        from asyncpipe.schedule.show import timeline_svg
    except ImportError as exc:
        print(f"no timelines: {exc}", file=sys.stderr)
        return []
    ms = LayerCosts(
        costs.forward_s * 1000,
        costs.backward_s * 1000,
        costs.input_s * 1000,
        costs.weight_s * 1000,
        costs.repeats,
    )
    written = []
    directory.mkdir(parents=True, exist_ok=True)
    for system in ("asyncpipe-1f1b", "asyncpipe-zero_bubble", "asyncpipe-interleaved"):
        sim = simulate_schedule(system, ranks, chunks, layers, virtual, ms)
        title = (
            f"{LABELS[system]}: {ranks} ranks, {chunks} micro-batches, simulated with the "
            f"calibrated costs (ms)"
        )
        path = directory / f"schedule_benchmarks_{ASYNCPIPE[system]}_{ranks}x{chunks}.svg"
        path.write_text(timeline_svg(sim, title))
        written.append(path)
    return written


# ----- markdown ----------------------------------------------------------------------------


def _calibration_text(calibrations: list[LayerCosts]) -> str:
    if len(calibrations) == 1:
        return f"median of {calibrations[0].repeats}"
    parts = [
        f"{c.forward_s * 1000:.2f} / {c.backward_s * 1000:.2f} / {c.input_s * 1000:.2f} / "
        f"{c.weight_s * 1000:.2f} ms"
        for c in calibrations
    ]
    return (
        f"mean of a calibration before the runs ({parts[0]}) and one after ({parts[1]}), each "
        f"the median of {calibrations[0].repeats}"
    )


def markdown_section(
    args: argparse.Namespace,
    argv: list[str],
    calibrations: list[LayerCosts],
    costs: LayerCosts,
    rows: list[Row],
    memory: list[MemoryRow],
    notes: list[str],
    timelines: list[Path],
    markdown_path: Path,
    seconds: float | None = None,
) -> str:
    """The body of the generated section (:func:`benchmarks.sections.write_section` puts it
    between the markers)."""
    f = args.f_ms
    per = args.layers // args.ranks
    body = [
        f"### Results: F = {f:g} ms, micro-batch {args.micro_batch}, shape {args.shape}",
        "",
        *(f"- {line}" for line in provenance("benchmarks.schedules", argv, seconds)),
        f"- {args.ranks} processes, gloo on loopback, {args.layers} layers ({per} per rank; "
        f"interleaved and the 2-stages-per-rank peers: 1 per model chunk), "
        f'checkpoint="never", {args.warmup} warm-up + {args.steps} timed steps per entry, '
        f"{args.rounds} interleaved round(s) in one process group",
        f"- Calibrated per layer and micro-batch ({_calibration_text(calibrations)}): forward "
        f"{costs.forward_s * 1000:.2f} ms, backward {costs.backward_s * 1000:.2f} ms, "
        f"B (input gradient) {costs.input_s * 1000:.2f} ms, W (weight gradient) "
        f"{costs.weight_s * 1000:.2f} ms (nominal {f:g} / {2 * f:g} / {f:g} / {f:g} ms)",
        "",
        _markdown(HEADER, table_cells(rows)),
        "",
        *(f"- {line}" for line in notes),
    ]
    breakdown = _breakdown_markdown(rows)
    if breakdown:
        body += ["", "asyncpipe's time per rank, mean ms per timed step:", "", breakdown]
    if memory:
        body += [
            "",
            f"#### Memory: shape {args.memory_shape}, chunks {args.memory_chunks}",
            "",
            f"Each schedule in its own process group; activations "
            f"({args.micro_batch}, {', '.join(map(str, SHAPES[args.memory_shape]))}) float32 = "
            f"{args.micro_batch * _numel(SHAPES[args.memory_shape]) * 4 / 2**20:g} MiB per "
            f"micro-batch and tensor; workers run with "
            f"`MALLOC_MMAP_THRESHOLD_={MEMORY_ENV['MALLOC_MMAP_THRESHOLD_']}`.",
            "",
            _markdown(MEMORY_HEADER, memory_cells(memory)),
        ]
    if timelines:
        body += ["", "Simulated timelines (calibrated costs, times in ms):", ""]
        for path in timelines:
            try:
                rel = path.resolve().relative_to(markdown_path.resolve().parent)
            except ValueError:
                rel = path
            body += [f"![{path.stem}]({rel.as_posix()})", ""]
    return "\n".join(body)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _breakdown_markdown(rows: list[Row]) -> str:
    names = ["compute", "of which layers", "send", "recv (incl. wait)", "before 1st action"]
    names += ["between actions", "after last action", "hop (median)"]
    header = ["chunks", "schedule", "rank", "step ms", *names]
    cells = []
    for row in rows:
        for rank, parts in enumerate(row.breakdown):
            values = [parts[key] for key in _BREAKDOWN]
            values.insert(1, parts["layers_s"])
            cells.append(
                [str(row.chunks), LABELS[row.system], str(rank)]
                + [_ms(sum(parts[key] for key in _BREAKDOWN))]
                + [f"{v * 1000:.1f}" for v in values]
                + [_ms(row.hop_s) if rank == 0 else ""]
            )
    return _markdown(header, cells) if cells else ""


# ----- command line ------------------------------------------------------------------------


def _split(text: str) -> list[str]:
    return [item for item in text.split(",") if item]


def _parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.schedules",
        description=__doc__,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--f-ms", type=float, default=5.0, help="forward sleep per layer (ms)")
    parser.add_argument("--micro-batch", type=int, default=4, help="samples per micro-batch")
    parser.add_argument("--shape", choices=("small", "large"), default="small")
    parser.add_argument("--chunks", default="4,8,16", help="micro-batch counts to run")
    parser.add_argument("--ranks", type=int, default=4, help="processes in the pipeline")
    parser.add_argument("--layers", type=int, default=8, help="layers of the model")
    parser.add_argument("--virtual-stages", type=int, default=2, help="chunks per rank (V)")
    parser.add_argument(
        "--schedules",
        default=",".join(ASYNCPIPE.values()),
        help="asyncpipe schedules to run",
    )
    parser.add_argument(
        "--peers",
        default=",".join(MATCH),
        help=f"torch.distributed.pipelining peers ({','.join(PEERS)}; 'none' for none)",
    )
    parser.add_argument("--steps", type=int, default=8, help="timed steps per entry")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per entry")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds")
    parser.add_argument(
        "--memory",
        default="gpipe,1f1b",
        help="asyncpipe schedules to run alone for peak memory ('none' to skip)",
    )
    parser.add_argument("--memory-shape", choices=("small", "large"), default="large")
    parser.add_argument("--memory-chunks", type=int, default=8)
    parser.add_argument("--memory-steps", type=int, default=3, help="timed steps per memory run")
    parser.add_argument("--no-timing", action="store_true", help="only the memory runs")
    parser.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="seconds before the timing group is killed (default: 120 + 3x the ideal time "
        "of all its steps)",
    )
    parser.add_argument("--pg-timeout", type=float, default=60.0, help="per wait, in workers")
    parser.add_argument("--json", type=Path, default=None, help="write all numbers here")
    parser.add_argument("--markdown", type=Path, default=None, help="write/replace the results")
    parser.add_argument(
        "--timelines",
        type=Path,
        default=None,
        help="write SVG timelines of the simulated plans (4 ranks, --timeline-chunks) here",
    )
    parser.add_argument("--timeline-chunks", type=int, default=8)
    parser.add_argument("--keep-logs", type=Path, default=None, help="keep worker files here")
    args = parser.parse_args(argv)
    names = {v: k for k, v in ASYNCPIPE.items()}
    schedules = _split(args.schedules)
    peers = [] if args.peers == "none" else _split(args.peers)
    memory = [] if args.memory == "none" else _split(args.memory)
    unknown = [s for s in schedules + memory if s not in names] + [
        p for p in peers if p not in PEERS
    ]
    if unknown:
        parser.error(
            f"unknown {unknown}: schedules are {', '.join(names)}; peers {', '.join(PEERS)}"
        )
    args.system_list = [names[s] for s in schedules] + peers
    args.memory_list = [names[s] for s in memory]
    if any(s not in SYSTEMS for s in args.system_list):
        parser.error("internal: unknown system")
    try:
        args.chunk_list = [int(c) for c in _split(args.chunks)]
    except ValueError as exc:
        parser.error(str(exc))
    if args.rounds < 1 or args.steps < 1 or args.warmup < 0:
        parser.error("--rounds and --steps must be >= 1, --warmup >= 0")
    if args.layers % (args.ranks * args.virtual_stages) != 0:
        parser.error("--layers must be a multiple of --ranks times --virtual-stages")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parse_args(argv)
    started = time.monotonic()
    print(f"calibrating one layer (F = {args.f_ms:g} ms, shape {args.shape}) ...", file=sys.stderr)
    costs = calibrate_layer(args.f_ms, args.micro_batch, args.shape)
    memory_costs = (
        calibrate_layer(args.f_ms, args.micro_batch, args.memory_shape, repeats=10)
        if args.memory_list and args.memory_shape != args.shape
        else costs
    )
    load_before = load()
    calibrations = [costs]
    rows: list[Row] = []
    memory: list[MemoryRow] = []
    with tempfile.TemporaryDirectory(prefix="asyncpipe-schedules-") as tmp:
        work = args.keep_logs or Path(tmp)
        if not args.no_timing:
            rows = run_timing(args, costs, work)
            rows.sort(key=lambda r: (r.chunks, args.system_list.index(r.system)))
            print("calibrating again ...", file=sys.stderr)
            after = calibrate_layer(args.f_ms, args.micro_batch, args.shape)
            calibrations = [costs, after]
            costs = average_costs(costs, after)
            simulate_rows([r for r in rows if r.error is None], args, costs)
        if args.memory_list:
            memory = run_memory(args, memory_costs, work)
    load_after = load()
    timelines: list[Path] = []
    if args.timelines is not None:
        timelines = write_timelines(
            args.timelines,
            args.ranks,
            args.timeline_chunks,
            args.layers,
            args.virtual_stages,
            costs,
        )

    notes = target_lines(rows) if rows else []
    notes.append(
        f"Load average before the runs: {load_before}; after: {load_after} (anything else "
        f"running on the machine inflates the step times)"
    )
    print()
    print(f"{machine()}; asyncpipe at commit {revision()}")
    print(
        f"F = {args.f_ms:g} ms, micro-batch {args.micro_batch}, shape {args.shape}, "
        f"{args.ranks} ranks, {args.layers} layers, {args.warmup} warm-up + {args.steps} timed "
        f"steps, {args.rounds} round(s); per layer: forward {costs.forward_s * 1000:.2f} ms, "
        f"backward {costs.backward_s * 1000:.2f} ms, B {costs.input_s * 1000:.2f} ms, "
        f"W {costs.weight_s * 1000:.2f} ms ({_calibration_text(calibrations)})"
    )
    if rows:
        print(_text(HEADER, table_cells(rows)))
    for line in notes:
        print(line)
    if memory:
        print(f"\nmemory: shape {args.memory_shape}, chunks {args.memory_chunks}")
        print(_text(MEMORY_HEADER, memory_cells(memory)))
    for path in timelines:
        print(f"wrote {path}")
    print(f"(total {time.monotonic() - started:.0f} s)")

    if args.json is not None:
        payload = {
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "machine": machine(),
            "revision": revision(),
            "argv": argv,
            "calibration": asdict(costs),
            "calibrations": [asdict(c) for c in calibrations],
            "memory_calibration": asdict(memory_costs),
            "features": FEATURES,
            "rows": [dict(asdict(r), vs_simulated=r.vs_simulated) for r in rows],
            "memory": [asdict(m) for m in memory],
            "notes": notes,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
    if args.markdown is not None:
        seconds = time.monotonic() - started
        section = markdown_section(
            args, argv, calibrations, costs, rows, memory, notes, timelines, args.markdown, seconds
        )
        write_section(args.markdown, "schedules", section, "Schedule benchmarks")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
