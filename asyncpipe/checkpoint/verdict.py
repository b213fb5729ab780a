"""The verdict round of a checkpoint: every rank tells rank 0 how its part went, rank 0 answers.

::

    rank r (r > 0)   Message([step, id, *name bytes], error) ──> rank 0
    rank 0           waits for every rank (one deadline), checks what they sent against its own
    rank 0           Message(error=verdict) ──> every rank      (verdict None: all went well)

The numbers a rank sends are float64 values: the step it saved (or the checkpoint's step it
read), a 48-bit id (its stage file's, or the manifest's it read), and for a save the bytes of
its optimizer's class name, so rank 0 can write them into the manifest without a round more.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..blame import NEWS_SECONDS, PEER_ERRORS
from ..pipe import AsyncPipe
from ..runtime import CHECKPOINT_CHANNEL
from ..transport import Message, PeerLost, TransportTimeout

__all__: list[str] = []


@dataclass(frozen=True)
class Report:
    """What a rank tells rank 0 of its part: ``step``, an ``id`` (below 2**53, exact as a
    float64) and a ``name`` (ASCII or not: sent as its UTF-8 bytes)."""

    step: int
    id: int = 0
    name: str = ""

    def tensor(self) -> torch.Tensor:
        """The report as one float64 tensor."""
        numbers = [float(self.step), float(self.id), *map(float, self.name.encode())]
        return torch.tensor(numbers, dtype=torch.float64)

    @staticmethod
    def of(numbers: Sequence[float]) -> Report:
        """The report whose :meth:`tensor` holds ``numbers`` (a bare step: older peers)."""
        step = int(numbers[0])
        ident = int(numbers[1]) if len(numbers) > 1 else 0
        name = bytes(int(n) for n in numbers[2:]).decode(errors="replace")
        return Report(step, ident, name)


Check = Callable[[int, Report], "str | None"]
"""``check(peer, its report)``: rank 0's problem with what ``peer`` sent, or None."""


def exchange(
    pipe: AsyncPipe, error: str | None, mine: Report, check: Check
) -> tuple[str | None, dict[int, Report]]:
    """Every rank tells rank 0 how its part of saving (or loading) went; rank 0 answers with
    the verdict (:func:`answer`). Returns the problems reported (rank 0 adds its own, and those
    ``check`` finds in what the ranks sent), or None when all went well; on rank 0 also every
    rank's report (those of ranks without an error), on the others only their own."""
    transport, timeout, world = pipe.transport, pipe.timeout, pipe.transport.world_size
    if transport.rank != 0:
        transport.send(0, CHECKPOINT_CHANNEL, Message(0, 1, (mine.tensor(),), error=error))
        waits = timeout + min(timeout, NEWS_SECONDS)  # rank 0 may wait `timeout` for a rank
        try:
            answer = transport.recv(0, CHECKPOINT_CHANNEL).wait(waits)
        except PEER_ERRORS as e:  # rank 0 waits for every rank first: the fault may be theirs
            lost = isinstance(e, ConnectionError)
            how = "lost rank 0" if lost else f"timed out after {waits:.1f} s"
            text = (
                f"rank {transport.rank} {how} waiting for rank 0's verdict on the checkpoint, "
                f"which rank 0 gives once every rank told it how its part went (waiting up to "
                f"{timeout:.1f} s for them): a rank slow, stuck or gone may be at fault, not "
                f"rank 0; rank 0's error names any that did not answer (raise the pipeline's "
                f"timeout if their work really takes longer)"
            )
            raise (PeerLost(text, 0) if lost else TransportTimeout(text)) from e
        # rank 0 answers after it took every rank's part; it may exit at once (GracefulStop)
        transport.flush_received(timeout)
        return answer.error, {transport.rank: mine}
    problems = [f"rank 0: {error}"] if error else []
    reports = {0: mine}
    # all posted at once, waited for against one deadline: the verdict comes within ``waits``
    pending = {peer: transport.recv(peer, CHECKPOINT_CHANNEL) for peer in range(1, world)}
    deadline = time.monotonic() + timeout
    for peer, receive in pending.items():
        try:
            message = receive.wait(max(deadline - time.monotonic(), 0.1))
        except Exception as e:
            problems.append(f"rank {peer}: no answer ({e})")
            continue
        if message.error is not None:
            problems.append(f"rank {peer}: {message.error}")
            continue
        reports[peer] = Report.of(message.values(peer, "checkpoint report"))
        problem = None if error is not None else check(peer, reports[peer])
        if problem is not None:
            problems.append(problem)
    return "; ".join(problems) or None, reports


def answer(pipe: AsyncPipe, verdict: str | None) -> None:
    """Rank 0 tells every other rank the verdict of :func:`exchange`."""
    transport = pipe.transport
    news = Message(0, 1, (torch.zeros(1),), error=verdict)
    for peer in range(1, transport.world_size):
        with contextlib.suppress(Exception):  # a rank that is gone learns nothing, needs nothing
            transport.send(peer, CHECKPOINT_CHANNEL, news)
    # A peer that took the verdict may end its process at once (GracefulStop exits): over
    # rpc the receipt of the send then never comes back, which is no failure of the save.
    with contextlib.suppress(Exception):
        transport.flush(pipe.timeout)
