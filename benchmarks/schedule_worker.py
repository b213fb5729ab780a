"""One benchmark rank of ``benchmarks.schedules``: runs a list of (system, chunks) entries."""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import resource
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .gpu import Placement, placement, synchronize
from .peers import FAIRSCALE, fairscale_asyncpipe_step, fairscale_pipe_step
from .worker import StepFn, _loss, step_record, write_record
from .workload import BUSY, RSS, build_model, make_batch

__all__ = [
    "ASYNCPIPE",
    "OURS",
    "OVER_SHM",
    "PEERS",
    "SYSTEMS",
    "base_system",
    "main",
    "stage_layers",
]

ASYNCPIPE = {
    "asyncpipe-gpipe": "gpipe",
    "asyncpipe-1f1b": "1f1b",
    "asyncpipe-interleaved": "interleaved",
    "asyncpipe-zero_bubble": "zero_bubble",
}
"""asyncpipe's systems: ``AsyncPipe(schedule=...)`` by schedule name."""

OVER_SHM = "@shm"
"""The suffix of an asyncpipe system run over ``transport="shm"`` instead of the group's
transport (``asyncpipe-1f1b@shm``): rows beside the others, in the same group of workers."""

OURS = {**ASYNCPIPE, **{f"{k}{OVER_SHM}": v for k, v in ASYNCPIPE.items()}}
"""Every asyncpipe system, over the group's transport and over shm, by schedule name."""


def base_system(system: str) -> str:
    """``system`` without its transport suffix."""
    return system.removesuffix(OVER_SHM)


PEERS = {
    "torch-gpipe": "ScheduleGPipe",
    "torch-1f1b": "Schedule1F1B",
    "torch-interleaved": "ScheduleInterleaved1F1B",
    "torch-zero_bubble": "ScheduleInterleavedZeroBubble",
    "torch-zbv": "ScheduleZBVZeroBubble",
}
"""torch.distributed.pipelining's schedules (class names in ``...pipelining.schedules``)."""

SYSTEMS = (*OURS, *PEERS, *FAIRSCALE)

MULTI_STAGE = {"asyncpipe-interleaved", "torch-interleaved", "torch-zbv"}
"""Systems that hold ``virtual_stages`` model chunks per rank; the others hold one."""


def stage_layers(system: str, ranks: int, layers: int, virtual: int, rank: int) -> list[int]:
    """The model stages of ``rank`` (in the order the rank holds them) under ``system``.

    One stage per rank: stage ``rank``. Interleaved: ``virtual`` stages, stage ``k`` on rank
    ``k % ranks``. ZBV: two stages in a V, rank ``r`` holding stages ``r`` and ``2R - 1 - r``.
    """
    if system not in MULTI_STAGE:
        return [rank]
    if system == "torch-zbv":
        return [rank, 2 * ranks - 1 - rank]
    return [rank + v * ranks for v in range(virtual)]


def _stage_count(system: str, ranks: int, virtual: int) -> int:
    if system == "torch-zbv":
        return 2 * ranks
    return ranks * virtual if base_system(system) in MULTI_STAGE else ranks


def _stage_module(model: nn.Sequential, stages: int, stage: int) -> nn.Sequential:
    per = len(model) // stages
    return nn.Sequential(*(model[i] for i in range(stage * per, (stage + 1) * per)))


def _asyncpipe_step(
    system: str,
    model: nn.Sequential,
    ranks: int,
    virtual: int,
    chunks: int,
    x: torch.Tensor,
    y: torch.Tensor,
    timeout_s: float,
    transport: str,
    where: Placement,
) -> StepFn:
    import asyncpipe

    stages = _stage_count(system, ranks, virtual)
    pipe = asyncpipe.AsyncPipe(
        model,
        balance=[len(model) // stages] * stages,
        chunks=chunks,
        checkpoint="never",
        schedule=OURS[system],
        virtual_stages=stages // ranks,
        timeout=timeout_s,
        transport="shm" if system.endswith(OVER_SHM) else transport,
        device=where.device,
    )

    def step() -> dict[str, Any]:
        pipe.step(x, y, _loss)
        return step_record(pipe)

    return step


def _torch_step(
    system: str,
    model: nn.Sequential,
    ranks: int,
    virtual: int,
    chunks: int,
    x: torch.Tensor,
    y: torch.Tensor,
    group: dist.ProcessGroup,
    device: torch.device,
) -> StepFn:
    from torch.distributed.pipelining import PipelineStage, schedules

    rank = dist.get_rank()
    stages = _stage_count(system, ranks, virtual)
    mine = stage_layers(system, ranks, len(model), virtual, rank)
    built = [
        PipelineStage(_stage_module(model, stages, s), s, stages, device, group=group) for s in mine
    ]
    cls = getattr(schedules, PEERS[system])
    if system in ("torch-gpipe", "torch-1f1b"):
        schedule = cls(built[0], n_microbatches=chunks, loss_fn=_loss)
    else:
        schedule = cls(built, n_microbatches=chunks, loss_fn=_loss)
    first, last = 0 in mine, stages - 1 in mine
    order = getattr(schedule, "pipeline_order", None)
    plan = (
        {str(r): [None if a is None else str(a) for a in row] for r, row in order.items()}
        if rank == 0 and isinstance(order, dict)
        else None
    )

    def step() -> dict[str, Any]:
        losses: list[torch.Tensor] = []
        if first and last:
            schedule.step(x, target=y, losses=losses)
        elif first:
            schedule.step(x)
        elif last:
            schedule.step(target=y, losses=losses)
        else:
            schedule.step()
        return {} if plan is None else {"plan": plan}

    return step


def _max_rss_bytes() -> int:
    """The process's peak RSS so far (``ru_maxrss`` is in KiB on Linux)."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def _entries(text: str) -> list[tuple[int, str, int]]:
    """``"3:asyncpipe-gpipe:8,..."`` -> ``[(3, "asyncpipe-gpipe", 8), ...]`` (index, system,
    chunks)."""
    out = []
    for item in text.split(","):
        index, system, chunks = item.split(":")
        if system not in SYSTEMS:
            raise ValueError(f"unknown system {system!r}; choose from {', '.join(SYSTEMS)}")
        out.append((int(index), system, int(chunks)))
    return out


def _build_step(
    system: str,
    args: argparse.Namespace,
    model: nn.Sequential,
    chunks: int,
    x: torch.Tensor,
    y: torch.Tensor,
    peer_group: dist.ProcessGroup,
    where: Placement,
) -> StepFn:
    """The step of one entry: asyncpipe, a torch.distributed.pipelining peer, or fairscale."""
    ranks = dist.get_world_size()
    if system in OURS:
        return _asyncpipe_step(
            system, model, ranks, args.virtual, chunks, x, y, args.pg_timeout, args.transport, where
        )
    if system == "fairscale-asyncpipe":
        return fairscale_asyncpipe_step(model, [len(model) // ranks] * ranks, chunks, x, y)
    if system == "fairscale-pipe":
        stages = args.pipe_stages
        return fairscale_pipe_step(
            model, [len(model) // stages] * stages, chunks, x, y, where.device
        )
    return _torch_step(system, model, ranks, args.virtual, chunks, x, y, peer_group, where.device)


def _memory_start(where: Placement) -> None:
    RSS.reset()
    if where.cuda:
        torch.cuda.reset_peak_memory_stats(where.device)


def _memory_record(run_record: dict[str, Any], where: Placement) -> None:
    """Append this step's memory: the RSS the layers saw, and on a GPU the allocator's peak."""
    run_record.setdefault("rss_start", []).append(RSS.start_bytes)
    run_record.setdefault("rss_peak", []).append(RSS.peak_bytes)
    if where.cuda:
        run_record.setdefault("cuda_peak", []).append(torch.cuda.max_memory_allocated(where.device))


def run(args: argparse.Namespace) -> int:
    rank = int(os.environ["RANK"])
    out = Path(args.out) / f"rank{rank}.json"
    record: dict[str, Any] = {"rank": rank, "runs": [], "error": None, "failed_entry": None}
    write_record(out, record)
    torch.set_num_threads(1)
    entries = _entries(args.entries)
    rpc = args.transport == "rpc" or any(s == "fairscale-asyncpipe" for _, s, _ in entries)
    ok = False
    try:
        import asyncpipe

        where = placement(args.device, int(os.environ["WORLD_SIZE"]))
        if where.cuda:
            torch.cuda.set_device(where.device)
        record["placement"] = where.describe(int(os.environ["WORLD_SIZE"]))
        asyncpipe.init(backend=where.backend, timeout=args.pg_timeout, rpc=rpc)
        # The peers talk on a group of their own, so no message can meet asyncpipe's.
        peer_group = dist.new_group(
            backend=where.backend, timeout=timedelta(seconds=args.pg_timeout)
        )
        assert peer_group is not None
        RSS.enabled = args.memory
        for index, system, chunks in entries:
            record["failed_entry"] = index  # until this entry completes
            write_record(out, record)
            model = build_model(args.f_ms, args.layers).to(where.device)
            x, y = (t.to(where.device) for t in make_batch(chunks, args.micro_batch, args.shape))
            step = _build_step(system, args, model, chunks, x, y, peer_group, where)
            run_record: dict[str, Any] = {
                "entry": index,
                "system": system,
                "chunks": chunks,
                "seconds": [],
                "busy": [],
                "max_rss_before": _max_rss_bytes(),
            }
            for i in range(args.warmup + args.steps):
                model.zero_grad(set_to_none=True)
                synchronize(where)
                dist.barrier()
                BUSY.reset()
                _memory_start(where)
                t0 = time.perf_counter()
                extra = step()
                synchronize(where)
                seconds = time.perf_counter() - t0
                if i >= args.warmup:
                    run_record["seconds"].append(seconds)
                    run_record["busy"].append(BUSY.seconds)
                    if args.memory:
                        _memory_record(run_record, where)
                    for key, value in extra.items():
                        if key in ("events", "events_start"):
                            run_record[f"last_{key}"] = value
                        elif key == "plan":
                            run_record["plan"] = value
                        else:
                            run_record.setdefault(key, []).append(value)
            run_record["max_rss_after"] = _max_rss_bytes()
            record["runs"].append(run_record)
            record["failed_entry"] = None
            write_record(out, record)
            del step, model
            gc.collect()
        dist.barrier()
        ok = True
    except Exception as exc:  # reported to the launcher through the record and the log
        traceback.print_exc()
        record["error"] = f"{type(exc).__name__}: {exc}".strip()[:1000]
        write_record(out, record)
        return 1
    finally:
        if rpc:
            from torch.distributed import rpc as torch_rpc

            with contextlib.suppress(Exception):  # not started, or a peer already gone
                torch_rpc.shutdown(graceful=ok)
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--entries", required=True, help="index:system:chunks,...")
    parser.add_argument("--f-ms", type=float, default=5.0)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--shape", choices=("small", "large"), default="small")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--virtual", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--memory", action="store_true", help="sample memory inside every step")
    parser.add_argument("--transport", choices=("p2p", "rpc"), default="p2p")
    parser.add_argument("--device", choices=("cpu", "cuda", "auto"), default="cpu")
    parser.add_argument("--pipe-stages", type=int, default=4, help="fairscale-pipe's partitions")
    parser.add_argument("--pg-timeout", type=float, default=60.0)
    parser.add_argument("--out", required=True)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
