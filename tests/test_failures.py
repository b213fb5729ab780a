"""Every way a stage can fail ends the whole job: each other rank raises a clear error naming
the failed rank and stage within the configured timeout, and every process exits non-zero."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
from launch import Ended, run_processes

pytestmark = pytest.mark.slow

JOB = os.path.join(os.path.dirname(__file__), "failure_job.py")
TIMEOUT = "10"  # generous: a loaded machine once let a 3 s timeout fire on a healthy rank


def report(ended: Ended) -> dict[str, Any]:
    lines = [line for line in ended.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, (ended.rank, ended.code, ended.stdout, ended.stderr[-2000:])
    result: dict[str, Any] = json.loads(lines[0][len("RESULT ") :])
    return result


# mode -> (failed rank, words the failed rank's own error has, words every other rank's has)
CASES = {
    "forward": (1, "injected forward failure", "stage 1 failed in 1F1"),
    "backward": (1, "injected backward failure", "stage 1 failed in 1B1 (micro-batch 1)"),
    "loss": (2, "injected loss failure", "stage 2 failed in 2F1"),
    "optimizer": (1, "injected optimizer hook failure", "rank 1 (stage 1) is gone"),
    "kill": (1, None, "rank 1 (stage 1) is gone"),
    "exit": (0, None, "rank 0 (stage 0) is gone"),
    # stage 2 finds stage 1 gone as it sends; stage 1's news names the cause
    "late_send": (1, "injected forward failure", "stage 1 failed in 1F1 (micro-batch 1)"),
    "sleep": (
        1,
        None,
        f"rank 1 (stage 1) sent nothing: rank {{}} timed out after {float(TIMEOUT):.1f} s",
    ),
}


@pytest.mark.parametrize("mode", list(CASES))
def test_a_failure_ends_every_rank_with_a_clear_error(mode: str) -> None:
    culprit, own, others = CASES[mode]
    # late_send: rank 2 ends after rank 1's process has ended (see failure_job.py), which waits
    # up to 2 s for the others' news first
    grace = 20 if mode == "late_send" else 5
    ended = run_processes(JOB, 3, mode, TIMEOUT, timeout=120, grace=grace)
    for process in ended:
        if process.rank == culprit and mode in ("kill", "exit"):
            assert process.code == (-9 if mode == "kill" else 1)
            continue
        if process.rank == culprit and mode == "sleep":
            assert process.code is None, "the sleeping rank should still sleep"
            continue
        assert process.code not in (0, None), (process.rank, process.code, process.stderr[-2000:])
        result = report(process)
        assert result["step"] == 1 or (mode == "optimizer" and process.rank == culprit), result
        if process.rank == culprit:
            assert own is not None and own in result["text"], result
            continue
        assert result["type"] == "StageFailure", result
        assert others.format(process.rank) in result["text"], result
        assert result["failed_rank"] == culprit and result["stage"] == culprit, result
        if own is not None and mode in ("forward", "loss"):  # relayed with its text
            assert own in result["text"], result
        if mode == "late_send" and process.rank == 2:
            assert "lost its connection to rank 1 in 2SEND_B0->1" in result["text"], result
        assert "Traceback" not in result["text"] and "pair.cc" not in result["text"], result


@pytest.mark.parametrize("transport", ["p2p", "shm"])
def test_a_rank_killed_before_a_2bw_flush_is_named_by_every_rank(transport: str) -> None:
    # Before, the last stage's drain needed nothing from stage 1, so its flush() returned as if
    # all went well, and its next wait (a checkpoint's) blamed rank 0 after the timeout.
    ended = run_processes(JOB, 3, "kill_flush", TIMEOUT, transport, timeout=120)
    for process in ended:
        if process.rank == 1:
            assert process.code == -9, (process.code, process.stderr[-2000:])
            continue
        result = report(process)
        assert process.code not in (0, None), (process.rank, process.code, result)
        assert result["type"] == "StageFailure" and result["step"] == 3, result
        assert result["failed_rank"] == 1 and "rank 1 (stage 1)" in result["text"], result
        assert result["seconds"] < float(TIMEOUT), result


def test_a_killed_rank_is_named_as_gone_over_rpc_before_the_timeout() -> None:
    ended = run_processes(JOB, 3, "kill", "30", "rpc", timeout=120)
    for process in ended:
        if process.rank == 1:
            assert process.code == -9
            continue
        # the exception's own status: not an abort (-6) from RPC threads left running at exit
        assert process.code == 1, (process.rank, process.code, process.stderr[-2000:])
        assert "terminate called" not in process.stderr, process.stderr[-2000:]
        result = report(process)
        # before: "sent nothing ... timed out after 30.0 s": an RPC peer was only waited for
        assert "rank 1 (stage 1) is gone" in result["text"], result
        assert result["failed_rank"] == 1 and result["stage"] == 1, result


@pytest.mark.parametrize("mode", ["init", "own"])
def test_a_job_that_ends_without_shutdown_exits_cleanly(mode: str) -> None:
    # Collectives right before exit left their clean-up to the group's worker threads, which
    # aborted the exiting process (signal 6) in 10 of 20 runs of this job before asyncpipe
    # paused at exit while the default group lived.
    job = os.path.join(os.path.dirname(__file__), "exit_job.py")
    for _ in range(4):
        for process in run_processes(job, 2, mode, timeout=60):
            assert process.code == 0, (process.rank, process.code, process.stderr[-2000:])
            assert "terminate called" not in process.stderr, process.stderr[-2000:]


def test_a_rank_slower_than_the_timeout_learns_the_others_gave_up_on_it() -> None:
    # Every process stays alive: stage 1 takes 2 * 3 + 1 s in one forward, timeout=3. Stage 1
    # ends last, after its failure path waits for the others' news; on a loaded machine that
    # once took longer than the default 5 s of grace (it had printed its result).
    ended = run_processes(JOB, 3, "late", "3", timeout=120, grace=20)
    for process in ended:
        assert process.code == 1, (process.rank, process.code, process.stderr[-2000:])
        result = report(process)
        assert result["failed_rank"] == 1 and result["stage"] == 1, result
        if process.rank == 1:
            # before: "rank 2 (stage 2) is gone ... crashed or was killed": gloo had closed
            # the connection when rank 2's own receive timed out
            assert "rank 2 (stage 2) gave up waiting for this rank" in result["text"], result
            assert "raise AsyncPipe(timeout=...)" in result["text"], result
        else:
            assert "rank 1 (stage 1) sent nothing" in result["text"], result


def test_a_worker_name_torch_refuses_is_refused_on_every_rank_at_once() -> None:
    # before: rank 0 raised torch's own error, rank 1 a store timeout after init's timeout
    for process in run_processes(JOB, 2, "badname", "10", timeout=60):
        assert process.code == 0, (process.rank, process.stderr[-2000:])
        result = report(process)
        assert result["type"] == "ValueError", result
        assert "worker_map[0] = 'tr ainer' is no RPC worker name" in result["text"], result
        assert process.seconds < 30, process.seconds


def test_a_step_after_shutdown_over_rpc_names_this_ranks_rpc_not_a_peer() -> None:
    for process in run_processes(JOB, 3, "after_shutdown", "10", "rpc", timeout=120):
        assert process.code == 1, (process.rank, process.code, process.stderr[-2000:])
        result = report(process)
        # before: "rank 0 (stage 0) is gone ... crashed or was killed (RPC has not been ...)"
        assert f"RPC is not running on rank {process.rank}" in result["text"], result
        assert "is gone" not in result["text"] and result["failed_rank"] == process.rank, result
