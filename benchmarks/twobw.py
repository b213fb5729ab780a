"""PipeDream-2BW against 1F1B on the reference workload: steady-state step time.

A flushing schedule pays the fill and drain of the pipeline in every step; 2BW pays it once
per run, so its steady-state step tends to the no-bubble limit, the compute of one stage:
nominally ``M * 3F * L``; measured, ``M * (forward + backward)`` of one stage's ``L`` layers
on one micro-batch as :func:`benchmarks.calibration.calibrate` times them in this process
before and after the runs (what the stage's compute costs on this host with nothing else
running). Each rank times ``--steps`` consecutive steps with no barrier between them (a
barrier would drain the 2BW pipeline) and divides; the table gives the slowest rank.

Run:
    python -m benchmarks.twobw --f-ms 3 --chunks 8 --steps 20 --runs 3
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .calibration import StageCosts, calibrate
from .launch import launch_workers
from .options import count, milliseconds, seconds, steps
from .sections import provenance, write_section
from .workload import BUSY, build_model, make_batch

__all__ = ["main"]

LAYERS = 8
"""The reference workload's layers; each of ``--ranks`` ranks takes ``LAYERS // ranks``."""

SCHEDULES = ("1f1b", "2bw", "2bw-lookahead2", "1f1b@shm", "2bw-lookahead2@shm")
"""What a run measures: ``"2bw-lookahead2"`` is ``schedule="2bw", lookahead=2``; ``@shm``
runs it over the shared-memory transport instead of p2p."""


FLUSHING = ("gpipe", "1f1b", "zero_bubble")
"""The flushing schedules a row may name beside 2BW's."""

TRANSPORTS = ("p2p", "shm", "rpc")
"""What may follow ``@`` in a row's name (``p2p`` without one)."""


def _schedule(name: str) -> tuple[str, int, str]:
    """(schedule, lookahead, transport) of a row's name."""
    name, _, transport = name.partition("@")
    base, _, lookahead = name.partition("-lookahead")
    return base, int(lookahead or 1), transport or "p2p"


def _check(args: argparse.Namespace) -> list[str]:
    """What is wrong with the command line's schedules and sizes (nothing: an empty list)."""
    problems = []
    if args.ranks > LAYERS:
        problems.append(
            f"--ranks must be at most {LAYERS}, the reference workload's layers (got {args.ranks})"
        )
    names = [s for s in args.schedules.split(",") if s]
    if not names:
        problems.append("--schedules names nothing to run; pass e.g. 1f1b,2bw")
    for name in names:
        try:
            base, lookahead, transport = _schedule(name)
        except ValueError:
            base, lookahead, transport = "", 1, "p2p"
        if base not in FLUSHING + ("2bw",) or transport not in TRANSPORTS or lookahead < 1:
            problems.append(
                f"--schedules: unknown entry {name!r}; each is {', '.join(FLUSHING)}, 2bw or "
                f"2bw-lookahead<K> (K at least 1), with @shm or @rpc for another transport "
                f"than p2p"
            )
        elif lookahead > 1 and base != "2bw":
            problems.append(f"--schedules: {name!r}: only 2bw takes a lookahead")
        elif base == "2bw" and args.chunks < lookahead * (args.ranks - 1):
            problems.append(
                f"--schedules: {name!r} needs chunks >= lookahead * (ranks - 1) (chunks "
                f"{args.chunks}, lookahead {lookahead}, ranks {args.ranks}); pass --chunks "
                f"{lookahead * (args.ranks - 1)} or more"
            )
    return problems


def _loss(output: object, target: object) -> torch.Tensor:
    assert isinstance(output, torch.Tensor)
    return output.mean()


def worker(args: argparse.Namespace) -> int:
    import asyncpipe

    torch.set_num_threads(1)
    asyncpipe.init(timeout=args.pg_timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    balance = [len(build_model(args.f_ms)) // world] * world
    record: dict[str, Any] = {"rank": rank}
    for schedule in args.schedules.split(","):
        model = build_model(args.f_ms, sum(balance))
        x, y = make_batch(args.chunks, args.micro_batch, args.shape)
        name, lookahead, transport = _schedule(schedule)
        pipe = asyncpipe.AsyncPipe(
            model,
            balance,
            chunks=args.chunks,
            checkpoint="never",
            schedule=name,
            lookahead=lookahead,
            transport=transport,
        )
        optimizer = torch.optim.SGD(pipe.parameters(), lr=1e-6)
        for _ in range(args.warmup):
            pipe.step(x, y, _loss, optimizer=optimizer)
        dist.barrier()  # the 2BW pipeline stays full through the barrier: no flush yet
        BUSY.reset()
        start = time.perf_counter()
        for _ in range(args.steps):
            pipe.step(x, y, _loss, optimizer=optimizer)
        seconds = time.perf_counter() - start
        busy = BUSY.seconds
        pipe.flush()
        dist.barrier()
        record[schedule] = {"step_s": seconds / args.steps, "busy_s": busy / args.steps}
    (Path(args.out) / f"rank{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()
    return 0


def _rows(records: list[dict[str, Any]], schedules: list[str]) -> list[dict[str, float]]:
    """Per schedule: the slowest rank's step and compute time."""
    rows = []
    for schedule in schedules:
        rows.append(
            {
                "step_s": max(r[schedule]["step_s"] for r in records),
                "busy_s": max(r[schedule]["busy_s"] for r in records),
            }
        )
    return rows


def table(rows: list[dict[str, float]], schedules: list[str], limit: float, measured: float) -> str:
    """The markdown table of one run: step and compute time per schedule, against the
    no-bubble limit (nominal and measured) and against 1F1B."""
    lines = [
        "| schedule | step ms | compute ms | / limit | / measured limit | / compute | vs 1f1b |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    steps = dict(zip(schedules, (r["step_s"] for r in rows), strict=True))
    for schedule, row in zip(schedules, rows, strict=True):
        versus = row["step_s"] / steps["1f1b"] if "1f1b" in steps else float("nan")
        lines.append(
            f"| {schedule} | {row['step_s'] * 1e3:.1f} | {row['busy_s'] * 1e3:.1f} | "
            f"{row['step_s'] / limit:.3f} | {row['step_s'] / measured:.3f} | "
            f"{row['step_s'] / row['busy_s']:.3f} | {versus:.3f} |"
        )
    return "\n".join(lines)


def measured_limit(calibrations: list[StageCosts], chunks: int) -> float:
    """Seconds one stage computes per mini-batch of ``chunks`` micro-batches with the
    calibrated costs (mean of the calibrations): the no-bubble limit on this host."""
    per_microbatch = [c.forward_s + c.backward_s for c in calibrations]
    return chunks * sum(per_microbatch) / len(per_microbatch)


def _calibration_text(calibrations: list[StageCosts]) -> str:
    each = ", ".join(f"{c.forward_s * 1e3:.2f} + {c.backward_s * 1e3:.2f} ms" for c in calibrations)
    return f"one stage on one micro-batch, forward + backward, before and after the runs: {each}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.twobw",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument(
        "--f-ms", type=milliseconds, default=3.0, help="forward sleep per layer (ms)"
    )
    parser.add_argument("--chunks", type=count, default=8, help="micro-batches per step")
    parser.add_argument("--micro-batch", type=count, default=4, help="rows per micro-batch")
    parser.add_argument("--shape", choices=("small", "large"), default="small")
    parser.add_argument("--ranks", type=count, default=4, help="processes, 8 // ranks layers each")
    parser.add_argument("--warmup", type=steps, default=3, help="untimed steps per schedule")
    parser.add_argument("--steps", type=count, default=20, help="timed steps per schedule")
    parser.add_argument(
        "--schedules",
        default=",".join(SCHEDULES),
        help="what to run: gpipe, 1f1b, zero_bubble, 2bw or 2bw-lookahead<K>, each with @shm "
        "or @rpc for another transport than p2p",
    )
    parser.add_argument("--pg-timeout", type=seconds, default=120.0, help="per wait, in workers")
    parser.add_argument("--runs", type=count, default=1, help="runs, each in new processes")
    parser.add_argument("--markdown", type=Path, default=None, help="page to write the table in")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    if args.worker:  # started by a driver that checked (the suite's too): ranks = world size
        return worker(args)
    problems = _check(args)
    if problems:
        parser.error("; ".join(problems))
    started = time.monotonic()
    worker_argv = [
        f"--f-ms={args.f_ms}",
        f"--chunks={args.chunks}",
        f"--micro-batch={args.micro_batch}",
        f"--shape={args.shape}",
        f"--warmup={args.warmup}",
        f"--steps={args.steps}",
        f"--schedules={args.schedules}",
        f"--pg-timeout={args.pg_timeout}",
    ]
    schedules = args.schedules.split(",")
    layers = LAYERS // args.ranks
    limit = args.chunks * 3 * args.f_ms / 1000.0 * layers
    print("calibrating one stage ...", file=sys.stderr)
    calibrations = [calibrate(args.f_ms, args.micro_batch, args.shape, layers)]
    runs = []
    for n in range(args.runs):
        print(f"run {n + 1}/{args.runs}: {', '.join(schedules)}", file=sys.stderr)
        try:
            records = launch_workers("benchmarks.twobw", worker_argv, args.ranks, args.ranks)
        except RuntimeError as exc:
            print(exc, file=sys.stderr)
            return 1
        runs.append(_rows(records, schedules))
    print("calibrating again ...", file=sys.stderr)
    calibrations.append(calibrate(args.f_ms, args.micro_batch, args.shape, layers))
    measured = measured_limit(calibrations, args.chunks)
    last = schedules[-1]
    runs.sort(key=lambda rows: rows[-1]["step_s"])
    median = runs[(len(runs) - 1) // 2]
    head = (
        f"Reference workload: {args.ranks} ranks, {layers} layers each, F = {args.f_ms:g} ms, "
        f"chunks {args.chunks}, micro-batch {args.micro_batch}, {args.shape} shape, "
        f"{args.warmup} warm-up + {args.steps} timed steps per run; no-bubble limit "
        f"{limit * 1e3:.1f} ms nominal, {measured * 1e3:.1f} ms measured ("
        + _calibration_text(calibrations)
        + ")"
    )
    notes = []
    if len(runs) > 1:
        spread = {
            f"{s} / limit": [rows[i]["step_s"] / limit for rows in runs]
            for i, s in enumerate(schedules)
        }
        spread.update(
            {
                f"{s} / measured limit": [rows[i]["step_s"] / measured for rows in runs]
                for i, s in enumerate(schedules)
            }
        )
        if "1f1b" in schedules:
            one = schedules.index("1f1b")
            for i, s in enumerate(schedules):
                if s != "1f1b":
                    spread[f"{s} vs 1f1b"] = [
                        rows[i]["step_s"] / rows[one]["step_s"] for rows in runs
                    ]
        notes.append(
            f"{len(runs)} runs, each in new processes; the table is the run with the median "
            f"{last} step. Every run: "
            + "; ".join(
                f"{name}: {', '.join(f'{v:.3f}' for v in sorted(values))}"
                for name, values in spread.items()
            )
        )
    text = table(median, schedules, limit, measured)
    print(head, text, *notes, sep="\n")
    if args.markdown is not None:
        lines = provenance("benchmarks.twobw", argv, time.monotonic() - started)
        body = [*(f"- {line}" for line in lines), f"- {head}", "", text, ""]
        body += [f"- {note}" for note in notes]
        write_section(args.markdown, "twobw", "\n".join(body), "PipeDream-2BW")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    raise SystemExit(main())
