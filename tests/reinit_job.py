"""A job that sets asyncpipe up several times in the same processes: each round runs
``asyncpipe.init()``, a two-stage pipeline's step, then ``asyncpipe.shutdown()``. Rank 1 comes to
every later round's ``init()`` a second after rank 0, so rank 0 reads torchrun's store first.

Run under ``torchrun --nproc-per-node=2 reinit_job.py ROUNDS TRANSPORT...`` (one transport per
round, the last repeated); rank 0 prints ``round R loss L`` for each round.
"""

from __future__ import annotations

import os
import sys
import time

import torch

import asyncpipe


def main(rounds: int, transports: list[str]) -> None:
    rank = int(os.environ["RANK"])
    for round_ in range(rounds):
        transport = transports[min(round_, len(transports) - 1)]
        if round_ and rank == 1:
            time.sleep(1.0)
        asyncpipe.init(backend="gloo", timeout=30, rpc=transport == "rpc")
        torch.manual_seed(0)
        model = torch.nn.Sequential(*(torch.nn.Linear(8, 8) for _ in range(4)))
        pipe = asyncpipe.AsyncPipe(model, [2, 2], chunks=2, transport=transport, timeout=20)
        loss = pipe.step(torch.randn(4, 8), torch.randn(4, 8), torch.nn.functional.mse_loss)
        if rank == 0:
            print(f"round {round_} loss {float(loss):.8f}", flush=True)
        pipe.close()
        del pipe
        asyncpipe.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2:] or ["p2p"])
