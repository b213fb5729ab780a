"""PipeDream-2BW: the plan as data, and training against the delayed-update reference."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from asyncpipe import AsyncPipe
from asyncpipe.balance.steady import steady_step
from asyncpipe.failure import MismatchedBatch
from asyncpipe.schedule import Costs, lower, one_f_one_b, simulate, two_bw, validate
from asyncpipe.schedule.two_bw import windows
from asyncpipe.transport import Transport
from tests.threads import run_threads, values

mse = nn.functional.mse_loss


def model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for n in range(4):
        layers += [nn.Linear(8, 8), nn.Tanh() if n % 2 else nn.LayerNorm(8)]
    return nn.Sequential(*layers)


def batches(steps: int, rows: int = 8) -> list[tuple[Tensor, Tensor]]:
    generator = torch.Generator().manual_seed(7)
    return [
        (torch.randn(rows, 8, generator=generator), torch.randn(rows, 8, generator=generator))
        for _ in range(steps)
    ]


def adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=0.02)


def delayed_reference(
    plain: nn.Module,
    data: list[tuple[Tensor, Tensor]],
    chunks: int,
    flush_after: set[int],
    max_norm: float | None = None,
    norms: list[float] | None = None,
    hook: Callable[[int, nn.Module], object] | None = None,
) -> tuple[list[float], nn.Module]:
    """The 2BW rule in one process: mini-batch t runs on W(t), and W(t+1) = W(t) updated with
    the gradient of mini-batch t-1 (computed at W(t-1)); a flush applies the pending gradient.
    With ``max_norm``, torch's ``clip_grad_norm_`` clips each gradient applied (its norms are
    appended to ``norms``). ``hook(t, model)`` runs before mini-batch t (e.g. switches modes or
    freezes parameters: mini-batch t then runs as it says). Returns what step() and flush()
    return, in call order, and the trained model."""
    plain = copy.deepcopy(plain)
    params = list(plain.parameters())
    opt = adam(params)
    pending: list[Tensor | None] | None = None
    pending_loss = math.nan
    returned: list[float] = []

    def apply(grads: list[Tensor | None]) -> None:
        for p, g in zip(params, grads):
            p.grad = g
        if max_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
            if norms is not None:
                norms.append(float(norm))
        opt.step()

    for t, (x, y) in enumerate(data):
        if hook is not None:
            hook(t, plain)
        plain.zero_grad()
        loss = 0.0
        for px, py in zip(x.chunk(chunks), y.chunk(chunks)):
            piece = mse(plain(px), py) / chunks
            piece.backward()
            loss += float(piece.detach())
        grads = [None if p.grad is None else p.grad.clone() for p in params]
        returned.append(pending_loss)
        if pending is not None:
            apply(pending)
        pending, pending_loss = grads, loss
        if t in flush_after:
            apply(pending)
            returned.append(pending_loss)
            pending, pending_loss = None, math.nan
    return returned, plain


def run_two_bw(
    balance: list[int],
    chunks: int,
    policy: str,
    steps: int,
    flush_after: set[int],
    max_norm: float | None = None,
    lookahead: int = 1,
    rows: int = 8,
) -> tuple[list[list[float]], list[AsyncPipe]]:
    """Every rank's returned losses (with ``max_norm``: then every ``grad_norm`` after them)
    and pipes."""
    plain, data = model(), batches(steps, rows)

    def fn(rank: int, transport: Transport) -> tuple[list[float], AsyncPipe]:
        pipe = AsyncPipe(
            copy.deepcopy(plain),
            balance,
            chunks=chunks,
            checkpoint=policy,
            schedule="2bw",
            lookahead=lookahead,
            transport=transport,
            timeout=20,
        )
        opt = adam(pipe.parameters())
        out, norms = [], []
        for t, (x, y) in enumerate(data):
            out.append(pipe.step(x, y, mse, optimizer=opt, max_norm=max_norm))
            norms.append(pipe.grad_norm)
            if t in flush_after:
                out.append(pipe.flush())
                norms.append(pipe.grad_norm)
        return out + (norms if max_norm is not None else []), pipe

    results = values(run_threads(fn, len(balance)))
    return [r[0] for r in results], [r[1] for r in results]


def assert_same(
    pipes: list[AsyncPipe], plain: nn.Module, got: list[list[float]], want: list[float]
) -> None:
    for rank_losses in got:
        assert len(rank_losses) == len(want)
        for a, b in zip(rank_losses, want):
            assert (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=1e-5, abs=1e-7)
    state: dict[str, Tensor] = {}
    for pipe in pipes:
        state.update(pipe.state_dict())
    for name, tensor in plain.state_dict().items():
        torch.testing.assert_close(state[name], tensor, rtol=1e-5, atol=1e-6)


# ----- the plan ----------------------------------------------------------------------------


@pytest.mark.parametrize(("stages", "chunks"), [(2, 1), (2, 4), (4, 3), (4, 8)])
def test_two_bw_is_1f1b_over_the_stream_of_mini_batches(stages: int, chunks: int) -> None:
    plan = two_bw(stages, chunks, batches=3)
    assert plan == one_f_one_b(stages, 3 * chunks)
    validate(lower(plan))


@pytest.mark.parametrize(
    ("stages", "chunks", "lookahead"), [(2, 2, 1), (4, 4, 1), (4, 8, 1), (4, 6, 2), (3, 8, 3)]
)
def test_windows_split_each_row_at_mini_batch_forwards(
    stages: int, chunks: int, lookahead: int
) -> None:
    batches_ = 3
    plan = lower(two_bw(stages, chunks, batches=batches_, lookahead=lookahead))
    cut = windows(plan, stages, chunks, batches_, lookahead)
    for rank, row in plan.items():
        parts = cut[rank]
        assert [a for part in parts for a in part] == row
        w = lookahead * (stages - rank - 1)
        for t, part in enumerate(parts[:batches_]):
            forwards = [a.microbatch for a in part if a.kind.value == "F"]
            backwards = [a.microbatch for a in part if a.kind.value == "B"]
            assert forwards == list(range(t * chunks, (t + 1) * chunks))
            assert backwards == list(range(max(t * chunks - w, 0), (t + 1) * chunks - w))
        assert [a.microbatch for a in parts[-1] if a.kind.value == "B"] == list(
            range(batches_ * chunks - w, batches_ * chunks)
        )


def test_the_simulator_shows_no_flush_between_mini_batches() -> None:
    costs = Costs(forward=1, backward=2)
    stream = simulate(two_bw(4, 8, batches=3), costs).makespan
    flushing = 3 * simulate(one_f_one_b(4, 8), costs).makespan
    assert stream == 3 * 8 * 3 + 3 * 3  # one fill and one drain for the whole stream
    assert flushing == 3 * (8 * 3 + 3 * 3)


def test_two_bw_needs_enough_micro_batches() -> None:
    with pytest.raises(ValueError, match="chunks >= 3"):
        two_bw(4, 2)
    with pytest.raises(ValueError, match="chunks >= 6 or a smaller lookahead"):
        two_bw(4, 5, lookahead=2)
    with pytest.raises(ValueError, match="lookahead must be a positive int"):
        two_bw(4, 8, lookahead=0)


def test_lookahead_runs_each_rank_that_many_forwards_ahead_of_the_next() -> None:
    plan = two_bw(4, 8, batches=3, lookahead=2)
    for rank, row in plan.items():
        first_backward = next(n for n, a in enumerate(row) if a is not None and a.kind.value == "B")
        assert first_backward == 2 * (4 - rank - 1) + 1
    validate(lower(plan))
    peak = simulate(plan, Costs(forward=1, backward=2)).peak_activations
    assert peak == {0: 7, 1: 5, 2: 3, 3: 1}  # 2 * (stages - r) - 1, against 1F1B's stages - r
    assert simulate(two_bw(4, 8, batches=3), Costs()).peak_activations == {0: 4, 1: 3, 2: 2, 3: 1}


def _steady_step(lookahead: int, latency: float) -> float:
    """The steady-state step: the stream's repeating window (exact), which here equals the
    time one more mini-batch adds to a long stream (it need not: steps may alternate)."""
    costs = Costs(forward=1, backward=2, send=latency)
    step = steady_step(4, 8, costs, lookahead).seconds
    longer = simulate(lower(two_bw(4, 8, batches=7, lookahead=lookahead)), costs).makespan
    shorter = simulate(lower(two_bw(4, 8, batches=6, lookahead=lookahead)), costs).makespan
    assert step == pytest.approx(longer - shorter)
    return step


def test_a_lookahead_of_two_hides_message_latency_in_the_steady_state() -> None:
    limit = 8 * 3  # a stage's compute of one mini-batch
    assert _steady_step(1, 0.0) == _steady_step(2, 0.0) == limit
    # 1F1B's spacing waits for each message on the way there and back
    assert _steady_step(1, 0.5) == pytest.approx(limit + 8 * 2 * 3 * 0.5 / 4)
    assert _steady_step(2, 0.5) == limit  # a micro-batch of work covers the round trip


# ----- training against the reference ------------------------------------------------------


@pytest.mark.parametrize("policy", ["never", "except_last", "always"])
@pytest.mark.parametrize(("balance", "chunks"), [([4, 4], 4), ([2, 2, 2, 2], 4)])
def test_2bw_matches_the_delayed_update_reference(
    balance: list[int], chunks: int, policy: str
) -> None:
    steps = 5
    got, pipes = run_two_bw(balance, chunks, policy, steps, flush_after={steps - 1})
    want, plain = delayed_reference(model(), batches(steps), chunks, {steps - 1})
    assert_same(pipes, plain, got, want)


@pytest.mark.parametrize("policy", ["never", "except_last"])
def test_2bw_with_lookahead_matches_the_same_delayed_update_reference(policy: str) -> None:
    steps = 5
    got, pipes = run_two_bw(
        [2, 2, 2, 2], 6, policy, steps, flush_after={2, 4}, lookahead=2, rows=12
    )
    want, plain = delayed_reference(model(), batches(steps, rows=12), 6, {2, 4})
    assert_same(pipes, plain, got, want)


def test_lookahead_is_checked_before_any_message() -> None:
    with pytest.raises(ValueError, match="lookahead=2 needs schedule='2bw'"):
        AsyncPipe(model(), [8], chunks=4, schedule="1f1b", lookahead=2)
    with pytest.raises(ValueError, match="lookahead must be a positive int"):
        AsyncPipe(model(), [8], chunks=4, schedule="2bw", lookahead=0)

    def fn(rank: int, transport: Transport) -> str:
        try:
            AsyncPipe(model(), [2, 2, 2, 2], 4, schedule="2bw", lookahead=2, transport=transport)
        except ValueError as e:
            return str(e)
        return ""

    for text in values(run_threads(fn, 4)):
        assert "chunks >= lookahead * (stages - 1) = 6" in text
        assert "pass chunks=6 or a smaller lookahead" in text


def test_every_option_2bw_cannot_run_with_is_refused_before_any_message() -> None:
    # no torch.distributed here: each problem is found from the arguments alone, all at once
    with pytest.raises(ValueError) as raised:
        AsyncPipe(
            model(),
            [2, 2, 2, 2],
            chunks=2,
            schedule="2bw",
            data_parallel_size=2,
            shared_weights=["0.weight"],
            autocast=torch.float16,
        )
    text = str(raised.value)
    for part in (
        "chunks >= stages - 1 so that a rank holds at most two weight versions (stages: 4, "
        "chunks: 2); pass chunks=3",
        "schedule '2bw' runs one pipeline; pass data_parallel_size=1",
        "schedule '2bw' does not tie weights across stages",
        "schedule '2bw' has no float16 loss scaling",
        "the p2p transport needs torch.distributed",
    ):
        assert part in text, text


def test_a_flush_in_the_middle_restarts_the_delayed_rule() -> None:
    got, pipes = run_two_bw([2, 2, 2, 2], 4, "except_last", 6, flush_after={2, 5})
    want, plain = delayed_reference(model(), batches(6), 4, {2, 5})
    assert_same(pipes, plain, got, want)


def test_a_checkpoint_taken_after_flush_resumes_exactly() -> None:
    plain, data = model(), batches(6)

    def fn(rank: int, transport: Transport) -> tuple[list[float], list[float], bool]:
        def build() -> tuple[AsyncPipe, torch.optim.Optimizer]:
            pipe = AsyncPipe(
                copy.deepcopy(plain), [2, 2, 2, 2], chunks=4, schedule="2bw", transport=transport
            )
            return pipe, adam(pipe.parameters())

        pipe, opt = build()
        first, saved = [], None
        for t, (x, y) in enumerate(data):
            first.append(pipe.step(x, y, mse, optimizer=opt))
            if t == 2:
                first.append(pipe.flush())
                saved = copy.deepcopy((pipe.state_dict(), opt.state_dict()))
        first.append(pipe.flush())
        assert saved is not None
        resumed, opt2 = build()
        resumed.load_state_dict(saved[0])
        opt2.load_state_dict(saved[1])
        second = [resumed.step(x, y, mse, optimizer=opt2) for x, y in data[3:]]
        second.append(resumed.flush())
        same = all(torch.equal(a, b) for a, b in zip(pipe.parameters(), resumed.parameters()))
        return first[4:], second, same

    for first, second, same in values(run_threads(fn, 4)):
        assert same
        assert len(first) == len(second) == 4
        assert math.isnan(first[0]) and math.isnan(second[0])
        assert first[1:] == second[1:]


@pytest.mark.parametrize(("balance", "policy"), [([4, 4], "never"), ([2, 2, 2, 2], "always")])
def test_2bw_clips_the_gradient_it_applies_by_its_norm_over_every_stage(
    balance: list[int], policy: str
) -> None:
    steps, max_norm = 5, 1.0
    got, pipes = run_two_bw(balance, 4, policy, steps, {2, steps - 1}, max_norm=max_norm)
    norms: list[float] = []
    want, plain = delayed_reference(model(), batches(steps), 4, {2, steps - 1}, max_norm, norms)
    calls = len(want)
    assert_same(pipes, plain, [g[:calls] for g in got], want)
    # every update's norm before clipping, as torch's on the reference; none before the first
    assert min(norms) < max_norm < max(norms)  # some updates were clipped, some not
    for rank_norms in (g[calls:] for g in got):
        assert [n for n in rank_norms if not math.isnan(n)] == pytest.approx(norms, rel=1e-6)
        assert math.isnan(rank_norms[0]) and math.isnan(rank_norms[4])  # after each start


def test_clip_grad_norm_is_refused_with_2bw_before_any_message() -> None:
    data = batches(2)

    def fn(rank: int, transport: Transport) -> str:
        pipe = AsyncPipe(model(), [4, 4], chunks=2, schedule="2bw", transport=transport)
        opt = adam(pipe.parameters())
        pipe.step(*data[0], mse, optimizer=opt)
        text = ""
        if rank == 0:  # alone: it must fail before it sends anything the other would read
            with pytest.raises(RuntimeError, match="max_norm=1.0") as info:
                pipe.clip_grad_norm_(1.0)
            text = str(info.value)
        pipe.step(*data[1], mse, optimizer=opt)  # the pipeline goes on
        pipe.flush()
        return text

    text = values(run_threads(fn, 2))[0]
    assert "holds the running gradient of the mini-batch in flight" in text


def test_max_norm_clips_before_the_optimizer_with_a_flushing_schedule() -> None:
    plain, (x, y) = model(), batches(1)[0]
    reference = copy.deepcopy(plain)
    opt = adam(reference.parameters())
    for px, py in zip(x.chunk(4), y.chunk(4)):
        (mse(reference(px), py) / 4).backward()
    norm = float(torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.1))
    opt.step()

    def fn(rank: int, transport: Transport) -> tuple[dict[str, Tensor], float]:
        pipe = AsyncPipe(copy.deepcopy(plain), [4, 4], chunks=4, transport=transport)
        with pytest.raises(ValueError, match="pass optimizer=optimizer too"):
            pipe.step(x, y, mse, max_norm=0.1)
        pipe.step(x, y, mse, optimizer=adam(pipe.parameters()), max_norm=0.1)
        return pipe.state_dict(), pipe.grad_norm

    state: dict[str, Tensor] = {}
    for part, got in values(run_threads(fn, 2)):
        state.update(part)
        assert got == pytest.approx(norm, rel=1e-6) and norm > 0.1
    for name, tensor in reference.state_dict().items():
        torch.testing.assert_close(state[name], tensor, rtol=1e-5, atol=1e-6)


def test_step_needs_the_optimizer() -> None:
    data = batches(1)

    def fn(rank: int, transport: Transport) -> None:
        pipe = AsyncPipe(model(), [4, 4], chunks=2, schedule="2bw", transport=transport)
        pipe.step(*data[0], mse)

    for status, error in run_threads(fn, 2):
        assert status == "error" and isinstance(error, TypeError), error
        assert "optimizer=optimizer" in str(error)


@pytest.mark.filterwarnings("ignore:Using a target size")  # mse broadcasts the short target
@pytest.mark.parametrize("found_by", ["step", "flush"])
def test_a_target_of_another_batch_size_is_refused_before_its_update(found_by: str) -> None:
    """2BW trained on it silently (mse broadcast 7 target rows over 8 input rows and the
    update was applied), where the flushing schedules raise MismatchedBatch."""
    plain, data = model(), batches(2)
    before = [p.detach().clone() for p in plain.parameters()]
    wrong = (data[0][0], data[0][1][:7])

    def fn(rank: int, transport: Transport) -> Any:
        pipe = AsyncPipe(plain, [4, 4], chunks=4, schedule="2bw", transport=transport)
        opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
        pipe.step(*wrong, mse, optimizer=opt)
        with pytest.raises(MismatchedBatch, match="8 input rows and 7 target rows"):
            if found_by == "step":
                pipe.step(*data[1], mse, optimizer=opt)
            else:
                pipe.flush()
        with pytest.raises(RuntimeError, match="failed in an earlier call"):
            pipe.flush()

    values(run_threads(fn, 2))
    assert all(torch.equal(p, q) for p, q in zip(before, plain.parameters()))  # not applied


def test_flush_drains_only_once() -> None:
    plain, data = model(), batches(2)

    def fn(rank: int, transport: Transport) -> list[float]:
        pipe = AsyncPipe(plain, [4, 4], chunks=2, schedule="2bw", transport=transport)
        opt = adam(pipe.parameters())
        got = [pipe.step(*data[0], mse, optimizer=opt), pipe.flush(), pipe.flush()]
        with pytest.raises(RuntimeError, match="inference only"):
            pipe(data[0][0])
        return got

    for got in values(run_threads(fn, 2)):
        assert math.isnan(got[0]) and not math.isnan(got[1]) and math.isnan(got[2])


def test_options_2bw_cannot_run_with_fail_in_the_constructor() -> None:
    def fn(rank: int, transport: Transport) -> None:
        AsyncPipe(model(), [2, 2, 2, 2], chunks=2, schedule="2bw", transport=transport)

    for status, error in run_threads(fn, 4):
        assert status == "error" and "pass chunks=3" in str(error)


def _gloo_worker(
    rank: int,
    world: int,
    policy: str,
    steps: int,
    max_norm: float | None,
    chunks: int = 4,
    lookahead: int = 1,
) -> tuple[list[float], dict]:
    torch.set_num_threads(1)
    balance = [8 // world] * world
    pipe = AsyncPipe(
        model(), balance, chunks, checkpoint=policy, schedule="2bw", lookahead=lookahead
    )
    opt = adam(pipe.parameters())
    data = batches(steps, 2 * chunks)
    out = [pipe.step(x, y, mse, optimizer=opt, max_norm=max_norm) for x, y in data]
    torch.distributed.barrier()  # nothing in flight may wait on a receive across a barrier
    out.append(pipe.flush())
    return out, pipe.state_dict()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("world", "policy", "max_norm", "chunks", "lookahead"),
    [
        (2, "never", None, 4, 1),
        (4, "except_last", None, 4, 1),
        (4, "never", 1.0, 4, 1),
        (4, "except_last", None, 6, 2),
    ],
)
def test_2bw_over_gloo_matches_the_delayed_update_reference(
    world: int, policy: str, max_norm: float | None, chunks: int, lookahead: int
) -> None:
    from tests.spawn import run_ranks

    steps = 4
    results = run_ranks(
        _gloo_worker, world, policy, steps, max_norm, chunks, lookahead, timeout=180
    )
    data = batches(steps, 2 * chunks)
    want, plain = delayed_reference(model(), data, chunks, {steps - 1}, max_norm)
    _check_ranks(results, want, plain, rel=1e-5, atol=1e-6)


def _check_ranks(
    results: list[tuple[list[float], dict]],
    want: list[float],
    plain: nn.Module,
    rel: float,
    atol: float,
) -> None:
    """Every rank returned the reference's losses, and the ranks' states make its weights."""
    state: dict[str, Tensor] = {}
    for losses, part in results:
        state.update(part)
        assert all(
            (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=rel)
            for a, b in zip(losses, want, strict=True)
        )
    for name, tensor in plain.state_dict().items():
        torch.testing.assert_close(state[name], tensor, rtol=rel, atol=atol)


def _wide(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(512, 512), nn.Tanh()) for _ in range(4)])


def _wide_batches(steps: int) -> list[tuple[Tensor, Tensor]]:
    generator = torch.Generator().manual_seed(3)
    return [
        (torch.randn(1024, 512, generator=generator), torch.randn(1024, 512, generator=generator))
        for _ in range(steps)
    ]


def _barrier_worker(rank: int, world: int, steps: int) -> tuple[list[float], dict]:
    torch.set_num_threads(1)
    pipe = AsyncPipe(_wide(), [2, 2], chunks=4, schedule="2bw", timeout=60)
    opt = adam(pipe.parameters())
    out = []
    for x, y in _wide_batches(steps):
        out.append(pipe.step(x, y, mse, optimizer=opt))
        torch.distributed.barrier()  # after every step, the first one too
    out.append(pipe.flush())
    return out, pipe.state_dict()


@pytest.mark.slow
def test_2bw_with_a_barrier_after_every_step_and_large_messages() -> None:
    # Micro-batches of (256, 512) float32 (512 KiB) always travel as a header and then their
    # tensors; a gradient sent in one window for the next must be taken before the barrier.
    from tests.spawn import run_ranks

    steps = 3
    results = run_ranks(_barrier_worker, 2, steps, timeout=240)
    want, plain = delayed_reference(_wide(), _wide_batches(steps), 4, {steps - 1})
    _check_ranks(results, want, plain, rel=1e-4, atol=1e-5)


@pytest.mark.parametrize("lookahead", [1, 2])
def test_memory_is_two_weight_versions_and_1f1b_activations(lookahead: int) -> None:
    plain, data = model(), batches(4, rows=16)

    def fn(rank: int, transport: Transport) -> tuple[int, int, int, int]:
        pipe = AsyncPipe(
            plain,
            [2, 2, 2, 2],
            chunks=8,
            schedule="2bw",
            lookahead=lookahead,
            transport=transport,
        )
        opt = adam(pipe.parameters())
        peak = 0
        for x, y in data:
            pipe.step(x, y, mse, optimizer=opt)
            assert pipe.last_step is not None
            peak = max(peak, pipe.last_step.peak_activations)
        stream = pipe._stream
        assert stream is not None
        stashed = sum(t.numel() for t in (stream.versions.stash or {}).values())
        pipe.flush()
        assert stream.versions.stash is None
        params = sum(p.numel() * p.element_size() for p in pipe.parameters())
        return peak, stream.versions.peak_versions, stashed, params

    for rank, (peak, versions, stashed, params) in enumerate(values(run_threads(fn, 4))):
        # as 1F1B (stages - rank micro-batches in flight), or 2 * (stages - rank) - 1
        assert peak == lookahead * (4 - rank - 1) + 1
        assert versions == (1 if rank == 3 else 2)  # the last stage never needs the stash
        assert stashed == (0 if rank == 3 else params)


# ----- a failure before the first action reaches every rank --------------------------------


def _rejecting_worker(rank: int, world: int, culprit: int, how: str, at: int) -> tuple:
    """Three 2BW steps in which rank ``culprit`` fails at step ``at`` before its first action
    (``how``: it passes no optimizer, an input or a target of another batch size) or in the
    update at its end; returns what this rank raised."""
    torch.set_num_threads(1)
    pipe = AsyncPipe(model(), [8 // world] * world, chunks=4, schedule="2bw", timeout=30)
    opt = adam(pipe.parameters())

    def fail(*_: object) -> None:
        if steps == at:
            raise ValueError("injected optimizer failure")

    if rank == culprit and how == "update":
        opt.register_step_pre_hook(fail)
    steps = 0
    try:
        for steps, (x, y) in enumerate(batches(3)):
            optimizer: object = opt
            if rank == culprit and steps == at:
                if how == "optimizer":
                    optimizer = None
                elif how == "input":
                    x = x[:2]
                elif how == "target":
                    y = y[:2]
            pipe.step(x, y, mse, optimizer=optimizer)
        pipe.flush()
    except Exception as e:
        fields = [getattr(e, name, None) for name in ("stage", "microbatch", "action")]
        return (type(e).__name__, str(e), steps, *fields)
    return ("no error", "", steps, None, None, None)


REJECTIONS = {
    # (world, culprit, how, step): (the culprit's own error, words every other rank's has,
    # the action it names)
    (2, 1, "optimizer", 1): ("TypeError", "stage 1 rejected its arguments", "1F4"),
    (4, 0, "input", 2): ("ValueError", "stage 0 rejected its arguments", "0F8"),
    (4, 3, "target", 1): ("ValueError", "stage 3 rejected its arguments", "3F4"),
    (4, 2, "update", 1): ("StageFailure", "stage 2 failed on rank 2 in the update", ""),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(REJECTIONS), ids=lambda c: f"{c[0]}ranks-{c[2]}")
def test_a_failure_before_the_first_action_reaches_every_rank(
    case: tuple[int, int, str, int],
) -> None:
    from tests.spawn import run_ranks

    world, culprit, how, at = case
    own, words, action = REJECTIONS[case]
    results = run_ranks(_rejecting_worker, world, culprit, how, at, timeout=180)
    for rank, (kind, text, step, stage, microbatch, named) in enumerate(results):
        if rank == culprit:
            assert kind == own and step == at, (rank, kind, text)
            if how == "target":  # the count it missed is the schedule's, not an input's
                assert "but this step runs 4: schedule '2bw' runs chunks=4" in text, text
            continue
        # a rejection stops the window it was to run; an update fails after its window, so a
        # peer may learn of it in the next one
        assert step == at or (how == "update" and step == at + 1), (rank, step, text)
        assert kind == "StageFailure", (rank, kind, text)
        assert words in text and "timed out" not in text, (rank, text)
        assert stage == culprit and named == action, (rank, stage, named, text)
        if action:
            assert f"before its first action {action} (micro-batch 0 of mini-batch {at})" in text
            assert microbatch == 0, (rank, microbatch)


class _FailsAt(nn.Module):
    """Tanh that raises at its ``at``-th call (counting from 0)."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at, self.calls = at, 0

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        if self.calls - 1 == self.at:
            raise ValueError("injected forward failure")
        return torch.tanh(x)


def test_a_failure_in_a_window_names_the_action_as_traces_do() -> None:
    data = batches(3)

    def fn(rank: int, transport: Transport) -> None:
        layers = list(model())
        layers[3] = _FailsAt(5)  # stage 1's forward of micro-batch 1 of mini-batch 1
        pipe = AsyncPipe(
            layers, [2, 2, 2, 2], chunks=4, checkpoint="never", schedule="2bw", transport=transport
        )
        opt = adam(pipe.parameters())
        for x, y in data:
            pipe.step(x, y, mse, optimizer=opt)

    for rank, (status, error) in enumerate(run_threads(fn, 4)):
        assert status == "error", rank
        assert "stage 1 failed in 1F5 (micro-batch 1 of mini-batch 1)" in str(error), error
        assert (error.stage, error.microbatch, error.action) == (1, 1, "1F5"), rank
