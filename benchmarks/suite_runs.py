"""The whole benchmark suite: every schedule and transport against the peers, memory, bandwidth
and the GPT model, in one run: the measurements of ``python -m benchmarks.suite``."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import gpt, schedule_results, schedules
from .calibration import LayerCosts
from .gpu import SHARED_GPU_PEERS
from .launch import launch_workers
from .peers import FAIRSCALE
from .schedule_worker import ASYNCPIPE, OVER_SHM, PEERS, base_system

__all__ = [
    "LINKS",
    "PARTS",
    "SuiteRow",
    "gpt_options",
    "run_bandwidth",
    "run_memory",
    "run_reference",
    "run_twobw",
    "twobw_table",
]

PARTS = ("reference", "2bw", "memory", "bandwidth", "gpt")
"""What the suite runs: the reference workload's step times for every system, PipeDream-2BW's
steady state against 1F1B's, peak memory of asyncpipe's schedules on the transfer-heavy shape,
activation bandwidth, and the GPT model."""

TORCH_PEERS = tuple(PEERS)
"""torch.distributed.pipelining's schedules, run beside asyncpipe over p2p."""


@dataclass
class SuiteRow:
    """One (stages, chunks, system, transport) result on the reference workload."""

    stages: int
    chunks: int
    system: str
    transport: str
    """``p2p``, ``shm`` or ``rpc`` for asyncpipe; how the peer talks otherwise."""
    step_s: float | None = None
    simulated_s: float | None = None
    memory: list[float] = field(default_factory=list)
    peak_activations: list[int] = field(default_factory=list)
    error: str | None = None

    @property
    def key(self) -> str:
        """The system and its transport, e.g. ``asyncpipe-1f1b/rpc``."""
        return f"{self.system}/{self.transport}"

    @property
    def vs_simulated(self) -> float | None:
        if self.step_s is None or not self.simulated_s:
            return None
        return self.step_s / self.simulated_s


def _schedule_args(args: argparse.Namespace, stages: int, **changes: Any) -> argparse.Namespace:
    """The namespace :mod:`benchmarks.schedules` reads, for one group of ``stages`` ranks."""
    values = {
        "f_ms": args.f_ms,
        "micro_batch": args.micro_batch,
        "shape": "small",
        "ranks": stages,
        "layers": args.layers,
        "virtual_stages": 2,
        "warmup": args.warmup,
        "steps": args.steps,
        "rounds": 1,
        "timeout": None,
        "pg_timeout": 60.0,
        "chunk_list": args.chunk_list,
        "system_list": [],
        "memory_list": [],
        "memory_shape": "large",
        "memory_chunks": 8,
        "memory_steps": 3,
        "transport": "p2p",
        "device": args.device,
        "sample_memory": True,
        "pipe_stages": stages,
    }
    values.update(changes)
    return argparse.Namespace(**values)


LINKS = {**{p: "gloo" for p in TORCH_PEERS}, "fairscale-asyncpipe": "rpc", "fairscale-pipe": "-"}
"""How each peer's stages talk (fairscale's Pipe is one process: its stages share memory)."""


def _suite_row(row: schedule_results.Row, stages: int, transport: str) -> SuiteRow:
    if row.system.endswith(OVER_SHM):  # run beside the p2p rows, in the same group
        transport = "shm"
    return SuiteRow(
        stages,
        row.chunks,
        base_system(row.system),
        LINKS.get(row.system, transport),
        row.step_s,
        row.simulated_s,
        list(row.memory),
        list(row.peak_activations),
        row.error,
    )


def run_reference(
    args: argparse.Namespace, costs: LayerCosts, work: Path, shared_gpu: bool
) -> list[SuiteRow]:
    """Every asyncpipe schedule over p2p, shm (CPU) and rpc, torch.distributed.pipelining's
    schedules and fairscale's AsyncPipe and Pipe, for each stage count and chunk count.

    Three groups per stage count: asyncpipe over p2p and over shm with torch's peers, asyncpipe
    over rpc with fairscale's AsyncPipe (both need RPC), and fairscale's one-process Pipe
    alone. A peer that fails is reported with its error; on a shared GPU the peers that cannot
    run are marked.
    """
    ours = list(ASYNCPIPE)
    over_shm = [f"{s}{OVER_SHM}" for s in ours] if args.device == "cpu" else []
    torch_peers = [] if shared_gpu else list(TORCH_PEERS)
    fairscale_rpc = [] if shared_gpu else ["fairscale-asyncpipe"]
    out: list[SuiteRow] = []
    for stages in args.stage_list:
        groups = [
            ("p2p", ours + over_shm + torch_peers, stages),
            ("rpc", ours + fairscale_rpc, stages),
            ("p2p", ["fairscale-pipe"], 1),  # one process; the transport is unused
        ]
        found: list[SuiteRow] = []
        for n, (transport, systems, ranks) in enumerate(groups):
            print(f"{stages} stages, {transport}: {', '.join(systems)}", file=sys.stderr)
            sub = _schedule_args(
                args,
                stages,
                system_list=systems,
                transport=transport,
                ranks=ranks,
                timeout=_timeout(args, stages, len(systems)),
            )
            rows = schedules.run_timing(sub, costs, work / f"{stages}-{n}")
            # Now the peers' recorded plans are known: simulate them too.
            schedule_results.simulate_rows([r for r in rows if r.error is None], sub, costs)
            found += [_suite_row(row, stages, transport) for row in rows]
        if shared_gpu:
            found += [
                SuiteRow(stages, c, peer, LINKS[peer], error=SHARED_GPU_PEERS)
                for peer in [*TORCH_PEERS, "fairscale-asyncpipe"]
                for c in args.chunk_list
            ]
        _peer_ideals(found)
        out += found
    return out


def _timeout(args: argparse.Namespace, stages: int, systems: int) -> float:
    """Seconds before a group is killed: 5 times the nominal GPipe time of all its steps (a
    shared machine can be that slow) plus start-up, or the one-process time for one rank."""
    per_layer = 3 * args.f_ms / 1000
    steps = args.warmup + args.steps
    total = sum((c + stages - 1) * per_layer * args.layers / stages for c in args.chunk_list)
    serial = sum(c * per_layer * args.layers for c in args.chunk_list)
    return 180.0 + 5.0 * steps * systems * max(total, serial / stages)


def _peer_ideals(rows: list[SuiteRow]) -> None:
    """fairscale's systems run fill-drain: their ideal is asyncpipe's GPipe plan's."""
    gpipe = {
        r.chunks: r.simulated_s for r in rows if r.system == "asyncpipe-gpipe" and r.simulated_s
    }
    for row in rows:
        if row.system in FAIRSCALE and row.simulated_s is None:
            row.simulated_s = gpipe.get(row.chunks)


def run_memory(
    args: argparse.Namespace, costs: LayerCosts, work: Path
) -> list[schedule_results.MemoryRow]:
    """asyncpipe's schedules one at a time on the transfer-heavy shape: peak memory per rank."""
    stages = max(args.stage_list)
    sub = _schedule_args(args, stages, memory_list=list(ASYNCPIPE), sample_memory=False)
    return schedules.run_memory(sub, costs, work / "memory")


def run_bandwidth(args: argparse.Namespace) -> dict[str, Any]:
    """Activation bandwidth between two processes: raw send/recv, p2p and rpc."""
    argv = ["--bandwidth-only", "--messages", str(args.messages), "--device", args.device]
    argv += ["--idle-hops", "0"]  # the suite reports the bandwidth only
    records = launch_workers("benchmarks.transports", argv, 2, 2, timeout_s=600)
    return dict(records[1], micro_batch=8)


def run_twobw(args: argparse.Namespace) -> list[dict[str, Any]]:
    """PipeDream-2BW against 1F1B in the steady state, per stage count and chunk count.

    2BW keeps the pipeline full across steps, so a barrier before each step (as the reference
    part times) would measure something else: :mod:`benchmarks.twobw` times consecutive steps
    with no barrier between them on every rank. The no-bubble limit is one stage's compute per
    step, ``M * 3F * L``.
    """
    out: list[dict[str, Any]] = []
    for stages in args.stage_list:
        for chunks in args.chunk_list:
            argv = [
                f"--f-ms={args.f_ms}", f"--chunks={chunks}", f"--micro-batch={args.micro_batch}",
                "--shape=small", f"--warmup={args.warmup}", f"--steps={args.steps}",
                "--schedules=1f1b,2bw",
            ]  # fmt: skip
            limit = chunks * 3 * args.f_ms / 1000 * args.layers / stages
            row: dict[str, Any] = {"stages": stages, "chunks": chunks, "limit_s": limit}
            print(f"2bw and 1f1b, {stages} stages, chunks {chunks}", file=sys.stderr)
            try:
                records = launch_workers("benchmarks.twobw", argv, stages, stages, 600)
            except RuntimeError as exc:
                out.append(dict(row, error=str(exc)))
                continue
            for schedule in ("1f1b", "2bw"):
                row[f"{schedule}_s"] = max(r[schedule]["step_s"] for r in records)
            out.append(row)
    return out


def twobw_table(rows: list[dict[str, Any]]) -> str:
    """The markdown table of :func:`run_twobw`'s rows."""
    lines = [
        "| stages | chunks | 1f1b ms | 2bw ms | no-bubble limit ms | 2bw / limit | 2bw / 1f1b |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        head = f"| {r['stages']} | {r['chunks']} |"
        if "error" in r:
            lines.append(f"{head} did not run: {r['error']} | | | | |")
            continue
        lines.append(
            f"{head} {r['1f1b_s'] * 1e3:.1f} | {r['2bw_s'] * 1e3:.1f} | {r['limit_s'] * 1e3:.1f} "
            f"| {r['2bw_s'] / r['limit_s']:.2f}x | {r['2bw_s'] / r['1f1b_s']:.2f}x |"
        )
    return "\n".join(lines)


def gpt_options(args: argparse.Namespace) -> argparse.Namespace:
    """The options of :mod:`benchmarks.gpt` for this run: its full or quick size, this device."""
    return gpt.parse_args(["--device", args.device, *(["--quick"] if args.quick else [])])
