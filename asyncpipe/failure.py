"""Failures and reports of a pipeline step, shared by every rank."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from .microbatch import Tensors

__all__ = ["StageFailure", "StepReport"]

_SEPARATOR = "\x1f"


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


def write_text(words: Tensor, text: str) -> None:
    """Put ``text`` into the int64 tensor ``words`` (host memory) for a collective that carries
    no strings: its length in bytes in ``words[0]``, its UTF-8 bytes from ``words[1]`` on (cut
    to fit). :func:`read_text` reads it back."""
    data = text.encode("utf-8")[: 8 * (words.numel() - 1)]
    words[0] = len(data)
    words[1:].view(torch.uint8)[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)


def read_text(words: Tensor) -> str:
    """The text :func:`write_text` put into ``words`` (a character cut in two is replaced)."""
    data = words[1:].view(torch.uint8)[: int(words[0])]
    return bytes(data.tolist()).decode("utf-8", "replace")


def refusal(lead: str, refused: list[int], me: int, what: str = "arguments") -> StageFailure:
    """The error of rank ``me`` when ranks ``refused`` rejected their ``what`` in a collective
    that checks them before the pipeline sends anything: ``lead`` says what cannot go on."""
    many = len(refused) > 1
    return StageFailure(
        f"{lead}: rank{'s' if many else ''} {', '.join(map(str, refused))} rejected "
        f"{'their' if many else 'its'} {what} (see the error there for what is wrong and how "
        f"to fix it); rank {me} stops too, before any message of the pipeline",
        rank=refused[0],
        stage=-1,
        microbatch=-1,
        action="",
    )


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


def loss_hint(out: Tensors, target: Tensors | None) -> str | None:
    """The likely cause when the loss of a micro-batch fails, if it is the caller's input."""
    if target is None:
        return "the target is None: pass the target to step() on the last stage"
    rows, wanted = out[0].shape[:1], target[0].shape[:1]
    if rows and wanted and rows != wanted:
        return (
            f"the micro-batch's output has {rows[0]} rows but its target has {wanted[0]}: input "
            f"and target must have the same batch size"
        )
    return None


class MismatchedBatch(ValueError):
    """Input and target had different batch sizes: found when a step ends, on every rank.

    The step ran, but its loss and gradients mean nothing: ``step(..., optimizer=...)``
    zeroes the gradients it added (without an optimizer, zero them before the next step). The
    pipeline stays usable, except under ``schedule="2bw"`` (see :doc:`/reliability`)."""


class Failed(Exception):
    """Internal: carries what failed, where, for the status exchange."""

    def __init__(
        self,
        text: str,
        stage: int,
        microbatch: int,
        action: str,
        rank: int,
        source: int | None = None,
    ) -> None:
        super().__init__(text)
        self.text, self.stage, self.microbatch = text, stage, microbatch
        self.action, self.rank, self.source = action, rank, source

    def encode(self) -> str:
        """The failure as the text of an error message."""
        fields = [str(self.stage), str(self.microbatch), self.action, str(self.rank), self.text]
        return _SEPARATOR.join(fields)

    @classmethod
    def decode(cls, text: str, source: int) -> Failed:
        parts = text.split(_SEPARATOR, 4)
        if len(parts) != 5:
            return cls(text, -1, -1, "", source, source)
        stage, microbatch, action, rank, message = parts
        return cls(message, int(stage), int(microbatch), action, int(rank), source)

    @property
    def relayed(self) -> bool:
        return self.source is not None
