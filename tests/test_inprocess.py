"""Single-process tests over the in-process transport: ranks are threads of this process."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Sequence
from copy import deepcopy
from typing import Any

import pytest
import torch
from models import grads_of, mlp, reference
from stubs import Unused
from threads import run_threads, values
from torch import Tensor, nn

import asyncpipe
from asyncpipe import AsyncPipe, LazyModule, StageFailure
from asyncpipe.transport import Transport

mse = nn.functional.mse_loss


def step_all(
    model: nn.Module | list[Any],
    balance: list[int],
    chunks: int,
    policy: str,
    x: Any,
    y: Any,
    loss_fn: Any = mse,
) -> list[tuple[float, AsyncPipe]]:
    def fn(rank: int, transport: Transport) -> tuple[float, AsyncPipe]:
        pipe = AsyncPipe(
            model, balance, chunks=chunks, checkpoint=policy, transport=transport, timeout=10
        )
        loss = pipe.step(x, y, loss_fn)
        return loss, pipe

    return values(run_threads(fn, len(balance)))


@pytest.mark.parametrize("policy", ["always", "except_last", "never"])
@pytest.mark.parametrize("balance", [[1, 3], [2, 2], [3, 1], [1, 1, 1, 1], [2, 1, 1]])
@pytest.mark.parametrize("chunks", [1, 3, 4])
def test_step_matches_plain_model(policy: str, balance: list[int], chunks: int) -> None:
    model = mlp(4)
    torch.manual_seed(1)
    x, y = torch.randn(10, 8), torch.randn(10, 8)
    want_loss, want_grads = reference(model, x, y, chunks, mse)
    results = step_all(model, balance, chunks, policy, x, y)
    for loss, _ in results:
        assert loss == pytest.approx(want_loss, rel=1e-6)
    # every rank kept the caller's layers, so the original model holds all the gradients
    for got, want in zip(grads_of(list(model.parameters())), want_grads):
        torch.testing.assert_close(got, want)


def test_each_rank_keeps_only_its_own_layers_and_the_callers_objects() -> None:
    model = mlp(4)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    results = step_all(model, [1, 3], 2, "never", x, y)
    first, second = results[0][1], results[1][1]
    assert len(first) == 1 and len(second) == 3
    assert first[0] is model[0] and list(second) == [model[1], model[2], model[3]]
    assert {id(p) for p in first.parameters()} == {id(p) for p in model[0].parameters()}
    assert (first.stage, second.stage) == (0, 1)
    assert first.is_first_stage and second.is_last_stage


def test_batch_smaller_than_chunks_runs_fewer_microbatches() -> None:
    model = mlp(4)
    x, y = torch.randn(3, 8), torch.randn(3, 8)
    want_loss, want_grads = reference(model, x, y, 8, mse)
    results = step_all(model, [2, 2], 8, "except_last", x, y)
    assert results[0][0] == pytest.approx(want_loss, rel=1e-6)
    for got, want in zip(grads_of(list(model.parameters())), want_grads):
        torch.testing.assert_close(got, want)


class Split(nn.Module):
    """(x) -> (a, b, positions): a tuple with an integer tensor that needs no gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        positions = torch.arange(x.shape[0]).unsqueeze(1).expand(-1, 4)
        return self.a(x), self.b(x), positions


class Mix(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, value: tuple[Tensor, Tensor, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        a, b, positions = value
        return torch.tanh(self.lin(a)), b * positions.float(), positions


class Join(nn.Module):
    def forward(self, value: tuple[Tensor, Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        a, b, _ = value
        return a, b


def tuple_loss(out: tuple[Tensor, Tensor], target: tuple[Tensor, Tensor]) -> Tensor:
    return mse(out[0], target[0]) + mse(out[1], target[1])


@pytest.mark.parametrize("policy", ["always", "never"])
def test_tuples_with_integer_tensors_cross_stages(policy: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(Split(), Mix(), Mix(), Join())
    x, y = torch.randn(6, 8), (torch.randn(6, 8), torch.randn(6, 4))
    want_loss, want_grads = reference(model, x, y, 3, tuple_loss)
    results = step_all(model, [1, 1, 2], 3, policy, x, y, tuple_loss)
    assert results[2][0] == pytest.approx(want_loss, rel=1e-6)
    for got, want in zip(grads_of(list(model.parameters())), want_grads):
        torch.testing.assert_close(got, want)


class Double(nn.Module):
    """Doubles its input in place: a recompute on an input it changed would double it twice."""

    def forward(self, x: Tensor) -> Tensor:
        return x.mul_(2)


@pytest.mark.parametrize("schedule", ["gpipe", "zero_bubble"])
@pytest.mark.parametrize("policy", ["always", "except_last", "never"])
def test_layers_may_modify_their_input_in_place(schedule: str, policy: str) -> None:
    # before: a stage that began with nn.ReLU(inplace=True) failed ("a leaf Variable that
    # requires grad is being used in an in-place operation"), and under zero_bubble so did
    # any in-place layer, as every layer's input is a leaf there
    torch.manual_seed(0)
    layers = [nn.Linear(8, 8), nn.ReLU(inplace=True), nn.Linear(8, 8), Double(), nn.Linear(8, 8)]
    model = nn.Sequential(*layers)
    x, y = torch.randn(6, 8), torch.randn(6, 8)
    want_loss, want_grads = reference(model, x, y, 3, mse)

    def fn(rank: int, transport: Transport) -> float:
        pipe = AsyncPipe(
            model, [1, 2, 2], 3, policy, schedule=schedule, transport=transport, timeout=10
        )
        return pipe.step(x, y, mse)

    for loss in values(run_threads(fn, 3)):
        assert loss == pytest.approx(want_loss, rel=1e-6)
    for got, want in zip(grads_of(list(model.parameters())), want_grads):
        torch.testing.assert_close(got, want)


def test_a_checkpointed_forward_copies_its_input_only_where_layers_change_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every checkpointed forward copied its inputs (a stage input of 4 MiB costs a millisecond
    to copy here), for the rare layer that modifies its input in place; now a stage's first
    checkpointed forward tells, and only a stage that does gets copies after it."""
    import asyncpipe.compute as compute

    copied: list[int] = []

    def counted(tensors: Sequence[Tensor]) -> tuple[Tensor, ...]:
        copied.append(threading.get_ident())
        return tuple(t.clone() for t in tensors)

    monkeypatch.setattr(compute, "copies", counted)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), Double(), nn.Linear(8, 8))
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    want_loss, want_grads = reference(model, x, y, 4, mse)
    ranks: dict[int, int] = {}

    def fn(rank: int, transport: Transport) -> float:
        ranks[threading.get_ident()] = rank
        pipe = AsyncPipe(model, [2, 2], 4, "always", transport=transport, timeout=10)
        return pipe.step(x, y, mse)

    for loss in values(run_threads(fn, 2)):
        assert loss == pytest.approx(want_loss, rel=1e-6)
    for got, want in zip(grads_of(list(model.parameters())), want_grads):
        torch.testing.assert_close(got, want)
    # stage 0 (two Linear layers): its first forward only; stage 1 (Double): all four
    assert Counter(ranks[ident] for ident in copied) == {0: 1, 1: 4}


class Sometimes(nn.Module):
    """Doubles its input in place from its third call on."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        return x.mul_(2) if self.calls > 2 else x * 2


def test_an_input_changed_in_place_where_it_was_not_before_is_an_error() -> None:
    model = nn.Sequential(nn.Linear(8, 8), Sometimes(), nn.Linear(8, 8))

    def fn(rank: int, transport: Transport) -> float:
        pipe = AsyncPipe(model, [1, 2], 4, "always", transport=transport, timeout=10)
        return pipe.step(torch.randn(8, 8), torch.randn(8, 8), mse)

    results = run_threads(fn, 2)
    assert all(isinstance(e, StageFailure) for _, e in results), results
    text = str(results[1][1])
    assert "stage 1 modified its input in place in micro-batch 2" in text, text
    assert "checkpoint='never'" in text, text


def test_lazy_modules_are_built_only_by_their_owner() -> None:
    torch.manual_seed(0)
    plain = mlp(4)
    lazy = [LazyModule(lambda layer=layer: layer) for layer in plain]
    x, y = torch.randn(4, 8), torch.randn(4, 8)

    def fn(rank: int, transport: Transport) -> list[bool]:
        mine = [LazyModule(lambda layer=layer: layer) for layer in plain]
        pipe = AsyncPipe(mine, [1, 3], chunks=2, transport=transport, timeout=10)
        pipe.step(x, y, mse)
        return [m.built for m in mine]

    built = values(run_threads(fn, 2))
    assert built == [[True, False, False, False], [False, True, True, True]]
    assert not any(m.built for m in lazy)


def test_reused_layer_runs_on_its_owner_with_the_plain_gradients() -> None:
    torch.manual_seed(0)
    a, b, c = nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)
    layers = [a, b, c, a, b]
    plain = nn.Sequential(*layers)
    x, y = torch.randn(6, 8), torch.randn(6, 8)
    want_loss, want_grads = reference(plain, x, y, 3, mse)
    results = step_all(layers, [2, 3], 3, "except_last", x, y)
    assert results[0][0] == pytest.approx(want_loss, rel=1e-6)
    pipe0, pipe1 = results[0][1], results[1][1]
    assert list(pipe0) == [a, b] and list(pipe1) == [c]
    for got, want in zip(grads_of(list(plain.parameters())), want_grads):
        torch.testing.assert_close(got, want)


def test_forward_and_back_helper_match_the_plain_model() -> None:
    model = mlp(4)
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    plain = __import__("copy").deepcopy(model)
    mse(plain(x), y).backward()

    def fn(rank: int, transport: Transport) -> Tensor | None:
        pipe = AsyncPipe(model, [2, 2], chunks=4, transport=transport, timeout=10)
        out = pipe(x if rank == 0 else None)
        if pipe.is_last_stage:
            loss = mse(out, y)
            loss.backward()
            return out.detach()
        pipe.back_helper(out)
        return None

    outs = values(run_threads(fn, 2))
    torch.testing.assert_close(outs[1], plain(x).detach())
    for got, want in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(got.grad, want.grad)


def test_step_refuses_while_a_training_forward_waits_for_its_backward() -> None:
    model = mlp(4)
    x, y = torch.randn(8, 8), torch.randn(8, 8)

    def fn(rank: int, transport: Transport) -> str:
        pipe = AsyncPipe(model, [2, 2], chunks=4, transport=transport, timeout=10)
        pipe(x if rank == 0 else None)
        try:
            pipe.step(x, y, mse)
        except RuntimeError as e:
            return str(e)
        return "stepped"

    for text in values(run_threads(fn, 2)):
        assert "still waits for its backward" in text and "before step()" in text, text


@pytest.mark.parametrize("mode", ["no_grad", "eval"])
def test_inference_pipeline_waits_for_no_gradients(mode: str) -> None:
    model = mlp(4)
    x = torch.randn(5, 8)
    with torch.no_grad():
        want = model(x)

    def fn(rank: int, transport: Transport) -> Tensor:
        pipe = AsyncPipe(model, [2, 2], chunks=2, transport=transport, timeout=10)
        if mode == "eval":
            pipe.eval()
            out = pipe(x if rank == 0 else None)
        else:
            with torch.no_grad():
                out = pipe(x if rank == 0 else None)
        return out

    outs = values(run_threads(fn, 2))
    torch.testing.assert_close(outs[1], want)
    assert not outs[1].requires_grad


class Boom(nn.Module):
    def __init__(self, where: str, microbatch: int) -> None:
        super().__init__()
        self.lin, self.where, self.microbatch, self.calls = nn.Linear(8, 8), where, microbatch, 0

    def forward(self, x: Tensor) -> Tensor:
        n = self.calls
        self.calls += 1
        if self.where == "forward" and n == self.microbatch:
            raise ValueError("boom in forward")
        out = self.lin(x)
        if self.where == "backward" and n == self.microbatch:

            def hook(grad: Tensor) -> Tensor:
                raise ValueError("boom in backward")

            out.register_hook(hook)
        return out


@pytest.mark.parametrize("where,action", [("forward", "1F2"), ("backward", "1B1")])
def test_failure_in_one_stage_reaches_every_rank(where: str, action: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 8), Boom(where, 2 if where == "forward" else 1), nn.Linear(8, 8)
    )
    x, y = torch.randn(8, 8), torch.randn(8, 8)

    def fn(rank: int, transport: Transport) -> float:
        pipe = AsyncPipe(
            model, [1, 1, 1], chunks=4, checkpoint="never", transport=transport, timeout=10
        )
        return pipe.step(x, y, mse)

    results = run_threads(fn, 3)
    for rank, (status, error) in enumerate(results):
        assert status == "error", f"rank {rank} did not fail"
        assert isinstance(error, StageFailure), repr(error)
        assert error.stage == 1 and str(error.stage) in str(error)
        assert f"micro-batch {action[-1]}" in str(error)
    assert action in str(results[1][1]) and f"boom in {where}" in str(results[1][1])
    assert isinstance(results[1][1].__cause__, ValueError)


class Sleepy(nn.Module):
    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def forward(self, x: Tensor) -> Tensor:
        time.sleep(self.seconds)
        return x


def test_a_stuck_stage_makes_the_others_fail_naming_the_peer() -> None:
    model = nn.Sequential(nn.Linear(8, 8), Sleepy(3.0), nn.Linear(8, 8))
    x, y = torch.randn(4, 8), torch.randn(4, 8)

    def fn(rank: int, transport: Transport) -> float:
        pipe = AsyncPipe(model, [1, 1, 1], chunks=1, transport=transport, timeout=1.0)
        return pipe.step(x, y, mse)

    began = time.monotonic()
    results = run_threads(fn, 3, timeout=30)
    assert time.monotonic() - began < 20
    status, error = results[2]
    assert status == "error" and "timed out" in str(error) and "from rank 1" in str(error)
    assert all(status == "error" for status, _ in results)


def test_ranks_that_run_different_calls_are_told_so() -> None:
    """Rank 0 steps while rank 1 runs a forward only: rank 0 named rank 1 as silent ("sent
    nothing ... stuck, far slower or gone") and rank 1 blamed rank 0 for the same; rank 0 now
    sees rank 1's step end well without the gradient and names the mismatch, and rank 1's
    error points at rank 0's."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    x, y = torch.randn(4, 4), torch.randn(4, 4)

    def fn(rank: int, transport: Transport) -> Any:
        pipe = AsyncPipe(model, [1, 1], chunks=2, transport=transport, timeout=2.0)
        return pipe.step(x, y, mse) if rank == 0 else pipe(x)

    (_, stepped), (_, forwarded) = run_threads(fn, 2, timeout=60)
    assert isinstance(stepped, StageFailure) and isinstance(forwarded, StageFailure)
    assert "rank 1 (stage 1) ended its step without sending what rank 0 waited for" in str(stepped)
    assert "the ranks ran different calls" in str(stepped)
    assert "on rank 0 (see that rank's error" in str(forwarded), forwarded


def test_non_tensor_at_a_boundary_is_named() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Flatten(0) if False else _ToList(), nn.Identity())

    def fn(rank: int, transport: Transport) -> float:
        pipe = AsyncPipe(model, [2, 1], chunks=2, transport=transport, timeout=10)
        return pipe.step(torch.randn(4, 8), torch.randn(4, 8), mse)

    results = run_threads(fn, 2)
    assert all(isinstance(e, StageFailure) for _, e in results)
    assert "output of stage 0 must be a tensor or a tuple of tensors" in str(results[0][1])
    assert "0F0" in str(results[1][1])


class _ToList(nn.Module):
    def forward(self, x: Tensor) -> Any:
        return [x, "label"]


def test_loss_must_be_a_scalar() -> None:
    model = mlp(2)

    def fn(rank: int, transport: Transport) -> float:
        pipe = AsyncPipe(model, [1, 1], chunks=2, transport=transport, timeout=10)
        return pipe.step(torch.randn(4, 8), torch.randn(4, 8), lambda o, t: (o - t) ** 2)

    results = run_threads(fn, 2)
    assert "loss_fn must return a tensor with one element" in str(results[1][1])
    assert isinstance(results[0][1], StageFailure)


def test_missing_input_on_the_first_stage_fails_everywhere() -> None:
    model = mlp(2)

    def fn(rank: int, transport: Transport) -> float:
        pipe = AsyncPipe(model, [1, 1], chunks=2, transport=transport, timeout=10)
        return pipe.step(None, torch.randn(4, 8), mse)

    results = run_threads(fn, 2)
    assert "input is needed on stage 0" in str(results[0][1])
    assert "input is needed on stage 0" in str(results[1][1])


def test_a_rank_posts_its_steps_receives_after_its_first_compute_not_before() -> None:
    """A rank whose first message is in hand when the step begins posts only that channel's
    next receive before its first forward (the next rank waits for that forward); the rest
    of the step's receives go when it may block next. Gradients stay the plain model's."""
    from asyncpipe.runtime import STATUS_CHANNEL
    from asyncpipe.transport.inprocess import InProcessTransport

    posted: dict[int, int] = {}
    seen: dict[int, int] = {}

    class Counting(InProcessTransport):
        def recv(self, src: int, channel: int, slot: int = 0) -> Any:
            if channel < STATUS_CHANNEL:
                posted[self.rank] = posted.get(self.rank, 0) + 1
            return super().recv(src, channel, slot)

    class Hub(asyncpipe.transport.InProcessHub):
        def transport(self, rank: int) -> InProcessTransport:
            return Counting(self, rank)

    class Probe(nn.Linear):
        def __init__(self, rank: int) -> None:
            super().__init__(8, 8)
            self.rank = rank

        def forward(self, x: Tensor) -> Tensor:
            seen.setdefault(self.rank, posted.get(self.rank, 0))
            return torch.tanh(super().forward(x))

    torch.manual_seed(0)
    model = nn.Sequential(Probe(0), Probe(1), Probe(2))
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    want_loss, want_grads = reference(model, x, y, 4, mse)
    seen.clear()

    def fn(rank: int, transport: Transport) -> float:
        pipe = AsyncPipe(
            model, [1, 1, 1], chunks=4, schedule="1f1b", transport=transport, timeout=10
        )
        return pipe.step(x, y, mse)

    losses = values(run_threads(fn, 3, hub_type=Hub))
    assert losses == pytest.approx([want_loss] * 3, rel=1e-6)
    for got, want in zip(grads_of(list(model.parameters())), want_grads):
        torch.testing.assert_close(got, want)
    # rank 0 has no receive before its forwards; ranks 1 and 2: the first and the next
    assert seen == {0: 0, 1: 2, 2: 2}
    # every receive was posted in the end: 4 forwards (and 4 gradients on the middle rank)
    assert posted == {0: 4, 1: 8, 2: 4}


def test_a_failed_pipeline_refuses_further_steps(tmp_path: Any) -> None:
    """clip_grad_norm_ returned 0 and checkpoint.save/load ran on a failed pipeline (after a
    timeout, save failed later with the transport's raw error)."""
    model = nn.Sequential(nn.Linear(8, 8), Boom("forward", 0))

    def fn(rank: int, transport: Transport) -> str:
        pipe = AsyncPipe(model, [1, 1], chunks=1, transport=transport, timeout=10)
        with pytest.raises(StageFailure):
            pipe.step(torch.randn(2, 8), torch.randn(2, 8), mse)
        with pytest.raises(RuntimeError, match="failed in an earlier call"):
            pipe.step(torch.randn(2, 8), torch.randn(2, 8), mse)
        with pytest.raises(RuntimeError, match="failed in an earlier call"):
            pipe.clip_grad_norm_(1.0)
        with pytest.raises(RuntimeError, match="failed in an earlier call"):
            asyncpipe.checkpoint.save(pipe, None, tmp_path, step=1)
        with pytest.raises(RuntimeError, match="failed in an earlier call"):
            asyncpipe.checkpoint.load(pipe, None, tmp_path)
        return "ok"

    assert values(run_threads(fn, 2)) == ["ok", "ok"]


def test_a_mismatched_batch_leaves_no_gradient_for_the_next_step_with_an_optimizer() -> None:
    """The step raised MismatchedBatch before its optimizer.zero_grad(), so the next good
    step's update applied the bad step's gradients too."""
    model = mlp(4)
    plain = deepcopy(model)
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    step = torch.optim.SGD(plain.parameters(), lr=0.1)
    mse(plain(x), y).backward()
    step.step()

    def fn(rank: int, transport: Transport) -> None:
        pipe = AsyncPipe(model, [2, 2], chunks=4, transport=transport, timeout=10)
        opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
        with pytest.raises(asyncpipe.MismatchedBatch, match=r"zero the gradients"):
            pipe.step(x, y[:4], mse, optimizer=opt)  # a row of target per 2 rows: broadcast
        assert all(p.grad is None or not p.grad.any() for p in pipe.parameters())
        pipe.step(x, y, mse, optimizer=opt)

    values(run_threads(fn, 2))
    for got, want in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(got, want)


def test_an_interrupted_step_is_named_when_the_pipeline_refuses_the_next() -> None:
    class Interrupt(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            raise KeyboardInterrupt  # str() of it is empty

    model = nn.Sequential(nn.Linear(8, 8), Interrupt())
    alone = asyncpipe.transport.InProcessHub(1).transport(0)
    pipe = AsyncPipe(model, [2], chunks=1, transport=alone, timeout=10)
    with pytest.raises(KeyboardInterrupt):
        pipe.step(torch.randn(2, 8), torch.randn(2, 8), mse)
    with pytest.raises(RuntimeError, match=r"failed in an earlier call \(KeyboardInterrupt\)"):
        pipe.step(torch.randn(2, 8), torch.randn(2, 8), mse)


def test_step_reports_timing() -> None:
    model = mlp(2)

    def fn(rank: int, transport: Transport) -> asyncpipe.StepReport | None:
        pipe = AsyncPipe(model, [1, 1], chunks=2, transport=transport, timeout=10)
        pipe.step(torch.randn(4, 8), torch.randn(4, 8), mse)
        return pipe.last_step

    for report in values(run_threads(fn, 2)):
        assert report is not None and 0 < report.busy_seconds <= report.seconds
        assert 0 <= report.idle_fraction < 1
        assert {e[0] for e in report.events} >= {"0F0", "0B1"} or {"1F0", "1B1"} <= {
            e[0] for e in report.events
        }


def test_loss_without_target_gets_none() -> None:
    model = mlp(2)
    x = torch.randn(4, 8)
    seen: list[object] = []

    def loss_fn(out: Tensor, target: object) -> Tensor:
        seen.append(target)
        return out.pow(2).mean()

    results = step_all(model, [1, 1], 2, "never", x, None, loss_fn)
    want, _ = reference(model, x, torch.zeros(4, 8), 2, lambda o, t: o.pow(2).mean())
    assert results[0][0] == pytest.approx(want, rel=1e-6)
    assert seen == [None, None]


def test_the_last_stage_reads_its_losses_once_a_step() -> None:
    """Reading a loss's value waits for the device (on a GPU it stalls the host), so the last
    stage collects the micro-batch losses and reads their sum once, when the step ends."""

    class Counted(Tensor):
        reads = 0

        @classmethod
        def __torch_function__(
            cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            if func in (Tensor.__float__, Tensor.item, Tensor.tolist):
                cls.reads += 1
            return super().__torch_function__(func, types, args, kwargs or {})

    model = mlp(2)
    torch.manual_seed(0)
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    want_loss, _ = reference(model, x, y, 4, mse)

    def counted(output: Tensor, target: Tensor) -> Tensor:
        return mse(output, target).as_subclass(Counted)

    def fn(rank: int, transport: Transport) -> float:
        pipe = AsyncPipe(model, [1, 1], chunks=4, transport=transport, timeout=10)
        return pipe.step(x, y, counted)

    losses = values(run_threads(fn, 2))
    assert losses == pytest.approx([want_loss] * 2, rel=1e-6)
    assert Counted.reads == 1  # one step of 4 micro-batches: one read


class _Unconfirmed(Unused):
    """A transport whose flush fails as ``error`` does: receipts a peer never returned."""

    def __init__(self, error: BaseException) -> None:
        super().__init__()
        self.error = error

    def flush(self, timeout: float) -> None:
        raise self.error


def test_flush_received_forgives_missing_receipts_only() -> None:
    from asyncpipe.transport import PeerLost, TransportTimeout

    _Unconfirmed(TransportTimeout("rank 0 could not deliver a message to rank 1")).flush_received(1)
    _Unconfirmed(PeerLost("rank 0 lost rank 1", 1)).flush_received(1)
    with pytest.raises(TransportTimeout):
        _Unconfirmed(TransportTimeout("late")).flush(1)
    with pytest.raises(RuntimeError, match="a bug"):  # anything else is not a receipt
        _Unconfirmed(RuntimeError("a bug")).flush_received(1)


class ToComplex(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return torch.complex(x, 0.5 * x)


class ComplexScale(nn.Module):
    """Multiplies by a complex parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, dtype=torch.complex64))

    def forward(self, z: Tensor) -> Tensor:
        return z * self.w


class FromComplex(nn.Module):
    def forward(self, z: Tensor) -> Tensor:
        return 2 * z.real + z.imag


@asyncpipe.skip.skippable(stash=["z"])
class StashComplex(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Any:
        yield asyncpipe.skip.stash("z", torch.complex(self.linear(x), -x))
        return x


@asyncpipe.skip.skippable(pop=["z"])
class PopComplex(nn.Module):
    def forward(self, x: Tensor) -> Any:
        z = yield asyncpipe.skip.pop("z")
        return x * (z.real + 3 * z.imag)


def complex_model() -> nn.Sequential:
    """Complex activations between stages 0 and 1 and between layers of stage 1, a complex
    parameter and a complex skip within stage 1 (balance [2, 6]); a complex skip from stage 0
    to stage 1 (balance [5, 3])."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 8),
        ToComplex(),
        ComplexScale(),
        FromComplex(),
        StashComplex(),
        nn.Linear(8, 8),
        PopComplex(),
        nn.Linear(8, 8),
    )


@pytest.mark.parametrize("balance", [[2, 6], [5, 3]])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zero_bubble"])
@pytest.mark.parametrize("policy", ["always", "except_last", "never"])
def test_complex_activations_and_skips_carry_gradients(
    balance: list[int], schedule: str, policy: str
) -> None:
    # before: "requires a gradient?" meant floating point, so a complex activation crossing a
    # boundary (or a complex skip) arrived without one: stage 0 got no weight gradient; under
    # zero_bubble a complex value between two layers of a stage failed W ("Trying to backward
    # through the graph a second time")
    model = complex_model()
    torch.manual_seed(1)
    x, y = torch.randn(6, 8), torch.randn(6, 8)
    want_loss, want_grads = reference(model, x, y, 3, mse)

    def fn(rank: int, transport: Transport) -> float:
        pipe = AsyncPipe(
            model, balance, 3, policy, schedule=schedule, transport=transport, timeout=10
        )
        return pipe.step(x, y, mse)

    for loss in values(run_threads(fn, 2)):
        assert loss == pytest.approx(want_loss, rel=1e-6)
    for got, want in zip(grads_of(list(model.parameters())), want_grads, strict=True):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("schedule", ["gpipe", "zero_bubble"])
def test_a_complex_input_gets_its_gradient(schedule: str) -> None:
    # before: a complex input that requires grad was not made a leaf, so each micro-batch's
    # backward went into the caller's graph on its own: the second failed ("Trying to
    # backward through the graph a second time") where that graph saved tensors
    model = complex_model()[2:]
    torch.manual_seed(1)
    a, y = torch.randn(6, 8, requires_grad=True), torch.randn(6, 8)
    plain, copy = a.detach().clone().requires_grad_(True), deepcopy(model)
    want = mse(copy(torch.complex(plain, plain).exp()), y)  # 3 micro-batches of 2 rows: the same
    want.backward()
    want_loss, want_grads = float(want.detach()), grads_of(list(copy.parameters()))

    def fn(rank: int, transport: Transport) -> float:
        pipe = AsyncPipe(model, [2, 4], 3, schedule=schedule, transport=transport, timeout=10)
        x = torch.complex(a, a).exp() if rank == 0 else None  # a graph that saves its output
        return pipe.step(x, y, mse)

    for loss in values(run_threads(fn, 2)):
        assert loss == pytest.approx(want_loss, rel=1e-6)
    assert a.grad is not None and plain.grad is not None
    torch.testing.assert_close(a.grad, plain.grad)
    for got, want in zip(grads_of(list(model.parameters())), want_grads, strict=True):
        torch.testing.assert_close(got, want)


def test_a_rank_too_slow_for_the_timeout_is_told_which_rank_timed_out_waiting_for_it() -> None:
    """Rank 1 calls step after rank 0 gave up waiting for it: rank 1's step runs (its
    messages were there) and the news tells it that rank 0 timed out waiting for it. Before,
    rank 1 read a failure of its own with no cause ("stage 1 failed in 1B0 ... on rank 1 (see
    that rank's error for the cause)")."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    x, y = torch.randn(4, 4), torch.randn(4, 4)

    def fn(rank: int, transport: Transport) -> Any:
        pipe = AsyncPipe(model, [1, 1], chunks=2, transport=transport, timeout=1.0)
        if rank == 1:
            time.sleep(2.0)
        return pipe.step(x, y, mse)

    (_, waited), (_, late) = run_threads(fn, 2, timeout=60)
    assert isinstance(waited, StageFailure) and "rank 1 (stage 1) sent nothing" in str(waited)
    assert isinstance(late, StageFailure) and (late.rank, late.stage) == (1, 1)
    assert "rank 0 timed out waiting for this rank (rank 1, stage 1) in 1B0" in str(late), late
    assert "slower than the pipeline's timeout=1 s" in str(late), late


def test_a_pipeline_cannot_be_copied_or_pickled() -> None:
    # A deep copy kept the original's message tags: stepped in another order on two ranks, the
    # copy and the original ran each other's stages without an error.
    import copy
    import pickle

    def fn(rank: int, transport: Transport) -> list[str]:
        pipe = AsyncPipe(mlp(), [2, 2], chunks=2, transport=transport)
        refused = []
        for attempt in (
            lambda: deepcopy(pipe),
            lambda: copy.copy(pipe),
            lambda: pickle.dumps(pipe),
        ):
            with pytest.raises(TypeError) as raised:
                attempt()
            refused.append(str(raised.value))
        return refused

    for refused in values(run_threads(fn, 2)):
        assert len(refused) == 3
        for text in refused:
            assert text.startswith("an AsyncPipe cannot be copied or pickled"), text
            assert "copy.deepcopy(model)" in text, text
