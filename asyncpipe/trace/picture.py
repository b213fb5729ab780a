"""Timeline pictures of a recorded step beside the simulated ideal of its plan."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from ..schedule import Plan, timeline_png, timeline_svg
from .run import StepTrace

__all__: list[str] = []


def titles(step: StepTrace, plan: Plan | None) -> tuple[str, str]:
    """Headings of the measured and the ideal picture."""
    measured = f"step {step.step}, measured: {step.makespan * 1e3:.1f} ms"
    if plan is None:
        return measured, ""
    ideal = step.ideal(plan)
    return measured, (
        f"simulated ideal of the same plan (measured compute, free messages): "
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
    out = [timeline_svg(ms.simulation(), heading)]
    if plan is not None:
        out.append(timeline_svg(ms.ideal(plan), ideal_heading))
    return out


def write_png(step: StepTrace, plan: Plan | None, path: str | os.PathLike[str]) -> None:
    """The measured step above its ideal, as one PNG (needs Pillow)."""
    from PIL import Image  # type: ignore[import-not-found, unused-ignore]

    heading, ideal_heading = titles(step, plan)
    ms = _in_ms(step)
    with tempfile.TemporaryDirectory() as scratch:
        parts = [Path(scratch) / "measured.png"]
        timeline_png(ms.simulation(), parts[0], heading)
        if plan is not None:
            parts.append(Path(scratch) / "ideal.png")
            timeline_png(ms.ideal(plan), parts[1], ideal_heading)
        images = [Image.open(p).convert("RGB") for p in parts]
        width = max(i.width for i in images)
        canvas = Image.new("RGB", (width, sum(i.height for i in images)), "#ffffff")
        y = 0
        for image in images:
            canvas.paste(image, (0, y))
            y += image.height
        canvas.save(Path(path), format="PNG")


def timeline_image(step: StepTrace, plan: Plan | None) -> Any:
    """:func:`write_png`'s picture as an array of shape (height, width, 3), for TensorBoard."""
    import numpy as np
    from PIL import Image  # type: ignore[import-not-found, unused-ignore]

    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "timeline.png"
        write_png(step, plan, path)
        with Image.open(path) as image:
            return np.asarray(image.convert("RGB"))
