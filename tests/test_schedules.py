"""Every schedule over the in-process transport matches the plain model; memory bounds hold."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from models import WithAux, grads_of, mlp, reference
from stubs import Unused
from threads import run_pipes, run_threads, values
from torch import Tensor, nn

from asyncpipe import AsyncPipe
from asyncpipe.schedule import Action, Kind, build, gpipe, lower, one_f_one_b
from asyncpipe.transport import Transport

mse = nn.functional.mse_loss


def acts(text: str) -> list[Action | None]:
    return [Action.parse(a) for a in text.split(" ")]


def run(
    model: Any,
    balance: list[int],
    chunks: int,
    policy: str,
    schedule: Any,
    rows: int = 10,
    virtual_stages: int = 1,
    world: int | None = None,
) -> tuple[list[float], list[AsyncPipe], Tensor, Tensor]:
    return run_pipes(model, balance, chunks, policy, schedule, rows, virtual_stages, world)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zero_bubble"])
@pytest.mark.parametrize("policy", ["always", "except_last", "never"])
@pytest.mark.parametrize("stages,chunks", [(2, 1), (2, 2), (3, 2), (3, 5), (4, 8)])
def test_schedule_matches_plain_model(schedule: str, policy: str, stages: int, chunks: int) -> None:
    model = mlp(2 * stages)
    losses, _, x, y = run(model, [2] * stages, chunks, policy, schedule, rows=2 * chunks + 1)
    want_loss, want_grads = reference(model, x, y, chunks, mse)
    assert all(loss == pytest.approx(want_loss, rel=1e-6) for loss in losses)
    for got, want in zip(grads_of(list(model.parameters())), want_grads):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("policy", ["always", "never"])
@pytest.mark.parametrize("ranks,virtual,chunks", [(2, 2, 4), (2, 3, 2), (3, 2, 6), (1, 2, 3)])
def test_interleaved_matches_plain_model(
    policy: str, ranks: int, virtual: int, chunks: int
) -> None:
    model = mlp(ranks * virtual)
    losses, pipes, x, y = run(
        model,
        [1] * (ranks * virtual),
        chunks,
        policy,
        "interleaved",
        rows=2 * chunks,
        virtual_stages=virtual,
        world=ranks,
    )
    want_loss, want_grads = reference(model, x, y, chunks, mse)
    assert all(loss == pytest.approx(want_loss, rel=1e-6) for loss in losses)
    for got, want in zip(grads_of(list(model.parameters())), want_grads):
        torch.testing.assert_close(got, want)
    # rank r holds the non-adjacent chunks r, r + ranks, ...
    assert list(pipes[0]) == [model[k] for k in range(0, ranks * virtual, ranks)]


def test_custom_plan_runs_and_must_match_the_batch() -> None:
    plan = {
        0: acts("0F0 0F1 0F2 0B0 0B1 0W0 0B2 0W1 0W2"),
        1: acts("1F0 1B0 1W0 1F1 1B1 1F2 1W1 1B2 1W2"),
    }
    model = mlp(4)
    losses, _, x, y = run(model, [2, 2], 3, "except_last", plan, rows=9)
    want_loss, want_grads = reference(model, x, y, 3, mse)
    assert losses[0] == pytest.approx(want_loss, rel=1e-6)
    for got, want in zip(grads_of(list(model.parameters())), want_grads):
        torch.testing.assert_close(got, want)

    with pytest.raises(ValueError, match=r"plan is for 3 micro-batches but chunks=4; pass chunks="):
        AsyncPipe(model, [2, 2], chunks=4, schedule=plan)  # before any process group is needed

    def uneven(rank: int, transport: Transport) -> float:  # 4 rows into 3: torch.chunk gives 2
        pipe = AsyncPipe(model, [2, 2], chunks=3, schedule=plan, transport=transport, timeout=10)
        return pipe.step(x[:4], y[:4], mse)

    results = run_threads(uneven, 2)
    assert "splits into 2 (torch.chunk into chunks=3)" in str(results[0][1]), results
    assert "rows are a multiple of 3" in str(results[0][1])


def test_invalid_custom_plan_fails_in_the_constructor() -> None:
    plan = {
        0: [Action.parse("0B0"), Action.parse("0F0")],
        1: [Action.parse(a) for a in ("1F0", "1B0")],
    }
    with pytest.raises(ValueError, match=r"schedule plan is not valid.*0B0 must come after 0F0"):
        AsyncPipe(mlp(2), [1, 1], schedule=plan, transport=_dummy(2))


def test_a_custom_plan_whose_forwards_start_with_another_micro_batch_matches() -> None:
    # a rank without the first stage took its first message as micro-batch 0's
    plan = {0: acts("0F1 0F0 0B0 0B1"), 1: acts("1F1 1F0 1B0 1B1")}
    model = mlp(2)
    losses, _, x, y = run(model, [1, 1], 2, "never", plan, rows=4)
    want_loss, want_grads = reference(model, x, y, 2, mse)
    _matches(losses, want_loss, model, want_grads)


def test_a_custom_plan_that_cannot_run_with_its_messages_fails_in_the_constructor() -> None:
    # validate accepts it without messages; lowered, rank 1 receives 1 before 0, which rank 0
    # sends after 0: every rank refuses it in the constructor, not at the first step
    plan = {0: acts("0F0 0F1 0B0 0B1"), 1: acts("1F1 1F0 1B0 1B1")}

    def build(rank: int, transport: Transport) -> None:
        AsyncPipe(mlp(2), [1, 1], chunks=2, schedule=plan, transport=transport, timeout=10)

    for status, error in run_threads(build, 2):
        assert status == "error" and isinstance(error, ValueError), error
        assert "cannot run once the sends and receives between ranks are added" in str(error)
        assert "must be received in the order they are sent" in str(error)


def test_a_lowered_custom_plan_is_refused_with_the_fix() -> None:
    plan = lower({0: acts("0F0 0B0"), 1: acts("1F0 1B0")})
    with pytest.raises(ValueError, match=r"holds sends and receives .*before asyncpipe.schedule"):
        AsyncPipe(mlp(2), [1, 1], chunks=1, schedule=plan, transport=_dummy(2))


def test_custom_plan_without_backwards_fails_in_the_constructor() -> None:
    plan = {0: [Action.parse("0F0")], 1: [Action.parse("1F0")]}
    with pytest.raises(ValueError, match="plan has no backward actions, so pipe.step"):
        AsyncPipe(mlp(2), [1, 1], schedule=plan, transport=_dummy(2))


def test_named_schedule_refuses_layers_reused_across_stages() -> None:
    a, b, c = nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)
    with pytest.raises(ValueError, match="schedule '1f1b' needs each rank to run one consecutive"):
        AsyncPipe([a, b, c, a], [2, 2], schedule="1f1b", transport=_dummy(2))


def test_virtual_stages_errors() -> None:
    with pytest.raises(ValueError, match="virtual_stages=2 needs schedule='interleaved'"):
        AsyncPipe(mlp(4), [1, 1, 1, 1], schedule="1f1b", virtual_stages=2, transport=_dummy(2))
    with pytest.raises(ValueError, match=r"rank times virtual_stages \(2\)"):
        AsyncPipe(mlp(6), [1] * 6, schedule="interleaved", virtual_stages=2, transport=_dummy(2))


def _dummy(world: int) -> Transport:
    from asyncpipe.transport import InProcessHub

    return InProcessHub(world).transport(0)


@pytest.mark.parametrize("stages", [2, 4])
def test_one_f_one_b_bounds_activations_by_stages(stages: int) -> None:
    chunks = 8
    model = mlp(stages)
    _, pipes, _, _ = run(model, [1] * stages, chunks, "never", "1f1b", rows=chunks)
    for pipe in pipes:
        assert pipe.last_step is not None
        assert pipe.last_step.peak_activations == min(stages - pipe.stage, chunks)
    _, pipes, _, _ = run(model, [1] * stages, chunks, "never", "gpipe", rows=chunks)
    assert all(p.last_step is not None and p.last_step.peak_activations == chunks for p in pipes)


def test_zero_bubble_peak_memory_equals_one_f_one_b() -> None:
    """Every rank holds at most 1F1B's peak (4 micro-batches with 4 stages, on its first
    rank), counted until W, and the later ranks use that room in the cool-down."""
    model = mlp(4)
    _, pipes, _, _ = run(model, [1] * 4, 8, "never", "zero_bubble", rows=8)
    peaks = [p.last_step.peak_activations for p in pipes if p.last_step is not None]
    assert peaks == [4, 4, 4, 4]


def test_split_backward_computes_weights_only_in_w(monkeypatch: pytest.MonkeyPatch) -> None:
    """B must not touch weight gradients: they are computed inside the W action only."""
    import asyncpipe.compute

    inside_w = [False]
    real = asyncpipe.compute.weight_backward

    def watched(*args: Any) -> None:
        inside_w[0] = True
        real(*args)
        inside_w[0] = False

    monkeypatch.setattr(asyncpipe.compute, "weight_backward", watched)
    plan = {0: acts("0F0 0B0 0W0")}
    model = mlp(2)
    seen: list[bool] = []
    for layer in (model[0][0], model[1][0]):
        layer.weight.register_hook(lambda g: seen.append(inside_w[0]))  # type: ignore[no-untyped-call]
    losses, _, x, y = run(model, [2], 1, "never", plan, rows=4)
    assert seen == [True, True]
    want_loss, want_grads = reference(model, x, y, 1, mse)
    assert losses[0] == pytest.approx(want_loss, rel=1e-6)
    for got, want in zip(grads_of(list(model.parameters())), want_grads):
        torch.testing.assert_close(got, want)


def test_build_names_every_schedule() -> None:
    assert build("1f1b", 3, 4) == one_f_one_b(3, 4)


@pytest.mark.parametrize("schedule", ["1f1b", "zero_bubble"])
def test_forward_and_back_helper_with_any_schedule(schedule: str) -> None:
    model = mlp(4)
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    plain = __import__("copy").deepcopy(model)
    mse(plain(x), y).backward()

    def fn(rank: int, transport: Transport) -> None:
        pipe = AsyncPipe(
            model, [2, 2], chunks=4, schedule=schedule, transport=transport, timeout=10
        )
        out = pipe(x if rank == 0 else None)
        if pipe.is_last_stage:
            mse(out, y).backward()
        else:
            pipe.back_helper(out)

    values(run_threads(fn, 2))
    for got, want in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(got.grad, want.grad)


class _Ordered(Unused):
    """A stand-in for a transport that matches messages in posting order, like NCCL."""

    early_receives = False


def test_posting_order_transport_refuses_plans_that_reorder_messages() -> None:
    from asyncpipe.runtime import Runtime

    def runtime(name: str, ranks: int, virtual: int) -> Runtime:
        owners = [k % ranks for k in range(ranks * virtual)]
        return Runtime(
            0,
            {0: []},
            owners,
            lambda m: build(name, ranks, m, virtual),
            _Ordered(0, ranks),
            1.0,
            torch.device("cpu"),
        )

    runtime("1f1b", 4, 1).plan(8, True)
    runtime("gpipe", 4, 1).plan(8, True)
    runtime("interleaved", 2, 2).plan(4, True)
    # rank 1 sends F0, B0, F1, B1 to rank 0, which takes F0, F1 before B0: fine per channel,
    # impossible when messages are matched in posting order
    plan = {0: acts("0F0 0F1 2F0 2B0 2F1 2B1 0B0 0B1"), 1: acts("1F0 1B0 1F1 1B1")}
    reorders = Runtime(
        0, {0: []}, [0, 1, 0], lambda m: plan, _Ordered(0, 2), 1.0, torch.device("cpu")
    )
    with pytest.raises(ValueError, match="in another order than they are sent"):
        reorders.plan(2, True)


def test_settle_points_follow_the_peers_row_order() -> None:
    from asyncpipe.schedule import lower
    from asyncpipe.schedule.messages import settle_points

    points = settle_points(lower(one_f_one_b(4, 8)), 1)
    named = {str(k): [str(a) for a in v] for k, v in points.items()}
    # stage 2 took activations 0 and 1 before it sent gradient 0 back
    assert named["1RECV_B0->2"] == ["1SEND_F0->2", "1SEND_F1->2"]
    # stage 0 took gradient 0 before it sent micro-batch 4 (after its warm-up of 3)
    assert named["1RECV_F4->0"] == ["1SEND_B0->0"]
    settled = [a for sends in points.values() for a in sends]
    assert len(settled) == len(set(settled)) == 12


def test_message_order_between_pairs_of_ranks() -> None:
    """misordered_pair: a receiver taking one rank's messages in another order than sent;
    crossed_pair: two ranks that both send to each other before receiving (fine when sends
    are buffered, a deadlock when a send waits for its receive)."""
    from asyncpipe.schedule.messages import crossed_pair, misordered_pair

    for stages, chunks in [(2, 1), (2, 4), (4, 8), (3, 5)]:
        assert misordered_pair(lower(gpipe(stages, chunks))) is None
        assert crossed_pair(lower(gpipe(stages, chunks))) is None
        assert misordered_pair(lower(one_f_one_b(stages, chunks))) is None
    # 1F1B's last warm-up forward goes out while the first gradient comes back
    assert crossed_pair(lower(one_f_one_b(2, 4))) == (0, 1)
    assert crossed_pair(lower(one_f_one_b(3, 2))) == (1, 2)
    # a receiver that takes micro-batch 1 before micro-batch 0
    plan = lower(gpipe(2, 2))
    row = plan[1]
    first = next(n for n, a in enumerate(row) if a is not None and a.kind is Kind.RECV_F)
    second = next(
        n for n, a in enumerate(row) if n > first and a is not None and a.kind is Kind.RECV_F
    )
    swapped = list(row)
    swapped[first], swapped[second] = row[second], row[first]
    assert misordered_pair({0: plan[0], 1: swapped}) == (0, 1)


def _step_everywhere(
    model: nn.Module,
    balance: list[int],
    schedule: str,
    policy: str,
    x: Tensor,
    y: Tensor,
    loss_fn: Any,
    world: int = 2,
) -> list[float]:
    """One step on ``world`` in-process ranks (4 micro-batches); each rank's loss."""
    virtual = len(balance) // world
    return run_pipes(
        model, balance, 4, policy, schedule, 0, virtual, world, batch=(x, y), loss_fn=loss_fn
    )[0]


def _plain(
    model: nn.Module, x: Tensor, y: Tensor, loss_fn: Any, copy: bool = True
) -> tuple[float, list[Tensor]]:
    """The plain model's mean micro-batch loss and its gradients (4 micro-batches), run on a
    copy of ``model`` (or on ``model`` itself)."""
    plain = __import__("copy").deepcopy(model) if copy else model
    total = 0.0
    for px, py in zip(x.chunk(4), y.chunk(4)):
        loss = loss_fn(plain(px), py) / 4
        loss.backward()
        total += float(loss.detach())
    return total, [p.grad for p in plain.parameters()]


def _matches(losses: list[float], want_loss: float, model: nn.Module, want_grads: Any) -> None:
    """Both ranks' losses are the plain model's, and so are the gradients of ``model``."""
    assert losses == pytest.approx([want_loss] * 2, rel=1e-6)
    for got, want in zip(grads_of(list(model.parameters())), want_grads):
        torch.testing.assert_close(got, want)


class _TwoHeads(nn.Module):
    """A last layer with two outputs, as a (logits, auxiliary) head."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return self.a(x), self.b(x)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zero_bubble", "interleaved"])
def test_a_loss_that_reads_part_of_a_tuple_output_matches(schedule: str) -> None:
    # zero_bubble asked autograd for the gradient of every output, and the unused one had none
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), _TwoHeads())
    x, y = torch.randn(8, 8), torch.randn(8, 8)

    def loss_fn(out: Any, target: Tensor) -> Tensor:
        return mse(out[0], target)

    balance = [1, 1, 1, 1] if schedule == "interleaved" else [2, 2]
    losses = _step_everywhere(model, balance, schedule, "never", x, y, loss_fn)
    want_loss, want_grads = _plain(model, x, y, loss_fn)
    assert losses == pytest.approx([want_loss] * 2, rel=1e-6)
    for got, want in zip(grads_of(list(model.parameters())), want_grads):
        if want is None:
            assert got is None or not got.any()
        else:
            torch.testing.assert_close(got, want)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zero_bubble"])
@pytest.mark.parametrize("policy", ["never", "always"])
def test_an_output_computed_from_another_and_both_in_the_loss(schedule: str, policy: str) -> None:
    """zero_bubble took the loss's gradient of the first output through the second one's
    graph and back-propagated the second's through it again: the backward failed ("Trying to
    backward through the graph a second time"), or counted that part twice."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), WithAux())
    x, y = torch.randn(8, 8), torch.randn(8, 8)

    def loss_fn(out: Any, target: Tensor) -> Tensor:
        return mse(out[0], target) + out[1]

    losses = _step_everywhere(model, [2, 2], schedule, policy, x, y, loss_fn)
    want_loss, want_grads = _plain(model, x, y, loss_fn)
    _matches(losses, want_loss, model, want_grads)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zero_bubble", "interleaved"])
@pytest.mark.parametrize("policy", ["never", "except_last"])
def test_a_first_layer_that_changes_the_input_in_place_matches(schedule: str, policy: str) -> None:
    # the micro-batches were views of the input sharing one version counter, so a ReLU in place
    # on one made autograd refuse the backward of another
    torch.manual_seed(0)
    model = nn.Sequential(nn.ReLU(inplace=True), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    balance = [1, 1, 1, 1] if schedule == "interleaved" else [2, 2]
    losses = _step_everywhere(model, balance, schedule, policy, x.clone(), y, mse)
    want_loss, want_grads = _plain(model, x.clone(), y, mse)
    _matches(losses, want_loss, model, want_grads)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zero_bubble", "interleaved"])
def test_the_callers_input_gets_its_gradient(schedule: str) -> None:
    # zero_bubble ran the first stage on fresh leaves and never passed their gradient on
    model = mlp(4)
    x, y = torch.randn(8, 8, requires_grad=True), torch.randn(8, 8)
    plain_x = x.detach().clone().requires_grad_(True)
    _plain(model, plain_x, y, mse)
    balance = [1, 1, 1, 1] if schedule == "interleaved" else [2, 2]
    _step_everywhere(model, balance, schedule, "never", x, y, mse)
    assert x.grad is not None
    torch.testing.assert_close(x.grad, plain_x.grad)


def test_a_target_given_as_a_tuple_of_one_reaches_the_loss_as_one() -> None:
    # loss_fn got the bare tensor, so t[0] read its first row and the loss broadcast silently
    model = mlp(4)
    x, y = torch.randn(8, 8), torch.randn(8, 8)

    def loss_fn(out: Tensor, target: Any) -> Tensor:
        assert isinstance(target, tuple) and len(target) == 1, type(target)
        return mse(out, target[0])

    losses = _step_everywhere(model, [2, 2], "1f1b", "never", x, (y,), loss_fn)  # type: ignore[arg-type]
    want_loss, want_grads = _plain(model, x, y, mse)
    _matches(losses, want_loss, model, want_grads)


class _ReadsWeight(nn.Module):
    """Multiplies by another layer's weight, which it reads without registering it."""

    def __init__(self, other: nn.Linear) -> None:
        super().__init__()
        self.read = lambda h: h @ other.weight.t()

    def forward(self, h: Tensor) -> Tensor:
        return self.read(h)


@pytest.mark.parametrize("schedule", ["1f1b", "zero_bubble"])
def test_a_parameter_a_layer_reads_without_registering_gets_its_gradient(schedule: str) -> None:
    # zero_bubble's W asked autograd only for each layer's own parameters
    def make() -> nn.Sequential:
        torch.manual_seed(0)
        first = nn.Linear(8, 8)
        return nn.Sequential(first, nn.Tanh(), _ReadsWeight(first), nn.Linear(8, 8))

    model, plain = make(), make()  # not a deepcopy: the closure would keep the original layer
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    want_loss, want_grads = _plain(plain, x, y, mse, copy=False)
    losses = _step_everywhere(model, [3, 1], schedule, "never", x, y, mse)
    _matches(losses, want_loss, model, want_grads)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zero_bubble", "interleaved"])
@pytest.mark.parametrize("policy", ["never", "except_last"])
def test_an_input_from_the_callers_own_graph_gets_its_gradient(schedule: str, policy: str) -> None:
    # every micro-batch's backward went into the caller's graph, which they share: the second
    # failed ("backward through the graph a second time")
    torch.manual_seed(0)
    model, embed = mlp(4), nn.Linear(8, 8)
    plain, plain_embed = __import__("copy").deepcopy(model), __import__("copy").deepcopy(embed)
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    balance = [1, 1, 1, 1] if schedule == "interleaved" else [2, 2]
    losses = _step_everywhere(model, balance, schedule, policy, embed(x), y, mse)
    want = sum(mse(plain(px), py) / 4 for px, py in zip(plain_embed(x).chunk(4), y.chunk(4)))
    want.backward()  # type: ignore[union-attr]
    want_loss = float(want.detach())  # type: ignore[union-attr]
    assert losses == pytest.approx([want_loss] * 2, rel=1e-6)
    for got, want in zip([*model.parameters(), *embed.parameters()],
                         [*plain.parameters(), *plain_embed.parameters()]):  # fmt: skip
        torch.testing.assert_close(got.grad, want.grad)
