"""The suite's tables (terminal and markdown) and its bar chart (PNG, drawn with pillow)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from .schedule_report import LABELS, format_markdown, format_ms, format_ratio, format_text
from .schedule_results import MATCH
from .suite_runs import LINKS, SuiteRow

__all__ = [
    "REFERENCE_HEADER",
    "SUMMARY_HEADER",
    "counterpart",
    "markdown_table",
    "plot",
    "reference_cells",
    "summary_cells",
    "text_table",
]

PEER_COLUMNS = {
    "torch": "asyncpipe / torch same schedule",
    "fairscale-asyncpipe": "asyncpipe / fairscale AsyncPipe",
    "fairscale-pipe": "asyncpipe / fairscale Pipe",
}
"""The ratio columns of the reference table: asyncpipe's step time over each peer's."""

REFERENCE_HEADER = [
    "stages",
    "chunks",
    "system",
    "transport",
    "step ms",
    "simulated ms",
    "/simulated",
    *PEER_COLUMNS.values(),
    "memory per rank MiB",
    "peak activations per rank",
]

SUMMARY_HEADER = ["peer", "stages", "chunks", "peer ms", "asyncpipe", "asyncpipe ms", "ratio"]

_SAME = {peer: (ours, "p2p") for peer, ours in MATCH.items()}
_SAME["torch-zbv"] = ("asyncpipe-zero_bubble", "p2p")
_SAME["fairscale-asyncpipe"] = ("asyncpipe-gpipe", "rpc")
_SAME["fairscale-pipe"] = ("asyncpipe-gpipe", "p2p")


def counterpart(peer: str) -> tuple[str, str]:
    """The asyncpipe system and transport that run the same kind of schedule as ``peer``:
    torch's schedules their namesakes over p2p (ZBV: zero_bubble), fairscale's AsyncPipe
    (fill-drain over RPC) gpipe over rpc, fairscale's Pipe gpipe over p2p."""
    return _SAME[peer]


def _label(row: SuiteRow) -> str:
    return LABELS.get(row.system, row.system)


def _ratio_to(rows: dict[tuple[int, int, str], SuiteRow], row: SuiteRow, peer: str) -> str:
    other = rows.get((row.stages, row.chunks, f"{peer}/{LINKS[peer]}"))
    if other is None or other.step_s is None or row.step_s is None:
        return "-"
    return format_ratio(row.step_s / other.step_s)


def _failed(error: str) -> str:
    """A row's error as its cell: ``FAILED: ...``, or the reason a peer was not run."""
    return error if error.startswith("not run") else f"FAILED: {error}"


def _mib(values: Sequence[float]) -> str:
    return "-" if not values else " / ".join(f"{v / 2**20:.1f}" for v in values)


def reference_cells(rows: list[SuiteRow]) -> list[list[str]]:
    """The reference table as strings, in :data:`REFERENCE_HEADER` order."""
    index = {(r.stages, r.chunks, r.key): r for r in rows}
    cells = []
    for row in rows:
        ratios = ["-"] * len(PEER_COLUMNS)
        if row.system.startswith("asyncpipe"):
            torch_peer = next((p for p, (o, _) in _SAME.items() if o == row.system), None)
            ratios = [
                _ratio_to(index, row, torch_peer) if torch_peer else "-",
                _ratio_to(index, row, "fairscale-asyncpipe"),
                _ratio_to(index, row, "fairscale-pipe"),
            ]
        cells.append(
            [
                str(row.stages),
                str(row.chunks),
                _label(row),
                row.transport,
                format_ms(row.step_s) if row.error is None else _failed(row.error),
                format_ms(row.simulated_s),
                format_ratio(row.vs_simulated),
                *ratios,
                _mib(row.memory),
                " / ".join(map(str, row.peak_activations)) or "-",
            ]
        )
    return cells


def summary_cells(rows: list[SuiteRow]) -> list[list[str]]:
    """Each peer against the asyncpipe system that runs its kind of schedule."""
    index = {(r.stages, r.chunks, r.key): r for r in rows}
    cells = []
    for row in rows:
        if row.system.startswith("asyncpipe"):
            continue
        ours, transport = counterpart(row.system)
        mine = index.get((row.stages, row.chunks, f"{ours}/{transport}"))
        mine_s = None if mine is None else mine.step_s
        ratio = "-"
        if mine_s is not None and row.step_s is not None:
            ratio = format_ratio(mine_s / row.step_s)
        theirs = format_ms(row.step_s) if row.error is None else _failed(row.error)
        cells.append(
            [
                _label(row),
                str(row.stages),
                str(row.chunks),
                theirs,
                f"{LABELS[ours]} over {transport}",
                format_ms(mine_s),
                ratio,
            ]
        )
    return cells


def markdown_table(header: list[str], cells: list[list[str]]) -> str:
    """A markdown table (``|`` in cells escaped)."""
    return format_markdown(header, cells)


def text_table(header: list[str], cells: list[list[str]]) -> str:
    """A fixed-width table for the terminal; long failures are numbered below it."""
    notes: list[str] = []
    short = []
    for line in cells:
        line = list(line)
        for i, cell in enumerate(line):
            if cell.startswith("FAILED") and len(cell) > 30:
                where = ", ".join(f"{h} {v}" for h, v in zip(header[:3], line[:3]))
                notes.append(f"[{len(notes) + 1}] {where}: {cell}")
                line[i] = f"FAILED [{len(notes)}]"
        short.append(line)
    return "\n".join([format_text(header, short), *notes])


# ----- the bar chart ---------------------------------------------------------------------------

_COLORS = [
    (31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189),
    (140, 86, 75), (227, 119, 194), (127, 127, 127), (188, 189, 34), (23, 190, 207),
    (57, 59, 121), (173, 73, 74), (99, 121, 57), (206, 109, 189), (231, 186, 82),
]  # fmt: skip


def plot(rows: list[SuiteRow], path: Path, title: str) -> Path | None:
    """A bar chart of step time / simulated ideal, one panel per stage count, bars grouped by
    chunks, one colour per system and transport. Returns None where pillow is missing."""
    try:
        from PIL import Image, ImageDraw, ImageFont
    except ImportError:
        return None
    done = [r for r in rows if r.vs_simulated is not None]
    keys = list(dict.fromkeys(r.key for r in rows))
    stage_list = sorted({r.stages for r in rows})
    chunk_list = sorted({r.chunks for r in rows})
    if not done or not keys:
        return None
    top = max(2.0, max(r.vs_simulated or 0.0 for r in done) * 1.05)
    panel_w, panel_h, left, gap, legend_w = 640, 360, 56, 64, 340
    width = left + len(stage_list) * (panel_w + gap) + legend_w
    height = panel_h + 130
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default()
    draw.text((left, 10), title, fill="black", font=font)
    y0, y1 = 50, 50 + panel_h  # plot area, top and bottom

    def y_of(value: float) -> float:
        return y1 - (min(value, top) / top) * (y1 - y0)

    for p, stages in enumerate(stage_list):
        x0 = left + p * (panel_w + gap)
        draw.rectangle((x0, y0, x0 + panel_w, y1), outline="black")
        tick = 0.0
        while tick <= top:
            y = y_of(tick)
            draw.line((x0 - 4, y, x0, y), fill="black")
            draw.text((x0 - 36, y - 6), f"{tick:.1f}x", fill="black", font=font)
            tick += 0.5
        group_w = panel_w / len(chunk_list)
        bar_w = max(2.0, (group_w - 16) / len(keys))
        for g, chunks in enumerate(chunk_list):
            gx = x0 + g * group_w + 8
            for k, key in enumerate(keys):
                row = next(
                    (r for r in done if r.stages == stages and r.chunks == chunks and r.key == key),
                    None,
                )
                if row is None or row.vs_simulated is None:
                    continue
                bx = gx + k * bar_w
                color = _COLORS[k % len(_COLORS)]
                draw.rectangle((bx, y_of(row.vs_simulated), bx + bar_w - 1, y1), fill=color)
            draw.text((gx + group_w / 2 - 30, y1 + 6), f"chunks {chunks}", fill="black", font=font)
        one = y_of(1.0)
        for x in range(x0, x0 + panel_w, 8):  # the ideal, dashed, over the bars
            draw.line((x, one, x + 4, one), fill="black")
        draw.text((x0 + panel_w / 2 - 40, y1 + 26), f"{stages} stages", fill="black", font=font)
    draw.text((left, y1 + 50), "bar: step time / simulated ideal (dashed: 1.0)", fill="black")
    lx = left + len(stage_list) * (panel_w + gap) - gap + 20
    for k, key in enumerate(keys):
        row = next(r for r in rows if r.key == key)
        y = y0 + k * 18
        draw.rectangle((lx, y, lx + 12, y + 12), fill=_COLORS[k % len(_COLORS)])
        link = "" if row.transport == "-" else f" ({row.transport})"
        draw.text((lx + 18, y), f"{_label(row)}{link}", fill="black", font=font)
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path)
    return path
