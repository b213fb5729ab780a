"""Schedule benchmark: asyncpipe's schedules against their simulated ideals and torch's peers."""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from .calibration import LayerCosts, calibrate_layer
from .launch import LaunchResult, launch, read_records
from .options import count, count_list, milliseconds, seconds, steps
from .schedule_report import markdown_section, target_lines, text_report, write_timelines
from .schedule_results import (
    MATCH,
    MEMORY_ENV,
    MemoryRow,
    Row,
    aggregate,
    average_costs,
    simulate_rows,
    simulate_schedule,
)
from .schedule_worker import ASYNCPIPE, OVER_SHM, PEERS, SYSTEMS
from .sections import load, machine, revision, write_section
from .workload import FEATURES

__all__ = ["main", "run_entries", "run_memory", "run_timing", "timing_entries"]


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
        records = read_records(out, args.ranks)
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
            aggregate(row, per_rank)
            row.plan = next((d[0]["plan"] for d in done if "plan" in d[0]), None)
        failed = [errors[i] for i in indices if i in errors]
        if failed and row.error is None:
            row.error = failed[0]
        if row.step_s is None and row.error is None:
            row.error = "no result"
    return list(rows.values())


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


# ----- command line ------------------------------------------------------------------------


def _split(text: str) -> list[str]:
    return [item for item in text.split(",") if item]


def _parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.schedules",
        description=__doc__,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--f-ms", type=milliseconds, default=5.0, help="forward sleep per layer (ms)"
    )
    parser.add_argument("--micro-batch", type=count, default=4, help="samples per micro-batch")
    parser.add_argument("--shape", choices=("small", "large"), default="small")
    parser.add_argument("--chunks", default="4,8,16", help="micro-batch counts to run")
    parser.add_argument("--ranks", type=count, default=4, help="processes in the pipeline")
    parser.add_argument("--layers", type=count, default=8, help="layers of the model")
    parser.add_argument("--virtual-stages", type=count, default=2, help="chunks per rank (V)")
    parser.add_argument(
        "--schedules",
        default=",".join(ASYNCPIPE.values()),
        help="asyncpipe schedules to run",
    )
    parser.add_argument(
        "--shm",
        default=",".join(ASYNCPIPE.values()),
        help="asyncpipe schedules to run over transport='shm' too, in rows of their own beside "
        "the p2p ones ('none' for none; needs gloo)",
    )
    parser.add_argument(
        "--peers",
        default=",".join(MATCH),
        help=f"torch.distributed.pipelining peers ({','.join(PEERS)}; 'none' for none)",
    )
    parser.add_argument("--steps", type=count, default=8, help="timed steps per entry")
    parser.add_argument("--warmup", type=steps, default=2, help="untimed steps per entry")
    parser.add_argument("--rounds", type=count, default=2, help="interleaved rounds")
    parser.add_argument(
        "--memory",
        default="gpipe,1f1b",
        help="asyncpipe schedules to run alone for peak memory ('none' to skip)",
    )
    parser.add_argument("--memory-shape", choices=("small", "large"), default="large")
    parser.add_argument("--memory-chunks", type=count, default=8)
    parser.add_argument("--memory-steps", type=count, default=3, help="timed steps per memory run")
    parser.add_argument("--no-timing", action="store_true", help="only the memory runs")
    parser.add_argument(
        "--timeout",
        type=seconds,
        default=None,
        help="seconds before the timing group is killed (default: 120 + 3x the ideal time "
        "of all its steps)",
    )
    parser.add_argument("--pg-timeout", type=seconds, default=60.0, help="per wait, in workers")
    parser.add_argument("--json", type=Path, default=None, help="write all numbers here")
    parser.add_argument("--markdown", type=Path, default=None, help="write/replace the results")
    parser.add_argument(
        "--timelines",
        type=Path,
        default=None,
        help="write SVG timelines of the simulated plans (4 ranks, --timeline-chunks) here",
    )
    parser.add_argument("--timeline-chunks", type=count, default=8)
    parser.add_argument("--keep-logs", type=Path, default=None, help="keep worker files here")
    args = parser.parse_args(argv)
    names = {v: k for k, v in ASYNCPIPE.items()}
    schedules = _split(args.schedules)
    peers = [] if args.peers == "none" else _split(args.peers)
    memory = [] if args.memory == "none" else _split(args.memory)
    shm = [] if args.shm == "none" else _split(args.shm)
    unknown = [s for s in schedules + memory + shm if s not in names] + [
        p for p in peers if p not in PEERS
    ]
    if unknown:
        parser.error(
            f"unknown {unknown}: schedules are {', '.join(names)}; peers {', '.join(PEERS)}"
        )
    args.system_list = [names[s] for s in schedules] + [names[s] + OVER_SHM for s in shm] + peers
    args.memory_list = [names[s] for s in memory]
    if any(s not in SYSTEMS for s in args.system_list):
        parser.error("internal: unknown system")
    args.chunk_list = count_list(parser, "--chunks", args.chunks)
    per_round = args.ranks * args.virtual_stages
    if args.layers % per_round != 0:
        parser.error(
            f"--layers must be a multiple of --ranks times --virtual-stages (layers "
            f"{args.layers}, ranks {args.ranks} x virtual stages {args.virtual_stages}); pass "
            f"--layers {per_round * max(1, args.layers // per_round)}"
        )
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
    print(text_report(args, calibrations, costs, rows, memory, notes))
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
