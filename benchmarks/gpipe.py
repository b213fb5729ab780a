"""GPipe benchmark: asyncpipe vs torch.distributed.pipelining on the reference workload."""

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

from .calibration import calibrate, calibrated_ideal_s
from .gpipe_report import (
    BREAKDOWN,
    Row,
    format_breakdown,
    format_text,
    markdown_section,
    target_line,
)
from .launch import LaunchResult, launch, read_records
from .options import count, count_list, milliseconds, seconds, steps
from .sections import load, machine, revision, write_section
from .worker import SYSTEMS
from .workload import nominal_ideal_s

__all__ = ["Row", "main"]


def _fairscale_status() -> str:
    try:
        import fairscale  # type: ignore[import-not-found]
    except Exception as exc:  # ImportError, or a broken install on this torch
        return f"fairscale: not available ({type(exc).__name__}: {exc})"
    version = getattr(fairscale, "__version__", "?")
    return (
        f"fairscale: {version} imports, but its Pipe is single-process (one device per "
        f"partition) and has no torchrun multi-process runner here; not benchmarked"
    )


def _asyncpipe_status() -> str | None:
    """None if ``asyncpipe.AsyncPipe`` can be imported, else why not."""
    try:
        import asyncpipe

        asyncpipe.AsyncPipe  # noqa: B018 - the attribute check is the point
    except Exception as exc:
        return f"not available ({type(exc).__name__}: {exc})"
    return None


def _aggregate(
    system: str,
    chunks: int,
    records: list[dict[str, Any]],
    nominal_s: float,
    calibrated_s: float,
) -> Row:
    row = Row(system, chunks, nominal_s, calibrated_s)
    runs = []
    for record in records:
        match = [r for r in record["runs"] if r["chunks"] == chunks]
        if not match:
            return row
        runs.append(match[0])
    steps = min(len(r["seconds"]) for r in runs)
    if steps == 0:
        return row
    per_step = [max(r["seconds"][i] for r in runs) for i in range(steps)]
    row.step_s = statistics.median(per_step)
    row.step_min_s, row.step_max_s = min(per_step), max(per_step)
    row.idle = [
        statistics.fmean(1.0 - r["busy"][i] / per_step[i] for i in range(steps)) for r in runs
    ]
    if all("lib_idle" in r for r in runs):
        row.lib_idle = [statistics.fmean(r["lib_idle"]) for r in runs]
        row.lib_step_s = statistics.median(
            max(r["lib_seconds"][i] for r in runs) for i in range(steps)
        )
    if all(key in r for r in runs for key in BREAKDOWN):
        row.breakdown = [{key: statistics.fmean(r[key]) for key in BREAKDOWN} for r in runs]
    return row


def merge_rounds(rounds: list[list[Row]]) -> list[Row]:
    """One row per (system, chunks): the round with the median step time (lower median).

    Systems run one after another, so with other load on the machine a single round can favour
    whichever system ran in a quiet moment; several rounds interleave them.
    """
    by_key: dict[tuple[str, int], list[Row]] = {}
    for rows in rounds:
        for row in rows:
            by_key.setdefault((row.system, row.chunks), []).append(row)
    merged = []
    for candidates in by_key.values():
        good = sorted((r for r in candidates if r.step_s is not None), key=lambda r: r.step_s or 0)
        row = good[(len(good) - 1) // 2] if good else candidates[0]
        row.rounds_s = [r.step_s for r in candidates]
        merged.append(row)
    return merged


def _run_system(
    system: str,
    args: argparse.Namespace,
    chunk_list: list[int],
    ideals: dict[int, tuple[float, float]],
    work: Path,
    timeout_s: float,
) -> list[Row]:
    """Run ``system`` for every chunk count; a failed count is reported and the rest relaunched.

    A worker stops at the first failing configuration (its peers may be stuck in a collective),
    so after an error the group is relaunched for the remaining chunk counts. After a timeout
    the remaining counts are not retried, which bounds the total time.
    """
    world = len(args.balance.split(","))
    rows = {c: Row(system, c, *ideals[c]) for c in chunk_list}
    if system == "asyncpipe" and (why := _asyncpipe_status()) is not None:
        for row in rows.values():
            row.error = why
        return list(rows.values())
    remaining = list(chunk_list)
    attempt = 0
    while remaining:
        out = work / f"{system}-{attempt}"
        attempt += 1
        worker_args = [
            "--system", system,
            "--chunks", ",".join(map(str, remaining)),
            "--f-ms", str(args.f_ms),
            "--micro-batch", str(args.micro_batch),
            "--shape", args.shape,
            "--balance", args.balance,
            "--warmup", str(args.warmup),
            "--steps", str(args.steps),
            "--pg-timeout", str(max(30.0, timeout_s / 2)),
            "--out", str(out),
        ]  # fmt: skip
        result: LaunchResult = launch("benchmarks.worker", worker_args, world, timeout_s, out)
        print(
            f"  {system} chunks {remaining}: {result.seconds:.1f} s wall, "
            f"{result.cpu_seconds:.1f} s CPU (all ranks, start-up included)",
            file=sys.stderr,
        )
        records = read_records(out, world)
        done = []
        if all(r is not None for r in records):
            for chunks in remaining:
                row = _aggregate(system, chunks, [r for r in records if r is not None],
                                 *ideals[chunks])  # fmt: skip
                if row.step_s is not None:
                    rows[chunks] = row
                    done.append(chunks)
        remaining = [c for c in remaining if c not in done]
        if result.ok or not remaining:
            break
        errors = [r["error"] for r in records if r is not None and r.get("error")]
        failure = errors[0] if errors and not result.timed_out else result.failure()
        failed = remaining[0]
        rows[failed].error = failure
        print(f"  {system} chunks {failed} FAILED: {failure}", file=sys.stderr)
        for rank in range(world):
            tail = result.log_tail(rank, 1500).strip()
            if result.returncodes[rank] != 0 and tail:
                print(f"  --- rank {rank} log tail ---\n{tail}", file=sys.stderr)
        remaining = remaining[1:]
        if result.timed_out:
            for chunks in remaining:
                rows[chunks].error = f"not run (chunks {failed} timed out)"
            break
    for row in rows.values():
        if row.step_s is None and row.error is None:
            row.error = "no result"
    return list(rows.values())


def _parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.gpipe",
        description=__doc__,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--f-ms", type=milliseconds, default=5.0, help="forward sleep per layer (ms)"
    )
    parser.add_argument("--micro-batch", type=count, default=4, help="samples per micro-batch")
    parser.add_argument(
        "--shape",
        choices=("small", "large"),
        default="small",
        help="activations (mb, 1024) or the transfer-heavy (mb, 256, 1024)",
    )
    parser.add_argument("--chunks", default="4,8,16", help="micro-batch counts to run")
    parser.add_argument("--steps", type=count, default=10, help="timed steps per row")
    parser.add_argument("--warmup", type=steps, default=2, help="untimed steps per row")
    parser.add_argument("--balance", default="2,2,2,2", help="layers per stage (one rank each)")
    parser.add_argument(
        "--systems", default=",".join(SYSTEMS), help=f"subset of {','.join(SYSTEMS)}"
    )
    parser.add_argument(
        "--timeout",
        type=seconds,
        default=None,
        help="seconds before one system's workers are killed "
        "(default: 90 + 3x the ideal time of all its steps)",
    )
    parser.add_argument("--json", type=Path, default=None, help="write all numbers here")
    parser.add_argument(
        "--markdown",
        type=Path,
        default=None,
        help="write/replace this shape's section of a markdown file",
    )
    parser.add_argument(
        "--rounds",
        type=count,
        default=1,
        help="run every system this many times, interleaved; report each row's median round",
    )
    parser.add_argument(
        "--keep-logs",
        type=Path,
        default=None,
        help="keep worker logs and per-rank records (with asyncpipe's events of each "
        "configuration's last step) in this directory",
    )
    args = parser.parse_args(argv)
    systems = [s for s in args.systems.split(",") if s]
    unknown = sorted(set(systems) - set(SYSTEMS))
    if unknown:
        parser.error(f"unknown systems {unknown}; choose from {list(SYSTEMS)}")
    args.system_list = systems
    args.chunk_list = count_list(parser, "--chunks", args.chunks)
    balance = count_list(parser, "--balance", args.balance)
    args.chunks = ",".join(map(str, args.chunk_list))  # as the workers and the report read them
    args.balance = ",".join(map(str, balance))
    if len(set(balance)) != 1:
        parser.error("the ideal-time formulas assume equal stages: use a uniform --balance")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parse_args(argv)
    balance = [int(b) for b in args.balance.split(",")]
    stages, layers_per_stage = len(balance), balance[0]
    started = time.monotonic()

    print(
        f"calibrating one stage ({layers_per_stage} layers, F = {args.f_ms:g} ms, "
        f"shape {args.shape}) ...",
        file=sys.stderr,
    )
    costs = calibrate(args.f_ms, args.micro_batch, args.shape, layers_per_stage)
    ideals = {
        c: (
            nominal_ideal_s(stages, c, layers_per_stage, args.f_ms),
            calibrated_ideal_s(stages, c, costs),
        )
        for c in args.chunk_list
    }
    timeout_s = args.timeout or 90.0 + 3.0 * (args.warmup + args.steps) * sum(
        cal for _, cal in ideals.values()
    )

    load_before = load()
    rounds: list[list[Row]] = []
    with tempfile.TemporaryDirectory(prefix="asyncpipe-bench-") as tmp:
        for round_index in range(args.rounds):
            work = (args.keep_logs or Path(tmp)) / f"round{round_index}"
            rows: list[Row] = []
            for system in args.system_list:
                print(
                    f"round {round_index + 1}/{args.rounds}: running {system} (chunks "
                    f"{args.chunks}, timeout {timeout_s:.0f} s) ...",
                    file=sys.stderr,
                )
                rows += _run_system(system, args, args.chunk_list, ideals, work, timeout_s)
            rounds.append(rows)
    rows = merge_rounds(rounds)
    rows.sort(key=lambda r: (r.chunks, args.system_list.index(r.system)))

    fairscale = _fairscale_status()
    extra = [fairscale]
    if (target := target_line(rows, args)) is not None:
        extra.append(target)
    extra.append(
        f"Load average before the runs: {load_before}; after: {load()} "
        f"(anything else running on the machine inflates the step times)"
    )
    print()
    print(f"{machine()}; asyncpipe at commit {revision()}")
    print(
        f"shape {args.shape}, F = {args.f_ms:g} ms, micro-batch {args.micro_batch}, "
        f"balance [{args.balance}], {args.warmup} warm-up + {args.steps} timed steps, "
        f"{args.rounds} round(s); "
        f"calibrated stage forward {costs.forward_s * 1000:.2f} ms, "
        f"backward {costs.backward_s * 1000:.2f} ms"
    )
    print(format_text(rows))
    for line in extra:
        print(line)
    breakdown = format_breakdown(rows)
    if breakdown:
        print("\nasyncpipe time per stage (mean ms per timed step):")
        print(breakdown)
    print(f"(total {time.monotonic() - started:.0f} s)")

    if args.json is not None:
        payload = {
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "machine": machine(),
            "revision": revision(),
            "config": {
                "f_ms": args.f_ms,
                "micro_batch": args.micro_batch,
                "shape": args.shape,
                "balance": balance,
                "chunks": args.chunk_list,
                "warmup": args.warmup,
                "steps": args.steps,
            },
            "calibration": asdict(costs),
            "fairscale": fairscale,
            "rows": [
                dict(asdict(r), vs_nominal=r.vs_nominal, vs_calibrated=r.vs_calibrated)
                for r in rows
            ],
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
    if args.markdown is not None:
        seconds = time.monotonic() - started
        section = markdown_section(rows, args, costs, layers_per_stage, extra, argv, seconds)
        write_section(args.markdown, f"gpipe shape={args.shape}", section, "Benchmarks")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
