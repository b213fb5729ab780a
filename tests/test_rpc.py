"""The RPC transport: same results as the plain model for every schedule, policy and skips."""

from __future__ import annotations

import pytest
from gloo_workers import check_errors, check_failed_constructor, check_two_pipelines, two_pipelines
from rpc_workers import (
    driver,
    driver_dies,
    driver_elsewhere,
    driver_everywhere,
    driver_reused_last,
    driver_stage_cannot_build,
    driver_worker_exits,
    driver_worker_stuck,
    named_workers,
    outbox,
    outbox_peer_dies,
    rpc_cannot_build,
    rpc_one_tuples,
    rpc_skips,
    rpc_transparency,
)
from spawn import run_ranks, run_ranks_raw

pytestmark = pytest.mark.slow


def test_rpc_two_processes_every_schedule_and_policy() -> None:
    results = run_ranks(
        rpc_transparency,
        2,
        [[2, 2], [1, 3]],
        [1, 3],
        ("gpipe", "1f1b", "zero_bubble"),
        ("always", "except_last", "never"),
        timeout=240,
    )
    check_errors(results)
    assert len(results[0]) == 2 * 2 * 3 * 3


@pytest.mark.parametrize("where", ["arguments", "build", "build-all"])
def test_rpc_a_constructor_that_fails_on_one_rank_stops_the_others_at_once(where: str) -> None:
    check_failed_constructor(run_ranks(rpc_cannot_build, 3, where, timeout=180), where)


def test_rpc_a_tuple_of_one_tensor_crosses_stages_as_a_tuple() -> None:
    for rank, errors in enumerate(run_ranks(rpc_one_tuples, 2, timeout=180)):
        for case, (loss, grads, inference) in errors.items():
            assert max(loss, grads, inference) < 1e-6, (rank, case, loss, grads, inference)


def test_rpc_three_processes_interleaved_and_skips() -> None:
    cases = [
        ("crossing", [1, 2, 2], schedule, "except_last", 3)
        for schedule in ("gpipe", "1f1b", "zero_bubble")
    ]
    cases.append(("six", [1] * 6, "interleaved", "always", 3))
    check_errors(run_ranks(rpc_skips, 3, cases, timeout=240))


@pytest.mark.parametrize("world,schedule", [(2, "gpipe"), (4, "1f1b")])
def test_driver_mode_trains_like_the_plain_model(world: int, schedule: str) -> None:
    result = run_ranks(driver, world, schedule, timeout=240)[0]
    assert result["grads"] == 2 * 2 * world  # weight and bias of 2 linears per stage
    assert result["loss_error"] < 1e-5 and result["grad_error"] < 1e-5, result
    assert result["state_keys"] and result["state_error"] < 1e-5, result
    assert result["output_error"] < 1e-5, result
    assert f"stage {world - 1} failed" in result["failure"]
    assert "this loss always fails" in result["failure"]
    text, stage, rank = result["foreach_failure"]
    assert f"stage {world - 1} (rank {world - 1}) raised in failing_on_last: KeyError" in text
    assert stage == rank == world - 1, result["foreach_failure"]
    assert "loss_fn is sent to other processes, so it must be picklable" in result["lambda"]


def test_driver_only_on_rank_zero() -> None:
    results = run_ranks(driver_elsewhere, 2, timeout=120)
    assert "built on rank 0 only (this is rank 1)" in results[1]


def test_a_stage_that_fails_to_build_is_named_by_the_driver_which_goes_on() -> None:
    # The other workers' stages hear of it at once (they waited until the timeout before),
    # and the driver names the rank where it began; the workers keep serving.
    kind, text, loss = run_ranks(driver_stage_cannot_build, 3, timeout=180)[0]
    assert kind == "ValueError", (kind, text)
    assert text.startswith("building the stage of rank 1 failed: RuntimeError: no memory"), text
    assert loss < 1e-6


@pytest.mark.parametrize("world", [2, 3])
def test_a_worker_stuck_in_its_layers_fails_the_drivers_step_within_its_timeout(
    world: int,
) -> None:
    # The driver waited for the stuck worker's answer until its layer returned (or RPC's
    # timeout), long after its own stage had timed out waiting for that worker. With three
    # ranks it named rank 1, which had only timed out waiting for the stuck rank 2.
    seen, named, took = run_ranks(driver_worker_stuck, world, timeout=150)[0]
    stuck = world - 1
    assert named == stuck, seen
    assert f"rank {stuck} (worker{stuck}) did not answer within 3.0 s" in seen, seen
    assert took < 18, took  # twice the pipeline's timeout and some; the layer sleeps 25 s


def test_workers_stop_serving_when_the_driver_dies() -> None:
    results = run_ranks_raw(driver_dies, 2, timeout=120, may_die=True)
    assert results[0] == ("died", 3)
    status, (message, seconds) = results[1]
    assert status == "ok"
    assert "the driver ('worker0') went away without shutting down" in message
    assert seconds < 60


def test_a_driver_whose_last_stage_is_on_rank_zero_steps_and_infers() -> None:
    loss, output, refused = run_ranks(driver_reused_last, 2, timeout=120)[0]
    assert loss < 1e-6 and output < 1e-6, (loss, output)
    assert "data_parallel_size must be 1" in refused, refused


def test_a_worker_that_exits_or_is_gone_is_named_by_the_driver() -> None:
    results = run_ranks_raw(driver_worker_exits, 2, timeout=120, may_die=True)
    assert results[1] == ("died", 5)
    (exits, exit_text), *gone = results[0][1]
    assert exits == 1 and "stage 1 (rank 1) raised in _exits: SystemExit: 2" in exit_text
    for rank, text in gone:  # the function that ended the process, then state_dict
        assert rank == 1 and "rank 1 (worker1) is gone: its process ended" in text, text


def test_messages_sent_faster_than_acknowledged_share_remote_calls() -> None:
    results = run_ranks(outbox, 2, 300, timeout=120)
    calls = results[0]
    # every message arrived once, in order, with its flags and error text (checked on rank 1)
    assert results[1] == [None] * 299 + ["stage 0 failed"]
    assert sum(calls) == 300
    # the first calls go at once, one message each; later ones carry what waited meanwhile
    assert calls[:4] == [1, 1, 1, 1] and len(calls) < 300 and max(calls) <= 64, calls


def test_a_peer_that_dies_with_messages_on_their_way_fails_the_flush() -> None:
    results = run_ranks_raw(outbox_peer_dies, 2, timeout=120, may_die=True)
    status, (kind, text, seconds) = results[0]
    assert status == "ok" and kind == "TransportTimeout", (kind, text)
    assert "could not deliver" in text and "rank 1" in text, text
    assert seconds < 60


def test_worker_names_given_to_init_reach_the_transport_driver_and_workers() -> None:
    results = run_ranks(named_workers, 2, timeout=120)
    assert results[0][0] < 1e-6 and results[1][0] < 1e-6 and results[0][1] < 1e-6, results
    # and the driver refuses 2BW before building anything
    assert "RemotePipe does not run schedule='2bw'" in results[0][2]


def test_a_driver_built_on_every_rank_names_the_workers_that_never_served() -> None:
    results = run_ranks_raw(driver_everywhere, 2, timeout=120, may_die=True)
    assert results[0][0] == "ok", results[0]
    kind, text = results[0][1]
    assert kind == "RuntimeError" and "rank 1: worker1 did not answer" in text, text
    assert "must call asyncpipe.rpc.serve()" in text, text


def test_rpc_two_pipelines_in_one_job_never_take_each_others_messages() -> None:
    # before: every pipeline over RPC used the mailbox "pipe"
    check_two_pipelines(run_ranks(two_pipelines, 2, "rpc", timeout=120))
