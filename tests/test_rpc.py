"""The RPC transport: same results as the plain model for every schedule, policy and skips."""

from __future__ import annotations

import pytest
from rpc_workers import rpc_skips, rpc_transparency
from spawn import run_ranks

pytestmark = pytest.mark.slow


def _check(results: list[dict[str, tuple[float, float]]]) -> None:
    for rank, checks in enumerate(results):
        assert checks, rank
        for key, (loss_error, grad_error) in checks.items():
            assert loss_error < 1e-5, f"rank {rank} {key}: loss off by {loss_error}"
            assert grad_error < 1e-5, f"rank {rank} {key}: gradients off by {grad_error}"


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
    _check(results)
    assert len(results[0]) == 2 * 2 * 3 * 3


def test_rpc_three_processes_interleaved_and_skips() -> None:
    cases = [
        ("crossing", [1, 2, 2], schedule, "except_last", 3)
        for schedule in ("gpipe", "1f1b", "zero_bubble")
    ]
    cases.append(("six", [1] * 6, "interleaved", "always", 3))
    _check(run_ranks(rpc_skips, 3, cases, timeout=240))
