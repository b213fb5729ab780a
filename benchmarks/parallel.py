"""Data parallel x pipeline benchmark: the reference workload as 1x4, 2x2 and 4x1 (replicas x
stages) on four processes, the cost of the gradient all-reduce, and activations crossing stages
in bfloat16 against float32.

Run ``python -m benchmarks.parallel``; it launches its own worker processes (loopback, gloo)
and prints a table; ``--markdown docs/parallel_benchmarks.md`` also writes it into that page.
The global batch is the same for every layout (8 micro-batches of 4 rows): a replica of ``D``
runs ``8 / D`` micro-batches.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .launch import launch_workers
from .options import count, milliseconds
from .sections import provenance, write_section
from .worker import _loss, timed_steps, write_record
from .workload import SHAPES, build_model, make_batch

__all__ = ["main"]

LAYOUTS = ((1, 4), (2, 2), (4, 1))
MICRO = 4


def _run(args: argparse.Namespace, replicas: int, stages: int, dtype: str) -> dict[str, Any]:
    import asyncpipe

    chunks = 8 // replicas
    reduced = dtype == "bf16"
    pipe = asyncpipe.AsyncPipe(
        build_model(args.f_ms),
        [8 // stages] * stages,
        chunks=chunks,
        checkpoint="never",
        schedule="1f1b",
        data_parallel_size=replicas,
        autocast=torch.bfloat16 if reduced else None,
        reduce_activations=reduced,
    )
    waits: list[float] = []
    averager = pipe._averager
    if averager is not None:  # time how long step() waits for the all-reduce
        finish = averager.finish

        def timed(stop: bool = False) -> None:
            start = time.perf_counter()
            finish(stop)
            waits.append(time.perf_counter() - start)

        averager.finish = timed  # type: ignore[method-assign]
    x, y = make_batch(chunks, MICRO, args.shape, seed=1 + pipe.data_parallel_rank)
    first, last = pipe.is_first_stage, pipe.is_last_stage
    times = timed_steps(
        lambda: pipe.step(x if first else None, y if last else None, _loss), args.steps
    )
    grad_bytes = sum(p.numel() * p.element_size() for p in pipe.parameters())
    element = 2 if reduced else 4
    activation = MICRO * int(torch.Size(SHAPES[args.shape]).numel()) * element
    return {
        "median_s": statistics.median(times),
        "allreduce_wait_s": statistics.median(waits[1:]) if len(waits) > 1 else 0.0,
        "grad_bytes": grad_bytes,
        # activation forward + its gradient back, per boundary and micro-batch, per replica
        "traffic_bytes": 2 * (stages - 1) * chunks * activation,
    }


def worker(args: argparse.Namespace) -> int:
    import asyncpipe

    asyncpipe.init()
    record: dict[str, Any] = {}
    for replicas, stages in LAYOUTS:
        record[f"{replicas}x{stages}-fp32"] = _run(args, replicas, stages, "fp32")
    record["1x4-bf16"] = _run(args, 1, 4, "bf16")
    write_record(Path(args.out) / f"rank{dist.get_rank()}.json", record)
    asyncpipe.shutdown()
    return 0


def _table(record: dict[str, Any], args: argparse.Namespace) -> str:
    lines = [
        f"Reference workload ({args.shape} shape, F = {args.f_ms} ms, 1F1B, no activation "
        f"checkpointing), 4 processes, global batch of 8 micro-batches x {MICRO} rows:",
        "",
        "| replicas x stages | activations | step (median) | vs 1x4 | all-reduce wait in step "
        "| gradient bytes per rank | activation traffic per replica and step |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    base = record["1x4-fp32"]["median_s"]
    for key, entry in record.items():
        layout, dtype = key.split("-")
        lines.append(
            f"| {layout} | {'bfloat16' if dtype == 'bf16' else 'float32'} | "
            f"{entry['median_s'] * 1e3:.1f} ms | {entry['median_s'] / base:.2f} | "
            f"{entry['allreduce_wait_s'] * 1e3:.2f} ms | {entry['grad_bytes']:,} | "
            f"{entry['traffic_bytes'] / 2**20:.2f} MiB |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.parallel",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    parser.add_argument(
        "--f-ms", type=milliseconds, default=3.0, help="forward sleep per layer (ms)"
    )
    parser.add_argument("--shape", choices=("small", "large"), default="large")
    parser.add_argument("--steps", type=count, default=8, help="timed steps per layout")
    parser.add_argument(
        "--markdown", type=Path, default=None, help="page to write the table in (its section)"
    )
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)
    argv = list(sys.argv[1:] if argv is None else argv)
    started = time.monotonic()
    try:
        records = launch_workers("benchmarks.parallel", argv, 4, 1)
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 1
    table = _table(records[0], args)
    print(table)
    if args.markdown is not None:
        lines = provenance("benchmarks.parallel", argv, time.monotonic() - started)
        body = "\n".join(f"- {line}" for line in lines) + "\n\n" + table
        write_section(args.markdown, "parallel", body, "Data parallel x pipeline benchmarks")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
