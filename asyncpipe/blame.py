"""Who failed, and how to say it: a rank's own failure, a peer's news of its failure, a peer
that went silent or is gone, and the notices a failed rank sends so nobody waits for it.

The end-of-step news each rank sends every other (``Runtime._finish``) is a row of floats::

    [loss, outcome, failed stage, micro-batch, rank, stop asked, input rows, target rows,
     failed action's kind (-1: none or unknown), this rank timed out waiting for the failed one]
"""

from __future__ import annotations

import time
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
RPC_DOWN = "RPC has not been initialized"
"""What torch's RPC raises on a rank where it is not running (shut down, or never started)."""
TIMEOUT_CLOSURE = "Application timeout caused pair closure"
"""What gloo says on a rank where a receive timed out: it closed every connection of the group."""
CLOSED_BY_PEER = "closed by peer"
"""What gloo says when the other end closed the connection: its process exited, or one of its
receives timed out and gloo closed its connections (the peer still runs)."""


def error_text(error: BaseException) -> str:
    """The text of ``error`` and of the errors that caused it."""
    texts: list[str] = []
    seen: set[int] = set()
    cause: BaseException | None = error
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        texts.append(str(cause))
        cause = cause.__cause__ or cause.__context__
    return "\n".join(texts)


def rpc_down(rank: int) -> str:
    """Why a step over RPC failed at once on ``rank``: RPC is not running there."""
    return (
        f"RPC is not running on rank {rank}: it was shut down (asyncpipe.shutdown()) or never "
        f"started, so this pipeline (transport='rpc') cannot run any more; call "
        f"asyncpipe.init(rpc=True) again on every rank and build a new AsyncPipe"
    )


class FailureBlame:
    """The runtime's reading of failures (mixed into :class:`~asyncpipe.runtime.Runtime`)."""

    rank: int
    owners: list[int]
    timeout: float
    transport: Transport
    _statuses: dict[int, PendingRecv]
    _heard: dict[int, float]
    """When a message last came from each rank (key -1: from any), by ``time.monotonic``."""

    if TYPE_CHECKING:  # provided by Runtime

        def channel(self, action: Action) -> tuple[int, int]: ...

        def outgoing(self) -> set[tuple[int, int]]: ...

    def _own_failure(self, action: Action | None, current: str, error: Exception) -> Failed:
        """This rank's failure: ``error`` came while it ran ``action`` (``current``: its text,
        or "prepare", or "" before any action)."""
        what = f"{type(error).__name__}: {error}"
        if RPC_DOWN in error_text(error):
            what = rpc_down(self.rank)
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
        if RPC_DOWN in error_text(error):  # this rank's own RPC is down, not the peer
            return self._own_failure(action, current, error)
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
        gave_up = self._gave_up(peer, action, current, error) if peer is not None else None
        if gave_up is not None:
            return gave_up
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

    def _heard_from(self, peer: int) -> None:
        """Note that a message from rank ``peer`` came just now (see :meth:`_gave_up`)."""
        self._heard[peer] = self._heard[-1] = time.monotonic()

    def _silence(self, peer: int) -> float | None:
        """Seconds since a message last came from rank ``peer`` (from any rank, if none came
        from it yet); None before any came."""
        last = self._heard.get(peer, self._heard.get(-1))
        return None if last is None else time.monotonic() - last

    def _gave_up(
        self, peer: int, action: Action | None, current: str, error: Exception
    ) -> Failed | None:
        """The failure to report where gloo's connection to ``peer`` was closed while this rank
        kept it waiting longer than the timeout: gloo closes a rank's connections when one of
        its receives times out, so the peer most likely gave up on this slow rank (it still
        runs; a peer that exited closes its connections alike). None where the evidence is
        that the peer is gone (the connection was reset, or this rank heard from it lately)."""
        if not isinstance(error, ConnectionError):
            return None
        text = error_text(error)
        silence = self._silence(peer)
        slow = silence is not None and silence >= self.timeout
        if TIMEOUT_CLOSURE not in text and not (CLOSED_BY_PEER in text.lower() and slow):
            return None
        stage = self.owners.index(peer) if peer in self.owners else -1
        since = f", {silence:.1f} s after it last received a message" if silence is not None else ""
        where = f"in {current}" if current else "as its step began"
        text = (
            f"rank {peer} (stage {stage}) gave up waiting for this rank after its timeout (or is "
            f"gone): rank {self.rank} found its connection to rank {peer} closed {where}{since} "
            f"({error}); gloo closes a rank's connections when one of its receives times out, "
            f"so rank {self.rank} was most likely slower than the pipeline's "
            f"timeout={self.timeout:g} s (its work took that long, or it began the step late): "
            f"raise AsyncPipe(timeout=...) if its work really takes that long, and see rank "
            f"{peer}'s own error"
        )
        mb = action.microbatch if action is not None else -1
        return Failed(text, action.stage if action is not None else -1, mb, current, self.rank)

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
        gave_up = self._gave_up(peer, action, str(action), error)
        if gave_up is not None:
            return gave_up
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
        peer = self.channel(action)[0]
        self._heard_from(peer)
        if message.error is not None:
            failure = Failed.decode(message.error, peer)
            failure.text += f" (reported to rank {self.rank} while it waited in {action})"
            raise failure


def failure_in(news: Sequence[float]) -> tuple[int, int, int, str, str]:
    """The failure a rank's end-of-step news reports: stage, micro-batch, rank, the failed
    action ("" where unknown) and the words saying where the step failed."""
    stage, microbatch, rank, code = (int(v) for v in [*news[2:5], news[8]])
    action = str(Action(stage, KINDS[code], microbatch)) if code >= 0 and stage >= 0 else ""
    where = f"in {action} (micro-batch {microbatch})" if action else f"at micro-batch {microbatch}"
    return stage, microbatch, rank, action, f"stage {stage} failed {where} on rank {rank}"
