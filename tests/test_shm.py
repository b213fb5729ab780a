"""The shared-memory transport: messages, queues, failures, and every schedule end to end."""

from __future__ import annotations

import sys

import pytest
import torch
from gloo_workers import check_errors, every_schedule, failure
from shm_workers import (
    after_shutdown,
    messages,
    peer_dies,
    set_up_errors,
    spill,
    transports_differ,
    two_bw,
)
from spawn import run_ranks, run_ranks_raw

from tests.test_2bw import batches, delayed_reference, model

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not sys.platform.startswith("linux"), reason="the shm transport runs on Linux"
    ),
]


def test_messages_arrive_intact_through_a_ring_smaller_than_them() -> None:
    sender, receiver = run_ranks(messages, 2, timeout=90)
    assert sender["names"] == [] and receiver["names"] == []  # unlinked once both opened
    assert sender["done"] == 1
    for n, payload in enumerate(receiver["sent"]):
        microbatch, microbatches, error, tensors = receiver["got"][n]
        assert (microbatch, microbatches, error) == (n, len(receiver["sent"]), None)
        assert len(tensors) == len(payload)
        for got, want in zip(tensors, payload):
            if want is None:
                assert got is None
                continue
            dtype, shape, requires_grad, value = got
            tensor, wanted_grad = want
            assert (dtype, shape, requires_grad) == (tensor.dtype, tuple(tensor.shape), wanted_grad)
            torch.testing.assert_close(value, tensor.resolve_conj(), rtol=0, atol=0)
    assert receiver["got"]["error"] == (9, 9, "stage 0 failed in 0F9", [])


def test_sends_never_wait_for_a_busy_receiver_and_flush_leaves_deferred_ones_out() -> None:
    sender, receiver = run_ranks(spill, 2, timeout=90)
    assert sender["sending"] < 0.5  # the receiver slept 1 s before taking anything
    assert sender["queued"] > 3 * 2**18  # all but the first ring's worth waited in the queue
    assert receiver["values"] == [0.0, 1.0, 2.0, 3.0]
    assert sender["flushed"] and receiver["late"] == [0, 1]
    assert "timed out after 0.5 s waiting for a message from rank 1" in sender["timeout"]


def test_a_peer_that_dies_is_named_without_waiting_for_the_timeout() -> None:
    results = run_ranks_raw(peer_dies, 2, timeout=60, may_die=True)
    assert results[1][0] == "died"
    text, seconds = results[0][1]
    assert "lost rank 1" in text and "exited" in text, text
    assert seconds < 10


def test_a_peer_whose_process_this_rank_cannot_see_is_left_to_the_timeout() -> None:
    # a peer in another PID namespace: its process id may name nothing here, or another
    # process; the transport must not call it dead (nor alive) on that id's word
    results = run_ranks_raw(peer_dies, 2, True, timeout=60, may_die=True)
    assert results[1][0] == "died"
    text, seconds = results[0][1]
    assert "timed out after 4.0 s waiting for a message from rank 1" in text, text


@pytest.mark.parametrize(
    "case,words",
    [
        ("hosts", "every rank of the pipeline must run on the same host"),
        ("memory", "could not create its shared memory"),
    ],
)
def test_a_transport_that_cannot_be_built_fails_on_every_rank(case: str, words: str) -> None:
    for kind, text in run_ranks(set_up_errors, 2, case, timeout=60):
        assert kind in ("ValueError", "RuntimeError") and words in text, text


def test_ranks_that_build_different_transports_say_so() -> None:
    for kind, text, _ in run_ranks(transports_differ, 2, timeout=90):  # before: a timeout each
        assert kind == "ValueError", (kind, text)
        assert "every rank must build the same transport (rank 0: 'shm', rank 1: 'p2p')" in text


@pytest.mark.parametrize("world", [2, 4])
def test_every_schedule_matches_the_plain_model_over_shm(world: int) -> None:
    results = every_schedule(
        world,
        [1, world, 2 * world],
        ("gpipe", "1f1b", "zero_bubble"),
        ("always", "except_last", "never") if world == 2 else ("except_last",),
        ([world, 2 * world], ("always", "never")),
        "shm",
    )
    check_errors(results)


@pytest.mark.parametrize("world", [2, 4])
def test_2bw_over_shm_follows_the_delayed_update_rule(world: int) -> None:
    plain, data = model(), batches(4)
    want, trained = delayed_reference(plain, data, 4, {3})
    for losses, state in run_ranks(two_bw, world, plain, data, 4, timeout=120):
        assert len(losses) == len(want)
        for a, b in zip(losses, want):
            assert (a != a and b != b) or a == pytest.approx(b, rel=1e-5, abs=1e-7)
        for name, tensor in state.items():
            torch.testing.assert_close(tensor, trained.state_dict()[name], rtol=1e-5, atol=1e-6)


def test_a_failing_stage_reaches_every_rank_over_shm() -> None:
    results = run_ranks(failure, 3, "forward", "shm", timeout=120)
    for rank, (kind, text, stage, microbatch, _, seconds) in enumerate(results):
        assert kind == "StageFailure" and stage == 1 and microbatch == 1, (rank, text)
        assert seconds < 30


def test_a_step_after_shutdown_is_refused_as_over_p2p() -> None:
    for kind, text in run_ranks(after_shutdown, 2, timeout=90):  # before: it ran
        assert kind == "StageFailure", (kind, text)
        assert "the process group of this pipeline was destroyed" in text, text
