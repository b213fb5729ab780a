"""Plan generator tests: interleaved 1F1B and zero-bubble against literals and formulas."""

from __future__ import annotations

import itertools

import pytest

from asyncpipe.schedule import (
    Action,
    Costs,
    Kind,
    Plan,
    build,
    gpipe,
    interleaved,
    lower,
    one_f_one_b,
    simulate,
    stage_owners,
    validate,
    zero_bubble,
)


def row(text: str) -> list[Action | None]:
    return [None if t == "." else Action.parse(t) for t in text.split()]


def idle(plan: Plan, costs: Costs) -> float:
    """Bubble time: the makespan less the busy time, which is the same on every rank here."""
    result = simulate(plan, costs)
    busy = set(round(b, 9) for b in result.busy.values())
    assert len(busy) == 1, f"ranks do unequal work: {result.busy}"
    return result.makespan - busy.pop()


def per_chunk(virtual_stages: int) -> Costs:
    """Costs of one model chunk when the whole model (per rank) costs F = 1, B = 2."""
    return Costs(forward=1 / virtual_stages, backward=2 / virtual_stages)


# ---------------------------------------------------------------------------------------------
# literal plans


def test_interleaved_literal() -> None:
    assert interleaved(2, 4, 2) == {
        0: row("0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3"),
        1: row("1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3"),
    }


def test_interleaved_literal_with_remainder_in_first_group() -> None:
    # 5 micro-batches on 2 ranks: groups {0, 1, 2} and {3, 4}
    assert interleaved(2, 5, 2) == {
        0: row("0F0 0F1 0F2 2F0 2F1 2F2 2B0 0F3 2B1 0F4 2B2 2F3 0B0 2F4 0B1 0B2 2B3 2B4 0B3 0B4"),
        1: row("1F0 1F1 1F2 3F0 3B0 3F1 3B1 3F2 3B2 1F3 1B0 1F4 1B1 3F3 1B2 3F4 3B3 3B4 1B3 1B4"),
    }


def test_interleaved_literal_fewer_microbatches_than_ranks() -> None:
    assert interleaved(3, 2, 2) == {
        0: row("0F0 0F1 3F0 3F1 3B0 3B1 0B0 0B1"),
        1: row("1F0 1F1 4F0 4F1 4B0 4B1 1B0 1B1"),
        2: row("2F0 2F1 5F0 5B0 5F1 5B1 2B0 2B1"),
    }


def test_zero_bubble_literals() -> None:
    assert zero_bubble(2, 3) == {
        0: row("0F0 0F1 0B0 0W0 0F2 0B1 0W1 0B2 0W2"),
        1: row("1F0 1B0 1F1 1B1 1W0 1F2 1B2 1W1 1W2"),
    }
    assert zero_bubble(3, 3) == {
        0: row("0F0 0F1 0F2 0B0 0W0 0B1 0W1 0B2 0W2"),
        1: row("1F0 1F1 1B0 1F2 1B1 1W0 1B2 1W1 1W2"),
        2: row("2F0 2B0 2F1 2B1 2F2 2B2 2W0 2W1 2W2"),
    }


def test_zero_bubble_docstring_timeline() -> None:
    # the picture in zero_bubble's docstring: start step of each action at unit costs
    timeline = simulate(zero_bubble(3, 3), Costs(forward=1, backward=1, weight=1)).timeline
    starts = {r: [(name[1:], int(start)) for name, start, _ in t] for r, t in timeline.items()}
    assert starts[0] == [
        ("F0", 0), ("F1", 1), ("F2", 2), ("B0", 5), ("W0", 6), ("B1", 7), ("W1", 8), ("B2", 9),
        ("W2", 10),
    ]  # fmt: skip
    assert starts[1] == [
        ("F0", 1), ("F1", 2), ("B0", 4), ("F2", 5), ("B1", 6), ("W0", 7), ("B2", 8), ("W1", 9),
        ("W2", 10),
    ]  # fmt: skip
    assert starts[2] == [
        ("F0", 2), ("B0", 3), ("F1", 4), ("B1", 5), ("F2", 6), ("B2", 7), ("W0", 8), ("W1", 9),
        ("W2", 10),
    ]  # fmt: skip


def test_registry_builds_the_new_schedules() -> None:
    assert build("interleaved", 2, 4, 2) == interleaved(2, 4, 2)
    assert build("zero_bubble", 3, 3) == zero_bubble(3, 3)


# ---------------------------------------------------------------------------------------------
# bad arguments


@pytest.mark.parametrize(
    "args,message",
    [
        ((0, 4, 2), r"stages must be a positive int \(got 0\)"),
        ((2, 0, 2), r"microbatches must be a positive int \(got 0\)"),
        ((2, 4, 0), r"virtual_stages must be a positive int.*\(got 0\)"),
        ((2, 4, True), r"virtual_stages must be a positive int.*\(got True\)"),
        ((2, 4, 1.5), r"virtual_stages must be a positive int.*\(got 1.5\)"),
        ((2.0, 4, 2), r"stages must be a positive int \(got 2.0\)"),
    ],
)
def test_interleaved_rejects_bad_arguments(args: tuple[object, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        interleaved(*args)  # type: ignore[arg-type]


@pytest.mark.parametrize("args", [(0, 3), (3, 0), (-1, 3), (True, 3), (2, "3")])
def test_zero_bubble_rejects_bad_arguments(args: tuple[object, object]) -> None:
    with pytest.raises(ValueError, match="must be a positive int"):
        zero_bubble(*args)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# sweeps: every plan valid, lowered or not, and timed as the formulas say


@pytest.mark.parametrize("stages", range(1, 9))
def test_sweep_interleaved(stages: int) -> None:
    for microbatches, v in itertools.product(range(1, 17), range(1, 5)):
        case = f"interleaved({stages}, {microbatches}, {v})"
        plan = interleaved(stages, microbatches, v)
        validate(plan)
        validate(lower(plan))
        owners = stage_owners(plan)
        assert owners == {k: k % stages for k in range(stages * v)}, case
        if v == 1:
            assert plan == one_f_one_b(stages, microbatches), case
        result = simulate(plan, per_chunk(v))
        # activations held: the warm-up forwards and one more (capped at all of them)
        first_group = microbatches if microbatches < 2 * stages else stages + microbatches % stages
        for r in range(stages):
            extra = stages - r - 1 if v > 1 else 0
            warmup = stages - r - 1 + extra + (v - 1) * first_group
            assert result.peak_activations[r] == min(warmup + 1, microbatches * v), case
        # the bubble of 1F1B shrinks V times: (R - 1) * (F + B) with F, B of one chunk
        bubble = idle(plan, per_chunk(v))
        assert bubble <= idle(one_f_one_b(stages, microbatches), per_chunk(1)) + 1e-9, case
        if microbatches >= stages:
            assert bubble == pytest.approx((stages - 1) * 3 / v), case


@pytest.mark.parametrize("stages", range(1, 9))
def test_sweep_zero_bubble(stages: int) -> None:
    unit = Costs(forward=1, backward=1, weight=1)
    for microbatches in range(1, 17):
        case = f"zero_bubble({stages}, {microbatches})"
        plan = zero_bubble(stages, microbatches)
        validate(plan)
        validate(lower(plan))
        kinds = [a.kind for r in plan.values() for a in r if a is not None]
        assert kinds.count(Kind.WEIGHT) == stages * microbatches, case
        assert stage_owners(plan) == {s: s for s in range(stages)}, case
        result = simulate(plan, unit)
        base = simulate(one_f_one_b(stages, microbatches), Costs(forward=1, backward=2))
        # no rank holds more activations than 1F1B's peak (its first rank's)
        assert max(result.peak_activations.values()) <= base.peak_activations[0], case
        assert result.makespan <= base.makespan, case
        if microbatches >= stages:  # ZB-H1: a third of 1F1B's bubble of 3 * (S - 1)
            assert result.makespan == 3 * microbatches + stages - 1, case
        if microbatches >= stages >= 2:
            assert result.makespan < base.makespan, case


@pytest.mark.parametrize("stages,microbatches,v", [(2, 4, 2), (3, 5, 3), (4, 8, 2), (4, 6, 4)])
def test_lowered_plans_time_the_same(stages: int, microbatches: int, v: int) -> None:
    for plan in (interleaved(stages, microbatches, v), zero_bubble(stages, microbatches)):
        costs = Costs(forward=1, backward=2, weight=1)
        assert simulate(lower(plan), costs).makespan == simulate(plan, costs).makespan


# ---------------------------------------------------------------------------------------------
# the textbook formulas


@pytest.mark.parametrize("stages,microbatches", itertools.product([1, 2, 4, 8], [1, 4, 8, 16]))
def test_gpipe_bubble_formula(stages: int, microbatches: int) -> None:
    result = simulate(gpipe(stages, microbatches), Costs(forward=1, backward=2))
    expected = (stages - 1) / (microbatches + stages - 1)
    assert result.total_bubble == pytest.approx(expected)
    assert all(b == pytest.approx(expected) for b in result.bubble.values())


@pytest.mark.parametrize("stages,microbatches", itertools.product([1, 2, 4, 8], [1, 4, 8, 16]))
def test_one_f_one_b_peak_in_flight(stages: int, microbatches: int) -> None:
    result = simulate(one_f_one_b(stages, microbatches), Costs(forward=1, backward=2))
    assert result.peak_activations == {s: min(stages - s, microbatches) for s in range(stages)}
    # and its bubble is GPipe's, with far fewer activations held
    expected = (stages - 1) / (microbatches + stages - 1)
    assert result.total_bubble == pytest.approx(expected)


@pytest.mark.parametrize(
    "stages,microbatches,v", [(2, 4, 2), (4, 8, 2), (4, 16, 2), (4, 8, 4), (8, 16, 2), (8, 32, 4)]
)
def test_interleaved_bubble_is_a_vth_of_one_f_one_b(stages: int, microbatches: int, v: int) -> None:
    """Same total work per rank (a chunk costs 1/V of a 1F1B stage): the idle time is exactly
    1/V of 1F1B's; as a fraction of the (shorter) makespan it is (R - 1) / (V * M + R - 1),
    which tends to 1/V of 1F1B's (R - 1) / (M + R - 1) as M grows."""
    base = simulate(one_f_one_b(stages, microbatches), per_chunk(1))
    mine = simulate(interleaved(stages, microbatches, v), per_chunk(v))
    assert idle(interleaved(stages, microbatches, v), per_chunk(v)) == pytest.approx(
        idle(one_f_one_b(stages, microbatches), per_chunk(1)) / v
    )
    assert mine.total_bubble == pytest.approx((stages - 1) / (v * microbatches + stages - 1))
    ratio = mine.total_bubble / base.total_bubble
    assert 1 / v < ratio <= (1 / v) * (1 + stages / microbatches)


def test_zero_bubble_beats_one_f_one_b_at_same_work() -> None:
    """S = 4, M = 8: 1F1B (F = 1, B = 2) takes 33 steps, zero-bubble (F = B = W = 1) 27."""
    base = simulate(one_f_one_b(4, 8), Costs(forward=1, backward=2))
    mine = simulate(zero_bubble(4, 8), Costs(forward=1, backward=1, weight=1))
    assert (base.makespan, mine.makespan) == (33, 27)
    assert mine.total_bubble == pytest.approx(3 / 27)
    assert base.peak_activations == {0: 4, 1: 3, 2: 2, 3: 1}
    assert mine.peak_activations == {0: 4, 1: 4, 2: 4, 3: 4}  # 1F1B's peak, on every rank
