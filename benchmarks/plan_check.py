"""How close ``asyncpipe.balance.plan`` predicts the step time of the reference workload.

Profiles the reference model in this process, ranks configurations with ``balance.plan``, then
runs a handful of them (the best, the best of each schedule and stage count, a poor one) as
real gloo jobs and prints predicted against measured step time::

    python -m benchmarks.plan_check --f-ms 3 --batch 32 --world 4

Each configuration runs as its own group of worker processes (``--worker`` mode, started by
:func:`benchmarks.launch.launch`); a step's time is the slowest rank's, and the median over the
timed steps counts.
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
from .options import count, count_list, milliseconds, steps
from .sections import provenance, write_section
from .workload import SHAPES, build_model

__all__ = ["main"]


def _worker(args: argparse.Namespace) -> int:
    """Run the configuration, write the step times (seconds) rank 0 measured.

    A flushing schedule's step is timed between barriers, each step the slowest rank's. 2BW
    never drains between mini-batches (a barrier between steps would drain it), so each rank
    times its ``--steps`` steps in a row with no barrier between them and divides, as
    ``plan`` predicts its steady-state step; the slowest rank's is the one figure written.
    """
    import torch.distributed as dist

    import asyncpipe

    torch.set_num_threads(1)
    asyncpipe.init(timeout=60)
    balance = [int(b) for b in args.balance.split(",")]
    model = build_model(args.f_ms, sum(balance))
    x = torch.randn(args.batch, *SHAPES[args.shape])
    pipe = asyncpipe.AsyncPipe(
        model,
        balance,
        chunks=args.chunks,
        checkpoint="never",
        schedule=args.schedule,
        virtual_stages=args.virtual_stages,
    )
    if args.schedule == "2bw":  # it applies each update itself: it needs the optimizer
        optimizer = torch.optim.SGD(pipe.parameters(), lr=1e-6)
        for _ in range(args.warmup):
            pipe.step(x, None, lambda out, _: out.mean(), optimizer=optimizer)
        dist.barrier()  # the 2BW pipeline stays full through the barrier: no flush yet
        start = time.perf_counter()
        for _ in range(args.steps):
            pipe.step(x, None, lambda out, _: out.mean(), optimizer=optimizer)
        took = torch.tensor([(time.perf_counter() - start) / args.steps])
        pipe.flush()
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        seconds = [float(took)]
    else:
        seconds = []
        for step in range(args.warmup + args.steps):
            model.zero_grad(set_to_none=True)
            dist.barrier()
            start = time.perf_counter()
            pipe.step(x, None, lambda out, _: out.mean())
            took = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            if step >= args.warmup:
                seconds.append(float(took))
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(seconds))
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _ping(args: argparse.Namespace) -> int:
    """Two ranks bounce a message of one activation's size; rank 0 writes the one-way time and
    the time to post a send (medians)."""
    import torch.distributed as dist

    import asyncpipe

    torch.set_num_threads(1)
    asyncpipe.init(timeout=60)
    rank = dist.get_rank()
    rows = args.batch // args.chunks
    buffer = torch.zeros(rows, *SHAPES[args.shape])
    trips, posts = [], []
    for trip in range(args.warmup + 40):
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            work = dist.isend(buffer, 1)
            posted = time.perf_counter()
            work.wait()
            dist.recv(buffer, 1)
        else:
            dist.recv(buffer, 0)
            dist.send(buffer, 0)
        if trip >= args.warmup and rank == 0:
            trips.append((time.perf_counter() - start) / 2)
            posts.append(posted - start)
    if rank == 0:
        Path(args.out).write_text(json.dumps([statistics.median(trips), statistics.median(posts)]))
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _link(args: argparse.Namespace, logs: Path) -> Any:
    """A :class:`asyncpipe.balance.Link` measured by a ping-pong between two processes now."""
    from asyncpipe.balance import Link

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "link.json"
        ping_args = [
            "--ping", "--batch", str(args.batch), "--chunks", str(args.chunks),
            "--shape", args.shape, "--out", str(out),
        ]  # fmt: skip
        result = launch("benchmarks.plan_check", ping_args, 2, 120.0, logs)
        if not result.ok:
            raise RuntimeError(f"ping-pong: {result.failure()}")
        one_way, post = json.loads(out.read_text())
    return Link(latency=one_way, bandwidth=float("inf"), post=post)


def _measure(args: argparse.Namespace, candidate: Any, logs: Path) -> float:
    """The median step time of ``candidate`` run as a real job.

    Raises:
        RuntimeError: the job failed, saying why.
    """
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "seconds.json"
        worker_args = [
            "--worker", "--f-ms", str(args.f_ms), "--batch", str(args.batch),
            "--shape", args.shape, "--chunks", str(candidate.chunks),
            "--schedule", candidate.schedule,
            "--virtual-stages", str(candidate.virtual_stages), "--warmup", str(args.warmup),
            "--steps", str(args.steps),
            "--balance", ",".join(map(str, candidate.balance)), "--out", str(out),
        ]  # fmt: skip
        result = launch("benchmarks.plan_check", worker_args, candidate.stages, 300.0, logs)
        if not result.ok:
            raise RuntimeError(result.failure())
        return statistics.median(json.loads(out.read_text()))


def _chosen(ranking: Any) -> list[Any]:
    """The best, the best of each (schedule, stages), and the worst multi-stage candidate."""
    picked: list[Any] = []
    seen: set[tuple[str, int]] = set()
    for candidate in ranking.candidates:
        key = (candidate.schedule, candidate.stages)
        if key not in seen:
            seen.add(key)
            picked.append(candidate)
    poor = [c for c in ranking.candidates if c.stages > 1]
    if poor and poor[-1] not in picked:
        picked.append(poor[-1])
    return picked


def _checked(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> tuple[list[int] | None, tuple[str, ...]]:
    """The chunk counts (None: every divisor) and schedules ``plan`` may choose; exits through
    ``parser.error`` if ``plan`` would refuse them (before the profiling, not after it)."""
    from asyncpipe.schedule import NAMES

    text = args.schedules
    schedules = tuple(dict.fromkeys(s.strip() for s in text.split(",") if s.strip()))
    unknown = [s for s in schedules if s not in NAMES]
    if unknown or not schedules:
        fixed = [s.lower() for s in schedules]
        good = fixed and all(f in NAMES for f in fixed)
        hint = f"; pass --schedules {','.join(fixed)}" if good else ""
        parser.error(
            f"argument --schedules: must be names from {', '.join(NAMES)}, in lower case and "
            f"separated by commas (got {text!r}"
            + (f"; unknown: {', '.join(unknown)}" if unknown else "")
            + f"){hint}"
        )
    if set(schedules) == {"interleaved"} and args.world < 2:
        parser.error(
            f"argument --schedules: interleaved needs at least 2 stages, so --world 2 or more "
            f"(got --world {args.world}); add another schedule or pass --world 2"
        )
    if not args.chunk_options:
        return None, schedules
    options = count_list(parser, "--chunk-options", args.chunk_options)
    odd = [c for c in options if args.batch % c]
    if odd:
        divisors = [c for c in range(1, args.batch + 1) if args.batch % c == 0]
        parser.error(
            f"argument --chunk-options: each chunk count must divide --batch, so that every "
            f"micro-batch has the same rows (--batch {args.batch}; not dividing: "
            f"{', '.join(map(str, odd))}); pass divisors of {args.batch}, e.g. "
            f"{','.join(map(str, divisors[:8]))}"
        )
    return options, schedules


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.plan_check",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--ping", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--measure-link",
        action="store_true",
        help="time a message between two processes first and predict with that link cost",
    )
    parser.add_argument(
        "--f-ms", type=milliseconds, default=3.0, help="forward sleep per layer (ms)"
    )
    parser.add_argument("--batch", type=count, default=32, help="rows of a mini-batch")
    parser.add_argument("--world", type=count, default=4, help="processes plan may use")
    parser.add_argument("--shape", choices=tuple(SHAPES), default="small")
    parser.add_argument(
        "--chunks", type=count, default=8, help="micro-batches of the --measure-link message"
    )
    parser.add_argument(
        "--chunk-options", default="", help="chunk counts plan may choose (default: all)"
    )
    parser.add_argument("--schedule", default="gpipe", help=argparse.SUPPRESS)
    parser.add_argument("--virtual-stages", type=count, default=1, help=argparse.SUPPRESS)
    parser.add_argument(
        "--schedules",
        default="gpipe,1f1b,zero_bubble",
        help="schedules plan may choose, from gpipe, 1f1b, interleaved, zero_bubble and 2bw "
        "(2bw: its steady-state step, timed over --steps steps in a row)",
    )
    parser.add_argument("--balance", default="2,2,2,2")
    parser.add_argument("--warmup", type=steps, default=2, help="untimed steps per run")
    parser.add_argument("--steps", type=count, default=8, help="timed steps per run")
    parser.add_argument("--repeat", type=count, default=5, help="timed runs per layer profile")
    parser.add_argument(
        "--fresh",
        action="store_true",
        help="profile again just before each run and predict it from that profile",
    )
    parser.add_argument("--out", default="")
    parser.add_argument("--logs", default="")
    parser.add_argument("--markdown", type=Path, default=None, help="page to write the table in")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    if args.worker:
        return _worker(args)
    if args.ping:
        return _ping(args)
    options, schedules = _checked(parser, args)

    from asyncpipe import balance

    started, load_before = time.monotonic(), os.getloadavg()[0]
    torch.set_num_threads(1)
    model = build_model(args.f_ms, 8)
    sample = torch.randn(args.batch, *SHAPES[args.shape])
    profile = balance.profile(model, sample, rows=[1, args.batch], repeat=args.repeat)
    logs = Path(args.logs or tempfile.mkdtemp(prefix="plan-check-"))
    link = _link(args, logs) if args.measure_link else balance.Link()
    print(f"link: {link}")
    try:
        ranking = balance.plan(
            profile, args.world, args.batch, chunks=options, schedules=schedules, link=link
        )
    except ValueError as exc:  # no configuration could be built: say why, no traceback
        parser.error(f"nothing to run: {exc}")
    head = (
        f"Reference workload: 8 layers, F = {args.f_ms:g} ms, {args.shape} shape, a batch of "
        f"{args.batch} rows on up to {args.world} processes; measured: the slowest rank's step, "
        f"median of {args.steps} after {args.warmup} warm-up"
    )
    print(head)
    print(ranking.table(8))
    print(ranking.reason)
    table = [
        "| configuration | predicted (ms) | measured (ms) | measured / predicted | load |",
        "|---|---:|---:|---:|---:|",
    ]
    print("\n" + "\n".join(table))
    best = ranking.best
    for candidate in _chosen(ranking):
        if args.fresh:  # predict again from a profile (and link) taken just before the run
            profile = balance.profile(model, sample, rows=[1, args.batch], repeat=args.repeat)
            link = _link(args, logs) if args.measure_link else balance.Link()
            candidate = balance.plan(
                profile,
                args.world,
                args.batch,
                stages=[candidate.stages],
                chunks=[candidate.chunks],
                schedules=[candidate.schedule],
                link=link,
            ).best
        try:
            measured: float | None = _measure(args, candidate, logs)
        except RuntimeError as exc:  # this configuration's job failed: say so in its row
            measured, failure = None, str(exc)
        name = (
            f"{candidate.schedule}, {candidate.stages} stages, {candidate.chunks} chunks, "
            f"balance {list(candidate.balance)}"
        )
        if (candidate.schedule, candidate.stages, candidate.chunks) == (
            best.schedule,
            best.stages,
            best.chunks,
        ):
            name += " (the best)"
        if measured is None:
            cells = f"FAILED: {failure.replace('|', '/')} | -"
        else:
            cells = f"{measured * 1e3:.1f} | {measured / candidate.seconds:.2f}"
        table.append(
            f"| {name} | {candidate.seconds * 1e3:.1f} | {cells} | {os.getloadavg()[0]:.1f} |"
        )
        print(table[-1], flush=True)
    if args.markdown is not None:
        body = [
            *(f"- {line}" for line in provenance("benchmarks.plan_check", argv)),
            f"- {head}",
            f"- Link: {link}",
            f"- Load average before: {load_before:.1f}; the load column is the 1-minute "
            "average after each row",
            "",
            "What `plan` said before the runs:",
            "",
            "```text",
            ranking.reason,
            "```",
            "",
            *table,
        ]
        body += ["", f"(the whole check took {(time.monotonic() - started) / 60:.1f} min)"]
        write_section(args.markdown, "plan_check", "\n".join(body), "Cut points")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
