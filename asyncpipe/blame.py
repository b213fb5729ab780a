"""Who failed, and how to say it: a rank's own failure, a peer's news of its failure, a peer
that went silent or is gone, and the notices a failed rank sends so nobody waits for it.

The end-of-step news each rank sends every other (``Runtime._finish``) is a row of floats::

    [loss, outcome, failed stage, micro-batch, rank, stop asked, input rows, target rows,
     failed action's kind (-1: none or unknown)]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from .failure import Failed, StageFailure
from .schedule import Action, Kind
from .transport import Message, PeerLost, PendingRecv, Transport, TransportTimeout

__all__: list[str] = []

KINDS = list(Kind)
OK, FAILED, RELAYED = 0.0, 1.0, 2.0
"""The outcome field of the news: this rank's step went well, failed, or failed elsewhere."""
NEWS_SECONDS = 2.0
"""How long a failed rank waits for its failure notices to be taken."""
PEER_ERRORS = (TransportTimeout, ConnectionError)
"""What a receive raises when its peer is silent or gone."""


class FailureBlame:
    """The runtime's reading of failures (mixed into :class:`~asyncpipe.runtime.Runtime`)."""

    rank: int
    owners: list[int]
    timeout: float
    transport: Transport
    _statuses: dict[int, PendingRecv]

    if TYPE_CHECKING:  # provided by Runtime

        def channel(self, action: Action) -> tuple[int, int]: ...

        def outgoing(self) -> set[tuple[int, int]]: ...

    def _own_failure(self, action: Action | None, current: str, error: Exception) -> Failed:
        """This rank's failure: ``error`` came while it ran ``action`` (``current``: its text,
        or "prepare", or "" before any action)."""
        what = f"{type(error).__name__}: {error}"
        if action is not None:
            text = (
                f"stage {action.stage} failed in {current} (micro-batch {action.microbatch}) on "
                f"rank {self.rank}: {what}"
            )
            return Failed(text, action.stage, action.microbatch, current, self.rank)
        if current == "prepare":
            text = f"rank {self.rank} rejected its arguments: {what}"
        else:
            text = f"rank {self.rank} failed before its first action: {what}"
        return Failed(text, -1, -1, current, self.rank)

    def _peer_failure(self, action: Action | None, current: str, error: Exception) -> Failed | None:
        """The failure to report when ``error`` (a timeout, or a lost connection) came while
        this rank ran ``action`` (``current``: its text): the peer's own news of its failure
        where the peer sent it before it went, else the peer named as silent or gone (None:
        nothing better than ``error`` itself is known)."""
        peer = error.peer if isinstance(error, PeerLost) else None
        if peer is None and action is not None and action.peer is not None:
            peer = self.owners[action.peer]
        if peer is not None and isinstance(error, ConnectionError):
            news = self._news_of(peer)
            if news is not None and news[1] != OK:
                stage, mb, rank, owed, where = failure_in(news)
                text = (
                    f"{where} (see that rank's error for the cause); rank {self.rank} lost its "
                    f"connection to rank {peer} in {current}"
                )
                return Failed(text, stage, mb, owed, rank, peer)
        waited = action.peer if action is not None and action.kind.is_recv else None
        if action is not None and waited is not None and peer == self.owners[waited]:
            return self._silent_peer(action, error)
        if isinstance(error, PeerLost):
            stage = self.owners.index(peer) if peer in self.owners else -1
            text = (
                f"rank {peer} (stage {stage}) is gone: rank {self.rank} lost its connection to "
                f"it {f'in {current}' if current else 'as its step began'} ({error}); rank "
                f"{peer} crashed or was killed, see its own log for the cause"
            )
            mb = action.microbatch if action is not None else -1
            return Failed(text, stage, mb, current, error.peer)
        return None

    def _news_of(self, peer: int) -> list[float] | None:
        """The end-of-step news of ``peer`` if it came before ``peer`` went (its receive was
        posted; a moment's wait at most), else None."""
        pending = self._statuses.get(peer)
        if pending is None:
            return None
        try:
            return pending.wait(min(self.timeout, NEWS_SECONDS / 4)).values(peer, "status")
        except Exception:
            return None

    def _silent_peer(self, action: Action, error: Exception) -> Failed:
        """The failure of a peer that died or fell silent while this rank waited in ``action``
        (a receive): it names that peer, its stage and the action it had not finished; or the
        mismatch where the peer's step ended well without it (this rank named)."""
        assert action.peer is not None
        peer = self.owners[action.peer]
        kind = Kind.FORWARD if action.kind is Kind.RECV_F else Kind.BACKWARD
        owed = Action(action.peer, kind, action.microbatch)
        what = "output" if kind is Kind.FORWARD else "input gradients"
        waited = f"in {action} waiting for the {what} of {owed} from rank {peer}"
        news = self._news_of(peer) if isinstance(error, TransportTimeout) else None
        if news is not None and news[1] == OK:  # the peer's step went well without it
            text = (
                f"rank {peer} (stage {action.peer}) ended its step without sending what rank "
                f"{self.rank} waited for {waited}: the ranks ran different calls (pipe.step on "
                f"some, pipe.forward or an evaluation on others) or different plans; call the "
                f"same method, in the same mode, on every rank"
            )  # this rank found it: the others' errors name it and point here
            return Failed(text, action.stage, action.microbatch, str(action), self.rank)
        if isinstance(error, TransportTimeout):
            text = (
                f"rank {peer} (stage {action.peer}) sent nothing: rank {self.rank} timed out after "
                f"{self.timeout:.1f} s {waited}; rank {peer} is stuck, far slower than the "
                f"others, or gone (raise AsyncPipe(timeout=...) if its work really takes that "
                f"long)"
            )
        else:
            gist = str(error).split(": ", 1)[-1]
            text = (
                f"rank {peer} (stage {action.peer}) is gone: rank {self.rank} lost its "
                f"connection {waited} ({gist}); rank {peer} crashed or was killed, see its own "
                f"log for the cause"
            )
        return Failed(text, action.peer, action.microbatch, str(owed), peer)

    def _notify(self, failure: Failed) -> None:
        """Tell every peer that reads from this rank, so nobody waits for us in vain."""
        message = Message(max(failure.microbatch, 0), 0, (), error=failure.encode())
        for peer, channel in sorted(self.outgoing()):
            if peer == failure.source:
                continue
            try:
                self.transport.send(peer, channel, message)
            except Exception:  # noqa: S112 - best effort: the peer may be gone already
                continue

    def _raise(self, failure: Failed, original: BaseException | None) -> BaseException:
        if failure.action == "prepare" and isinstance(original, (TypeError, ValueError)):
            return original  # the caller's own bad argument: raise it as it is
        error = StageFailure(
            failure.text,
            rank=failure.rank,
            stage=failure.stage,
            microbatch=failure.microbatch,
            action=failure.action,
        )
        if original is not None and not isinstance(original, Failed):
            error.__cause__ = original
        return error

    def _check_error(self, message: Message, action: Action) -> None:
        if message.error is not None:
            failure = Failed.decode(message.error, self.channel(action)[0])
            failure.text += f" (reported to rank {self.rank} while it waited in {action})"
            raise failure


def failure_in(news: Sequence[float]) -> tuple[int, int, int, str, str]:
    """The failure a rank's end-of-step news reports: stage, micro-batch, rank, the failed
    action ("" where unknown) and the words saying where the step failed."""
    stage, microbatch, rank, code = (int(v) for v in [*news[2:5], news[8]])
    action = str(Action(stage, KINDS[code], microbatch)) if code >= 0 and stage >= 0 else ""
    where = f"in {action} (micro-batch {microbatch})" if action else f"at micro-batch {microbatch}"
    return stage, microbatch, rank, action, f"stage {stage} failed {where} on rank {rank}"
