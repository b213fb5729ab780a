"""Worker functions for the multi-process balance='auto' tests of test_balance_profile.py."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from asyncpipe import AsyncPipe
from asyncpipe.transport import P2PTransport


class Sleep(nn.Module):
    """A linear layer whose forward also sleeps ``ms`` milliseconds."""

    def __init__(self, ms: float) -> None:
        super().__init__()
        self.seconds, self.lin = ms / 1000, nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        time.sleep(self.seconds)
        out: Tensor = self.lin(x)
        return out


def _attempt(build: Any) -> tuple[str, str, float]:
    """(error type or "ok", its text or the balance, seconds it took)."""
    start = time.monotonic()
    try:
        pipe = build()
    except Exception as e:
        return type(e).__name__, str(e), time.monotonic() - start
    return "ok", str(pipe.balance), time.monotonic() - start


def mixed_and_options(rank: int, world: int) -> dict[str, Any]:
    """balance='auto' on one rank and a list on the other (each way), options that AsyncPipe
    refuses with balance='auto', then an embedding that renormalises its rows in forward
    (max_norm) balanced with 'auto' across two data-parallel replicas, in the same
    processes: each one's outcome here."""
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
    x = torch.randn(4, 8)
    found: dict[str, Any] = {}
    for auto_rank in (0, 1):
        found[f"mixed{auto_rank}"] = _attempt(
            lambda auto_rank=auto_rank: AsyncPipe(
                model,
                "auto" if rank == auto_rank else [2, 2],
                chunks=2,
                sample=x,
                timeout=15,
            )
        )
    for name, options in (
        ("zero", {"virtual_stages": 0}),
        ("text", {"virtual_stages": "2"}),
        ("replicas", {"data_parallel_size": 0}),
    ):
        found[name] = _attempt(
            lambda options=options: AsyncPipe(
                model, "auto", chunks=2, sample=x, timeout=15, **options
            )
        )
    torch.manual_seed(0)
    embedding = nn.Embedding(10, 4, max_norm=1.0)
    embedded = nn.Sequential(embedding, nn.Linear(4, 4))
    pipe = AsyncPipe(
        embedded,
        "auto",
        chunks=1,
        sample=torch.tensor([[1, 2], [3, 4]]),
        data_parallel_size=2,
        timeout=30,
    )
    weights = [torch.zeros(10, 4) for _ in range(world)]
    dist.all_gather(weights, embedding.weight.detach().clone())
    found["replicas_equal"] = all(torch.equal(w, weights[0]) for w in weights)
    found["replicas_balance"] = pipe.balance
    return found


def subgroups(rank: int, world: int) -> dict[str, Any]:
    """Two pipelines on process groups {0, 1} and {2, 3}, each with a model of its own: both
    with balance='auto', then {0, 1} with a list and {2, 3} with 'auto'."""
    low, high = dist.new_group([0, 1]), dist.new_group([2, 3])
    x = torch.randn(4, 8)
    found: dict[str, Any] = {}
    for name in ("both", "high_only"):
        if rank < 2:
            model = nn.Sequential(Sleep(1), Sleep(1), Sleep(1), Sleep(60))
            balance: Any = "auto" if name == "both" else [2, 2]
        else:
            model = nn.Sequential(Sleep(60), Sleep(1), Sleep(1), Sleep(1))
            balance = "auto"
        group = low if rank < 2 else high
        found[name] = _attempt(
            lambda model=model, balance=balance, group=group: AsyncPipe(
                model, balance, chunks=2, sample=x, transport=P2PTransport(group=group), timeout=20
            )
        )
    return found
