"""Tracing overhead: the reference workload with and without ``AsyncPipe(trace=...)``.

Runs 4 processes over gloo; in the same processes, blocks of untraced and traced steps take
turns (so both see the same machine), each block a plain training loop with no barrier. Prints
the time per step of each and the overhead, and rank 0's own cost of tracing per step::

    python -m benchmarks.trace_overhead                 # F = 3 ms, chunks 8, ~2.5 minutes
    python -m benchmarks.trace_overhead --rounds 1 --steps 20
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from .launch import launch
from .workload import build_model, make_batch

__all__ = ["main"]


def _loss(output: torch.Tensor, target: object) -> torch.Tensor:
    return output.mean()


def worker(args: argparse.Namespace) -> None:
    import asyncpipe

    torch.set_num_threads(1)
    asyncpipe.init(timeout=120)
    rank = int(os.environ["RANK"])
    balance = [2, 2, 2, 2]
    model = build_model(args.f_ms, sum(balance))
    x, y = make_batch(args.chunks, 4, "small")
    plain = asyncpipe.AsyncPipe(model, balance, args.chunks, checkpoint="never", timeout=120)
    traced = asyncpipe.AsyncPipe(
        model, balance, args.chunks, checkpoint="never", timeout=120,
        trace=args.trace_dir, trace_every=args.every,
    )  # fmt: skip
    recorder = traced._recorder
    assert recorder is not None
    spent: list[float] = []  # main thread: handing each step to the recorder
    writing: list[float] = []  # rank 0's writer thread: CPU seconds per step written
    end_step, write = recorder.end_step, recorder.writer.write

    def timed_end_step(**kwargs: Any) -> None:
        began = time.perf_counter()
        end_step(**kwargs)
        spent.append(time.perf_counter() - began)

    def timed_write(step: Any) -> None:
        began = time.thread_time()
        write(step)
        writing.append(time.thread_time() - began)

    recorder.end_step = timed_end_step  # type: ignore[method-assign]
    recorder.writer.write = timed_write  # type: ignore[method-assign]
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-6)
    blocks: dict[str, list[float]] = {"plain": [], "traced": []}

    def block(pipe: asyncpipe.AsyncPipe, name: str, steps: int) -> None:
        torch.distributed.barrier()
        began = time.perf_counter()
        for _ in range(steps):
            optimizer.zero_grad()
            pipe.step(x if pipe.is_first_stage else None, y if pipe.is_last_stage else None, _loss)
            with pipe.trace_span("optimizer"):
                optimizer.step()
        blocks[name].append((time.perf_counter() - began) / steps)

    block(plain, "plain", 3)  # warm-up of both
    block(traced, "traced", 3)
    blocks = {"plain": [], "traced": []}
    spent.clear()
    writing.clear()
    for n in range(args.rounds):  # alternate which goes first, against drifts of the machine
        first, second = ((plain, "plain"), (traced, "traced"))[:: 1 if n % 2 == 0 else -1]
        block(*first, args.steps)
        block(*second, args.steps)
    traced.close()
    costs: list[list[float]] = [[] for _ in range(4)]
    torch.distributed.all_gather_object(costs, spent)
    if rank == 0:
        record = {"blocks": blocks, "end_step": costs, "writer_cpu": writing[3:]}
        Path(args.out).write_text(json.dumps(record))
    torch.distributed.destroy_process_group()


def _ms(values: list[float]) -> str:
    return ", ".join(f"{v * 1e3:.1f}" for v in values)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--f-ms", type=float, default=3.0, help="forward sleep per layer (ms)")
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20, help="steps per block")
    parser.add_argument("--rounds", type=int, default=10, help="plain/traced block pairs")
    parser.add_argument("--every", type=int, default=50, help="trace_every (timeline images)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--trace-dir", default="", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "result.json"
        forwarded = [
            "--worker", "--f-ms", str(args.f_ms), "--chunks", str(args.chunks),
            "--steps", str(args.steps), "--rounds", str(args.rounds), "--every", str(args.every),
            "--trace-dir", str(Path(scratch) / "trace"), "--out", str(out),
        ]  # fmt: skip
        budget = 120 + 4 * args.rounds * args.steps * args.chunks * args.f_ms * 9e-3
        result = launch("benchmarks.trace_overhead", forwarded, 4, budget, Path(scratch) / "logs")
        if not result.ok:
            print(result.failure(), file=sys.stderr)
            print(result.log_tail(0), file=sys.stderr)
            return 1
        record = json.loads(out.read_text())
    plain = statistics.median(record["blocks"]["plain"])
    traced = statistics.median(record["blocks"]["traced"])
    ms = 1e3
    print(
        f"reference workload: F = {args.f_ms:g} ms, chunks {args.chunks}, 4 processes, "
        f"{args.rounds} x {args.steps} steps each, trace_every {args.every}"
    )
    print(f"untraced step: {plain * ms:.1f} ms (blocks: {_ms(record['blocks']['plain'])})")
    print(f"traced step:   {traced * ms:.1f} ms (blocks: {_ms(record['blocks']['traced'])})")
    ratios = [t / p for p, t in zip(record["blocks"]["plain"], record["blocks"]["traced"])]
    print(
        f"difference:    {(traced / plain - 1) * 100:+.2f} % of the step (medians); per round "
        f"pair: median {(statistics.median(ratios) - 1) * 100:+.2f} %, from "
        f"{(min(ratios) - 1) * 100:+.1f} % to {(max(ratios) - 1) * 100:+.1f} %"
    )
    for rank, spent in enumerate(record["end_step"]):
        print(
            f"rank {rank}, training loop's share of tracing per step: median "
            f"{statistics.median(spent) * ms:.2f} ms, mean {statistics.mean(spent) * ms:.2f} ms"
        )
    writer = record["writer_cpu"]
    images = sorted(writer)[-max(1, len(writer) // args.every) :]
    print(
        f"rank 0, writer thread CPU per step: median {statistics.median(writer) * ms:.2f} ms, "
        f"mean {statistics.mean(writer) * ms:.2f} ms (steps with a timeline image: "
        f"{statistics.mean(images) * ms:.0f} ms)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
