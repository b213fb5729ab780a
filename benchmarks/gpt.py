"""GPT benchmark: training tokens per second of the example GPT with asyncpipe, with
torch.distributed.pipelining and in one process, on the same model, split and data.

Run ``python -m benchmarks.gpt`` (or as part of ``python -m benchmarks.suite``). Every system builds
the model of ``examples/gpt.py`` from the same seed, trains it with AdamW on the same batches of
``examples/data/stdlib_docs.txt`` and reports the median step time, tokens per second and the
loss of every step (the same model and data give the same losses, up to rounding). The pipelines
use ``--stages`` processes, the same compute-balanced split and the same schedule, no activation
checkpointing; one process uses every core (``torch.set_num_threads``) or the one GPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .gpu import SHARED_GPU_PEERS, Placement, placement, synchronize
from .launch import REPO_ROOT, launch_workers
from .options import count, seconds, steps
from .worker import write_record
from .workload import stage_module

__all__ = ["SYSTEMS", "main", "parse_args", "run_systems"]

SYSTEMS = {
    "asyncpipe": "asyncpipe",
    "torch": "torch.distributed.pipelining",
    "single": "one process",
}
"""What the benchmark compares, and how each shows in the table."""

SIZES = {
    "full": {"dim": 128, "depth": 8, "heads": 4, "seq_len": 64, "batch": 32, "steps": 8},
    "quick": {"dim": 64, "depth": 4, "heads": 4, "seq_len": 32, "batch": 16, "steps": 3},
}
"""Model and run sizes: ``full`` fits two CPU cores in about a minute per system."""


def _examples() -> tuple[Any, Any]:
    """``examples/gpt.py`` and ``examples/train_lm.py`` (the examples are not a package)."""
    sys.path.insert(0, str(REPO_ROOT / "examples"))
    import gpt as model_module  # type: ignore[import-not-found]
    import train_lm  # type: ignore[import-not-found]

    return model_module, train_lm


# ----- worker side -----------------------------------------------------------------------------


def _pipeline_step(
    system: str,
    model: nn.Sequential,
    balance: list[int],
    args: argparse.Namespace,
    where: Placement,
    loss_fn: Any,
) -> tuple[Any, list[nn.Parameter]]:
    """A step function ``(inputs, targets) -> loss or None`` and this rank's parameters."""
    rank = dist.get_rank()
    if system == "asyncpipe":
        import asyncpipe

        pipe = asyncpipe.AsyncPipe(
            model,
            balance,
            chunks=args.chunks,
            checkpoint="never",
            schedule=args.schedule,
            device=where.device,
        )

        def asyncpipe_step(inputs: torch.Tensor, targets: torch.Tensor) -> float | None:
            return pipe.step(inputs, targets, loss_fn)

        return asyncpipe_step, list(pipe.parameters())
    if where.staged:
        raise RuntimeError(SHARED_GPU_PEERS)
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    world = len(balance)
    module = stage_module(model, balance, rank)
    stage = PipelineStage(module, rank, world, where.device)
    cls = Schedule1F1B if args.schedule == "1f1b" else ScheduleGPipe
    schedule = cls(stage, n_microbatches=args.chunks, loss_fn=loss_fn)

    def torch_step(inputs: torch.Tensor, targets: torch.Tensor) -> float | None:
        if rank == 0:
            schedule.step(inputs)
            return None
        if rank == world - 1:
            losses: list[torch.Tensor] = []
            schedule.step(target=targets, losses=losses)
            return float(torch.stack(losses).mean())
        schedule.step()
        return None

    return torch_step, list(module.parameters())


def worker(args: argparse.Namespace) -> int:
    world = int(os.environ["WORLD_SIZE"])
    where = placement(args.device, world)
    torch.set_num_threads(args.threads)
    if where.cuda:
        torch.cuda.set_device(where.device)
    gpt_model, train_lm = _examples()
    corpus = train_lm.Corpus.load(train_lm.DATA)
    torch.manual_seed(args.seed)
    model = gpt_model.build_model(
        len(corpus.chars), args.dim, args.depth, args.heads, args.seq_len
    ).to(where.device)
    balance = _balance(gpt_model, model, args)
    record: dict[str, Any] = {"system": args.system, "losses": [], "seconds": []}
    if args.system == "single":
        step = _single_step(model, gpt_model.lm_loss)
        params = list(model.parameters())
    else:
        import asyncpipe

        asyncpipe.init(backend=where.backend, timeout=120)
        step, params = _pipeline_step(args.system, model, balance, args, where, gpt_model.lm_loss)
    record["placement"] = where.describe(world)
    optimizer = torch.optim.AdamW(params, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    generator = torch.Generator().manual_seed(args.seed + 1)
    for i in range(args.warmup + args.steps):
        inputs, targets = corpus.batch(corpus.train, args.batch, args.seq_len, generator)
        inputs, targets = inputs.to(where.device), targets.to(where.device)
        synchronize(where)
        if dist.is_initialized():
            dist.barrier()
        start = time.perf_counter()
        optimizer.zero_grad()
        loss = step(inputs, targets)
        optimizer.step()
        synchronize(where)
        seconds = time.perf_counter() - start
        record["losses"].append(loss)
        if i >= args.warmup:
            record["seconds"].append(seconds)
    record["balance"] = balance
    record["parameters"] = sum(p.numel() for p in model.parameters())
    rank = dist.get_rank() if dist.is_initialized() else 0
    write_record(Path(args.out) / f"rank{rank}.json", record)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0


def _balance(gpt_model: Any, model: nn.Sequential, args: argparse.Namespace) -> list[int]:
    from asyncpipe.balance import blocks

    costs: list[float] = gpt_model.layer_costs(model, args.seq_len)
    result: list[int] = blocks(costs, args.stages)
    return result


def _single_step(model: nn.Sequential, loss_fn: Any) -> Any:
    def step(inputs: torch.Tensor, targets: torch.Tensor) -> float:
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        return float(loss)

    return step


# ----- driver side -----------------------------------------------------------------------------


def run_system(args: argparse.Namespace, system: str) -> dict[str, Any]:
    """One system's result: step seconds, tokens per second and losses, or its error."""
    world = 1 if system == "single" else args.stages
    threads = max(1, (os.cpu_count() or 1) // world)
    argv = [*args.argv, "--system", system, "--threads", str(threads)]
    tokens = args.batch * args.seq_len
    if system == "torch" and placement(args.device, world, rank=0).staged:
        return {"system": system, "error": SHARED_GPU_PEERS, "tokens": tokens}
    try:
        records = launch_workers("benchmarks.gpt", argv, world, world, timeout_s=args.timeout)
    except RuntimeError as exc:
        return {"system": system, "error": str(exc), "tokens": tokens}
    seconds = records[0]["seconds"]
    step_s = statistics.median(seconds)
    losses = [next((r["losses"][i] for r in records if r["losses"][i] is not None), None)
              for i in range(len(records[0]["losses"]))]  # fmt: skip
    return {
        "system": system,
        "processes": world,
        "threads": threads,
        "step_s": step_s,
        "tokens_per_s": tokens / step_s,
        "tokens": tokens,
        "losses": losses,
        "balance": records[0]["balance"],
        "parameters": records[0]["parameters"],
        "placement": records[0]["placement"],
    }


def run_systems(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every system of ``args.systems``, in order."""
    out = []
    for system in args.systems:
        print(f"gpt: {SYSTEMS[system]} ...", file=sys.stderr)
        out.append(run_system(args, system))
    return out


def table(results: list[dict[str, Any]]) -> str:
    """A markdown table of :func:`run_systems`' results."""
    base = next((r for r in results if r["system"] == "single" and "step_s" in r), None)
    lines = [
        "| system | processes x threads | step ms | tokens/s | vs one process | last loss |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in results:
        if "error" in r:
            why = r["error"] if r["error"].startswith("not run") else f"did not run: {r['error']}"
            lines.append(f"| {SYSTEMS[r['system']]} | {why} | | | | |")
            continue
        versus = "-" if base is None else f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x"
        last = r["losses"][-1]
        lines.append(
            f"| {SYSTEMS[r['system']]} | {r['processes']} x {r['threads']} | "
            f"{r['step_s'] * 1e3:.1f} | {r['tokens_per_s']:,.0f} | {versus} | "
            + ("-" if last is None else f"{last:.4f}")
            + " |"
        )
    return "\n".join(lines)


def describe(args: argparse.Namespace, results: list[dict[str, Any]]) -> str:
    """One sentence: the model, the split and the run."""
    done = next((r for r in results if "parameters" in r), {})
    return (
        f"GPT of `examples/gpt.py`: dim {args.dim}, depth {args.depth}, {args.heads} heads, "
        f"sequence {args.seq_len}, batch {args.batch} ({args.batch * args.seq_len} tokens per "
        f"step), {done.get('parameters', '?'):,} parameters; pipelines: {args.stages} stages, "
        f"balance {done.get('balance', '?')}, {args.chunks} micro-batches, {args.schedule}, "
        f'checkpoint="never"; AdamW; {args.warmup} warm-up + {args.steps} timed steps.'
    )


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpt", description=__doc__)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    parser.add_argument("--system", choices=tuple(SYSTEMS), help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="a small model, 3 steps")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="subset to run")
    parser.add_argument("--stages", type=count, default=4, help="pipeline processes")
    parser.add_argument("--chunks", type=count, default=8, help="micro-batches per step")
    parser.add_argument("--schedule", choices=("gpipe", "1f1b"), default="1f1b")
    parser.add_argument("--device", choices=("cpu", "cuda", "auto"), default="auto")
    parser.add_argument("--warmup", type=steps, default=2, help="untimed steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=seconds, default=600.0, help="per system, seconds")
    for name in ("dim", "depth", "heads", "seq_len", "batch", "steps"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=count, default=None)
    args = parser.parse_args(argv)
    size = SIZES["quick" if args.quick else "full"]
    for name, value in size.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.systems = [s for s in args.systems.split(",") if s]
    unknown = [s for s in args.systems if s not in SYSTEMS]
    if unknown:
        parser.error(f"unknown systems {unknown}; choose from {', '.join(SYSTEMS)}")
    # What every worker is started with: the resolved sizes, not --quick.
    args.argv = [
        "--stages", str(args.stages), "--chunks", str(args.chunks),
        "--schedule", args.schedule, "--device", args.device, "--warmup", str(args.warmup),
        "--seed", str(args.seed), "--dim", str(args.dim), "--depth", str(args.depth),
        "--heads", str(args.heads), "--seq-len", str(args.seq_len),
        "--batch", str(args.batch), "--steps", str(args.steps),
    ]  # fmt: skip
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.worker:
        return worker(args)
    results = run_systems(args)
    print(describe(args, results))
    print(table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
