"""Transport benchmark: activation bandwidth of p2p, shm and rpc against raw send/recv, and the
step time of the reference workload over each transport.

Run ``python -m benchmarks.transports``; it launches its own worker processes (loopback, gloo,
TensorPipe) and prints a table; ``--markdown docs/transports.md`` also writes it into that page.

Bandwidth: rank 0 sends ``--messages`` tensors of one shape to rank 1, one direction, with no
compute in between; rank 1 times from telling rank 0 to start to its last message. ``raw`` is
``torch.distributed.isend``/``irecv`` of the bare tensor (the limit of torch.distributed on this
machine), ``p2p``, ``shm`` (shared memory, when the group is gloo) and ``rpc`` are asyncpipe's
transports carrying the same tensor in a message, receives posted ahead as the runtime posts
them. Each method runs ``--trials`` bursts, the methods taking turns; the
table gives the best burst of each (the least disturbed by the machine) and the ratios of the
medians beside. Round trip: ranks 0 and 1 send a small tensor back and forth ``--trips`` times
per trial, each message sent when the previous one came back (one hop's latency); raw is the
process group's own send/recv, as ``p2p`` calls them. Hop after waiting: rank 0 sleeps
``IDLE_S`` (20 ms), then sends a small tensor to rank 1, which has waited for it all that
time, ``--idle-hops`` times per trial; the median time from the send's start to the receive's
return (one monotonic clock on the host) is a hop on a pipeline's critical path, where the
receiver waited for a neighbour's compute and the sender comes out of its own. Step time:
``AsyncPipe`` with the GPipe, 1F1B and zero-bubble schedules on the reference workload (8
sleep layers, F ms forward) over each transport, and fairscale's ``AsyncPipe`` (fill-drain,
over RPC) on the same workload, in ``--rounds`` rounds of ``--steps`` steps each, every round
in new processes (fairscale last in each: its pipeline slows down whatever runs after it in the
same processes); the table compares medians over all rounds and, round by round, systems that
ran in the same processes a minute apart at most.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .gpu import placement, synchronize
from .launch import launch_workers
from .options import count, milliseconds, steps
from .sections import provenance, write_section
from .transport_steps import merge_rounds, step_rows, step_times
from .worker import write_record
from .workload import SHAPES, nominal_ideal_s

__all__ = ["bandwidth_table", "main"]


# ----- worker side -----------------------------------------------------------------------------


LAYERS = 8
"""The layers of the reference workload (``build_model``'s default), split evenly over
``--processes`` for the step times."""

SLOTS = 8
"""Messages reuse SLOTS micro-batch slots, as a pipeline's steps do."""

RECEIVER_WORK_S = 50e-6
"""The work a receiver does per message in the ``raw+work`` stream of small tensors: a raw
send/recv stream whose receiver spends this long (spinning) after each message, about what
asyncpipe's receive does beside gloo's own calls. It shows how much of the raw rate is left
once a receiver does anything at all per message."""


def _bandwidth(
    method: str,
    shape: tuple[int, ...],
    messages: int,
    transports: dict[str, Any],
    device: torch.device,
) -> float | None:
    """Seconds rank 1 took to receive ``messages`` tensors of ``shape`` (None on rank 0)."""
    from asyncpipe.transport import Message, P2PTransport, RPCTransport, ShmTransport

    rank = dist.get_rank()
    tensor = torch.randn(*shape, device=device)
    if method not in transports:  # one per method and shape, kept from warm-up to the run
        makers = {
            "p2p": lambda: P2PTransport(device=device),
            "shm": lambda: ShmTransport(device=device),
            "rpc": RPCTransport,
            "raw": lambda: None,
            "raw+work": lambda: None,
        }
        transports[method] = makers[method]()
    transport = transports[method]

    def post(n: int) -> Any:
        if transport is None:
            return dist.irecv(torch.empty(*shape, device=device), 0)
        return transport.recv(0, 0, n % SLOTS)

    # A window of SLOTS receives posted ahead, one per slot, as a pipeline posts them. Rank 1
    # starts the clock as it tells rank 0 to go, so the first message's latency counts
    # (timing from its arrival let a sender that ran ahead hide it: messages queued before
    # the first was taken came at memory speed) and the ranks' skew leaving a barrier does not.
    pending = {n: post(n) for n in range(min(SLOTS, messages))} if rank == 1 else {}
    dist.barrier()
    if rank > 1:  # only ranks 0 and 1 take part
        dist.barrier()
        return None
    go = torch.zeros(1)
    if rank == 0:
        dist.recv(go, 1)
        works = []
        for n in range(messages):
            if transport is None:
                works.append(dist.isend(tensor, 1))
            else:
                transport.send(1, 0, Message(n % SLOTS, SLOTS, (tensor,)))
        for work in works:
            work.wait()
        if transport is not None:
            transport.flush(120)
        dist.barrier()
        return None
    start = time.perf_counter()
    dist.send(go, 0)
    for n in range(messages):
        receive = pending.pop(n)
        if transport is None:
            receive.wait()
        else:
            receive.wait(120)
        if method == "raw+work":
            until = time.perf_counter() + RECEIVER_WORK_S
            while time.perf_counter() < until:
                pass
        if n + SLOTS < messages:
            pending[n + SLOTS] = post(n + SLOTS)
    synchronize(device)
    seconds = time.perf_counter() - start
    dist.barrier()
    return seconds


class _Hop:
    """One small tensor's sends and receives between ranks 0 and 1 for the latency
    measurements: over ``transport`` (asyncpipe's), or, where it is None (``raw``), the
    process group's own send/recv, as asyncpipe's p2p calls them. Message ``n`` uses slot
    ``n % SLOTS``, as a pipeline's steps do."""

    def __init__(self, transport: Any, shape: tuple[int, ...], device: torch.device) -> None:
        group = dist.group.WORLD
        assert group is not None
        self.transport, self.group, self.shape, self.device = transport, group, shape, device
        self.tensor = torch.randn(*shape, device=device)

    def post(self, src: int, tag: int, n: int) -> Any:
        if self.transport is None:
            buffer = torch.empty(*self.shape, device=self.device)
            return self.group.recv([buffer], src, tag)
        return self.transport.recv(src, tag, n % SLOTS)

    def wait(self, receive: Any) -> None:
        if self.transport is None:
            receive.wait()
        else:
            receive.wait(120)

    def send(self, dst: int, tag: int, n: int) -> None:
        """Send message ``n`` and wait until it is taken."""
        from asyncpipe.transport import Message

        if self.transport is None:
            self.group.send([self.tensor], dst, tag).wait()
        else:
            self.transport.send(dst, tag, Message(n % SLOTS, SLOTS, (self.tensor,)))
            self.transport.settle(dst, tag, n % SLOTS, 120)

    def flush(self) -> None:
        if self.transport is not None:
            self.transport.flush(120)


def _round_trip(
    method: str,
    shape: tuple[int, ...],
    trips: int,
    transports: dict[str, Any],
    device: torch.device,
) -> float | None:
    """Seconds rank 0 took for ``trips`` round trips of a tensor of ``shape`` to rank 1 and
    back (None on the other ranks): each message waits for the previous one, so this is the
    latency of a hop, as a pipeline's critical path pays it. Each side posts its next receive
    before it sends, as the runtime does; ``transports`` are those of :func:`_bandwidth`."""
    rank = dist.get_rank()
    hop = _Hop(transports[method], shape, device)
    peer = 1 - rank
    dist.barrier()
    if rank > 1:
        dist.barrier()
        return None
    receive = hop.post(peer, 10 + peer, 0)
    start = time.perf_counter()
    for n in range(trips):
        if rank == 0:
            hop.send(peer, 10 + rank, n)
            hop.wait(receive)
            if n + 1 < trips:
                receive = hop.post(peer, 10 + peer, n + 1)
        else:
            hop.wait(receive)
            if n + 1 < trips:
                receive = hop.post(peer, 10 + peer, n + 1)
            hop.send(peer, 10 + rank, n)
    seconds = time.perf_counter() - start
    hop.flush()
    dist.barrier()
    return seconds if rank == 0 else None


IDLE_S = 0.02
"""How long the receiver of a waiting hop waits before each message: about a stage's compute
on the reference workload, which a rank waits for its neighbour's micro-batch in a pipeline."""


def _waiting_hop(
    method: str,
    shape: tuple[int, ...],
    hops: int,
    transports: dict[str, Any],
    device: torch.device,
) -> float | None:
    """The median seconds from rank 0 beginning to send a tensor of ``shape`` to rank 1
    returning it from its receive, over ``hops`` messages each sent ``IDLE_S`` after the last
    (None on the other ranks than 1): the latency of a hop whose receiver had been waiting, as
    a pipeline's critical path pays it, sender and receiver both coming out of a sleep. Both
    ranks read the same monotonic clock of this host; rank 0 sends its times at the end."""
    rank = dist.get_rank()
    hop = _Hop(transports[method], shape, device)
    dist.barrier()
    if rank > 1:
        dist.barrier()
        return None
    if rank == 0:
        began = []
        for n in range(hops):
            time.sleep(IDLE_S)
            began.append(time.perf_counter())
            hop.send(1, 20, n)
        hop.flush()
        dist.send(torch.tensor(began, dtype=torch.float64, device=device), 1)
        dist.barrier()
        return None
    arrived = []
    for n in range(hops):
        hop.wait(hop.post(0, 20, n))
        synchronize(device)  # the data is here, not only ordered on a stream (NCCL)
        arrived.append(time.perf_counter())
    stamps = torch.empty(hops, dtype=torch.float64, device=device)  # rank 0's send times
    dist.recv(stamps, 0)
    dist.barrier()
    return statistics.median(a - s for a, s in zip(arrived, stamps.tolist()))


def _in_turns(
    methods: tuple[str, ...], trials: int, measure: Callable[..., float | None], *rest: Any
) -> dict[str, list[float]]:
    """``trials`` values of ``measure(method, *rest)`` for each method, the methods taking
    turns (against the machine's drifts); only those this rank measured (None elsewhere)."""
    out: dict[str, list[float]] = {method: [] for method in methods}
    for trial in range(trials):
        turn = trial % len(methods)
        for method in methods[turn:] + methods[:turn]:
            value = measure(method, *rest)
            if value is not None:
                out[method].append(value)
    return out


def worker(args: argparse.Namespace) -> int:
    import asyncpipe

    where = placement(args.device, int(os.environ["WORLD_SIZE"]))
    # gloo sends host memory only: on a shared GPU the bandwidth is that of host tensors.
    device = torch.device("cpu") if where.staged else where.device
    asyncpipe.init(backend=where.backend, rpc=True)
    record: dict[str, Any] = {
        "bandwidth": {},
        "steps": {},
        "placement": where.describe(dist.get_world_size()),
        "tensors": str(device),
    }
    micro = args.micro_batch
    shm = ("shm",) if dist.get_backend() == "gloo" else ()  # needs a gloo group
    shapes = (("small", (micro, *SHAPES["small"])), ("large", (micro, *SHAPES["large"])))
    for label, shape in () if args.steps_only else shapes:
        count = args.messages if label == "small" else max(args.messages // 10, 20)
        transports: dict[str, Any] = {}
        methods = ("raw", "p2p", *shm, "rpc")
        streams = methods + ("raw+work",) * (label == "small")
        for method in streams:
            _bandwidth(method, shape, 2 * SLOTS, transports, device)  # warm up
        # (the warm-up let the slots learn their sizes)
        trials = _in_turns(streams, args.trials, _bandwidth, shape, count, transports, device)
        if label == "small":  # the latency of a hop, with the same transports
            for method in methods:
                _round_trip(method, shape, 2 * SLOTS, transports, device)  # warm up
            trips = _in_turns(
                methods, args.trials, _round_trip, shape, args.trips, transports, device
            )
            if trips["raw"]:
                record["round_trip"] = {
                    method: {
                        "best_s": min(t) / args.trips,
                        "median_s": statistics.median(t) / args.trips,
                    }
                    for method, t in trips.items()
                }
            if args.idle_hops:
                for method in methods:
                    _waiting_hop(method, shape, SLOTS, transports, device)  # warm up
                hops = _in_turns(
                    methods, args.trials, _waiting_hop, shape, args.idle_hops, transports, device
                )
                if hops["raw"]:
                    record["waiting_hop"] = {
                        method: {"best_s": min(h), "median_s": statistics.median(h)}
                        for method, h in hops.items()
                    }
        for method, seconds in trials.items():
            if seconds:
                size = 4 * int(torch.Size(shape).numel())
                record["bandwidth"][f"{label}-{method}"] = {
                    "bytes": size,
                    "messages": count,
                    "seconds": min(seconds),
                    "bytes_per_s": size * count / min(seconds),
                    "median_bytes_per_s": size * count / statistics.median(seconds),
                }
    if dist.get_world_size() >= 2 and not args.bandwidth_only:
        record["steps"] = step_times(args, ("p2p", *shm, "rpc"))
    write_record(Path(args.out) / f"rank{dist.get_rank()}.json", record)
    asyncpipe.shutdown()
    return 0


# ----- driver side -----------------------------------------------------------------------------


TRANSPORTS = ("p2p", "shm", "rpc")
"""asyncpipe's transports in the tables' order (shm where the group is gloo)."""


def _ours(record: dict[str, Any], prefix: str = "") -> list[str]:
    """The transports ``record`` has entries for, in table order."""
    return [m for m in TRANSPORTS if f"{prefix}{m}" in record]


def _head(lead: list[str], ours: list[str]) -> list[str]:
    """A table's header and alignment rows: ``lead`` columns, raw, each transport, each
    transport's ratio to raw, and the ratios of the medians."""
    names = [*lead, "raw send/recv", *ours, *(f"{m} / raw" for m in ours)]
    names.append(f"medians: {', '.join(ours)} / raw")
    return ["| " + " | ".join(names) + " |", "|---|" + "---:|" * (len(names) - 1)]


def bandwidth_table(bandwidth: dict[str, dict[str, float]], micro_batch: int) -> str:
    """The markdown table of a bandwidth record (rank 1's ``record["bandwidth"]``)."""
    ours = _ours(bandwidth, "small-")
    lines = _head(["shape", "bytes"], ours)

    def rate(entry: dict[str, float]) -> str:
        return f"{entry['bytes_per_s'] / 2**20:.0f} MiB/s"

    def median(entry: dict[str, float]) -> float:
        return entry.get("median_bytes_per_s", entry["bytes_per_s"])

    for label in ("small", "large"):
        shape = (micro_batch, *SHAPES[label])
        raw = bandwidth[f"{label}-raw"]
        entries = [bandwidth[f"{label}-{m}"] for m in ours]
        best = [f"{e['bytes_per_s'] / raw['bytes_per_s']:.2f}" for e in entries]
        medians = " / ".join(f"{median(e) / median(raw):.2f}" for e in entries)
        lines.append(
            f"| {shape} | {raw['bytes']} | {rate(raw)} | "
            + " | ".join(rate(e) for e in entries)
            + " | "
            + " | ".join(best)
            + f" | {medians} |"
        )
    worked = bandwidth.get("small-raw+work")
    if worked is not None:
        raw = bandwidth["small-raw"]
        lines += [
            "",
            f"The same raw stream of {(micro_batch, *SHAPES['small'])} tensors with "
            f"{RECEIVER_WORK_S * 1e6:.0f} us of work on the receiver after each message: "
            f"{rate(worked)} ({worked['bytes_per_s'] / raw['bytes_per_s']:.2f} of raw; "
            f"medians {median(worked) / median(raw):.2f}).",
        ]
    return "\n".join(lines)


def round_trip_table(
    trips: dict[str, dict[str, float]], micro_batch: int, lead: str = "round trip of"
) -> str:
    """The markdown table of rank 0's ``record["round_trip"]`` (one hop's latency), or of rank
    1's ``record["waiting_hop"]`` with ``lead`` naming it: best and median of each method."""
    ours = _ours(trips)
    raw = trips["raw"]
    entries = [trips[m] for m in ours]
    shape = (micro_batch, *SHAPES["small"])

    def us(entry: dict[str, float]) -> str:
        return f"{entry['best_s'] * 1e6:.0f} us"

    return "\n".join(
        [
            *_head([lead], ours),
            f"| {shape} | {us(raw)} | "
            + " | ".join(us(e) for e in entries)
            + " | "
            + " | ".join(f"{e['best_s'] / raw['best_s']:.2f}" for e in entries)
            + " | "
            + " / ".join(f"{e['median_s'] / raw['median_s']:.2f}" for e in entries)
            + " |",
        ]
    )


def _table(records: list[dict[str, Any]], args: argparse.Namespace) -> str:
    lines = [bandwidth_table(records[1]["bandwidth"], args.micro_batch)]
    if "round_trip" in records[0]:
        lines += ["", round_trip_table(records[0]["round_trip"], args.micro_batch)]
    if "waiting_hop" in records[1]:
        hop = records[1]["waiting_hop"]
        lead = f"hop after {IDLE_S * 1e3:.0f} ms of waiting, of"
        lines += ["", round_trip_table(hop, args.micro_batch, lead)]
    if args.bandwidth_only:
        return "\n".join(lines)
    steps = records[0]["steps"]
    world = args.processes
    ideal = nominal_ideal_s(world, args.chunks, LAYERS // world, args.f_ms)
    lines += [
        "",
        f"Reference workload, {world} processes, chunks {args.chunks}, F = {args.f_ms} ms, no "
        f"activation checkpointing (GPipe and 1F1B nominal ideal {ideal * 1e3:.0f} ms). "
        f"fairscale's AsyncPipe runs fill-drain (GPipe), so the GPipe rows are the like-for-like "
        f"comparison; the others are what one argument (schedule=...) gives on the same workload:",
        "",
        "| system | median step | best step | median / GPipe's nominal ideal | fairscale / this "
        "| fairscale / this, by round | this / fairscale, by round |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    return "\n".join(lines + step_rows(steps, ideal))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.transports",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    parser.add_argument("--processes", type=count, default=4, help="processes for the step time")
    parser.add_argument("--micro-batch", type=count, default=8, help="rows of a message")
    parser.add_argument("--messages", type=count, default=400, help="messages of the small shape")
    parser.add_argument(
        "--trials", type=count, default=9, help="timed bursts per method and shape (best reported)"
    )
    parser.add_argument(
        "--trips", type=count, default=200, help="round trips of the small shape per trial"
    )
    parser.add_argument(
        "--idle-hops",
        type=steps,
        default=30,
        help="messages per trial of the hop to a receiver that waited (0: none)",
    )
    parser.add_argument(
        "--f-ms", type=milliseconds, default=5.0, help="forward sleep per layer (ms)"
    )
    parser.add_argument("--chunks", type=count, default=8, help="micro-batches per step")
    parser.add_argument(
        "--steps", type=count, default=4, help="timed steps per system and round (step time)"
    )
    parser.add_argument(
        "--rounds", type=count, default=3, help="rounds of the step times, each in new processes"
    )
    parser.add_argument("--steps-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--markdown", type=Path, default=None, help="page to write the tables in (its section)"
    )
    parser.add_argument("--bandwidth-only", action="store_true", help="no step times")
    parser.add_argument("--device", choices=("cpu", "cuda", "auto"), default="cpu")
    args = parser.parse_args(argv)
    if args.processes < 2 or (not args.bandwidth_only and LAYERS % args.processes):
        parser.error(
            f"--processes must be at least 2 (the bandwidth runs between two) and, for the step "
            f"times, divide the reference workload's {LAYERS} layers (got {args.processes}); "
            f"pass 2, 4 or 8, or --bandwidth-only"
        )
    if args.worker:
        return worker(args)
    argv = list(sys.argv[1:] if argv is None else argv)
    started = time.monotonic()
    try:
        records = launch_workers("benchmarks.transports", argv, args.processes, 2)
        if not args.bandwidth_only:  # the step times' later rounds, each in new processes
            rounds = [records[0]["steps"]]
            for _ in range(args.rounds - 1):
                more = launch_workers(
                    "benchmarks.transports", [*argv, "--steps-only"], args.processes, 2
                )
                rounds.append(more[0]["steps"])
            records[0]["steps"] = merge_rounds(rounds)
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 1
    table = _table(records, args)
    print(table)
    if args.markdown is not None:
        lines = provenance("benchmarks.transports", argv, time.monotonic() - started)
        lines.append(f"Placement: {records[0]['placement']}")
        body = "\n".join(f"- {line}" for line in lines) + "\n\n" + table
        write_section(args.markdown, "transports", body, "Transport benchmarks")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
