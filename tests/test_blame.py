"""How a rank reads a failure it cannot see directly: a peer that closed its connection (gone,
or gave up on this slow rank), RPC that is down on this rank, and worker names torch refuses."""

from __future__ import annotations

import time

import pytest

from asyncpipe.blame import FailureBlame
from asyncpipe.failure import Failed
from asyncpipe.group import worker_names
from asyncpipe.schedule import Action
from asyncpipe.transport import PeerLost

CLOSED = "rank 1 lost rank 2 while sending to it: Connection closed by peer [127.0.0.1]:4242"


class Blame(FailureBlame):
    """Rank 1 of three stages on three ranks, timeout 2 s."""

    def __init__(self) -> None:
        self.rank, self.owners, self.timeout, self._statuses = 1, [0, 1, 2], 2.0, {}
        self._heard = {}

    def channel(self, action: Action) -> tuple[int, int]:
        assert action.peer is not None
        return self.owners[action.peer], 0


def blame(error: Exception, current: str, heard: float | None) -> Failed:
    runtime = Blame()
    if heard is not None:  # seconds ago a message from rank 2 came
        runtime._heard = {2: time.monotonic() - heard, -1: time.monotonic() - heard}
    failure = runtime._peer_failure(Action.parse(current), current, error)
    assert failure is not None
    return failure


@pytest.mark.parametrize("current", ["1SEND_F0->2", "1RECV_B0->2"])
def test_a_peer_that_closed_after_this_rank_was_slower_than_the_timeout_gave_up(
    current: str,
) -> None:
    failure = blame(PeerLost(CLOSED, 2), current, heard=4.0)
    # before: "rank 2 (stage 2) is gone ... rank 2 crashed or was killed" (it was alive)
    assert "rank 2 (stage 2) gave up waiting for this rank after its timeout" in failure.text
    assert "raise AsyncPipe(timeout=...)" in failure.text and "crashed" not in failure.text
    assert failure.rank == 1 and failure.stage == 1  # this rank was the slow one


def test_gloos_own_words_for_a_timeout_closure_say_a_peer_gave_up() -> None:
    error = PeerLost("rank 1 lost rank 2: Application timeout caused pair closure", 2)
    assert "gave up waiting" in blame(error, "1SEND_F0->2", heard=0.0).text


@pytest.mark.parametrize(
    ("text", "heard"),
    [(CLOSED, 0.1), ("rank 1 lost rank 2: Connection reset by peer", 4.0)],
)
def test_a_peer_whose_connection_closed_without_a_timeout_is_gone(text: str, heard: float) -> None:
    failure = blame(PeerLost(text, 2), "1SEND_F0->2", heard=heard)
    assert "rank 2 (stage 2) is gone" in failure.text and "crashed or was killed" in failure.text
    assert failure.rank == 2


def test_rpc_shut_down_on_this_rank_is_this_ranks_failure_not_the_peers() -> None:
    cause = RuntimeError("RPC has not been initialized. Call torch.distributed.rpc.init_rpc first.")
    error = PeerLost("rank 1 lost rank 0 (RPC worker 'worker0') while waiting: ...", 0)
    error.__cause__ = cause
    failure = blame(error, "1RECV_F0->0", heard=None)
    # before: "rank 0 (stage 0) is gone ... crashed or was killed (RPC has not been ...)"
    assert "is gone" not in failure.text and failure.rank == 1, failure.text
    assert "RPC is not running on rank 1" in failure.text
    assert "asyncpipe.shutdown()" in failure.text and "asyncpipe.init(rpc=True)" in failure.text
    own = Blame()._own_failure(Action.parse("0SEND_F0->1"), "0SEND_F0->1", cause)
    assert "RPC is not running on rank 1" in own.text


def test_worker_names_fill_in_the_ranks_left_out() -> None:
    assert worker_names(None, 2) == {0: "worker0", 1: "worker1"}
    assert worker_names({1: "a-b_c:d"}, 2) == {0: "worker0", 1: "a-b_c:d"}


@pytest.mark.parametrize(
    ("worker_map", "words"),
    [
        ({"0": "trainer", "1": "stage1"}, "keys must be the ranks (ints 0..1), got '0'"),
        ({0: "a", 2: "b"}, "got 2"),
        ({0: "tr ainer:x", 1: "s"}, "worker_map[0] = 'tr ainer:x' is no RPC worker name"),
        ({0: "a.b"}, "is no RPC worker name"),
        ({0: "x" * 128}, "is no RPC worker name"),
        ({0: ""}, "is no RPC worker name"),
        ({0: 7}, "worker_map[0] must be a str"),
        ({0: "a", 1: "a"}, "gives ranks [0, 1] the same RPC worker name 'a'"),
        ({0: "worker1"}, "gives ranks [0, 1] the same RPC worker name 'worker1'"),
    ],
)
def test_worker_maps_torch_would_refuse_or_ignore_are_refused(
    worker_map: dict[object, object], words: str
) -> None:
    # before: torch refused a bad name on its rank only (the others waited for it, then
    # raised a store timeout), and string keys were silently ignored
    with pytest.raises(ValueError, match="worker_map") as raised:
        worker_names(worker_map, 2)
    assert words in str(raised.value)


def test_the_worker_name_rule_is_torchs() -> None:
    from torch.distributed.rpc import WorkerInfo

    for name in ["a-b_c:d", "x" * 127, "a.b", "tr ainer", "", "x" * 128, "é"]:
        try:
            WorkerInfo(name, 0)
            torch_takes = True
        except RuntimeError:
            torch_takes = False
        try:
            worker_names({0: name}, 1)
            ours = True
        except ValueError:
            ours = False
        assert ours == torch_takes, name
