"""Timeline pictures of a recorded step beside the simulated ideal of its plan."""

from __future__ import annotations

import io
import os
from pathlib import Path

from ..schedule import Plan, timeline_svg
from ..schedule.show import chart_width, timeline_image
from .run import StepTrace, stream_window

__all__: list[str] = []


def titles(step: StepTrace, plan: Plan | None) -> tuple[str, str]:
    """Headings of the measured and the ideal picture."""
    measured = f"step {step.step}, measured (times in ms): {step.makespan * 1e3:.1f} ms"
    if plan is None:
        return measured, ""
    ideal = step.ideal(plan)
    what = "the same plan" if stream_window(step.plan) is None else "the same 2BW window"
    return measured, (
        f"simulated ideal of {what} (measured compute, free messages): "
        f"{ideal.makespan * 1e3:.1f} ms"
    )


def _in_ms(step: StepTrace) -> StepTrace:
    """The step with times in milliseconds, so the picture's axis reads in ms."""
    from dataclasses import replace

    from .run import RankStep

    ranks = {
        rank: RankStep(
            r.start * 1e3,
            r.seconds * 1e3,
            tuple((n, s * 1e3, e * 1e3) for n, s, e in r.events),
            r.peak_memory,
        )
        for rank, r in step.ranks.items()
    }
    return replace(step, ranks=ranks)


def svgs(step: StepTrace, plan: Plan | None) -> list[str]:
    """The measured step and (with a plan) its ideal, as SVG documents (times in ms)."""
    heading, ideal_heading = titles(step, plan)
    ms = _in_ms(step)
    measured, span = ms.simulation(), ms.makespan
    width = chart_width(measured, span)  # both on one time scale
    out = [timeline_svg(measured, heading, axis_end=span, width=width)]
    if plan is not None:
        out.append(timeline_svg(ms.ideal(plan), ideal_heading, axis_end=span, width=width))
    return out


def png_bytes(step: StepTrace, plan: Plan | None) -> tuple[bytes, int, int]:
    """The measured step above its ideal as PNG bytes, with the width and height (needs
    Pillow)."""
    from PIL import Image  # type: ignore[import-not-found, unused-ignore]

    heading, ideal_heading = titles(step, plan)
    ms = _in_ms(step)
    measured, span = ms.simulation(), ms.makespan
    width = chart_width(measured, span)  # both on one time scale
    images = [timeline_image(measured, heading, span, width)]
    if plan is not None:
        images.append(timeline_image(ms.ideal(plan), ideal_heading, span, width))
    width = max(i.width for i in images)
    canvas = Image.new("RGB", (width, sum(i.height for i in images)), "#ffffff")
    y = 0
    for image in images:
        canvas.paste(image, (0, y))
        y += image.height
    buffer = io.BytesIO()
    canvas.save(buffer, format="PNG", compress_level=1)  # fast; the picture is mostly flat
    return buffer.getvalue(), canvas.width, canvas.height


def write_png(step: StepTrace, plan: Plan | None, path: str | os.PathLike[str]) -> None:
    """:func:`png_bytes` into a file."""
    Path(path).write_bytes(png_bytes(step, plan)[0])
