"""Failures and reports of a pipeline step, shared by every rank."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["StageFailure", "StepReport"]


class StageFailure(RuntimeError):
    """A stage of the pipeline failed; raised on every rank of the pipeline.

    Attributes:
        stage: the stage (segment) whose action failed, or -1 if unknown.
        microbatch: the micro-batch it worked on, or -1.
        action: the action string, e.g. ``"2F3"``, or ``""``.
        rank: the rank where it failed.
    """

    def __init__(self, text: str, *, rank: int, stage: int, microbatch: int, action: str) -> None:
        super().__init__(text)
        self.rank, self.stage, self.microbatch, self.action = rank, stage, microbatch, action


@dataclass(frozen=True)
class StepReport:
    """Timing of one step on this rank.

    Attributes:
        seconds: wall time of the step.
        busy_seconds: time spent in compute actions (forward, backward, weight gradient).
        events: ``(action, start, end)`` for every action run, seconds since the step began.
    """

    seconds: float
    busy_seconds: float
    events: list[tuple[str, float, float]] = field(default_factory=list, repr=False)
    start: float = 0.0
    """``time.perf_counter()`` when the step began (the system-wide monotonic clock on Linux)."""
    peak_activations: int = 0
    """Most micro-batches whose activations this rank held at once (forward run, backward or
    weight gradient not yet)."""

    @property
    def idle_fraction(self) -> float:
        """Share of the step this rank spent not computing (waiting, sending, bubbles)."""
        return 0.0 if self.seconds <= 0 else max(0.0, 1.0 - self.busy_seconds / self.seconds)
