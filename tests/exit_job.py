"""A job that ends right after collectives, without ``asyncpipe.shutdown()``: the script
behind the clean-exit test.

Run as ``python exit_job.py MODE`` on ranks set up like torchrun's. MODE ``init`` sets the
group up with ``asyncpipe.init()``; ``own`` with ``torch.distributed.init_process_group`` and
then builds an ``AsyncPipe`` on it. Either way the script's last lines are collectives.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

import asyncpipe


def main(mode: str) -> None:
    if mode == "init":
        asyncpipe.init(backend="gloo", timeout=30)
    else:
        dist.init_process_group("gloo")
        net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
        asyncpipe.AsyncPipe(net, [1, 1], chunks=2, timeout=30)
    x = torch.randn(1000)
    for _ in range(3):
        dist.all_reduce(x)
        dist.broadcast(x, 0)


if __name__ == "__main__":
    main(sys.argv[1])
