"""Skip connections across real processes over gloo: direct routes, every schedule."""

from __future__ import annotations

import pytest
from skip_workers import skips, skips_batch_norm, skips_forward
from spawn import run_ranks

pytestmark = pytest.mark.slow


def _check(results: list[dict[str, tuple[float, float]]], cases: int) -> None:
    for rank, checks in enumerate(results):
        assert len(checks) == cases, (rank, sorted(checks))
        for key, (loss_error, grad_error) in checks.items():
            assert loss_error < 1e-5, f"rank {rank} {key}: loss off by {loss_error}"
            assert grad_error < 1e-5, f"rank {rank} {key}: gradients off by {grad_error}"


def test_two_processes_skip_across_one_boundary() -> None:
    cases = [
        ("three", balance, schedule, policy, 4)
        for balance in ([1, 2], [2, 1])
        for schedule in ("gpipe", "1f1b")
        for policy in ("always", "never")
    ]
    _check(run_ranks(skips, 2, cases, timeout=180), len(cases))


def test_three_processes_every_schedule_and_policy() -> None:
    cases = [
        ("three", [1, 1, 1], "gpipe", policy, 3) for policy in ("always", "except_last", "never")
    ]
    cases += [
        ("crossing", balance, schedule, policy, chunks)
        for balance in ([1, 2, 2], [2, 1, 2])
        for schedule in ("gpipe", "1f1b", "zero_bubble")
        for policy, chunks in (("except_last", 2), ("always", 6))
    ]
    cases += [("six", [1] * 6, "interleaved", policy, 3) for policy in ("always", "never")]
    _check(run_ranks(skips, 3, cases, timeout=240), len(cases))


def test_forward_back_helper_and_inference_with_skips() -> None:
    for grad_error, inference_error in run_ranks(skips_forward, 3, timeout=120):
        assert grad_error < 1e-5 and inference_error < 1e-5


@pytest.mark.parametrize("schedule", ["1f1b", "zero_bubble"])
def test_skip_across_deferred_batch_norm(schedule: str) -> None:
    for grad_error, stat_error in run_ranks(skips_batch_norm, 2, schedule, timeout=120):
        assert grad_error < 1e-5 and stat_error < 1e-5, (grad_error, stat_error)
