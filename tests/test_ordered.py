"""The runtime over a transport that matches messages in posting order, whatever their
channel, as NCCL does (tests/ordered.py): every schedule, skips, several steps with the
agreements that exchange values between ranks (float16 loss scale, gradient clipping), a
failure, and inference, each equal to the plain model or failing as over gloo."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from models import grads_of, mlp, reference
from ordered import MisorderedError, OrderedHub
from skip_models import crossing
from threads import run_pipes, run_threads, values
from torch import Tensor, nn

from asyncpipe import AsyncPipe, StageFailure
from asyncpipe.trace import load_steps
from asyncpipe.transport import Message, Transport

mse = nn.functional.mse_loss


def check(model: nn.Module, losses: list[float], x: Tensor, y: Tensor, chunks: int) -> None:
    want_loss, want_grads = reference(model, x, y, chunks, mse)
    assert all(loss == pytest.approx(want_loss, rel=1e-6) for loss in losses)
    for got, want in zip(grads_of(list(model.parameters())), want_grads):
        torch.testing.assert_close(got, want)


def test_the_transport_catches_a_receive_posted_out_of_turn() -> None:
    hub = OrderedHub(2)
    a, b = hub.transport(0), hub.transport(1)
    early = b.recv(0, channel=7)  # e.g. end-of-step news, posted before the data it precedes
    due = b.recv(0, channel=1)
    a.send(1, 1, Message(0, 1, (torch.ones(2),)))
    a.send(1, 7, Message(0, 1, (torch.zeros(2),)))
    with pytest.raises(MisorderedError, match="receive #0 from rank 0 for channel 7"):
        early.wait(1.0)
    with pytest.raises(MisorderedError, match="receive #1"):
        due.wait(1.0)


@pytest.mark.parametrize(
    ("schedule", "balance", "virtual"),
    [
        ("gpipe", [2, 2], 1),
        ("gpipe", [1, 1, 1, 1], 1),
        ("1f1b", [2, 2], 1),
        ("1f1b", [1, 1, 1, 1], 1),
        ("zero_bubble", [1, 1, 1, 1], 1),
        ("interleaved", [1] * 8, 2),
    ],
)
@pytest.mark.parametrize("policy", ["always", "never"])
def test_every_schedule_matches_the_plain_model(
    schedule: str, balance: list[int], virtual: int, policy: str
) -> None:
    model = mlp(sum(balance))
    world = len(balance) // virtual
    losses, _, x, y = run_pipes(
        model, balance, 4, policy, schedule, 8, virtual, world, hub_type=OrderedHub
    )
    check(model, losses, x, y, 4)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_crossing_skips_match_the_plain_model(schedule: str) -> None:
    model = crossing()
    losses, _, x, y = run_pipes(
        model, [1, 2, 2], 3, "except_last", schedule, 7, seed=5, hub_type=OrderedHub
    )
    check(model, losses, x, y, 3)


def test_steps_with_float16_loss_scale_and_clipping_agree_on_every_rank() -> None:
    """Each step exchanges an overflow flag (float16 loss scale) and the gradient norm
    (clipping) among all ranks: both exchanges send before they receive here."""
    model = mlp(4)
    torch.manual_seed(2)
    x, y = torch.randn(8, 8), torch.randn(8, 8)

    def fn(rank: int, transport: Transport) -> list[float]:
        pipe = AsyncPipe(
            model, [1, 1, 1, 1], chunks=4, autocast=torch.float16, transport=transport, timeout=10
        )
        norms = []
        for _ in range(3):
            pipe.step(x, y, mse)
            norms.append(float(pipe.clip_grad_norm_(1.0)))
            pipe.zero_grad()
        return norms

    norms = values(run_threads(fn, 4, hub_type=OrderedHub))
    assert all(n == norms[0] for n in norms) and all(v > 0 for v in norms[0])


def test_a_failure_reaches_every_rank() -> None:
    class Boom(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            raise ValueError("injected failure")

    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), Boom(), nn.Linear(8, 8))

    def fn(rank: int, transport: Transport) -> Any:
        pipe = AsyncPipe(model, [1, 1, 2], chunks=2, transport=transport, timeout=10)
        return pipe.step(torch.randn(4, 8), torch.randn(4, 8), mse)

    results = run_threads(fn, 3, hub_type=OrderedHub)
    for rank, (status, error) in enumerate(results):
        assert status == "error" and isinstance(error, StageFailure), (rank, error)
        assert "stage 2 failed in 2F0" in str(error), (rank, error)


def test_inference_matches_the_plain_model() -> None:
    model = mlp(4)
    x = torch.randn(6, 8)

    def fn(rank: int, transport: Transport) -> Tensor | None:
        pipe = AsyncPipe(model, [2, 2], chunks=3, transport=transport, timeout=10)
        pipe.eval()
        with torch.no_grad():
            out: Tensor | None = pipe(x if rank == 0 else None)
        return out if rank == 1 else None

    out = values(run_threads(fn, 2, hub_type=OrderedHub))[1]
    with torch.no_grad():
        torch.testing.assert_close(out, model(x))


def test_2bw_is_refused_before_any_message() -> None:
    def fn(rank: int, transport: Transport) -> Any:
        return AsyncPipe(mlp(2), [1, 1], chunks=2, schedule="2bw", transport=transport)

    for status, error in run_threads(fn, 2, hub_type=OrderedHub):
        assert status == "error" and isinstance(error, ValueError), error
        assert "matches messages in posting order" in str(error) and "rpc" in str(error)


def test_traced_steps_match_the_plain_model(tmp_path: Path) -> None:
    """Tracing adds clock and trace messages between the ranks."""
    model = mlp(4)
    torch.manual_seed(4)
    x, y = torch.randn(8, 8), torch.randn(8, 8)

    def fn(rank: int, transport: Transport) -> float:
        pipe = AsyncPipe(model, [2, 2], chunks=4, transport=transport, timeout=10, trace=tmp_path)
        losses = [pipe.step(x, y, mse) for _ in range(3)]
        pipe.close()
        return losses[0]

    model.zero_grad()
    losses = values(run_threads(fn, 2, hub_type=OrderedHub))
    want_loss, _ = reference(model, x, y, 4, mse)
    assert all(loss == pytest.approx(want_loss, rel=1e-6) for loss in losses)
    steps = load_steps(tmp_path)
    assert [s.step for s in steps] == [0, 1, 2]
    assert all(set(s.ranks) == {0, 1} for s in steps)
