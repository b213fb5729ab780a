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
from .options import count, milliseconds
from .sections import load, provenance, write_section
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

    def timed_write(step: Any, **options: Any) -> None:
        began = time.thread_time()
        write(step, **options)
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
    asyncpipe.shutdown()  # meets the others first: no collective's clean-up is left for exit


def _ms(values: list[float]) -> str:
    return ", ".join(f"{v * 1e3:.1f}" for v in values)


def _span(values: list[float], digits: int = 2) -> str:
    """``a`` or ``a to b`` in ms."""
    low, high = min(values) * 1e3, max(values) * 1e3
    return (
        f"{low:.{digits}f}"
        if f"{low:.{digits}f}" == f"{high:.{digits}f}"
        else (f"{low:.{digits}f} to {high:.{digits}f}")
    )


def report(record: dict[str, Any], args: argparse.Namespace) -> list[str]:
    """The results as markdown: a table of what tracing costs per step, and the wall clock."""
    plain_blocks, traced_blocks = record["blocks"]["plain"], record["blocks"]["traced"]
    plain, traced = statistics.median(plain_blocks), statistics.median(traced_blocks)
    ratios = [t / p for p, t in zip(plain_blocks, traced_blocks, strict=True)]
    loop = record["end_step"]
    medians = [statistics.median(spent) for spent in loop]
    means = [statistics.mean(spent) for spent in loop]
    writer = record["writer_cpu"]
    drawn = len(writer) // args.every
    images = sorted(writer)[-drawn:] if drawn else []
    image = f"{statistics.mean(images) * 1e3:.0f} ms" if images else "none drawn in this run"
    return [
        "| per step | rank 0 | other ranks |",
        "|---|---|---|",
        f"| the training loop's share (timing, payload, hand-over), median / mean | "
        f"{medians[0] * 1e3:.2f} / {means[0] * 1e3:.2f} ms | {_span(medians[1:])} / "
        f"{_span(means[1:])} ms |",
        f"| rank 0's writer thread, CPU time, median / mean | "
        f"{statistics.median(writer) * 1e3:.2f} / {statistics.mean(writer) * 1e3:.2f} ms "
        f"| none |",
        f"| of which a timeline image (every {args.every} steps) | {image} | none |",
        "",
        f"- Against the untraced step ({plain * 1e3:.1f} ms): the training loop's share on "
        f"rank 0 is {medians[0] / plain:.2%} of the step at the median "
        f"({means[0] / plain:.2%} at the mean), the writer thread's "
        f"{statistics.mean(writer) / plain:.2%} of one core's time.",
        f"- Wall clock, {args.rounds} pair(s) of blocks of {args.steps} untraced and "
        f"{args.steps} traced steps in the same processes: {plain * 1e3:.1f} ms untraced and "
        f"{traced * 1e3:.1f} ms traced per step (medians of the blocks), "
        f"**{(traced / plain - 1) * 100:+.1f} %**; the median of the pairs is "
        f"{(statistics.median(ratios) - 1) * 100:+.2f} %, the pairs range from "
        f"{(min(ratios) - 1) * 100:+.1f} % to {(max(ratios) - 1) * 100:+.1f} %.",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.trace_overhead",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--f-ms", type=milliseconds, default=3.0, help="forward sleep per layer (ms)"
    )
    parser.add_argument("--chunks", type=count, default=8, help="micro-batches per step")
    parser.add_argument("--steps", type=count, default=20, help="steps per block")
    parser.add_argument("--rounds", type=count, default=10, help="plain/traced block pairs")
    parser.add_argument("--every", type=count, default=50, help="trace_every (timeline images)")
    parser.add_argument("--markdown", type=Path, default=None, help="page to write the table in")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--trace-dir", default="", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    started, load_before = time.monotonic(), load()
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
    head = (
        f"Reference workload: F = {args.f_ms:g} ms, chunks {args.chunks}, 4 processes over "
        f"gloo, balance [2, 2, 2, 2], trace_every {args.every}"
    )
    lines = report(record, args)
    print(head, *lines, sep="\n")
    print(f"untraced blocks: {_ms(record['blocks']['plain'])} ms per step")
    print(f"traced blocks:   {_ms(record['blocks']['traced'])} ms per step")
    if args.markdown is not None:
        body = [
            *(f"- {line}" for line in provenance("benchmarks.trace_overhead", argv)),
            f"- {head}",
            f"- Load average before: {load_before}; after: {load()}",
            "",
            *lines,
        ]
        write_section(args.markdown, "trace_overhead", "\n".join(body), "Tracing a run")
    print(f"(total {time.monotonic() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
