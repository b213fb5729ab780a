"""The schedule benchmark's report: tables, targets, terminal text, timelines and markdown."""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

from .calibration import LayerCosts
from .peers import FAIRSCALE
from .schedule_results import BREAKDOWN, MATCH, MEMORY_ENV, MemoryRow, Row, simulate_schedule
from .schedule_worker import ASYNCPIPE, OURS, OVER_SHM
from .sections import machine, provenance, revision
from .workload import SHAPES

__all__ = [
    "HEADER",
    "LABELS",
    "MEMORY_HEADER",
    "TARGET_SIMULATED",
    "calibration_text",
    "format_markdown",
    "format_ms",
    "format_ratio",
    "format_text",
    "markdown_section",
    "memory_cells",
    "table_cells",
    "target_lines",
    "text_report",
    "write_timelines",
]

TARGET_SIMULATED = 1.10
"""Target: every asyncpipe schedule at most 1.10x its simulated ideal."""

LABELS = {
    "asyncpipe-gpipe": "gpipe",
    "asyncpipe-1f1b": "1f1b",
    "asyncpipe-interleaved": "interleaved (V=2)",
    "asyncpipe-zero_bubble": "zero_bubble",
    "torch-gpipe": "ScheduleGPipe",
    "torch-1f1b": "Schedule1F1B",
    "torch-interleaved": "ScheduleInterleaved1F1B (2 stages/rank)",
    "torch-zero_bubble": "ScheduleInterleavedZeroBubble (1 stage/rank)",
    "torch-zbv": "ScheduleZBVZeroBubble (2 stages/rank, V)",
    **FAIRSCALE,
}
LABELS.update({f"{k}{OVER_SHM}": f"{LABELS[k]} over shm" for k in ASYNCPIPE})
"""How each system shows in the tables."""


def _suffix(system: str) -> str:
    """The transport suffix of an asyncpipe system (empty over the group's transport)."""
    return OVER_SHM if system.endswith(OVER_SHM) else ""


# ----- tables ------------------------------------------------------------------------------


def format_ms(seconds: float | None) -> str:
    """Seconds as a table cell in milliseconds, ``-`` for none."""
    return "-" if seconds is None else f"{seconds * 1000:.1f}"


def format_ratio(value: float | None) -> str:
    """A ratio as a table cell (``1.23x``), ``-`` for none."""
    return "-" if value is None else f"{value:.2f}x"


def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value / 2**20:.1f}"


def _ints(values: Sequence[int]) -> str:
    return "-" if not values else " / ".join(str(v) for v in values)


HEADER = [
    "chunks",
    "system",
    "schedule",
    "step ms",
    "simulated ms",
    "/simulated",
    "/asyncpipe gpipe",
    "asyncpipe / this",
    "idle (measured)",
    "idle (simulated)",
    "peak activations per rank (measured; simulated)",
]


def table_cells(rows: list[Row]) -> list[list[str]]:
    """The timing table as strings, in :data:`HEADER` order."""
    step = {(r.system, r.chunks): r.step_s for r in rows}
    cells = []
    for row in rows:
        base = step.get((f"asyncpipe-gpipe{_suffix(row.system)}", row.chunks))
        ours = step.get((MATCH.get(row.system, ""), row.chunks))
        vs_gpipe = None if base is None or row.step_s is None else row.step_s / base
        versus = None if ours is None or row.step_s is None else ours / row.step_s
        peak = ""
        if row.peak_activations or row.simulated_peak:
            peak = f"{_ints(row.peak_activations)}; {_ints(row.simulated_peak)}"
        cells.append(
            [
                str(row.chunks),
                "asyncpipe" if row.system in OURS else "torch",
                LABELS[row.system],
                format_ms(row.step_s) if row.error is None else f"FAILED: {row.error}",
                format_ms(row.simulated_s),
                format_ratio(row.vs_simulated),
                format_ratio(vs_gpipe),
                format_ratio(versus),
                "-" if not row.idle else f"{statistics.fmean(row.idle):.2f}",
                "-" if row.simulated_bubble is None else f"{row.simulated_bubble:.2f}",
                peak or "-",
            ]
        )
    return cells


MEMORY_HEADER = [
    "schedule",
    "rank",
    "peak activations (measured; simulated)",
    "RSS growth in step MiB",
    "RSS at step start MiB",
    "ru_maxrss MiB",
    "ru_maxrss - RSS at step start MiB",
    "step ms",
]


def memory_cells(rows: list[MemoryRow]) -> list[list[str]]:
    cells = []
    for row in rows:
        if row.error is not None:
            cells.append([LABELS[row.system], str(row.rank), f"FAILED: {row.error}"])
            cells[-1] += ["-"] * (len(MEMORY_HEADER) - 3)
            continue
        growth = None
        if row.max_rss is not None and row.rss_start is not None:
            growth = row.max_rss - row.rss_start
        cells.append(
            [
                LABELS[row.system],
                str(row.rank),
                f"{row.peak_activations}; {row.simulated_peak}",
                _mib(row.rss_growth),
                _mib(row.rss_start),
                _mib(row.max_rss),
                _mib(growth),
                format_ms(row.step_s),
            ]
        )
    return cells


def format_markdown(header: list[str], cells: list[list[str]]) -> str:
    """A markdown table (``|`` and newlines in cells escaped)."""

    def esc(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(esc(c) for c in line) + " |" for line in cells])


def format_text(header: list[str], cells: list[list[str]]) -> str:
    """A fixed-width table; a long failure in ``cells`` is replaced by a number and listed
    below the table (with the cells' third and first columns)."""
    notes: list[str] = []
    for line in cells:
        for i, cell in enumerate(line):
            if cell.startswith("FAILED") and len(cell) > 30:
                notes.append(f"[{len(notes) + 1}] {line[2]} chunks {line[0]}: {cell}")
                line[i] = f"FAILED [{len(notes)}]"
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)) for line in cells]
    return "\n".join(lines + notes)


def target_lines(rows: list[Row], chunks: int = 8) -> list[str]:
    """The three targets, each with its verdict and the numbers behind it: over the group's
    transport (p2p), and again over shm where the run has shm rows."""
    lines = []
    suffixes = [""] + [OVER_SHM] * any(r.system.endswith(OVER_SHM) for r in rows)
    step = {(r.system, r.chunks): r.step_s for r in rows}
    for suffix in suffixes:
        over_what = " over shm" if suffix else ""
        ours = [r for r in rows if r.system in OURS and _suffix(r.system) == suffix]
        over = [r for r in ours if r.vs_simulated is None or r.vs_simulated > TARGET_SIMULATED]
        worst = max((r.vs_simulated for r in ours if r.vs_simulated is not None), default=None)
        verdict = "met" if ours and not over else "NOT met"
        detail = ", ".join(
            f"{LABELS[r.system]} chunks {r.chunks}: {format_ratio(r.vs_simulated)}" for r in over
        )
        lines.append(
            f"Target (every asyncpipe schedule{over_what} <= {TARGET_SIMULATED:.2f}x its "
            f"simulated ideal): {verdict} (worst {format_ratio(worst)}"
            + (f"; over: {detail})" if detail else ")")
        )
        base = step.get((f"asyncpipe-1f1b{suffix}", chunks))
        parts = []
        met = base is not None
        for system in (f"asyncpipe-interleaved{suffix}", f"asyncpipe-zero_bubble{suffix}"):
            mine = step.get((system, chunks))
            if mine is None or base is None:
                parts.append(f"{LABELS[system]}: no result")
                met = False
                continue
            parts.append(f"{LABELS[system]} {mine / base:.2f}x of 1f1b{over_what}")
            met = met and mine < base
        lines.append(
            f"Target (interleaved and zero_bubble faster than 1f1b at chunks {chunks}"
            f"{over_what}): {'met' if met else 'NOT met'} ({', '.join(parts)})"
        )
        parts, met = [], True
        for peer, plain in MATCH.items():
            system = f"{plain}{suffix}"
            for c in sorted({r.chunks for r in rows}):
                theirs, mine = step.get((peer, c)), step.get((system, c))
                if theirs is None or mine is None:
                    if (peer, c) in step and (system, c) in step:
                        parts.append(f"{LABELS[system]} chunks {c}: no comparison")
                        met = False
                    continue
                if mine > theirs:
                    met = False
                    parts.append(f"{LABELS[system]} chunks {c}: {mine / theirs:.2f}x")
        lines.append(
            f"Target (asyncpipe{over_what} no slower than torch.distributed.pipelining's same "
            "schedule): "
            + ("met" if met else "NOT met")
            + (f" (slower: {', '.join(parts)})" if parts else "")
        )
    return lines


# ----- the terminal -----------------------------------------------------------------------


def text_report(
    args: argparse.Namespace,
    calibrations: list[LayerCosts],
    costs: LayerCosts,
    rows: list[Row],
    memory: list[MemoryRow],
    notes: list[str],
) -> str:
    """What the command prints after the runs: a blank line, the machine, the workload and its
    calibration, the timing table, the notes and the memory table."""
    lines = [
        "",
        f"{machine()}; asyncpipe at commit {revision()}",
        f"F = {args.f_ms:g} ms, micro-batch {args.micro_batch}, shape {args.shape}, "
        f"{args.ranks} ranks, {args.layers} layers, {args.warmup} warm-up + {args.steps} timed "
        f"steps, {args.rounds} round(s); per layer: forward {costs.forward_s * 1000:.2f} ms, "
        f"backward {costs.backward_s * 1000:.2f} ms, B {costs.input_s * 1000:.2f} ms, "
        f"W {costs.weight_s * 1000:.2f} ms ({calibration_text(calibrations)})",
    ]
    if rows:
        lines.append(format_text(HEADER, table_cells(rows)))
    lines += notes
    if memory:
        lines.append(f"\nmemory: shape {args.memory_shape}, chunks {args.memory_chunks}")
        lines.append(format_text(MEMORY_HEADER, memory_cells(memory)))
    return "\n".join(lines)


# ----- timelines ---------------------------------------------------------------------------


def write_timelines(
    directory: Path, ranks: int, chunks: int, layers: int, virtual: int, costs: LayerCosts
) -> list[Path]:
    """SVG timelines of the simulated 1f1b, zero_bubble and interleaved plans (times in ms)."""
    try:
        from asyncpipe.schedule.show import timeline_svg
    except ImportError as exc:
        print(f"no timelines: {exc}", file=sys.stderr)
        return []
    ms = LayerCosts(
        costs.forward_s * 1000,
        costs.backward_s * 1000,
        costs.input_s * 1000,
        costs.weight_s * 1000,
        costs.repeats,
    )
    written = []
    directory.mkdir(parents=True, exist_ok=True)
    for system in ("asyncpipe-1f1b", "asyncpipe-zero_bubble", "asyncpipe-interleaved"):
        sim = simulate_schedule(system, ranks, chunks, layers, virtual, ms)
        title = (
            f"{LABELS[system]}: {ranks} ranks, {chunks} micro-batches, simulated with the "
            f"calibrated costs (ms)"
        )
        path = directory / f"schedule_benchmarks_{ASYNCPIPE[system]}_{ranks}x{chunks}.svg"
        path.write_text(timeline_svg(sim, title))
        written.append(path)
    return written


# ----- markdown ----------------------------------------------------------------------------


def calibration_text(calibrations: list[LayerCosts]) -> str:
    """How the per-layer costs were calibrated: one calibration, or the mean of two."""
    if len(calibrations) == 1:
        return f"median of {calibrations[0].repeats}"
    parts = [
        f"{c.forward_s * 1000:.2f} / {c.backward_s * 1000:.2f} / {c.input_s * 1000:.2f} / "
        f"{c.weight_s * 1000:.2f} ms"
        for c in calibrations
    ]
    return (
        f"mean of a calibration before the runs ({parts[0]}) and one after ({parts[1]}), each "
        f"the median of {calibrations[0].repeats}"
    )


def markdown_section(
    args: argparse.Namespace,
    argv: list[str],
    calibrations: list[LayerCosts],
    costs: LayerCosts,
    rows: list[Row],
    memory: list[MemoryRow],
    notes: list[str],
    timelines: list[Path],
    markdown_path: Path,
    seconds: float | None = None,
) -> str:
    """The body of the generated section (:func:`benchmarks.sections.write_section` puts it
    between the markers)."""
    f = args.f_ms
    per = args.layers // args.ranks
    body = [
        f"### Results: F = {f:g} ms, micro-batch {args.micro_batch}, shape {args.shape}",
        "",
        *(f"- {line}" for line in provenance("benchmarks.schedules", argv, seconds)),
        f"- {args.ranks} processes, gloo on loopback, {args.layers} layers ({per} per rank; "
        f"interleaved and the 2-stages-per-rank peers: 1 per model chunk), "
        f'checkpoint="never", {args.warmup} warm-up + {args.steps} timed steps per entry, '
        f"{args.rounds} interleaved round(s) in one process group",
        f"- Calibrated per layer and micro-batch ({calibration_text(calibrations)}): forward "
        f"{costs.forward_s * 1000:.2f} ms, backward {costs.backward_s * 1000:.2f} ms, "
        f"B (input gradient) {costs.input_s * 1000:.2f} ms, W (weight gradient) "
        f"{costs.weight_s * 1000:.2f} ms (nominal {f:g} / {2 * f:g} / {f:g} / {f:g} ms)",
        "",
        format_markdown(HEADER, table_cells(rows)),
        "",
        *(f"- {line}" for line in notes),
    ]
    breakdown = _breakdown_markdown(rows)
    if breakdown:
        body += ["", "asyncpipe's time per rank, mean ms per timed step:", "", breakdown]
    if memory:
        body += [
            "",
            f"#### Memory: shape {args.memory_shape}, chunks {args.memory_chunks}",
            "",
            f"Each schedule in its own process group; activations "
            f"({args.micro_batch}, {', '.join(map(str, SHAPES[args.memory_shape]))}) float32 = "
            f"{args.micro_batch * _numel(SHAPES[args.memory_shape]) * 4 / 2**20:g} MiB per "
            f"micro-batch and tensor; workers run with "
            f"`MALLOC_MMAP_THRESHOLD_={MEMORY_ENV['MALLOC_MMAP_THRESHOLD_']}`.",
            "",
            format_markdown(MEMORY_HEADER, memory_cells(memory)),
        ]
    if timelines:
        body += ["", "Simulated timelines (calibrated costs, times in ms):", ""]
        for path in timelines:
            try:
                rel = path.resolve().relative_to(markdown_path.resolve().parent)
            except ValueError:
                rel = path
            body += [f"![{path.stem}]({rel.as_posix()})", ""]
    return "\n".join(body)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _breakdown_markdown(rows: list[Row]) -> str:
    names = ["compute", "of which layers", "send", "recv (incl. wait)", "before 1st action"]
    names += ["between actions", "after last action", "hop (median)"]
    header = ["chunks", "schedule", "rank", "step ms", *names]
    cells = []
    for row in rows:
        for rank, parts in enumerate(row.breakdown):
            values = [parts[key] for key in BREAKDOWN]
            values.insert(1, parts["layers_s"])
            cells.append(
                [str(row.chunks), LABELS[row.system], str(rank)]
                + [format_ms(sum(parts[key] for key in BREAKDOWN))]
                + [f"{v * 1000:.1f}" for v in values]
                + [format_ms(row.hop_s) if rank == 0 else ""]
            )
    return format_markdown(header, cells) if cells else ""
