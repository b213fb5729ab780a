"""The trace writer: TensorBoard scalars, timeline pictures and the config, on rank 0."""

from __future__ import annotations

import importlib.util
import json
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

from ..schedule import Plan, format_plan, parse_plan
from .run import StepTrace, plan_kind

__all__ = ["TraceWriter"]

EVENTS = "events.jsonl"
PLANS = "plans.json"
CONFIG = "config.json"


class TraceWriter:
    """Writes the trace of a pipeline run into a directory, on rank 0 of the pipeline.

    ``AsyncPipe(..., trace="runs/exp1")`` builds one; build it yourself for more control, or
    subclass it and extend :meth:`write`. The directory gets:

    - TensorBoard event files (``tensorboard --logdir runs``): per step ``train/loss``,
      ``train/step_seconds``, ``train/samples_per_second``, ``pipeline/bubble_fraction``,
      ``idle_fraction/rank<r>`` and ``peak_memory_mib/rank<r>``; every ``every`` training steps
      (counted from this run's first, which gets one; inference steps do not count) a
      ``timeline`` image (the measured step above the simulated ideal of the same plan, or of
      the same window of the stream for a 2BW step) with
      ``pipeline/ideal_bubble_fraction`` and ``pipeline/ideal_step_seconds``; the configuration
      as text (``config``); inference steps (``pipe(x)`` under ``no_grad`` or ``eval()``) only
      get ``eval/step_seconds``, ``eval/samples_per_second`` and ``eval/bubble_fraction``;
    - ``events.jsonl`` (one line per step, every rank's events on rank 0's clock),
      ``plans.json`` and ``config.json``, which ``python -m asyncpipe.trace DIR`` reads;
    - at :meth:`close`: ``trace.json`` (Chrome trace / Perfetto), ``timeline.png`` and
      ``timeline.html`` (see :func:`~asyncpipe.trace.render`).

    A run into a directory that already holds one (a job restarted after a failure) goes on
    where it ended: its steps are numbered from one past the last recorded step
    (:attr:`first_step`) in ``events.jsonl`` and TensorBoard alike, a last line cut off
    while it was written is dropped, ``plans.json`` keeps the earlier plans (a plan that
    differs from the one recorded under its key is stored as ``key#2``), and ``config.json``
    holds the latest configuration (TensorBoard's ``config`` text has one per run, at its
    first step). Pass a new directory to start from step 0.

    With ``data_parallel_size > 1`` every replica writes through a copy of the writer (same
    class and settings) whose directory is ``directory / "replica<d>"``, as a path given as
    ``trace`` is split.

    Args:
        directory: where to write (created if missing).
        every: training steps between timeline images (this run's first training step gets
            one).
        images: draw timeline images (they need Pillow, ``pip install asyncpipe[trace]``;
            without it the trace is written without them, with a warning).
        tensorboard: write TensorBoard event files.

    Example:
        >>> from asyncpipe.trace import TraceWriter
        >>> writer = TraceWriter("runs/exp1", every=100)                  # doctest: +SKIP
        >>> pipe = asyncpipe.AsyncPipe(model, [2, 2], chunks=8, trace=writer)  # doctest: +SKIP
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        every: int = 50,
        *,
        images: bool = True,
        tensorboard: bool = True,
    ) -> None:
        if not (isinstance(every, int) and every > 0):
            raise ValueError(f"every must be a positive number of steps (got {every!r})")
        self.directory = Path(directory)
        self.every, self.images, self.tensorboard = every, images, tensorboard
        self.plans: dict[str, Plan] = {}
        self.first_step = 0
        """The number of this run's first step: one past the last step recorded in the
        directory (0 in a new one); set by :meth:`open`."""
        self._earlier: set[str] = set()
        self._since_picture: int | None = None
        """Training steps since the last one due a picture (None: none was yet)."""
        self._events: IO[str] | None = None
        self._board: Any = None

    def open(self, config: Mapping[str, object]) -> None:
        """Start a run: create the directory, write the configuration; in a directory that
        holds a recorded run, go on after its last step (see :attr:`first_step`)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        self.first_step = _recorded_end(self.directory / EVENTS)
        self.plans = {**load_plans(self.directory), **self.plans}
        self._earlier = set(self.plans)
        if self.images and importlib.util.find_spec("PIL") is None:
            warnings.warn(
                "timeline images need Pillow, which is not installed; the trace is written "
                "without them (pip install pillow to get them)",
                stacklevel=2,
            )
            self.images = False
        (self.directory / CONFIG).write_text(json.dumps(dict(config), indent=1, default=str))
        self._events = (self.directory / EVENTS).open("a")
        if self.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._board = SummaryWriter(str(self.directory), flush_secs=10)
            table = "\n".join(f"| {key} | {value} |" for key, value in config.items())
            text = "| setting | value |\n|---|---|\n" + table
            self._board.add_text("config", text, self.first_step)

    def add_plan(self, key: str, plan: Plan) -> str:
        """Keep a lowered plan the steps refer to; returns its key in ``plans.json``:
        ``key``, or ``key#2`` (``#3``, ...) where an earlier run in the directory recorded
        another plan under ``key``."""
        stored, revision = key, 1
        while stored in self._earlier and self.plans[stored] != plan:
            revision += 1
            stored = f"{key}#{revision}"
        self.plans[stored] = plan
        text = {k: format_plan(p) for k, p in self.plans.items()}
        (self.directory / PLANS).write_text(json.dumps(text, indent=1))
        return stored

    def write(self, step: StepTrace, *, picture: bool = True) -> None:
        """Record one step (called on rank 0, one step behind the pipeline).

        ``picture=False`` leaves out the timeline image of a step due one: the recorder passes
        it for steps that waited more than 2 s for the writer, which then catches up (an image
        takes about a tenth of a second to draw)."""
        if self._events is not None:
            self._events.write(step.to_json() + "\n")
            self._events.flush()
        board = self._board
        if board is None:
            return
        n = step.step
        seconds = step.makespan
        if plan_kind(step.plan).endswith("/eval"):  # inference between training steps: kept apart
            board.add_scalar("eval/step_seconds", seconds, n)
            if step.samples and seconds > 0:
                board.add_scalar("eval/samples_per_second", step.samples / seconds, n)
            board.add_scalar("eval/bubble_fraction", step.bubble, n)
            return
        if step.loss is not None:
            board.add_scalar("train/loss", step.loss, n)
        board.add_scalar("train/step_seconds", seconds, n)
        if step.samples and seconds > 0:
            board.add_scalar("train/samples_per_second", step.samples / seconds, n)
        board.add_scalar("pipeline/bubble_fraction", step.bubble, n)
        for rank, part in sorted(step.ranks.items()):
            board.add_scalar(f"idle_fraction/rank{rank}", step.idle(rank), n)
            board.add_scalar(f"peak_memory_mib/rank{rank}", part.peak_memory / 2**20, n)
        due = self._since_picture is None or self._since_picture + 1 >= self.every
        self._since_picture = 0 if due else (self._since_picture or 0) + 1
        if due and step.plan in self.plans:
            ideal = step.ideal(self.plans[step.plan])
            board.add_scalar("pipeline/ideal_bubble_fraction", ideal.total_bubble, n)
            board.add_scalar("pipeline/ideal_step_seconds", ideal.makespan, n)
            if self.images and picture:
                from tensorboard.compat.proto.summary_pb2 import (  # type: ignore[import-untyped, unused-ignore]
                    Summary,
                )

                from .picture import png_bytes

                data, width, height = png_bytes(step, self.plans[step.plan])
                image = Summary.Image(
                    height=height, width=width, colorspace=3, encoded_image_string=data
                )
                summary = Summary(value=[Summary.Value(tag="timeline", image=image)])
                # the PNG as drawn: SummaryWriter.add_image would decode and encode it again
                board._get_file_writer().add_summary(summary, n)

    def close(self) -> None:
        """Flush and close the files, then render the run (trace.json, timeline.png/html)."""
        if self._events is not None:
            self._events.close()
            self._events = None
        if self._board is not None:
            self._board.close()
            self._board = None
        from .render import render

        render(self.directory, quiet=True, images=self.images)


def _recorded_end(path: Path) -> int:
    """One past the last step recorded in ``path`` (0 without one); a last line cut off while
    it was written (no newline after it) is removed, so the next step starts a line."""
    if not path.exists():
        return 0
    data = path.read_bytes()
    whole = data.rfind(b"\n") + 1
    if whole < len(data):
        os.truncate(path, whole)
    for line in reversed(data[:whole].splitlines()):
        try:
            return int(json.loads(line)["step"]) + 1
        except (ValueError, KeyError, TypeError):
            continue
    return 0


def load_plans(directory: str | os.PathLike[str]) -> dict[str, Plan]:
    """The plans of a recorded run, by key."""
    path = Path(directory) / PLANS
    if not path.exists():
        return {}
    return {key: parse_plan(text) for key, text in json.loads(path.read_text()).items()}


def load_steps(directory: str | os.PathLike[str]) -> list[StepTrace]:
    """The steps of a recorded run, in order.

    A last line that does not parse is a step cut off while it was written (rank 0 killed, or
    the file read while a run writes it): it is left out with a warning. A bad line before the
    last is an error that names the file and the line.
    """
    path = Path(directory) / EVENTS
    if not path.exists():
        replicas = sorted(
            (p for p in Path(directory).glob("replica*") if (p / EVENTS).exists()),
            key=lambda p: (len(p.name), p.name),
        )
        if replicas:  # AsyncPipe(trace=DIR, data_parallel_size=N) writes DIR/replica<d>
            names = ", ".join(str(p) for p in replicas)
            raise FileNotFoundError(
                f"{directory} holds one trace per data-parallel replica, not one trace: pass "
                f"one of them ({names})"
            )
        raise FileNotFoundError(
            f"{path} does not exist: pass the directory given to AsyncPipe(trace=...), after "
            f"the run wrote at least one step"
        )
    lines = [(n, line) for n, line in enumerate(path.read_text().split("\n"), 1) if line.strip()]
    steps = []
    for n, line in lines:
        try:
            steps.append(StepTrace.from_json(line))
        except (ValueError, KeyError, TypeError, IndexError) as e:
            why = f"{type(e).__name__}: {e}"
            if isinstance(e, json.JSONDecodeError):  # its "line 1" is the line's own
                why = f"{e.msg} at column {e.colno}"
            if n == lines[-1][0]:
                warnings.warn(
                    f"{path}, line {n} (the last) is not a whole step, left out: a step cut "
                    f"off while it was written ({why})",
                    stacklevel=2,
                )
                break
            raise ValueError(
                f"every line of a trace but the last must be a recorded step: {path}, line "
                f"{n} of {lines[-1][0]} is not ({why}); delete that line "
                f"(or the file) to read the rest"
            ) from e
    return steps
