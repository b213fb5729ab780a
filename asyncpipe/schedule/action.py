"""Actions: the unit of work in a pipeline plan, with a compact text form ("2F0")."""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

__all__: list[str] = []


class Kind(str, enum.Enum):
    """What an action does. Compute kinds run layers; the others move tensors between ranks."""

    FORWARD = "F"
    BACKWARD = "B"
    WEIGHT = "W"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"

    @property
    def is_compute(self) -> bool:
        return self in _COMPUTE

    @property
    def is_send(self) -> bool:
        return self in _SENDS

    @property
    def is_recv(self) -> bool:
        return self in _RECVS


# Looked up on every action the runtime runs: a set of members costs tens of nanoseconds where
# a tuple of ``Kind.X`` costs a class-attribute lookup through the enum's metaclass each.
_COMPUTE = frozenset((Kind.FORWARD, Kind.BACKWARD, Kind.WEIGHT))
_SENDS = frozenset((Kind.SEND_F, Kind.SEND_B))
_RECVS = frozenset((Kind.RECV_F, Kind.RECV_B))


_PATTERN = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|B|W)(\d+)(?:->(\d+))?$")


@dataclass(frozen=True, order=True)
class Action:
    """One step of a plan: ``stage`` does ``kind`` for micro-batch ``microbatch``.

    The text form is ``f"{stage}{kind}{microbatch}"``, e.g. ``"2F0"`` (stage 2, forward,
    micro-batch 0) or ``"1SEND_F3"``. Communication actions name the peer stage after an arrow:
    ``"1SEND_F3->2"`` sends stage 1's output of micro-batch 3 to stage 2.

    Example:
        >>> Action.parse("2F0")
        Action(stage=2, kind=<Kind.FORWARD: 'F'>, microbatch=0, peer=None)
        >>> str(Action(1, Kind.BACKWARD, 3))
        '1B3'
    """

    stage: int
    kind: Kind
    microbatch: int
    peer: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.kind, Kind):
            object.__setattr__(self, "kind", Kind(self.kind))
        if self.stage < 0 or self.microbatch < 0:
            raise ValueError(
                f"stage and micro-batch of an action must be >= 0 "
                f"(stage: {self.stage}, microbatch: {self.microbatch})"
            )
        if (self.peer is None) == (not self.kind.is_compute):
            raise ValueError(
                f"send and receive actions name a peer stage, compute actions do not "
                f"(kind: {self.kind.value}, peer: {self.peer})"
            )

    def __str__(self) -> str:
        text = f"{self.stage}{self.kind.value}{self.microbatch}"
        return text if self.peer is None else f"{text}->{self.peer}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """Read the text form back: ``Action.parse(str(a)) == a``.

        Raises:
            ValueError: if ``text`` is not of the form ``<stage><kind><microbatch>[-><peer>]``.
        """
        match = _PATTERN.match(text.strip())
        if match is None:
            raise ValueError(
                f"cannot parse action {text!r}: expected <stage><kind><microbatch>, kind one of "
                f"F, B, W, SEND_F, RECV_F, SEND_B, RECV_B, e.g. '2F0' or '1SEND_F3->2'"
            )
        stage, kind, microbatch, peer = match.groups()
        return cls(int(stage), Kind(kind), int(microbatch), None if peer is None else int(peer))


Plan = dict[int, list[Action | None]]
"""A schedule: for each rank, the actions it runs in order (``None`` is an idle slot)."""


def format_plan(plan: Plan, mark: dict[int, int] | None = None) -> str:
    """Render a plan as text, one row per rank; ``mark`` maps rank -> index to flag with ``>>``."""
    lines = []
    for rank in sorted(plan):
        cells = []
        for index, action in enumerate(plan[rank]):
            cell = "." if action is None else str(action)
            if mark is not None and mark.get(rank) == index:
                cell = f">>{cell}<<"
            cells.append(cell)
        lines.append(f"rank {rank}: " + " ".join(cells))
    return "\n".join(lines)
