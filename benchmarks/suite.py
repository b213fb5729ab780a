"""``python -m benchmarks.suite``: every schedule and transport against the peers, memory,
bandwidth and the GPT model in one run, written into the benchmark suite page."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from . import gpt
from . import suite_runs as runs
from .calibration import calibrate_layer
from .gpu import SHARED_GPU_NOTE, placement
from .launch import REPO_ROOT
from .options import count, count_list, milliseconds, steps
from .peers import fairscale_version
from .schedule_report import MEMORY_HEADER, memory_cells
from .schedule_results import MemoryRow
from .sections import load, provenance, write_section
from .suite_report import (
    REFERENCE_HEADER,
    SUMMARY_HEADER,
    markdown_table,
    plot,
    reference_cells,
    summary_cells,
    text_table,
)
from .transports import bandwidth_table

__all__: list[str] = []

DOC = REPO_ROOT / "docs" / "benchmark_suite.md"


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.suite",
        description="Run the benchmark suite: every asyncpipe schedule over p2p and rpc against "
        "torch.distributed.pipelining and fairscale on the reference workload, PipeDream-2BW "
        "against 1F1B, peak memory, activation bandwidth and the GPT model; print the tables "
        "and, with --markdown, write them (and a bar chart) into that page.",
    )
    parser.add_argument("--quick", action="store_true", help="4 stages, chunks 8, few steps")
    parser.add_argument(
        "--only",
        default=",".join(runs.PARTS),
        help=f"parts to run (default {','.join(runs.PARTS)})",
    )
    parser.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="auto (default): CUDA where available",
    )
    parser.add_argument("--stages", default=None, help="pipeline ranks (default 2,4)")
    parser.add_argument("--chunks", default=None, help="micro-batches (default 4,8,16)")
    parser.add_argument(
        "--f-ms", type=milliseconds, default=5.0, help="forward sleep per layer, ms (5)"
    )
    parser.add_argument("--micro-batch", type=count, default=4, help="rows per micro-batch (4)")
    parser.add_argument("--steps", type=count, default=None, help="timed steps (default 6)")
    parser.add_argument("--warmup", type=steps, default=None, help="untimed steps (default 2)")
    parser.add_argument("--messages", type=count, default=None, help="bandwidth messages (300)")
    parser.add_argument(
        "--markdown",
        type=Path,
        default=None,
        help=f"page whose section of this device to write (e.g. {DOC.relative_to(REPO_ROOT)}); "
        "without it the run only prints",
    )
    parser.add_argument(
        "--plot",
        type=Path,
        default=None,
        help="bar chart (default: _static/benchmark_suite_<device>.png beside the page)",
    )
    parser.add_argument("--json", type=Path, default=None, help="write every number here")
    parser.add_argument("--keep-logs", type=Path, default=None, help="keep worker files here")
    args = parser.parse_args(argv)
    args.parts = [p for p in args.only.split(",") if p]
    unknown = [p for p in args.parts if p not in runs.PARTS]
    if unknown:
        parser.error(f"unknown parts {unknown}; choose from {', '.join(runs.PARTS)}")
    args.device = "cuda" if args.device == "auto" and torch.cuda.is_available() else args.device
    args.device = "cpu" if args.device == "auto" else args.device
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch.cuda.is_available() is False on this machine")
    quick = args.quick
    args.stage_list = count_list(parser, "--stages", args.stages or ("4" if quick else "2,4"))
    args.chunk_list = count_list(parser, "--chunks", args.chunks or ("8" if quick else "4,8,16"))
    args.steps = args.steps or (3 if quick else 6)
    args.warmup = args.warmup if args.warmup is not None else (1 if quick else 2)
    args.messages = args.messages or (60 if quick else 300)
    args.layers = 8
    if any(8 % (2 * s) for s in args.stage_list):
        parser.error(
            f"--stages: each must divide 4 (8 layers, interleaved with 2 per rank; got "
            f"{args.stages!r}); pass some of 1,2,4"
        )
    if args.markdown is not None:
        default_plot = args.markdown.parent / "_static" / f"benchmark_suite_{args.device}.png"
        args.plot = args.plot or default_plot
    return args


@dataclass
class Results:
    """Everything one run of the suite measured."""

    meta: list[str] = field(default_factory=list)
    rows: list[runs.SuiteRow] = field(default_factory=list)
    twobw: list[dict[str, Any]] = field(default_factory=list)
    memory: list[MemoryRow] = field(default_factory=list)
    bandwidth: dict[str, Any] = field(default_factory=dict)
    gpt: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def key(device: str) -> str:
    """The key of a device's generated section of the suite's page."""
    return f"suite device={device}"


def _relative(path: Path, page: Path) -> str:
    try:
        return path.resolve().relative_to(page.resolve().parent).as_posix()
    except ValueError:
        return path.as_posix()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    started = time.monotonic()
    where = placement(args.device, max(args.stage_list), rank=0)
    device_line = where.describe(max(args.stage_list))
    print(f"device: {device_line}", file=sys.stderr)
    costs = calibrate_layer(args.f_ms, args.micro_batch, "small")
    load_before = load()
    out = Results(notes=[f"fairscale: {fairscale_version()}"])
    if where.staged:
        out.notes.append(SHARED_GPU_NOTE)
    with tempfile.TemporaryDirectory(prefix="asyncpipe-suite-") as tmp:
        work = args.keep_logs or Path(tmp)
        if "reference" in args.parts:
            out.rows = runs.run_reference(args, costs, work, where.staged)
        if "2bw" in args.parts:
            out.twobw = runs.run_twobw(args)
        if "memory" in args.parts:
            out.memory = runs.run_memory(args, costs, work)
        if "bandwidth" in args.parts:
            try:
                out.bandwidth = runs.run_bandwidth(args)
            except RuntimeError as exc:
                out.notes.append(f"bandwidth: {exc}")
        if "gpt" in args.parts:
            out.gpt = gpt.run_systems(runs.gpt_options(args))
    out.notes.append(
        f"Load average before the runs: {load_before}; after: {load()} (other work on the "
        f"machine inflates the step times)"
    )
    seconds = time.monotonic() - started
    lines = provenance("benchmarks.suite", argv, seconds)
    out.meta = [
        *lines[:2],
        f"Device: {device_line}",
        *lines[2:],
        f"Reference workload: 8 layers, F = {args.f_ms:g} ms, micro-batch {args.micro_batch}, "
        f"activations ({args.micro_batch}, 1024), {args.warmup} warm-up + {args.steps} timed "
        f'steps per entry, checkpoint="never"; calibrated per layer: forward '
        f"{costs.forward_s * 1e3:.2f} ms, backward {costs.backward_s * 1e3:.2f} ms, B "
        f"{costs.input_s * 1e3:.2f} ms, W {costs.weight_s * 1e3:.2f} ms",
    ]
    _print(out)
    if args.json is not None:
        payload = {
            **asdict(out),
            "rows": [dict(asdict(r), vs_simulated=r.vs_simulated) for r in out.rows],
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
    if args.markdown is not None:
        picture = None
        if out.rows:
            picture = plot(out.rows, args.plot, f"asyncpipe and peers: {device_line}")
        section = _section(args, out, picture)
        write_section(args.markdown, key(args.device), section, "Benchmark suite")
        if picture:
            print(f"wrote {picture}")
    return 0


def _print(out: Results) -> None:
    print("\n".join(out.meta))
    if out.rows:
        print(text_table(REFERENCE_HEADER, reference_cells(out.rows)))
        print("\nEach peer against asyncpipe's same kind of schedule:")
        print(text_table(SUMMARY_HEADER, summary_cells(out.rows)))
    if out.twobw:
        print("\nPipeDream-2BW against 1F1B, steady state (no barrier between steps):")
        print(runs.twobw_table(out.twobw))
    if out.memory:
        print("\nMemory, shape (4, 256, 1024), chunks 8, largest stage count:")
        print(text_table(MEMORY_HEADER, memory_cells(out.memory)))
    if out.bandwidth:
        print(f"\nActivation bandwidth, 2 processes, {out.bandwidth['tensors']} tensors:")
        print(bandwidth_table(out.bandwidth["bandwidth"], out.bandwidth["micro_batch"]))
    if out.gpt:
        print("\n" + gpt.table(out.gpt))
    print("\n".join(out.notes))


def _section(args: argparse.Namespace, out: Results, picture: Path | None) -> str:
    title = "GPU" if args.device == "cuda" else "CPU"
    body = [f"## Results on the {title}", "", *(f"- {line}" for line in out.meta), ""]

    def part(heading: str, *blocks: str) -> None:
        body.extend([f"### {heading}", ""])
        for block in blocks:
            body.extend([block, ""])

    if out.rows:
        charts = []
        if picture is not None:
            charts.append(f"![step time / simulated ideal]({_relative(picture, args.markdown)})")
        part(
            "Reference workload: every schedule, transport and peer",
            markdown_table(REFERENCE_HEADER, reference_cells(out.rows)),
            *charts,
        )
        part("Each peer against asyncpipe", markdown_table(SUMMARY_HEADER, summary_cells(out.rows)))
    if out.twobw:
        part(
            "PipeDream-2BW against 1F1B: steady state, no barrier between steps",
            runs.twobw_table(out.twobw),
        )
    if out.memory:
        part(
            f"Memory: activations (4, 256, 1024), chunks 8, {max(args.stage_list)} stages",
            markdown_table(MEMORY_HEADER, memory_cells(out.memory)),
        )
    if out.bandwidth:
        part(
            f"Activation bandwidth: 2 processes, {out.bandwidth['tensors']} tensors",
            bandwidth_table(out.bandwidth["bandwidth"], out.bandwidth["micro_batch"]),
        )
    if out.gpt:
        part(
            "GPT model: training tokens per second",
            gpt.describe(runs.gpt_options(args), out.gpt),
            gpt.table(out.gpt),
        )
    body += [f"- {line}" for line in out.notes]
    return "\n".join(body)


if __name__ == "__main__":
    raise SystemExit(main())
