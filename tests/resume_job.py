"""A two-stage training job that checkpoints, stops on signals and resumes: the script behind
the graceful-stop and elastic-restart tests.

Run as ``python resume_job.py CKPT LOG STEPS EVERY KILL_AT SIGNAL_AT`` on ranks set up like
torchrun's. It resumes from CKPT if a checkpoint is there, saves every EVERY steps, and on its
first attempt (``TORCHELASTIC_RESTART_COUNT`` 0 or unset) rank 1 kills itself with SIGKILL
before step KILL_AT, or sends itself SIGUSR1 before step SIGNAL_AT (-1: never). Rank 0 appends
``attempt step loss`` lines to LOG.
"""

from __future__ import annotations

import os
import signal
import sys

import training

import asyncpipe
from asyncpipe import checkpoint


def main(
    ckpt: str, log: str, steps: int, every: int, kill_at: int, signal_at: int, transport: str
) -> None:
    rank = int(os.environ["RANK"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    asyncpipe.init(backend="gloo", timeout=60, rpc=transport == "rpc")
    pipe = asyncpipe.AsyncPipe(training.model(), [4, 4], chunks=2, timeout=20, transport=transport)
    opt = training.optimizer(pipe.parameters())
    try:
        start = checkpoint.load(pipe, opt, ckpt).step
    except FileNotFoundError:
        start = 0
    stop = checkpoint.GracefulStop(pipe, opt, ckpt)
    for step in range(start, steps):
        if attempt == 0 and start == 0 and rank == 1 and step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        if attempt == 0 and start == 0 and rank == 1 and step == signal_at:
            os.kill(os.getpid(), signal.SIGUSR1)
        loss = training.train_step(pipe, opt, step)
        if rank == 0:
            with open(log, "a") as f:
                f.write(f"{attempt} {step} {loss!r}\n")
        if (step + 1) % every == 0:
            checkpoint.save(pipe, opt, ckpt, step=step + 1)
        stop.check(step + 1)
    asyncpipe.checkpoint.save(pipe, opt, ckpt, step=steps)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    transport = sys.argv[7] if len(sys.argv) > 7 else "p2p"
    main(sys.argv[1], sys.argv[2], *(int(a) for a in sys.argv[3:7]), transport)  # type: ignore[call-arg]
