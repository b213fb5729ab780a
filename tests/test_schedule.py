"""Pure plan tests: actions, generators, lowering, validation and simulation (no torch)."""

from __future__ import annotations

import itertools

import pytest

from asyncpipe.schedule import (
    Action,
    Costs,
    Kind,
    PlanError,
    format_plan,
    forward_only,
    gpipe,
    lower,
    simulate,
    validate,
)


def row(text: str) -> list[Action | None]:
    return [None if t == "." else Action.parse(t) for t in text.split()]


def test_action_text_round_trip() -> None:
    for text in ["2F0", "0B13", "1W2", "1SEND_F3->2", "3RECV_B0->4"]:
        assert str(Action.parse(text)) == text
    assert Action.parse("2F0") == Action(2, Kind.FORWARD, 0)


@pytest.mark.parametrize("text", ["F0", "2X0", "2F", "-1F0", "1SEND_F0", "1F0->2"])
def test_action_parse_rejects_bad_text(text: str) -> None:
    with pytest.raises(ValueError):
        Action.parse(text)


def test_gpipe_literal() -> None:
    assert gpipe(2, 3) == {
        0: row("0F0 0F1 0F2 0B0 0B1 0B2"),
        1: row("1F0 1F1 1F2 1B0 1B1 1B2"),
    }


def test_gpipe_with_stages_sharing_a_rank() -> None:
    assert gpipe(3, 2, ranks=[0, 1, 0]) == {
        0: row("0F0 0F1 2F0 2F1 2B0 2B1 0B0 0B1"),
        1: row("1F0 1F1 1B0 1B1"),
    }


def test_lower_literal() -> None:
    assert lower(gpipe(2, 2)) == {
        0: row("0F0 0SEND_F0->1 0F1 0SEND_F1->1 0RECV_B0->1 0B0 0RECV_B1->1 0B1"),
        1: row("1RECV_F0->0 1F0 1RECV_F1->0 1F1 1B0 1SEND_B0->0 1B1 1SEND_B1->0"),
    }


def test_lower_keeps_same_rank_neighbours_local() -> None:
    plan = lower(gpipe(3, 1, ranks=[0, 0, 1]))
    assert plan[0] == row("0F0 1F0 1SEND_F0->2 1RECV_B0->2 1B0 0B0")


def test_forward_only_drops_backward() -> None:
    plan = forward_only(lower(gpipe(2, 2)))
    assert plan[1] == row("1RECV_F0->0 1F0 1RECV_F1->0 1F1")
    validate(plan)


@pytest.mark.parametrize(
    "stages,microbatches", list(itertools.product([1, 2, 3, 4, 8], [1, 2, 3, 4, 8, 16]))
)
def test_sweep_gpipe_validates_and_simulates_to_the_formula(stages: int, microbatches: int) -> None:
    plan = gpipe(stages, microbatches)
    assert validate(plan) is plan
    validate(lower(plan))
    for p in (plan, lower(plan)):
        result = simulate(p, Costs(forward=1.0, backward=2.0))
        assert result.makespan == pytest.approx((microbatches + stages - 1) * 3.0)
        assert all(b == pytest.approx(3.0 * microbatches) for b in result.busy.values())


def test_simulate_send_cost_delays_each_hop() -> None:
    result = simulate(gpipe(3, 1), Costs(forward=1, backward=1, send=0.5))
    # three forwards, two hops down, three backwards, two hops up
    assert result.makespan == pytest.approx(6 + 4 * 0.5)


def test_simulate_bubble_fraction() -> None:
    result = simulate(gpipe(4, 4), Costs(forward=1, backward=2))
    assert result.bubble[0] == pytest.approx(1 - 12 / 21)


def test_validate_rejects_backward_before_forward() -> None:
    plan = {0: row("0F0 0B0"), 1: row("1B0 1F0")}
    with pytest.raises(PlanError, match=r"1B0 must come after 1F0") as info:
        validate(plan)
    assert ">>1B0<<" in str(info.value)


def test_validate_rejects_missing_and_duplicate_actions() -> None:
    with pytest.raises(PlanError, match="misses 1B1"):
        validate({0: row("0F0 0F1 0B0 0B1"), 1: row("1F0 1F1 1B0")})
    with pytest.raises(PlanError, match="appears twice"):
        validate({0: row("0F0 0F0 0B0")})
    for empty in ({0: [], 1: []}, {0: [None]}):  # a bare "max() arg is an empty sequence"
        with pytest.raises(PlanError, match="the plan has no actions"):
            validate(empty)


def test_validate_finds_deadlock_and_marks_rows() -> None:
    plan = lower(gpipe(2, 2))
    plan[1] = row("1RECV_F1->0 1F1 1RECV_F0->0 1F0 1B0 1SEND_B0->0 1B1 1SEND_B1->0")
    with pytest.raises(PlanError, match="order they are sent"):
        validate(plan)


def test_validate_reports_a_true_deadlock() -> None:
    # each rank first waits for the other's backward
    plan = {0: row("0F0 0RECV_B0->1 0SEND_F0->1 0B0"), 1: row("1RECV_F0->0 1F0 1B0 1SEND_B0->0")}
    with pytest.raises(PlanError, match="deadlocks") as info:
        validate(plan)
    assert ">>0RECV_B0->1<<" in str(info.value) and ">>1RECV_F0->0<<" in str(info.value)


def test_validate_rejects_bad_shapes() -> None:
    with pytest.raises(PlanError, match="non-empty dict"):
        validate({})
    with pytest.raises(PlanError, match="ranks must be"):
        validate({1: row("0F0")})
    with pytest.raises(PlanError, match="must be Action or None"):
        validate({0: ["0F0"]})  # type: ignore[list-item]
    with pytest.raises(PlanError, match="exactly one rank"):
        validate({0: row("0F0"), 1: row("0F1")})


def test_format_plan_marks() -> None:
    assert format_plan({0: row("0F0 . 0B0")}, {0: 2}) == "rank 0: 0F0 . >>0B0<<"


def test_simulate_send_cost_per_sending_stage() -> None:
    # only stage 0 pays a latency: one hop down (0 -> 1) and none up (1 -> 0)
    result = simulate(gpipe(2, 1), Costs(forward=1, backward=1, send={0: 0.5, 1: 0.0}))
    assert result.makespan == pytest.approx(4.5)
