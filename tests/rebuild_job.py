"""A two-stage job over p2p (gloo) whose failed step sends a notice no rank takes (both ranks
failed, or the other had all it needed), then builds a new pipeline on the same process group
and steps it.

Run as ``python rebuild_job.py CASE`` on ranks set up like torchrun's (see
``launch.run_processes``). CASE is ``2bw_short`` (schedule "2bw", chunks=4: every rank passes a
batch of 6 rows, as at the end of an epoch, which both refuse before their window begins),
``1f1b_both`` (stage 0 fails in 0F1 and stage 1 in 1F0 of the same step, each on its own) or
``1f1b_last`` (stage 0 fails in its last backward, 0B3, when stage 1 has all it needs from
it). Each rank closes the failed pipeline and builds a new one on the same model's initial
weights. Every rank prints one line ``RESULT {json}``: the error the failed step raised and
how long it took, the first loss of the rebuilt pipeline and the plain model's, and the sum of
an all_reduce over the group after it.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

import asyncpipe

ROWS, CHUNKS = 8, 4


class Faulty(nn.Module):
    """Passes its input on; once armed, raises in the forward (or, with ``backward``, in the
    backward) of the ``at``-th micro-batch it sees."""

    def __init__(self, at: int, backward: bool = False) -> None:
        super().__init__()
        self.at, self.backward, self.armed, self.calls = at, backward, False, 0

    def forward(self, x: Tensor) -> Tensor:
        if not self.armed:
            return x
        self.calls += 1
        if self.calls == self.at and not self.backward:
            raise ValueError(f"injected forward failure on rank {os.environ['RANK']}")
        if self.calls == self.at:

            def fail(grad: Tensor) -> Tensor:
                raise ValueError(f"injected backward failure on rank {os.environ['RANK']}")

            x = x * 1.0
            x.register_hook(fail)
        return x


def model(faults: tuple[Faulty, Faulty] | None = None) -> nn.Sequential:
    torch.manual_seed(0)
    first, second = faults or (Faulty(0), Faulty(0))
    return nn.Sequential(nn.Linear(8, 8), first, nn.Linear(8, 8), second)


def build(net: nn.Sequential, schedule: str) -> asyncpipe.AsyncPipe:
    return asyncpipe.AsyncPipe(
        net, [2, 2], chunks=CHUNKS, schedule=schedule, checkpoint="never", timeout=20
    )


def main(case: str) -> None:
    asyncpipe.init(backend="gloo", timeout=60)
    generator = torch.Generator().manual_seed(1)
    x, y = torch.randn(ROWS, 8, generator=generator), torch.randn(ROWS, 8, generator=generator)
    mse = nn.functional.mse_loss
    schedule = "2bw" if case.startswith("2bw") else "1f1b"
    at = {"2bw_short": (0, 0), "1f1b_both": (2, 1), "1f1b_last": (CHUNKS, 0)}[case]
    faults = (Faulty(at[0], backward=case == "1f1b_last"), Faulty(at[1]))
    pipe = build(model(faults), schedule)
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
    pipe.step(x, y, mse, optimizer=optimizer)  # a good step first
    for fault in faults:
        fault.armed = fault.at > 0
    result: dict[str, Any] = {}
    began = time.monotonic()
    try:
        if case == "2bw_short":
            pipe.step(x[:6], y[:6], mse, optimizer=optimizer)  # the epoch's short last batch
        else:
            pipe.step(x, y, mse, optimizer=optimizer)
        result["error"] = None
    except Exception as e:
        result.update(error=type(e).__name__, text=str(e))
    result["seconds"] = time.monotonic() - began
    pipe.close()  # as the docs ask before building again; a failed pipeline closes at once
    del pipe, optimizer

    net = model()  # the same initial weights
    with torch.no_grad():
        result["expected"] = float(mse(net(x), y))
    try:
        again = build(net, schedule)
        optimizer = torch.optim.SGD(again.parameters(), lr=0.1)
        loss = again.step(x, y, mse, optimizer=optimizer)
        if schedule == "2bw":  # the loss of a mini-batch comes one step late
            loss = again.flush()
        result["loss"] = float(loss)
        total = torch.ones(1)
        dist.all_reduce(total)
        result["all_reduce"] = float(total)
        again.close()
    except Exception as e:
        result.update(rebuild=type(e).__name__, rebuild_text=str(e)[:2000])
    print("RESULT " + json.dumps(result), flush=True)
    if "rebuild" in result:
        sys.exit(1)
    asyncpipe.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
