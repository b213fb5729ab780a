"""Profiling leaves the model and the sample as they were; balances respect reused layers;
plan's memory under checkpointing; balance='auto' on process subgroups and its arguments."""

from __future__ import annotations

import itertools
import random
import time

import pytest
import torch
from balance_workers import mixed_and_options, subgroups
from spawn import run_ranks
from torch import Tensor, nn

from asyncpipe import balance
from asyncpipe.arguments import check_arguments
from asyncpipe.balance import LayerProfile, Link, Profile
from asyncpipe.options import option_problems
from asyncpipe.partition import partition


class Sleep(nn.Module):
    """Sleeps ``ms`` milliseconds in forward; one parameter."""

    def __init__(self, ms: float) -> None:
        super().__init__()
        self.ms, self.w = ms, nn.Parameter(torch.ones(1))

    def forward(self, x: Tensor) -> Tensor:
        time.sleep(self.ms / 1000)
        return x * self.w


class Counter(nn.Module):
    """Replaces its buffer by a new tensor on every call (a step counter, an EMA)."""

    calls: Tensor

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros(()))
        self.lin = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        self.calls = self.calls + 1
        out: Tensor = self.lin(x)
        return out


# ----- profiling leaves the model and the sample as they were --------------------------------


def test_profiling_restores_parameters_a_layer_changes_in_place() -> None:
    # nn.Embedding(max_norm=...) renormalises the rows it looks up, in place, in forward: with
    # balance="auto" and data-parallel replicas only the profiling rank's replica changed.
    torch.manual_seed(0)
    embedding = nn.Embedding(10, 4, max_norm=1.0)
    model = nn.Sequential(embedding, nn.Linear(4, 4))
    before = embedding.weight.detach().clone()
    ids = torch.tensor([[1, 2], [3, 4]])
    balance.by_time(model, ids, 2, repeat=1)
    balance.by_size(model, ids, 2)
    balance.profile(model, ids, repeat=1)
    assert torch.equal(embedding.weight.detach(), before)


def test_profiling_restores_a_buffer_the_layer_replaces() -> None:
    counter = Counter()
    model = nn.Sequential(counter, nn.Linear(4, 4))
    calls = counter.calls
    balance.by_time(model, torch.randn(8, 4), 2, repeat=1)
    balance.profile(model, torch.randn(8, 4), repeat=1)
    assert counter.calls is calls and float(calls) == 0.0
    assert [name for name, _ in model.named_buffers()] == ["0.calls"]


def test_profiling_under_no_grad_still_measures_the_backward() -> None:
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
    x = torch.randn(8, 16)
    with torch.no_grad():
        found = balance.profile(model, x, rows=[8], repeat=1)
        assert not torch.is_grad_enabled()
    assert all(m[0].activations == 8 * 16 * 4 for m in found.layers), found  # inputs saved
    assert all(m[0].backward > 0 for m in found.layers)


def test_profiling_takes_layers_that_modify_their_input_in_place() -> None:
    # a leaf in an in-place operation: such layers get an alias, as in the pipeline
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.ReLU(inplace=True), nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Linear(4, 4)
    )
    x = torch.randn(8, 4)
    kept = x.clone()
    assert len(balance.by_time(model, x, 2, repeat=1)) == 2
    assert sum(balance.by_size(model, x, 2)) == 4
    balance.profile(model, x, repeat=1)
    assert torch.equal(x, kept)  # the caller's sample is never modified


def test_a_sample_without_rows_and_torch_lazy_modules_are_refused_clearly() -> None:
    model = nn.Sequential(nn.Linear(1, 4), nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"rows in dim 0 \(tensor 0 of it is 0-dim.*unsqueeze"):
        balance.by_time(model, torch.tensor(1.0), 2)
    with pytest.raises(ValueError, match=r"rows in dim 0"):
        balance.profile(model, (torch.tensor(1.0),))
    lazy = nn.Sequential(nn.LazyLinear(4), nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"layers 0 \(LazyLinear\) hold uninitialised.*run one "
                       r"forward through the model first"):  # fmt: skip
        balance.by_time(lazy, torch.randn(8, 3), 2)


# ----- balances: reused layers, tie-breaks at any scale --------------------------------------


def _loads(layers: list[object], costs: list[float], sizes: list[int]) -> list[float] | None:
    """What each stage runs under ``sizes`` as partition() places it, or None if refused."""
    modules = {id(k): nn.Identity() for k in layers}
    try:
        _, segments = partition([modules[id(k)] for k in layers], sizes)
    except ValueError:
        return None
    work = [0.0] * len(sizes)
    for seg in segments:
        for inv in seg.invocations:
            work[seg.stage] += costs[inv.order]
    return work


def test_blocks_with_reused_layers_is_optimal_and_partition_takes_it() -> None:
    rng = random.Random(0)
    for _ in range(150):
        n, k = rng.randint(2, 7), rng.randint(1, 4)
        names = [rng.choice("abcdef") for _ in range(n)]
        costs = [float(rng.randint(0, 9)) for _ in range(n)]
        if len(set(names)) < k:
            with pytest.raises(ValueError, match="every stage (needs at least one|must own a) "):
                balance.blocks(costs, k, layers=names)
            continue
        got = balance.blocks(costs, k, layers=names)
        loads = _loads(list(names), costs, got)
        assert loads is not None, (names, costs, got)
        valid = [
            max(w)
            for s in itertools.product(range(1, n + 1), repeat=k)
            if sum(s) == n and (w := _loads(list(names), costs, list(s))) is not None
        ]
        assert max(loads) == min(valid), (names, costs, k, got)


def test_by_time_runs_a_reused_layer_on_the_stage_of_its_first_position() -> None:
    slow = Sleep(30)
    # [fast, slow, slow]: the second stage would only reuse a layer of the first
    assert balance.by_time([Sleep(1), slow, slow], torch.randn(4, 4), 2, repeat=1) == [1, 2]
    # [A, B, C, D, A] in ms [40, 20, 20, 20, (40 on A's stage)]: A's stage alone is best
    a = Sleep(40)
    layers = [a, Sleep(20), Sleep(20), Sleep(20), a]
    assert balance.by_time(layers, torch.randn(4, 4), 2, repeat=1) == [1, 4]


def test_by_size_counts_a_reused_layers_parameters_once() -> None:
    a, b, c = (nn.Linear(64, 64, bias=False) for _ in range(3))
    # [a, b, c, a]: 16 KiB of parameters each, once for a; [a | b, c, a] holds 2 (a runs on
    # stage 0 twice), where [a, b | c, a] holds 2 + a's second activations on stage 0
    assert balance.by_size([a, b, c, a], torch.randn(1, 64), 2) == [1, 3]


@pytest.mark.parametrize(
    ("costs", "stages", "want"),
    [([1, 1, 1, 4, 1, 1, 1, 1], 4, [3, 1, 2, 2]), ([2, 1, 1, 1, 1, 1, 1, 2], 3, [2, 3, 3])],
)
def test_blocks_breaks_ties_alike_at_every_scale(
    costs: list[int], stages: int, want: list[int]
) -> None:
    # costs in seconds (by_time: 1e-5 s per layer) fell below an absolute slack of 1e-9
    for unit in (1.0, 1e-3, 1e-5, 1e-8, 1e6):
        assert balance.blocks([c * unit for c in costs], stages) == want, unit


# ----- plan's memory under checkpointing -----------------------------------------------------


def test_plan_counts_a_checkpointed_stage_as_its_inputs_and_one_recompute() -> None:
    layer = LayerProfile(forward=1e-3, backward=2e-3, params=0, activations=10_000, output=1_000)
    free = Link(latency=0.0, bandwidth=float("inf"), post=0.0)

    def memory(layers: int, checkpoint: str) -> int:
        return balance.plan(
            Profile((1,), ((layer,),) * layers), 2, 4, stages=[2], chunks=[4],
            schedules=["gpipe"], checkpoint=checkpoint, link=free,
        ).best.memory  # fmt: skip

    # two layers per stage, gpipe holds all 4 micro-batches on each rank; rank 1 keeps the
    # input it got (1000 bytes) per micro-batch and one micro-batch's activations while
    # recomputing; rank 0's inputs are views of the batch
    assert memory(4, "never") == 4 * 20_000
    assert memory(4, "always") == 4 * 1_000 + 20_000
    assert memory(4, "except_last") == 4 * 1_000 + 2 * 20_000
    # the inputs do not grow with the layers of a stage
    assert memory(16, "always") == 4 * 1_000 + 8 * 10_000


# ----- balance='auto' across processes -------------------------------------------------------


def test_auto_balance_on_process_subgroups_profiles_each_pipeline_on_its_own() -> None:
    # Before, every pipeline took the balance global rank 0 found for its own model, and a
    # pipeline without rank 0 waited for it until the timeout.
    results = run_ranks(subgroups, 4, timeout=150)
    for rank, found in enumerate(results):
        want = "[3, 1]" if rank < 2 else "[1, 3]"
        assert found["both"][:2] == ("ok", want), (rank, found)
        assert found["high_only"][:2] == ("ok", "[2, 2]" if rank < 2 else want), (rank, found)
        assert found["high_only"][2] < 15, (rank, found)  # not a timeout


def test_auto_balance_against_a_list_and_refused_options_fail_at_once_everywhere() -> None:
    results = run_ranks(mixed_and_options, 2, timeout=150)
    for rank, found in enumerate(results):
        for auto_rank in (0, 1):
            kind, text, seconds = found[f"mixed{auto_rank}"]
            assert kind == "ValueError" and seconds < 10, (rank, found)
            assert (
                f"rank {auto_rank} passes balance='auto' and rank {1 - auto_rank} a list" in text
            ), text
        # the same words as AsyncPipe's own check, before anything multiplies or profiles
        for name, text in (
            ("zero", _refused(virtual_stages=0)),
            ("text", _refused(virtual_stages="2")),
            ("replicas", _refused(data_parallel_size=0)),
        ):
            assert found[name][0] == "ValueError" and found[name][1] == text, (name, found[name])
        # the profiling rank's replica keeps its embedding rows, as the other replica does
        assert found["replicas_equal"] and found["replicas_balance"] == [2], found


def _refused(**options: object) -> str:
    """AsyncPipe's error for one bad option, with a balance given as a list."""
    model = nn.Sequential(nn.Linear(8, 8))
    virtual_stages = options.pop("virtual_stages", 1)
    problems = option_problems(
        transport=None, balance=[1], virtual_stages=virtual_stages, timeout=15.0,
        autocast=None, loss_scale=1.0, data_parallel_size=options.pop("data_parallel_size", 1),
        shared_weights=False, trace=None, trace_every=1,
    )  # fmt: skip
    problems = [p for p in problems if "transport" not in p]
    with pytest.raises(ValueError) as caught:
        check_arguments(model, [1], 2, "never", "gpipe", virtual_stages, 1, problems)
    return str(caught.value)
