"""One benchmark rank: time asyncpipe or a torch.distributed.pipelining peer on the workload."""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .workload import BUSY, build_model, make_batch, stage_module

__all__ = ["SYSTEMS", "main", "step_record"]

SYSTEMS = ("asyncpipe", "torch-gpipe", "torch-1f1b")
"""What a worker can run: the library, and torch.distributed.pipelining's two schedules."""

StepFn = Callable[[], dict[str, Any]]
"""Runs one pipeline step on this rank; returns extra per-step numbers (may be empty).

The key ``"events"`` (asyncpipe's ``(action, start, end)`` list) is kept for the last step only.
"""


def _loss(output: object, target: object) -> torch.Tensor:
    """The trivial loss of the reference workload: the output's mean (the target is ignored)."""
    if not isinstance(output, torch.Tensor):
        raise TypeError(f"expected the last stage to output a tensor, got {type(output)}")
    return output.mean()


def _breakdown(events: list[tuple[str, float, float]], seconds: float) -> dict[str, float]:
    """Split one rank's step: compute, send and receive actions, the wait before the first
    action (a rank's first receive), gaps between actions, and the end-of-step exchange."""
    from asyncpipe.schedule import Action

    sums = {"compute": 0.0, "send": 0.0, "recv": 0.0}
    for text, began, ended in events:
        kind = Action.parse(text).kind
        key = "compute" if kind.is_compute else "send" if kind.is_send else "recv"
        sums[key] += ended - began
    first_start = min((began for _, began, _ in events), default=0.0)
    last_end = max((ended for _, _, ended in events), default=0.0)
    return {
        "compute_s": sums["compute"],
        "send_s": sums["send"],
        "recv_s": sums["recv"],
        "head_s": first_start,
        "gap_s": last_end - first_start - sum(sums.values()),
        "tail_s": seconds - last_end,
    }


def step_record(pipe: Any) -> dict[str, Any]:
    """What a benchmark keeps of an ``AsyncPipe``'s last step: its time, idle fraction, busy
    time, peak activations, the per-kind breakdown of its actions and the actions' events."""
    last = pipe.last_step
    if last is None:
        raise RuntimeError("AsyncPipe.step() left no last_step report")
    events = [(str(a), float(b), float(e)) for a, b, e in last.events]
    return {
        "lib_seconds": float(last.seconds),
        "lib_busy": float(last.busy_seconds),
        "lib_idle": float(last.idle_fraction),
        "peak_activations": int(last.peak_activations),
        **_breakdown(events, last.seconds),
        "events": events,
        "events_start": float(last.start),
    }


def _asyncpipe_step(
    model: nn.Sequential,
    balance: list[int],
    chunks: int,
    x: torch.Tensor,
    y: torch.Tensor,
    timeout_s: float,
) -> StepFn:
    import asyncpipe

    pipe = asyncpipe.AsyncPipe(
        model, balance=balance, chunks=chunks, checkpoint="never", timeout=timeout_s
    )

    def step() -> dict[str, Any]:
        pipe.step(x, y, _loss)
        return step_record(pipe)

    return step


def _torch_step(
    system: str,
    model: nn.Sequential,
    balance: list[int],
    chunks: int,
    x: torch.Tensor,
    y: torch.Tensor,
) -> StepFn:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    rank, world = dist.get_rank(), dist.get_world_size()
    stage = PipelineStage(stage_module(model, balance, rank), rank, world, torch.device("cpu"))
    schedule_cls = ScheduleGPipe if system == "torch-gpipe" else Schedule1F1B
    schedule = schedule_cls(stage, n_microbatches=chunks, loss_fn=_loss)

    def step() -> dict[str, Any]:
        if rank == 0:
            schedule.step(x)
        elif rank == world - 1:
            losses: list[torch.Tensor] = []
            schedule.step(target=y, losses=losses)
        else:
            schedule.step()
        return {}

    return step


def timed_steps(step: Callable[[], object], steps: int) -> list[float]:
    """Seconds of ``steps`` calls of ``step`` after one untimed warm-up call, each started
    together on every rank (a barrier before each)."""
    times = []
    for _ in range(steps + 1):
        dist.barrier()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return times[1:]


def write_record(path: Path, record: dict[str, Any]) -> None:
    """Write a rank's JSON record atomically (the launcher may read it at any time)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1))
    tmp.replace(path)


def run(args: argparse.Namespace) -> int:
    rank = int(os.environ["RANK"])
    out = Path(args.out) / f"rank{rank}.json"
    record: dict[str, Any] = {
        "system": args.system,
        "rank": rank,
        "runs": [],
        "error": None,
        "failed_chunks": None,
    }
    write_record(out, record)
    torch.set_num_threads(1)
    try:
        if args.system == "asyncpipe":
            import asyncpipe

            asyncpipe.init(timeout=args.pg_timeout)
        else:
            dist.init_process_group("gloo", timeout=timedelta(seconds=args.pg_timeout))
        balance = [int(b) for b in args.balance.split(",")]
        if dist.get_world_size() != len(balance):
            raise ValueError(f"balance {balance} needs {len(balance)} ranks")
        for chunks in (int(c) for c in args.chunks.split(",")):
            record["failed_chunks"] = chunks  # until this configuration completes
            model = build_model(args.f_ms, sum(balance))
            x, y = make_batch(chunks, args.micro_batch, args.shape)
            if args.system == "asyncpipe":
                step = _asyncpipe_step(model, balance, chunks, x, y, args.pg_timeout)
            else:
                step = _torch_step(args.system, model, balance, chunks, x, y)
            run_record: dict[str, Any] = {"chunks": chunks, "seconds": [], "busy": []}
            for i in range(args.warmup + args.steps):
                model.zero_grad(set_to_none=True)
                dist.barrier()
                BUSY.reset()
                t0 = time.perf_counter()
                extra = step()
                seconds = time.perf_counter() - t0
                if i >= args.warmup:
                    run_record["seconds"].append(seconds)
                    run_record["busy"].append(BUSY.seconds)
                    for key, value in extra.items():
                        if key == "events":
                            run_record["last_events"] = value
                        else:
                            run_record.setdefault(key, []).append(value)
            record["runs"].append(run_record)
            record["failed_chunks"] = None
            write_record(out, record)
            del step, model
            gc.collect()
        dist.barrier()
    except Exception as exc:  # reported to the launcher through the record and the log
        traceback.print_exc()
        record["error"] = f"{type(exc).__name__}: {exc}".strip()[:1000]
        write_record(out, record)
        return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--system", choices=SYSTEMS, required=True)
    parser.add_argument("--chunks", default="4,8,16")
    parser.add_argument("--f-ms", type=float, default=5.0)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--shape", choices=("small", "large"), default="small")
    parser.add_argument("--balance", default="2,2,2,2")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--pg-timeout", type=float, default=60.0)
    parser.add_argument("--out", required=True)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
