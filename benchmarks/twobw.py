"""PipeDream-2BW against 1F1B on the reference workload: steady-state step time.

A flushing schedule pays the fill and drain of the pipeline in every step; 2BW pays it once
per run, so its steady-state step tends to the no-bubble limit, the compute of one stage
(``M * 3F * L``). Each rank times ``--steps`` consecutive steps with no barrier between them
(a barrier would drain the 2BW pipeline) and divides; the table gives the slowest rank.

Run:
    python -m benchmarks.twobw --f-ms 3 --chunks 8 --steps 20
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .launch import launch_workers
from .workload import BUSY, build_model, make_batch

__all__ = ["main"]

SCHEDULES = ("1f1b", "2bw")


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
        pipe = asyncpipe.AsyncPipe(
            model, balance, chunks=args.chunks, checkpoint="never", schedule=schedule
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--f-ms", type=float, default=3.0)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--shape", choices=("small", "large"), default="small")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--schedules", default=",".join(SCHEDULES))
    parser.add_argument("--pg-timeout", type=float, default=120.0)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)
    argv = [
        f"--f-ms={args.f_ms}",
        f"--chunks={args.chunks}",
        f"--micro-batch={args.micro_batch}",
        f"--shape={args.shape}",
        f"--warmup={args.warmup}",
        f"--steps={args.steps}",
        f"--schedules={args.schedules}",
        f"--pg-timeout={args.pg_timeout}",
    ]
    records = launch_workers("benchmarks.twobw", argv, args.ranks, args.ranks)
    layers = 8 // args.ranks
    limit = args.chunks * 3 * args.f_ms / 1000.0 * layers
    print(
        f"reference workload: {args.ranks} ranks, {layers} layers each, F = {args.f_ms:g} ms, "
        f"chunks {args.chunks}, {args.shape} shape; no-bubble limit {limit * 1e3:.1f} ms"
    )
    print(
        f"{'schedule':<9} {'step ms':>8} {'compute ms':>11} {'/ limit':>8} {'/ compute':>10} "
        f"{'vs 1f1b':>8}"
    )
    steps = {s: max(r[s]["step_s"] for r in records) for s in args.schedules.split(",")}
    for schedule, step in steps.items():
        busy = max(r[schedule]["busy_s"] for r in records)
        versus = step / steps["1f1b"] if "1f1b" in steps else float("nan")
        print(
            f"{schedule:<9} {step * 1e3:8.1f} {busy * 1e3:11.1f} {step / limit:8.3f} "
            f"{step / busy:10.3f} {versus:8.3f}"
        )
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    raise SystemExit(main())
