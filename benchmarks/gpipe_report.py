"""The GPipe benchmark's results: one row per (system, chunks), and their tables and section."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from .calibration import StageCosts
from .sections import provenance

__all__ = [
    "BREAKDOWN",
    "HEADER",
    "TARGET_RATIO",
    "Row",
    "format_breakdown",
    "format_markdown_table",
    "format_text",
    "markdown_section",
    "table_cells",
    "target_line",
]

TARGET_RATIO = 1.10
"""asyncpipe's target: step time <= 1.10x the nominal ideal at F = 5 ms, chunks 8, small."""


BREAKDOWN = {
    "compute_s": "compute",
    "send_s": "send",
    "recv_s": "recv (incl. wait)",
    "head_s": "before 1st action",
    "gap_s": "between actions",
    "tail_s": "after last action",
}
"""asyncpipe's per-step time split (worker keys -> column names), from ``last_step.events``."""


@dataclass
class Row:
    """One (system, chunks) result, aggregated over ranks and timed steps."""

    system: str
    chunks: int
    nominal_s: float
    calibrated_s: float
    step_s: float | None = None
    """Median over timed steps of the slowest rank's step time (all ranks start together)."""
    step_min_s: float | None = None
    step_max_s: float | None = None
    idle: list[float] = field(default_factory=list)
    """Per stage: mean over timed steps of 1 - (time inside the layers) / (the step's time)."""
    lib_idle: list[float] = field(default_factory=list)
    """Per stage, asyncpipe only: mean of ``pipe.last_step.idle_fraction``."""
    lib_step_s: float | None = None
    """asyncpipe only: median over steps of the slowest rank's ``pipe.last_step.seconds``."""
    breakdown: list[dict[str, float]] = field(default_factory=list)
    """Per stage, asyncpipe only: mean seconds per step of each part in :data:`BREAKDOWN`."""
    error: str | None = None
    rounds_s: list[float | None] = field(default_factory=list)
    """The step time of every round (``--rounds``); the row's other numbers are the median's."""

    @property
    def vs_nominal(self) -> float | None:
        return None if self.step_s is None else self.step_s / self.nominal_s

    @property
    def vs_calibrated(self) -> float | None:
        return None if self.step_s is None else self.step_s / self.calibrated_s


def format_breakdown(rows: list[Row], markdown: bool = False) -> str:
    """asyncpipe's per-stage time split, mean ms per step, one line per (chunks, stage)."""
    header = ["chunks", "stage", "step ms", *BREAKDOWN.values()]
    cells = []
    for row in rows:
        if row.system != "asyncpipe" or not row.breakdown:
            continue
        for stage, parts in enumerate(row.breakdown):
            values = [parts[key] * 1000 for key in BREAKDOWN]
            cells.append([str(row.chunks), str(stage), _fmt_ms(sum(parts.values()))])
            cells[-1] += [f"{v:.1f}" for v in values]
    if not cells:
        return ""
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        return "\n".join(lines + ["| " + " | ".join(c) + " |" for c in cells])
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(header)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(line, widths, strict=True)) for line in cells]
    return "\n".join(lines)


def _fmt_ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f}"


def _fmt_ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _fmt_fracs(values: list[float]) -> str:
    return "-" if not values else " / ".join(f"{v:.2f}" for v in values)


HEADER = [
    "chunks",
    "system",
    "step ms",
    "nominal ms",
    "calibrated ms",
    "/nominal",
    "/calibrated",
    "asyncpipe / this",
    "idle per stage (layer clock)",
    "idle per stage (asyncpipe)",
]


def table_cells(rows: list[Row]) -> list[list[str]]:
    """The result table as strings, one list per row, in :data:`HEADER` order."""
    ours = {r.chunks: r.step_s for r in rows if r.system == "asyncpipe"}
    cells = []
    for row in rows:
        mine = ours.get(row.chunks)
        versus = (
            None
            if row.system == "asyncpipe" or mine is None or row.step_s is None
            else mine / row.step_s
        )
        step = _fmt_ms(row.step_s) if row.error is None else f"FAILED: {row.error}"
        cells.append(
            [
                str(row.chunks),
                row.system,
                step,
                _fmt_ms(row.nominal_s),
                _fmt_ms(row.calibrated_s),
                _fmt_ratio(row.vs_nominal),
                _fmt_ratio(row.vs_calibrated),
                _fmt_ratio(versus),
                _fmt_fracs(row.idle),
                _fmt_fracs(row.lib_idle),
            ]
        )
    return cells


def format_text(rows: list[Row]) -> str:
    """A fixed-width table for the terminal (long error texts are wrapped after the table)."""
    cells = table_cells(rows)
    notes: list[str] = []
    for line in cells:
        if line[2].startswith("FAILED") and len(line[2]) > 30:
            notes.append(f"[{len(notes) + 1}] {line[1]} chunks {line[0]}: {line[2]}")
            line[2] = f"FAILED [{len(notes)}]"
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(HEADER)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(HEADER, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)) for line in cells]
    return "\n".join(lines + notes)


def format_markdown_table(rows: list[Row]) -> str:
    def esc(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(esc(c) for c in line) + " |" for line in table_cells(rows)]
    return "\n".join(lines)


def target_line(rows: list[Row], args: argparse.Namespace) -> str | None:
    if args.shape != "small" or args.f_ms != 5.0:
        return None
    for row in rows:
        if row.system == "asyncpipe" and row.chunks == 8:
            if row.vs_nominal is None:
                return f"Target (asyncpipe <= {TARGET_RATIO:.2f}x nominal, chunks 8): no result"
            verdict = "met" if row.vs_nominal <= TARGET_RATIO else "NOT met"
            return (
                f"Target (asyncpipe <= {TARGET_RATIO:.2f}x nominal at F = 5 ms, chunks 8, "
                f"small shape): {verdict} ({row.vs_nominal:.2f}x)"
            )
    return None


def markdown_section(
    rows: list[Row],
    args: argparse.Namespace,
    costs: StageCosts,
    layers_per_stage: int,
    extra_lines: list[str],
    argv: list[str],
    seconds: float | None = None,
) -> str:
    """The body of this shape's generated section (:func:`benchmarks.sections.write_section`
    puts it between the markers)."""
    f = args.f_ms
    nominal_f, nominal_b = layers_per_stage * f, 2 * layers_per_stage * f
    body = [
        f"### Shape {args.shape}, F = {f:g} ms, micro-batch {args.micro_batch}",
        "",
        *(f"- {line}" for line in provenance("benchmarks.gpipe", argv, seconds)),
        f"- {len(args.balance.split(','))} processes, gloo on loopback, balance "
        f'[{args.balance.replace(",", ", ")}], checkpoint="never", '
        f"{args.warmup} warm-up + {args.steps} timed steps per row"
        + (
            f"; {args.rounds} interleaved rounds, each row from its median round"
            if args.rounds > 1
            else ""
        ),
        f"- Calibrated stage costs per micro-batch: forward {costs.forward_s * 1000:.2f} ms, "
        f"backward {costs.backward_s * 1000:.2f} ms (nominal {nominal_f:g} / {nominal_b:g} ms; "
        f"median of {costs.repeats})",
        "",
        format_markdown_table(rows),
        "",
        *(f"- {line}" for line in extra_lines),
    ]
    breakdown = format_breakdown(rows, markdown=True)
    if breakdown:
        body += ["", "asyncpipe's time per stage, mean ms per timed step:", "", breakdown]
    return "\n".join(body)
