"""Pictures of a plan: a text grid of its steps and a Gantt chart (SVG or PNG) of its timing."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal
from xml.sax.saxutils import escape, quoteattr

from .action import Action, Plan
from .simulate import Simulation

__all__: list[str] = []


def grid(plan: Plan) -> str:
    """The plan as a step-by-rank grid: one row per rank, one aligned column per step.

    The header row numbers the steps (the position in each rank's list, not a time); an idle
    slot (``None``) shows as ``"."``. Trailing spaces are stripped from every line.

    Args:
        plan: ``{rank: [Action | None, ...]}``, lowered or not.

    Returns:
        the grid as text, lines joined with ``"\\n"`` and no final newline.

    Example:
        >>> from asyncpipe.schedule import build
        >>> print(grid(build("1f1b", 2, 3)))
        step    0   1   2   3   4   5
        rank 0: 0F0 0F1 0B0 0F2 0B1 0B2
        rank 1: 1F0 1B0 1F1 1B1 1F2 1B2
    """
    ranks = sorted(plan)
    cells = {rank: ["." if a is None else str(a) for a in plan[rank]] for rank in ranks}
    steps = max((len(row) for row in cells.values()), default=0)
    widths = [
        max([len(str(step))] + [len(cells[r][step]) for r in ranks if step < len(cells[r])])
        for step in range(steps)
    ]
    labels = {rank: f"rank {rank}:" for rank in ranks}
    label_width = max([len("step")] + [len(label) for label in labels.values()])

    def line(label: str, row: list[str]) -> str:
        parts = [label.ljust(label_width)] + [c.ljust(w) for c, w in zip(row, widths)]
        return " ".join(parts).rstrip()

    header = line("step", [str(step) for step in range(steps)])
    return "\n".join([header] + [line(labels[rank], cells[rank]) for rank in ranks])


_RANK_LINE = re.compile(r"^rank\s+(\d+)\s*:(.*)$")


def parse_plan(text: str) -> Plan:
    """Read a plan written as :func:`~asyncpipe.schedule.format_plan` prints it.

    One line per rank, ``rank <r>: <action> <action> ...``, actions in the text form of
    :meth:`Action.parse <asyncpipe.schedule.Action.parse>` and ``"."`` for an idle slot. Blank
    lines and lines starting with ``#`` are skipped. The plan is not validated: pass it to
    :func:`~asyncpipe.schedule.validate` for that.

    Raises:
        ValueError: naming the line that is not of this form, or a rank given twice.

    Example:
        >>> plan = parse_plan("rank 0: 0F0 0B0\\nrank 1: 1F0 . 1B0")
        >>> [str(a) for a in plan[1]]
        ['1F0', 'None', '1B0']
    """
    plan: Plan = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        content = raw.strip()
        if not content or content.startswith("#"):
            continue
        match = _RANK_LINE.match(content)
        if match is None:
            raise ValueError(
                f"line {number} of the plan must read 'rank <r>: <action> ...', e.g. "
                f"'rank 0: 0F0 0B0' (got {content!r})"
            )
        rank = int(match.group(1))
        if rank in plan:
            raise ValueError(
                f"line {number} of the plan gives rank {rank} a second time; "
                f"write each rank's actions on one line"
            )
        row: list[Action | None] = []
        for token in match.group(2).split():
            if token == ".":
                row.append(None)
                continue
            try:
                row.append(Action.parse(token))
            except ValueError as e:
                raise ValueError(f"line {number} of the plan (rank {rank}): {e}") from e
        plan[rank] = row
    if not plan:
        raise ValueError("the plan has no 'rank <r>: <action> ...' lines; write one per rank")
    return dict(sorted(plan.items()))


# --- Gantt chart: a layout of plain shapes, then one renderer for SVG and one for Pillow. ---

_COLOURS = {"F": "#4c78a8", "B": "#e45756", "W": "#54a24b", "comm": "#9a9a9a"}
_IDLE = "#eeeeee"
_INK = "#222222"
_FAINT = "#888888"
_FONT = "DejaVu Sans Mono, Menlo, Consolas, monospace"
_CHAR = 0.6  # width of a monospace character, in font sizes

_PAD = 12.0
_LABEL_WIDTH = 64.0
_RIGHT_WIDTH = 60.0
_ROW = 30.0
_BOX = 22.0
_THIN = 7.0
_MIN_BOX = 1.5
_GAP = 0.75


@dataclass(frozen=True)
class _Rect:
    x: float
    y: float
    width: float
    height: float
    fill: str
    role: str  # "background", "idle", "action" or "legend"
    kind: str = ""
    tooltip: str = ""
    stroke: str = ""


@dataclass(frozen=True)
class _Text:
    x: float
    y: float  # the vertical middle of the text
    text: str
    size: float
    anchor: Literal["start", "middle", "end"] = "start"
    fill: str = _INK
    bold: bool = False


@dataclass(frozen=True)
class _Line:
    x1: float
    y1: float
    x2: float
    y2: float
    stroke: str = _INK
    width: float = 1.0


_Shape = _Rect | _Text | _Line


@dataclass(frozen=True)
class _Picture:
    width: float
    height: float
    title: str
    shapes: list[_Shape]


def _group(text: str) -> str:
    """The colour group of a timeline entry: "F", "B", "W" or "comm" (send or receive)."""
    kind = Action.parse(text).kind
    return kind.value if kind.is_compute else "comm"


def _tick_step(span: float) -> float:
    """A round step (1, 2 or 5 times a power of ten) giving about eight ticks over ``span``."""
    raw = span / 8
    magnitude = 10.0 ** math.floor(math.log10(raw))
    return next(m * magnitude for m in (1.0, 2.0, 5.0, 10.0) if m * magnitude >= raw * 0.999)


def _number(value: float) -> str:
    return f"{round(value, 9):g}"


def _text_width(text: str, size: float) -> float:
    return len(text) * size * _CHAR


def _span(simulation: Simulation, axis_end: float) -> float:
    entries = [e for row in simulation.timeline.values() for e in row]
    span = max([simulation.makespan, axis_end] + [end for _, _, end in entries])
    return span if span > 0 else 1.0


def chart_width(simulation: Simulation, axis_end: float = 0.0) -> float:
    """Pixels of the time axis of ``simulation``'s picture: wide enough that its shortest
    action gets a box of some size, within 480 to 1600."""
    span = _span(simulation, axis_end)
    entries = [e for row in simulation.timeline.values() for e in row]
    durations = [end - start for _, start, end in entries if end - start > 0]
    shortest = min(durations, default=span)
    return min(max(span / shortest * 36.0, 480.0), 1600.0)


def _layout(
    simulation: Simulation, title: str, axis_end: float = 0.0, pixels: float = 0.0
) -> _Picture:
    ranks = sorted(simulation.timeline)
    span = _span(simulation, axis_end)
    chart = pixels if pixels > 0 else chart_width(simulation, axis_end)
    scale = chart / span
    shapes: list[_Shape] = []

    y = _PAD
    left = _PAD + _LABEL_WIDTH
    if title:
        shapes.append(_Text(_PAD, y + 9, title, 15, bold=True))
        y += 24
    bubbles = simulation.bubble
    summary = (
        f"makespan {_number(simulation.makespan)}, total bubble "
        f"{simulation.total_bubble:.1%}, {len(ranks)} ranks"
    )
    shapes.append(_Text(_PAD, y + 7, summary, 12, fill=_FAINT))
    y += 20
    shapes.append(_Text(left + chart + 8, y + 5, "bubble", 10, fill=_FAINT))
    y += 12

    top = y
    for rank in ranks:
        middle = y + _ROW / 2
        box_top = middle - _BOX / 2
        shapes.append(_Text(left - 8, middle, f"rank {rank}", 12, anchor="end"))
        shapes.append(_Rect(left, box_top, chart, _BOX, _IDLE, "idle"))
        for text, start, end in simulation.timeline[rank]:
            group = _group(text)
            x = left + start * scale
            width = max((end - start) * scale, _MIN_BOX)
            if width > 3 * _GAP:  # a hairline between back-to-back boxes
                width -= _GAP
            height = _BOX if group != "comm" else _THIN
            box_y = box_top if group != "comm" else box_top + _BOX - _THIN
            tooltip = f"{text}: {_number(start)} to {_number(end)}"
            shapes.append(_Rect(x, box_y, width, height, _COLOURS[group], "action", group, tooltip))
            if group != "comm" and _text_width(text, 11) + 4 <= width:
                shapes.append(_Text(x + width / 2, middle, text, 11, "middle", "#ffffff"))
        bubble = bubbles.get(rank, 0.0)
        shapes.append(_Text(left + chart + 8, middle, f"{bubble:.1%}", 11))
        y += _ROW

    axis = y + 4
    shapes.append(_Line(left, top, left, axis, _FAINT))
    shapes.append(_Line(left, axis, left + chart, axis))
    step = _tick_step(span)
    for n in range(int(span / step + 1e-9) + 1):
        x = left + n * step * scale
        shapes.append(_Line(x, axis, x, axis + 5))
        shapes.append(_Text(x, axis + 14, _number(n * step), 10, "middle"))
    shapes.append(_Text(left - 8, axis + 14, "time", 10, "end", _FAINT))

    legend = axis + 34
    x = _PAD
    items = [
        ("F", "forward (F)"),
        ("B", "backward (B)"),
        ("W", "weight gradient (W)"),
        ("comm", "send / receive"),
        ("idle", "idle (bubble)"),
    ]
    for group, label in items:
        if group == "idle":
            swatch = _Rect(x, legend - 6, 12, 12, _IDLE, "legend", group, stroke=_FAINT)
        elif group == "comm":
            swatch = _Rect(x, legend + 6 - _THIN / 2, 12, _THIN / 2, _COLOURS[group], "legend")
        else:
            swatch = _Rect(x, legend - 6, 12, 12, _COLOURS[group], "legend", group)
        shapes.append(swatch)
        shapes.append(_Text(x + 17, legend, label, 11))
        x += 17 + _text_width(label, 11) + 18

    heading = max(_text_width(title, 15), _text_width(summary, 12))
    width = max(left + chart + _RIGHT_WIDTH + _PAD, x + _PAD, 2 * _PAD + heading)
    height = legend + 8 + _PAD
    background = _Rect(0, 0, width, height, "#ffffff", "background")
    return _Picture(width, height, title, [background, *shapes])


def _svg_number(value: float) -> str:
    text = f"{value:.2f}".rstrip("0").rstrip(".")
    return "0" if text == "-0" else text


_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f]")


def _xml_text(text: str) -> str:
    return escape(_CONTROL.sub("", text))


def _xml_attribute(text: str) -> str:
    return quoteattr(_CONTROL.sub("", text))


def _svg_shape(shape: _Shape) -> str:
    n = _svg_number
    if isinstance(shape, _Rect):
        attributes = (
            f'x="{n(shape.x)}" y="{n(shape.y)}" width="{n(shape.width)}" '
            f'height="{n(shape.height)}" fill="{shape.fill}"'
        )
        classes = shape.role + (f" kind-{shape.kind}" if shape.kind else "")
        attributes += f' class="{classes}"'
        if shape.stroke:
            attributes += f' stroke="{shape.stroke}" stroke-width="0.5"'
        if shape.tooltip:
            return f"<rect {attributes}><title>{_xml_text(shape.tooltip)}</title></rect>"
        return f"<rect {attributes}/>"
    if isinstance(shape, _Line):
        return (
            f'<line x1="{n(shape.x1)}" y1="{n(shape.y1)}" x2="{n(shape.x2)}" y2="{n(shape.y2)}" '
            f'stroke="{shape.stroke}" stroke-width="{n(shape.width)}"/>'
        )
    weight = ' font-weight="bold"' if shape.bold else ""
    return (
        f'<text x="{n(shape.x)}" y="{n(shape.y)}" font-size="{n(shape.size)}" '
        f'text-anchor="{shape.anchor}" dominant-baseline="central" fill="{shape.fill}"'
        f"{weight}>{_xml_text(shape.text)}</text>"
    )


def timeline_svg(
    simulation: Simulation, title: str = "", *, axis_end: float = 0.0, width: float = 0.0
) -> str:
    """A self-contained SVG Gantt chart of a simulated plan.

    One row per rank and one box per entry of ``simulation.timeline``, spanning its start to end
    time: forwards blue, backwards red, weight gradients green, sends and receives as thin grey
    bars. Boxes wide enough carry the action's text; every box has a tooltip with its times.
    Idle time (the bubble) is the light grey band left uncovered; the right column gives each
    rank's bubble fraction. A time axis and a legend sit below the rows. Action boxes carry the
    class ``action`` (and ``kind-F``, ``kind-B``, ``kind-W`` or ``kind-comm``).

    Args:
        simulation: what :func:`~asyncpipe.schedule.simulate` returned.
        title: a heading for the picture (also its SVG ``<title>``); none if empty.
        axis_end: draw the time axis at least this far (to put two pictures on one scale).
        width: pixels of the time axis (default: :func:`chart_width`); give two pictures
            the same ``axis_end`` and ``width`` to draw them on one scale.

    Returns:
        the SVG document as text.

    Example:
        >>> from asyncpipe.schedule import Costs, build, simulate
        >>> svg = timeline_svg(simulate(build("gpipe", 2, 2), Costs()), title="GPipe")
        >>> svg.startswith("<svg") and svg.count('class="action') == 8
        True
    """
    picture = _layout(simulation, title, axis_end, width)
    size, height = _svg_number(picture.width), _svg_number(picture.height)
    lines = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{size}" height="{height}" '
        f'viewBox="0 0 {size} {height}" font-family={_xml_attribute(_FONT)}>'
    ]
    if picture.title:
        lines.append(f"<title>{_xml_text(picture.title)}</title>")
    lines += [_svg_shape(shape) for shape in picture.shapes]
    lines.append("</svg>")
    return "\n".join(lines) + "\n"


def timeline_png(simulation: Simulation, path: str | Path, title: str = "") -> None:
    """Write the picture of :func:`timeline_svg` as a PNG file, drawn with Pillow.

    Pillow is not a dependency of asyncpipe: install it (``pip install pillow``) to use this
    function, or write the SVG instead, which needs nothing.

    Args:
        simulation: what :func:`~asyncpipe.schedule.simulate` returned.
        path: the file to write (overwritten if it exists).
        title: a heading for the picture; none if empty.

    Raises:
        RuntimeError: if Pillow cannot be imported.

    Example:
        >>> from asyncpipe.schedule import Costs, build, simulate
        >>> timeline_png(simulate(build("1f1b", 4, 8), Costs()), "1f1b.png")  # doctest: +SKIP
    """
    timeline_image(simulation, title).save(Path(path), format="PNG")


def timeline_image(
    simulation: Simulation, title: str = "", axis_end: float = 0.0, width: float = 0.0
) -> Any:
    """The picture of :func:`timeline_png` as a Pillow image (RGB), not written anywhere;
    ``axis_end`` and ``width`` as in :func:`timeline_svg`."""
    try:
        from PIL import Image, ImageDraw, ImageFont  # type: ignore[import-not-found, unused-ignore]
    except ImportError as e:
        raise RuntimeError(
            "timeline_png needs Pillow, which is not installed (import PIL failed: "
            f"{e}); run `pip install pillow`, or write the picture with timeline_svg instead"
        ) from e

    zoom = 2.0
    picture = _layout(simulation, title, axis_end, width)
    size = (math.ceil(picture.width * zoom), math.ceil(picture.height * zoom))
    image = Image.new("RGB", size, "#ffffff")
    draw = ImageDraw.Draw(image)
    fonts: dict[tuple[float, bool], ImageFont.FreeTypeFont | ImageFont.ImageFont] = {}

    def font(points: float, bold: bool) -> ImageFont.FreeTypeFont | ImageFont.ImageFont:
        key = (points, bold)
        if key not in fonts:
            names = ["DejaVuSansMono-Bold.ttf"] if bold else []
            names.append("DejaVuSansMono.ttf")
            for name in names:
                try:
                    fonts[key] = ImageFont.truetype(name, round(points * zoom))
                    break
                except OSError:
                    continue
            else:
                fonts[key] = ImageFont.load_default(round(points * zoom))
        return fonts[key]

    anchors = {"start": "lm", "middle": "mm", "end": "rm"}
    for shape in picture.shapes:
        if isinstance(shape, _Rect):
            box = [
                shape.x * zoom,
                shape.y * zoom,
                (shape.x + shape.width) * zoom - 1,
                (shape.y + shape.height) * zoom - 1,
            ]
            box[2], box[3] = max(box[2], box[0]), max(box[3], box[1])
            draw.rectangle(box, fill=shape.fill, outline=shape.stroke or None)
        elif isinstance(shape, _Line):
            points = [(shape.x1 * zoom, shape.y1 * zoom), (shape.x2 * zoom, shape.y2 * zoom)]
            draw.line(points, fill=shape.stroke, width=max(1, round(shape.width * zoom)))
        else:
            draw.text(
                (shape.x * zoom, shape.y * zoom),
                shape.text,
                fill=shape.fill,
                font=font(shape.size, shape.bold),
                anchor=anchors[shape.anchor],
            )
    return image
