"""Balancing: block partition answers, profiles, by_time / by_size, plan, balance='auto'."""

from __future__ import annotations

import copy
import time
from typing import Any

import pytest
import torch
from cut_workers import auto, auto_alone, auto_profile_fails, auto_refused, auto_replicas
from spawn import run_ranks
from torch import Tensor, nn

from asyncpipe import balance
from asyncpipe.balance import LayerProfile, Link, Profile


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, seconds: float) -> Tensor:
        ctx.seconds = seconds
        time.sleep(seconds)
        return x * 1.0

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        time.sleep(2 * ctx.seconds)
        return grad, None


class Sleepy(nn.Module):
    """Sleeps ``ms`` in forward and twice that in backward."""

    def __init__(self, ms: float) -> None:
        super().__init__()
        self.lin, self.seconds = nn.Linear(4, 4), ms / 1000

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = _Sleep.apply(self.lin(x), self.seconds)  # type: ignore[no-untyped-call]
        return out


@pytest.mark.parametrize(
    ("costs", "stages", "want"),
    [
        ([1, 1, 1, 1], 2, [2, 2]),
        ([1, 1, 1, 4, 1, 1, 1, 1], 4, [3, 1, 2, 2]),
        ([4, 1, 1, 1, 1], 2, [1, 4]),
        ([1, 2, 3, 4, 5], 3, [3, 1, 1]),
        ([0, 0, 0], 3, [1, 1, 1]),
        ([5], 1, [1]),
        ([1, 1, 1, 1, 1, 1, 1], 3, [2, 2, 3]),
    ],
)
def test_block_partition_known_answers(costs: list[float], stages: int, want: list[int]) -> None:
    assert balance.blocks(costs, stages) == want


def test_block_partition_is_optimal_against_brute_force() -> None:
    import itertools
    import random

    rng = random.Random(0)
    for _ in range(50):
        n, k = rng.randint(2, 7), rng.randint(1, 4)
        if k > n:
            continue
        costs = [rng.randint(0, 9) for _ in range(n)]
        got = balance.blocks(costs, k)
        assert sum(got) == n and len(got) == k and min(got) >= 1

        def worst(sizes: tuple[int, ...] | list[int], costs: list[int] = costs) -> int:
            edges = [0, *itertools.accumulate(sizes)]
            return max(sum(costs[a:b]) for a, b in zip(edges, edges[1:]))

        splits = [
            s for s in itertools.product(range(1, n + 1), repeat=k) if sum(s) == n and min(s) >= 1
        ]
        assert worst(got) == min(worst(s) for s in splits), (costs, k, got)


def test_block_partition_errors_are_listed_at_once() -> None:
    with pytest.raises(ValueError, match=r"layers: 2, stages: 3.*bad: 1: -1"):
        balance.blocks([1, -1], 3)


def test_a_layer_that_sleeps_four_times_longer_gets_its_own_stage() -> None:
    # Medians of 5 timed runs, 3 ms against 12 ms: a loaded machine stretches single sleeps
    # by milliseconds, which once flipped a run of one 2 ms against 8 ms repeat.
    model = nn.Sequential(*[Sleepy(12 if n == 3 else 3) for n in range(8)])
    found = balance.by_time(model, torch.randn(2, 4), 4, repeat=5)
    edges = [sum(found[:n]) for n in range(5)]
    assert 3 in edges and 4 in edges, found  # layer 3 alone


def test_by_size_counts_parameters_and_activations() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 400), nn.Linear(400, 4))
    x = torch.randn(2, 4)
    assert balance.by_size(model, x, 2) == [3, 1]
    p = balance.profile(model, x, rows=[2])
    assert [m[0].params for m in p.layers] == [80, 80, 8000, 6416]
    assert p.layers[3][0].activations == 2 * 400 * 4  # its input, saved for the weight grad


def test_profiling_leaves_the_model_unchanged() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.5), nn.Linear(4, 2))
    model[0].weight.grad = torch.ones(4, 4)
    model.eval()
    model[1].train()
    state = copy.deepcopy(model.state_dict())
    balance.by_time(model, torch.randn(8, 4), 2, repeat=1)
    balance.by_size(model, torch.randn(8, 4), 2)
    for key, value in model.state_dict().items():
        assert torch.equal(value, state[key]), key
    assert torch.equal(model[0].weight.grad, torch.ones(4, 4))
    assert model[3].weight.grad is None
    assert [m.training for m in model] == [False, True, False, False]


def test_profiling_restores_the_rng() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5))
    x = torch.randn(8, 4)
    torch.manual_seed(1)
    expected = torch.rand(2)
    torch.manual_seed(1)
    balance.profile(model, x, repeat=1)
    assert torch.equal(torch.rand(2), expected)


def _flat(forward: float, backward: float, layers: int, rows: tuple[int, ...]) -> Profile:
    """Equal layers whose time and memory grow with the rows (given at rows[0])."""

    def at(r: int) -> LayerProfile:
        k = r / rows[0]
        return LayerProfile(forward * k, backward * k, 100, round(64 * k), round(16 * k))

    return Profile(rows, tuple(tuple(at(r) for r in rows) for _ in range(layers)))


def test_profile_interpolates_a_fixed_and_a_per_row_cost() -> None:
    a = LayerProfile(1.0, 2.0, 10, 100, 40)
    b = LayerProfile(4.0, 8.0, 10, 400, 160)
    p = Profile((2, 8), ((a, b),))
    (mid,) = p.at(4)
    assert (mid.forward, mid.backward, mid.activations, mid.output) == (2.0, 4.0, 200, 80)


def test_plan_matches_the_ideal_of_each_schedule_without_link_costs() -> None:
    f = 0.003
    ranking = balance.plan(
        _flat(f, 2 * f, 8, (1,)),
        4,
        8,
        chunks=[8],
        stages=[4],
        schedules=("gpipe", "1f1b"),
        link=Link(latency=0.0, bandwidth=float("inf"), post=0.0),
    )
    gpipe = next(c for c in ranking.candidates if c.schedule == "gpipe")
    assert gpipe.balance == (2, 2, 2, 2)
    assert gpipe.seconds == pytest.approx((8 + 4 - 1) * 3 * f * 2)
    assert "best:" in ranking.reason


def test_plan_prefers_more_stages_when_messages_are_cheap_and_is_deterministic() -> None:
    profile = _flat(0.001, 0.002, 8, (1, 8))
    first = balance.plan(profile, 4, 16)
    second = balance.plan(profile, 4, 16)
    assert first == second
    assert first.best.stages == 4 and first.best.fits
    seconds = [c.seconds for c in first.candidates]
    assert seconds == sorted(seconds)
    assert "faster than the runner-up" in first.reason and "than one stage" in first.reason


def test_plan_puts_configurations_over_the_memory_limit_last() -> None:
    profile = _flat(0.001, 0.002, 8, (1, 8))
    free = balance.plan(profile, 4, 16, schedules=("gpipe", "1f1b"))
    limit = free.best.memory - 1  # the fastest no longer fits
    ranking = balance.plan(profile, 4, 16, memory_limit=limit, schedules=("gpipe", "1f1b"))
    fits = [c.fits for c in ranking.candidates]
    assert fits == sorted(fits, reverse=True) and not all(fits) and any(fits)
    assert all((c.memory <= limit) == c.fits for c in ranking.candidates)
    assert ranking.best.memory <= limit and ranking.best.seconds > free.best.seconds
    assert f"need more than {limit} bytes" in ranking.reason


def test_plan_arguments_are_checked_at_once() -> None:
    with pytest.raises(ValueError, match=r"world_size.*batch_size.*checkpoint"):
        balance.plan(_flat(1, 2, 4, (1,)), 0, -1, checkpoint="sometimes")


def test_auto_balance_gives_every_rank_the_same_answer() -> None:
    results = run_ranks(auto, 2, timeout=120)
    assert results[0][0] == results[1][0] and sum(results[0][0]) == 8
    for _, loss_error, grad_error in results:
        assert loss_error < 1e-5 and grad_error < 1e-5


@pytest.mark.parametrize("who", [0, 1])
def test_auto_balance_refused_on_one_rank_stops_the_other_at_once(who: int) -> None:
    # Before, the rank without a sample raised alone and the other waited for it in the
    # broadcast of rank 0's balance (the process group's timeout, 30 min by default).
    results = run_ranks(auto_refused, 2, who, timeout=120)
    for rank, (kind, text, culprit, loss_error) in enumerate(results):
        assert loss_error < 1e-5, (rank, loss_error)
        if rank == who:
            assert kind == "ValueError" and "pass sample=" in text, text
        else:
            assert kind == "StageFailure" and culprit == who, (kind, text)
            assert f"rank {who} rejected its arguments to it" in text, text
            assert f"rank {rank} stops too" in text and "waited" not in text, text


def test_auto_balance_without_the_others_times_out_naming_what_it_waited_for() -> None:
    kind, text = run_ranks(auto_alone, 2, timeout=120)[0]
    assert kind == "TransportTimeout", (kind, text)
    assert "is AsyncPipe built with balance='auto' on every rank?" in text, text
    assert "at most 2.0 s" in text, text


def test_auto_balance_whose_profiling_fails_raises_rank_0s_error_everywhere() -> None:
    for kind, text in run_ranks(auto_profile_fails, 2, timeout=120):
        assert kind == "ValueError", (kind, text)
        assert "failed on rank 0: RuntimeError: this layer takes no input: naïve" in text, text


@pytest.mark.slow
def test_auto_balance_with_replicas_has_one_entry_per_pipeline_rank() -> None:
    results = run_ranks(auto_replicas, 4, timeout=180)
    assert all(r[0] == results[0][0] for r in results) and len(results[0][0]) == 2
    for _, loss_error, grad_error in results:
        assert loss_error < 1e-5 and grad_error < 1e-5


def test_plan_simulates_interleaved_with_two_chunks_per_rank() -> None:
    ranking = balance.plan(_flat(0.001, 0.002, 8, (1, 8)), 4, 16, schedules=("interleaved",))
    assert ranking.candidates and all(c.virtual_stages == 2 for c in ranking.candidates)
    assert all(len(c.balance) == 2 * c.stages for c in ranking.candidates)


def test_auto_balance_needs_a_sample_and_torch_distributed() -> None:
    from threads import run_threads

    from asyncpipe import AsyncPipe

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))

    def make(rank: int, transport: Any) -> None:
        AsyncPipe(model, "auto", transport=transport)

    status, error = run_threads(make, 2)[0]
    assert status == "error" and isinstance(error, ValueError)
    assert "pass sample=" in str(error) and "call asyncpipe.balance.by_time once" in str(error)


# ----- 2BW: ranked by its steady-state step -------------------------------------------------

_NO_LINK = Link(latency=0.0, bandwidth=float("inf"), post=0.0)


def test_plan_ranks_2bw_by_its_steady_state_step_below_1f1b() -> None:
    f = 0.001  # 8 layers, 2 per stage: a stage's forward 2f, backward 4f
    ranking = balance.plan(
        _flat(f, 2 * f, 8, (1,)), 4, 8, stages=[4], chunks=[8], schedules=("1f1b", "2bw"),
        link=_NO_LINK,
    )  # fmt: skip
    two_bw, one_f_one_b = ranking.candidates
    assert (two_bw.schedule, one_f_one_b.schedule) == ("2bw", "1f1b")
    assert two_bw.balance == one_f_one_b.balance == (2, 2, 2, 2)
    # 1F1B pays the fill and drain every step; 2BW's steady step is a stage's compute alone
    assert one_f_one_b.seconds == pytest.approx((8 + 4 - 1) * 6 * f)
    assert two_bw.seconds == pytest.approx(8 * 6 * f)
    assert two_bw.bubble == pytest.approx(0.0, abs=1e-9) and two_bw.lookahead == 1
    assert "(steady state)" in str(two_bw) and "best: 2bw" in ranking.reason


def test_plan_counts_2bw_memory_as_2bw_holds_it() -> None:
    # one layer per stage: 100 bytes of parameters, 64 bytes of activations per micro-batch
    def memory(schedule: str, lookahead: int = 1) -> int:
        ranking = balance.plan(
            _flat(0.001, 0.002, 4, (1,)), 4, 8, stages=[4], chunks=[8], schedules=[schedule],
            link=_NO_LINK, lookahead=lookahead,
        )  # fmt: skip
        return ranking.best.memory

    # rank 0 holds 4 micro-batches (1F1B's spacing); 2BW adds the stash and the finished
    # gradient kept beside the next mini-batch's
    assert memory("1f1b") == 2 * 100 + 4 * 64
    assert memory("2bw") == 4 * 100 + 4 * 64
    assert memory("2bw", lookahead=2) == 4 * 100 + 7 * 64  # 2 * (stages - 0) - 1 in flight


def test_plan_predicts_2bw_lookahead_hiding_message_latency() -> None:
    # forward 1 ms, backward 2 ms per stage, a message 0.5 ms (as in tests/test_2bw.py)
    link = Link(latency=0.0005, bandwidth=float("inf"), post=0.0)
    profile = _flat(0.001, 0.002, 4, (1,))

    def best(lookahead: int) -> balance.Candidate:
        return balance.plan(
            profile, 4, 8, stages=[4], chunks=[8], schedules=["2bw"], link=link,
            lookahead=lookahead,
        ).best  # fmt: skip

    assert best(1).seconds == pytest.approx(0.024 + 8 * 2 * 3 * 0.0005 / 4)
    assert best(2).seconds == pytest.approx(0.024) and best(2).lookahead == 2
    assert "2bw lookahead 2," in str(best(2))


def test_steady_step_is_exact_where_steps_alternate() -> None:
    from asyncpipe.balance.steady import steady_step
    from asyncpipe.schedule import Costs, simulate, two_bw

    costs = Costs(forward=1, backward=2, send=0.5)
    spans = [simulate(two_bw(2, 1, batches=n), costs).makespan for n in range(1, 8)]
    # one more mini-batch adds 3, then 4, then 3, ...: neither difference alone is the step
    assert [b - a for a, b in zip(spans, spans[1:])] == [3.0, 4.0, 3.0, 4.0, 3.0, 4.0]
    found = steady_step(2, 1, costs)
    assert found.seconds == 3.5 and found.repeats
    assert steady_step(4, 8, Costs(forward=1, backward=2)).seconds == 24.0


# ----- plan's arguments ---------------------------------------------------------------------


class _Untouchable(Profile):
    def at(self, rows: float) -> list[LayerProfile]:
        raise AssertionError("plan estimated a layer before checking its arguments")


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"schedules": ("1F1B",)}, ValueError, r"in lower case \(unknown: \['1F1B'\]\); pass "
         r"schedules=\['1f1b'\]"),
        ({"schedules": ("fast",)}, ValueError, r"unknown: \['fast'\]\); pass names from"),
        ({"schedules": "1f1b"}, TypeError, r"sequence of schedule names \(got '1f1b'\); pass "
         r"a list or tuple"),
        ({"schedules": ()}, ValueError, r"at least one schedule \(got \(\)\); pass some of"),
        ({"chunks": [0]}, ValueError, r"chunks must be positive ints \(bad: \[0\]\); pass "
         r"divisors of batch_size, e.g. \[1, 2, 4, 8\]"),
        ({"chunks": [16, 3]}, ValueError, r"must divide batch_size.*batch_size: 8, not "
         r"dividing: \[16, 3\]\); pass divisors"),
        ({"chunks": 8}, TypeError, r"chunks must be a sequence of ints \(got int\)"),
        ({"stages": [0]}, ValueError, r"stages must be positive ints \(bad: \[0\]\); pass "
         r"stage counts from 1 to 2"),
        ({"stages": [3]}, ValueError, r"may exceed world_size \(world_size: 2, stages: \[3\]\); "
         r"pass stages from 1 to 2"),
        ({"link": 0.001}, TypeError, r"link must be an asyncpipe.balance.Link \(got float\)"),
        ({"link": Link(latency=-1.0)}, ValueError, r"latency >= 0.*got Link\(latency=-1.0"),
        ({"memory_limit": 0}, ValueError, r"memory_limit must be a positive number of bytes"),
        ({"memory_limit": "1G"}, TypeError, r"memory_limit must be a number of bytes or None"),
        ({"lookahead": 2}, ValueError, r"lookahead=2 applies to schedule '2bw' only.*add "
         r"'2bw' to schedules or pass lookahead=1"),
        ({"lookahead": 0, "schedules": ["2bw"]}, ValueError, r"lookahead must be a positive "
         r"int \(got 0\)"),
    ],
)  # fmt: skip
def test_plan_refuses_each_bad_argument_before_any_work(
    kwargs: dict[str, Any], error: type[Exception], message: str
) -> None:
    profile = _Untouchable((1,), _flat(1, 2, 4, (1,)).layers)
    with pytest.raises(error, match=message):
        balance.plan(profile, 2, 8, **kwargs)


def test_plan_lists_every_bad_argument_at_once() -> None:
    with pytest.raises(ValueError) as caught:
        balance.plan(
            _flat(1, 2, 4, (1,)), 2, 8, stages=[5], chunks=[0], schedules=["1F1B", "gpipe"],
            link="fast", lookahead=3,
        )  # fmt: skip
    text = str(caught.value)
    for part in ("world_size (world_size: 2", "layers: 4, stages: [5]", "chunks must be",
                 "unknown: ['1F1B']", "link must be", "lookahead=3 applies"):  # fmt: skip
        assert part in text, (part, text)
    with pytest.raises(TypeError, match=r"profile must be a Profile \(got list\)"):
        balance.plan([], 2, 8)  # type: ignore[arg-type]


def test_plan_says_why_nothing_could_be_built() -> None:
    with pytest.raises(ValueError, match=r"no configuration.*2bw, 4 stages, 2 chunks: .*needs at "
                       r"least lookahead \* \(stages - 1\) micro-batches"):  # fmt: skip
        balance.plan(_flat(1, 2, 4, (1,)), 4, 8, stages=[4], chunks=[2], schedules=["2bw"])
