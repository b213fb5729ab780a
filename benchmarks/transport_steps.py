"""The step-time part of the transport benchmark: asyncpipe's schedules over each transport and
fairscale's ``AsyncPipe`` on the reference workload, in rounds, and the table's rows."""

from __future__ import annotations

import argparse
import functools
import statistics
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from .peers import fairscale_asyncpipe_step
from .worker import _loss, timed_steps
from .workload import build_model, make_batch

__all__ = ["FAIRSCALE", "merge_rounds", "step_rows", "step_times"]


def _asyncpipe_stepper(
    transport: str, f_ms: float, chunks: int, schedule: str
) -> Callable[[], object]:
    """One step of a fresh ``AsyncPipe`` on the reference workload (a callable)."""
    import asyncpipe

    world = dist.get_world_size()
    model = build_model(f_ms)
    pipe = asyncpipe.AsyncPipe(
        model,
        [len(model) // world] * world,
        chunks=chunks,
        checkpoint="never",
        schedule=schedule,
        transport=transport,
    )
    x, y = make_batch(chunks, 4, "small")
    first, last = pipe.is_first_stage, pipe.is_last_stage
    return lambda: pipe.step(x if first else None, y if last else None, _loss)


def _fairscale_stepper(f_ms: float, chunks: int) -> Callable[[], object]:
    """One step of a fresh fairscale ``AsyncPipe`` (over RPC) on the same workload."""
    world = dist.get_world_size()
    model = build_model(f_ms)
    x, y = make_batch(chunks, 4, "small")
    return fairscale_asyncpipe_step(model, [len(model) // world] * world, chunks, x, y)


FAIRSCALE = "fairscale AsyncPipe over rpc"


def step_times(args: argparse.Namespace, transports: tuple[str, ...]) -> dict[str, Any]:
    """One round of every system's step time on the reference workload: each builds a fresh
    pipeline and runs ``args.steps`` timed steps, fairscale last (its RPC pipeline leaves these
    processes slower for whatever runs after it: 370-390 ms GPipe steps over ``p2p`` became 425
    after two of its runs, over ``rpc`` 390 became 750). Per system: the times of its steps, or
    why fairscale could not run. The driver runs ``--rounds`` of these, each in new processes."""
    makers: dict[str, Callable[[], Callable[[], object]]] = {
        f"asyncpipe {schedule} over {transport}": functools.partial(
            _asyncpipe_stepper, transport, args.f_ms, args.chunks, schedule
        )
        for schedule in ("gpipe", "1f1b", "zero_bubble")
        for transport in transports
    }
    makers[FAIRSCALE] = functools.partial(_fairscale_stepper, args.f_ms, args.chunks)
    out: dict[str, Any] = {}
    for name, make in makers.items():
        try:
            step = make()
        except Exception as e:  # fairscale on a PyTorch it does not support
            if name != FAIRSCALE:
                raise
            out[name] = {"error": f"{type(e).__name__}: {e}"}
            continue
        out[name] = {"times_s": timed_steps(step, args.steps)}
    return out


def merge_rounds(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The step-time records of several rounds as one: per system, the median and best of all
    its steps and the median of each round (or the first round's error)."""
    out: dict[str, Any] = {}
    for name, first in rounds[0].items():
        if "error" in first:
            out[name] = first
            continue
        runs = [r[name]["times_s"] for r in rounds if "times_s" in r.get(name, {})]
        every = [t for run in runs for t in run]
        out[name] = {
            "median_s": statistics.median(every),
            "min_s": min(every),
            "round_medians_s": [statistics.median(run) for run in runs],
        }
    return out


def step_rows(steps: dict[str, dict[str, Any]], ideal: float) -> list[str]:
    """The step-time table's rows: each system's median and best step, its median over the
    nominal ideal, fairscale's median over its median, and the same ratio (and its inverse,
    the target's form) in each round, lowest to highest (both ran in the same round)."""
    peer = steps[FAIRSCALE]
    rows = []
    for name, entry in steps.items():
        if "error" in entry:
            rows.append(f"| {name} | did not run: {entry['error']} | | | | | |")
            continue
        versus = by_round = inverse = "n/a"
        if "median_s" in peer:
            versus = f"{peer['median_s'] / entry['median_s']:.2f}"
            pairs = zip(peer.get("round_medians_s", []), entry.get("round_medians_s", []))
            ratios = sorted(theirs / ours for theirs, ours in pairs)
            if ratios:
                by_round = f"{ratios[0]:.2f}-{ratios[-1]:.2f}"
                inverse = f"{1 / ratios[-1]:.2f}-{1 / ratios[0]:.2f}"
        rows.append(
            f"| {name} | {entry['median_s'] * 1e3:.1f} ms | {entry['min_s'] * 1e3:.1f} ms | "
            f"{entry['median_s'] / ideal:.2f}x | {versus} | {by_round} | {inverse} |"
        )
    return rows
