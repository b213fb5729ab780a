"""Data parallel x pipeline on 4 processes: 2 stages x 2 replicas."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from parallel_workers import (
    bf16_replicas,
    groups_released,
    replica_arguments_differ,
    replica_fails,
    replica_stops,
    replicas_differ,
    saved_replicas,
    two_by_two,
    unused_parameters,
)
from spawn import run_ranks

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(
    "schedule,transport",
    [("gpipe", "p2p"), ("1f1b", "p2p"), ("zero_bubble", "p2p"), ("interleaved", "p2p"),
     ("1f1b", "rpc"), ("zero_bubble", "shm")],
)  # fmt: skip
def test_two_stages_by_two_replicas_match_the_plain_model(schedule: str, transport: str) -> None:
    results = run_ranks(two_by_two, 4, schedule, transport, timeout=180)
    assert [(r["stage"], r["replica"], r["size"]) for r in results] == [
        (0, 0, 2), (1, 0, 2), (0, 1, 2), (1, 1, 2)
    ]  # fmt: skip
    for r in results:
        assert r["grad_error"] < 1e-5 and r["norm_error"] < 1e-5, r
        # the data-parallel group waits as long as asyncpipe's bounded waits allow (twice the
        # pipeline's timeout of 30 s, plus a minute), not torch's default of 30 minutes
        assert r["group_timeout"] == 120.0, r


@pytest.mark.parametrize("mode", ["step", "manual"])
def test_a_failed_replica_stops_the_other_replicas(mode: str) -> None:
    # The healthy replica waited for the failed one's gradients in the all-reduce until the
    # process group's timeout (30 minutes by default) or until the failed processes exited.
    results = run_ranks(replica_fails, 4, mode, timeout=180)
    for rank, (kind, text, stage) in enumerate(results):
        assert kind == "StageFailure" and stage == 0, (rank, kind, text)
        if rank < 2:  # replica 0: told by replica 1
            assert text.startswith("replica 1 of the pipeline failed in this step (") and (
                f"stage {rank} of replica 0 stops too" in text
            ), text
            assert "mat1 and mat2 shapes cannot be multiplied" in text, text
        else:
            assert "mat1 and mat2 shapes cannot be multiplied" in text, text


def test_a_replica_that_takes_no_step_fails_the_others_within_twice_the_timeout() -> None:
    results = run_ranks(replica_fails, 4, "absent", timeout=180)
    assert results[2:] == [("no error", "", -1)] * 2
    for rank, (kind, text, stage) in enumerate(results[:2]):
        assert kind == "StageFailure" and stage == rank, (rank, kind, text)
        assert f"stage {rank} of replica 0 waited for the other replicas of its stage" in text
        assert f"(replica 1 on global rank {rank + 2})" in text, text  # who it waited for
        assert "at most 4.0 s" in text, text


def test_ranks_that_ask_for_different_replicas_say_so_at_once() -> None:
    for kind, text in run_ranks(replicas_differ, 2, timeout=50):  # before: a 60 s timeout
        assert kind == "ValueError", (kind, text)
        assert "every rank must pass the same data_parallel_size (rank 0: 1, rank 1: 2)" in text


def test_replicas_built_with_other_arguments_are_refused_at_once() -> None:
    for rank, (kind, text) in enumerate(run_ranks(replica_arguments_differ, 4, timeout=120)):
        assert kind == "ValueError", (rank, kind, text)
        other = 1 if rank < 2 else 0
        assert f"replica {1 - other}'s differ from those of replica {other} in: loss_scale" in text


def test_parameters_without_a_gradient_on_every_replica_keep_none() -> None:
    for rank, (none, used, moved) in enumerate(run_ranks(unused_parameters, 4, timeout=120)):
        assert none == [True, True] and used == [True, True], (rank, none, used)
        assert moved == [0.0, 0.0], (rank, moved)


def test_a_stop_asked_on_one_replica_is_agreed_by_every_rank() -> None:
    assert run_ranks(replica_stops, 4, timeout=180) == [True] * 4


def test_bfloat16_replicas_train() -> None:
    curves = run_ranks(bf16_replicas, 4, timeout=180)
    for curve in curves:
        assert curve[-1] < 0.6 * curve[0]
    # the replicas see different halves of the batch, so their losses differ
    assert curves[1][-1] != curves[3][-1]


def test_a_pipe_keeps_no_process_group_alive_after_it_is_destroyed() -> None:
    for result in run_ranks(groups_released, 4, timeout=120):
        assert result["groups"] >= 3  # the world, the pipeline's and the data-parallel group
        assert result["alive"] == 0, result
        assert "process group of this pipeline was destroyed" in result["after"], result


def test_replicas_save_one_checkpoint_and_every_rank_learns_it(tmp_path: Path) -> None:
    # before: both replicas wrote the same stage files and manifest, racing (saves failed at
    # random on some ranks, with a misleading "not the same path" error)
    for result in run_ranks(saved_replicas, 4, str(tmp_path), timeout=180):
        assert result["outcomes"] == ["saved"] * 3, result
        assert result["step"] == 3 and result["error"] == 0.0, result
    assert sorted(os.listdir(tmp_path)) == ["manifest.json", "stage0.step3.pt", "stage1.step3.pt"]
