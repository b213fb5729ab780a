"""A three-stage training job in which stage 1 fails in a chosen way at its second step.

Run as ``python failure_job.py MODE TIMEOUT [TRANSPORT]`` on ranks set up like torchrun's (see
``launch.run_processes``; the transport is p2p by default); MODE is forward, backward, loss,
optimizer, kill, sleep, exit (rank 0 ends its process between two steps) or late_send (forward
under 1F1B, while the last stage's backward of micro-batch 0 waits until stage 1's process has
ended before that backward's gradient is sent to it), late (stage 1 takes twice the timeout in
one forward, and every process stays alive), badname (``init(rpc=True)`` with a worker name
torch refuses), after_shutdown (a step after ``asyncpipe.shutdown()``) or kill_flush (under
``schedule="2bw"``, stage 1 kills its process after the last step, before ``pipe.flush()``).
Every rank prints one line ``RESULT {json}`` describing how its job ended, then lets the error
end the process (a non-zero exit code).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import time
from typing import Any

import torch
from torch import Tensor, nn

import asyncpipe

STEPS = 3
FAILING_STEP = 1  # the second step (counting from 0)


class Faulty(nn.Module):
    """A linear layer that fails in forward or backward of micro-batch 1 at the failing step."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.lin, self.mode, self.step, self.calls = nn.Linear(8, 8), mode, 0, 0
        self.timeout = 0.0

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        now = self.step == FAILING_STEP and self.calls == 2
        if now and self.mode == "forward":
            raise ValueError("injected forward failure")
        if now and self.mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if now and self.mode == "sleep":
            time.sleep(10**6)
        if now and self.mode == "late":
            time.sleep(2 * self.timeout + 1)  # the others give up on this rank meanwhile
        out = self.lin(x)
        if self.mode == "slow" and self.step == FAILING_STEP and self.calls == 1:

            def slow(grad: Tensor) -> Tensor:
                wait_until_gone(1)  # the failed stage 1 ends its process meanwhile
                return grad

            out.register_hook(slow)
        if now and self.mode == "backward":

            def fail(grad: Tensor) -> Tensor:
                raise ValueError("injected backward failure")

            out.register_hook(fail)
        return out


def pid_file(rank: int) -> str:
    return os.path.join(tempfile.gettempdir(), f"failure_job_{os.environ['MASTER_PORT']}_{rank}")


def wait_until_gone(rank: int, limit: float = 60.0) -> None:
    """Wait until rank ``rank``'s process has ended (``limit`` s at most): a fixed sleep let a
    loaded machine keep that process alive past it, so that this rank's send went through and
    the job ended another way than the one under test."""
    with open(pid_file(rank)) as f:
        pid = int(f.read())
    os.remove(pid_file(rank))
    end = time.monotonic() + limit
    while time.monotonic() < end:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    break  # ended; its parent has not yet collected its exit code
        except FileNotFoundError:
            break
        time.sleep(0.05)
    time.sleep(0.2)  # the kernel has closed its sockets; let gloo's reader see it


def main(mode: str, timeout: float, transport: str = "p2p") -> None:
    rank = int(os.environ["RANK"])
    if mode == "late_send" and rank == 1:
        with open(pid_file(rank), "w") as f:
            f.write(str(os.getpid()))
    torch.manual_seed(0)
    faulty = Faulty("forward" if mode == "late_send" else mode)
    last = Faulty("slow" if mode == "late_send" else "")
    faulty.timeout = timeout
    model = nn.Sequential(nn.Linear(8, 8), faulty, last)
    if mode == "badname":  # every rank refuses the map at once (torch did on one rank)
        try:
            asyncpipe.init(backend="gloo", rpc=True, worker_map={0: "tr ainer", 1: "s"})
        except ValueError as e:
            print("RESULT " + json.dumps({"rank": rank, "type": "ValueError", "text": str(e)}))
        asyncpipe.shutdown()
        return
    asyncpipe.init(backend="gloo", rpc=transport == "rpc")
    schedule = {"late_send": "1f1b", "kill_flush": "2bw"}.get(mode, "gpipe")
    pipe = asyncpipe.AsyncPipe(
        model,
        [1, 1, 1],
        chunks=4,
        checkpoint="never",
        timeout=timeout,
        schedule=schedule,
        transport=transport,
    )
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
    calls = 0

    def loss_fn(out: Tensor, target: Tensor) -> Tensor:
        nonlocal calls
        calls += 1
        if mode == "loss" and step == FAILING_STEP and calls == STEPS * 4 + 2:
            raise ValueError("injected loss failure")
        return nn.functional.mse_loss(out, target)

    def hook(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if mode == "optimizer" and rank == 1 and step == FAILING_STEP - 1:
            raise ValueError("injected optimizer hook failure")

    optimizer.register_step_pre_hook(hook)
    began = time.monotonic()
    step = 0
    if mode == "after_shutdown":
        pipe.step(torch.randn(8, 8), torch.randn(8, 8), loss_fn)
        asyncpipe.shutdown()
    try:
        for step in range(STEPS):
            faulty.step, faulty.calls, calls = step, 0, STEPS * 4 if step else 0
            last.step, last.calls = step, 0
            if mode == "exit" and step == FAILING_STEP:
                if rank == 0:
                    os._exit(1)
                time.sleep(2)  # rank 0 is gone before this step posts its first receive
            began = time.monotonic()
            x, y = torch.randn(8, 8), torch.randn(8, 8)
            if mode == "kill_flush":  # 2BW steps the optimizer itself, one step late
                pipe.step(x, y, loss_fn, optimizer=optimizer)
                continue
            pipe.step(x, y, loss_fn)
            optimizer.step()
            optimizer.zero_grad()
        if mode == "kill_flush":
            step = STEPS
            if rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            began = time.monotonic()
            pipe.flush()
    except BaseException as e:
        report = {
            "rank": rank,
            "step": step,
            "type": type(e).__name__,
            "text": str(e),
            "stage": getattr(e, "stage", None),
            "failed_rank": getattr(e, "rank", None),
            "action": getattr(e, "action", None),
            "seconds": time.monotonic() - began,
        }
        print("RESULT " + json.dumps(report), flush=True)
        raise
    print("RESULT " + json.dumps({"rank": rank, "type": "finished"}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]), *sys.argv[3:])
