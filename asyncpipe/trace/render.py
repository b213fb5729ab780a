"""Render a recorded run: summary table, timeline PNG and HTML, merged Chrome trace."""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from .chrome import chrome_trace
from .html import page
from .picture import svgs, write_png
from .run import StageSummary, StepTrace, steady, stream_window, summarize
from .writer import load_plans, load_steps

__all__ = ["Rendered", "render"]

CHROME_STEPS = 100


@dataclass(frozen=True)
class Rendered:
    """What :func:`render` wrote and found."""

    text: str
    """The summary table, as printed."""
    summary: list[StageSummary]
    step: StepTrace
    """The step drawn in the timelines."""
    files: dict[str, Path]
    """``"trace"``, ``"html"`` and (with Pillow) ``"png"``."""


def _table(steps: list[StepTrace], summary: list[StageSummary]) -> str:
    mean_seconds = sum(s.makespan for s in steps) / len(steps)
    bubble = sum(s.bubble for s in steps) / len(steps)
    lines = [
        f"{len(steps)} steps, mean step {mean_seconds * 1e3:.1f} ms, pipeline bubble {bubble:.1%}",
        f"{'rank':>6} {'busy':>8} {'comm':>8} {'idle':>8} {'peak MiB':>9}",
    ]
    for s in summary:
        lines.append(
            f"{s.rank:>6} {s.busy:>8.1%} {s.communication:>8.1%} {s.idle:>8.1%} "
            f"{s.peak_memory / 2**20:>9.0f}"
        )
    lines.append(
        "busy: F, B, W; comm: sends, receives with their waits, end-of-step exchange; "
        "idle: not busy"
    )
    return "\n".join(lines)


def render(
    directory: str | os.PathLike[str],
    *,
    step: int | None = None,
    out: str | os.PathLike[str] | None = None,
    images: bool = True,
    quiet: bool = False,
) -> Rendered:
    """Summarize a run that ``AsyncPipe(trace=directory)`` recorded and draw it.

    Writes ``trace.json`` (Chrome trace of the last 100 steps, every rank a track, times on
    rank 0's clock: open it in https://ui.perfetto.dev or chrome://tracing), ``timeline.html``
    (self-contained: the summary and the SVG timelines of one step and of the simulated ideal
    of its plan) and, with Pillow, ``timeline.png`` into ``out`` (default: the run's directory).

    Args:
        directory: the trace directory of the run.
        step: the step to draw (default: the last one with the run's most frequent plan,
            e.g. the last training step rather than an evaluation after it).
        out: where to write the files.
        images: also write the PNG.
        quiet: do not print the summary.

    Example:
        >>> from asyncpipe.trace import render
        >>> render("runs/exp1").files["html"]                  # doctest: +SKIP
        PosixPath('runs/exp1/timeline.html')
    """
    directory = Path(directory)
    if not directory.is_dir():
        what = "is not a directory" if directory.exists() else "does not exist"
        raise FileNotFoundError(
            f"{directory} {what}: pass the directory given as AsyncPipe(trace=...)"
        )
    target = Path(out) if out is not None else directory
    steps = everything = load_steps(directory)
    if not steps:
        raise ValueError(f"{directory} has no recorded steps yet; run at least one step first")
    plans = load_plans(directory)
    # The run's main kind of step (e.g. training, not the evaluation between): its plan is the
    # most frequent one (of those as frequent, the one whose steps ran last); the summary
    # covers those steps and the default picture the last one.
    counts = Counter(s.plan for s in steps)
    last_of = {s.plan: n for n, s in enumerate(steps)}
    common = max(counts, key=lambda plan: (counts[plan], last_of[plan]))
    steps = [s for s in steps if s.plan == common] if step is None else steps
    chosen = steps[-1]
    if step is not None:
        found = [s for s in steps if s.step == step]
        if not found:
            raise ValueError(
                f"step {step} is not in {directory} (recorded: {steps[0].step} to "
                f"{steps[-1].step}); pass one of those"
            )
        chosen = found[0]
    same = [s for s in steps if s.plan == chosen.plan]
    window = stream_window(chosen.plan)
    # A steady 2BW window after the first one: that first window paid for the warm-up. And
    # the step asked for (--step N) is in its own summary, even the first of its kind.
    warmed = (
        window is not None
        and window[1] != 0
        and any(
            stream_window(s.plan) == (window[0], 0, window[2]) and s.step < same[0].step
            for s in everything
        )
    )
    measured = same if warmed or chosen is same[0] else steady(same)
    summary = summarize(measured)
    text = _table(measured, summary)
    files = {"trace": target / "trace.json", "html": target / "timeline.html"}
    if target.exists() and not target.is_dir():
        raise FileNotFoundError(f"{target} is a file: pass a directory to write into")
    target.mkdir(parents=True, exist_ok=True)
    with files["trace"].open("w") as f:
        json.dump(chrome_trace(everything[-CHROME_STEPS:]), f)  # every kind of step
    plan = plans.get(chosen.plan)
    lines = text.splitlines()[:1]
    if plan is not None:
        ideal = chosen.ideal(plan)
        lines.append(
            f"step {chosen.step}: {chosen.makespan * 1e3:.1f} ms, bubble {chosen.bubble:.1%}; "
            f"the simulated ideal of its plan: {ideal.makespan * 1e3:.1f} ms, bubble "
            f"{ideal.total_bubble:.1%}"
        )
    document = page(f"asyncpipe trace: {directory.name}", lines, summary, svgs(chosen, plan))
    files["html"].write_text(document)
    if images:
        try:
            write_png(chosen, plan, target / "timeline.png")
            files["png"] = target / "timeline.png"
        except (ImportError, RuntimeError):  # no Pillow
            text += "\n(timeline.png needs Pillow: pip install pillow)"
    text = "\n".join([text, *lines[1:]])
    if not quiet:
        print(text)
        for name, path in files.items():
            print(f"{name}: {path}")
    return Rendered(text, summary, chosen, files)
