"""A rank killed while the shm transport is set up leaves nothing behind in ``/dev/shm``, and
the survivors name it."""

from __future__ import annotations

import os
import sys

import pytest
from shm_setup_workers import killed_after_create
from spawn import run_ranks_raw

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not sys.platform.startswith("linux"), reason="the shm transport runs on Linux"
    ),
]


def test_a_rank_killed_after_it_made_its_rings_leaves_none_in_dev_shm() -> None:
    results = run_ranks_raw(killed_after_create, 3, timeout=120, may_die=True)
    assert results[1] == ("died", -9)
    tokens = {result[1][0] for r, result in enumerate(results) if r != 1}
    assert len(tokens) == 1
    token = tokens.pop()
    left = sorted(name for name in os.listdir("/dev/shm") if f"asyncpipe-{token}-" in name)
    for name in left:  # leave /dev/shm clean even when the test fails
        os.unlink(os.path.join("/dev/shm", name))
    assert left == []  # before, rank 1's rings and doorbell stayed: 0-1, 2-1 and its doorbell
    for rank in (0, 2):
        status, (_, kind, text, peer, seconds) = results[rank]
        assert status == "ok"
        assert kind == "PeerLost" and peer == 1, text
        assert "rank 1 (process" in text and "exited during it" in text
        assert seconds < 60
