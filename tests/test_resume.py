"""Whole jobs that stop and go on: a graceful stop on a signal, and an elastic restart under
``torchrun --max-restarts`` after a worker was killed; both end with the loss curve of a job
that was never interrupted."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from launch import run_processes
from threads import run_threads, values
from training import model, optimizer, train_step

from asyncpipe import AsyncPipe, checkpoint
from asyncpipe.transport import Transport

pytestmark = pytest.mark.slow

JOB = os.path.join(os.path.dirname(__file__), "resume_job.py")
STEPS = 8


def torchrun(*args: str) -> subprocess.CompletedProcess[str]:
    """``torchrun --standalone --nproc-per-node=2 *args`` (one thread per process), finished."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([*command, *args], env=env, capture_output=True, text=True, timeout=240)


def uninterrupted() -> list[float]:
    net = model()

    def fn(rank: int, transport: Transport) -> list[float]:
        pipe = AsyncPipe(net, [4, 4], chunks=2, transport=transport, timeout=20)
        opt = optimizer(pipe.parameters())
        return [train_step(pipe, opt, step) for step in range(STEPS)]

    return values(run_threads(fn, 2))[0]


def read_log(path: Path) -> list[tuple[int, int, float]]:
    rows = [line.split() for line in path.read_text().splitlines()]
    return [(int(a), int(s), float(loss)) for a, s, loss in rows]


def test_a_signal_stops_every_rank_at_the_same_step_with_a_checkpoint(tmp_path: Path) -> None:
    ckpt, log = tmp_path / "ckpt", tmp_path / "log"
    args = (str(ckpt), str(log), str(STEPS), "100")
    first = run_processes(JOB, 2, *args, "-1", "3", timeout=120)
    assert [p.code for p in first] == [0, 0], [p.stderr[-2000:] for p in first]
    # rank 1 got SIGUSR1 before step 3; the end of step 3 told rank 0; both saved step 4
    assert checkpoint.read_manifest(ckpt).step == 4
    assert [s for _, s, _ in read_log(log)] == [0, 1, 2, 3]
    second = run_processes(JOB, 2, *args, "-1", "-1", timeout=120)
    assert [p.code for p in second] == [0, 0], [p.stderr[-2000:] for p in second]
    rows = read_log(log)
    assert [s for _, s, _ in rows] == list(range(STEPS))
    assert [loss for _, _, loss in rows] == pytest.approx(uninterrupted(), rel=1e-6)


def test_a_signal_over_rpc_ends_every_rank_cleanly(tmp_path: Path) -> None:
    # before: rank 0 waited for the receipt of its "saved" answer to rank 1, which had taken
    # it and exited; the receipt never came and rank 0's save failed (exit 1, 2 runs of 3)
    ckpt, log = tmp_path / "ckpt", tmp_path / "log"
    args = (str(ckpt), str(log), str(STEPS), "100", "-1", "1", "rpc")
    first = run_processes(JOB, 2, *args, timeout=120)
    assert [p.code for p in first] == [0, 0], [p.stderr[-2000:] for p in first]
    assert checkpoint.read_manifest(ckpt).step == 2


@pytest.mark.parametrize("transport", ["p2p", "rpc"])
def test_elastic_restart_goes_on_from_the_last_checkpoint(tmp_path: Path, transport: str) -> None:
    # Both failed to connect on restart before asyncpipe.init() named the keys of a restarted
    # attempt's group and RPC agent apart from the attempt before's (the job worked around it
    # with a port of its own until then).
    ckpt, log = tmp_path / "ckpt", tmp_path / "log"
    done = torchrun(
        "--max-restarts=3",  # a restart's own start-up may fail to connect under heavy load
        "--monitor-interval=0.2",
        JOB,
        str(ckpt),
        str(log),
        str(STEPS),
        "2",  # a checkpoint every 2 steps
        "5",  # rank 1 is killed before step 5 of the first attempt
        "-1",
        transport,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    rows = read_log(log)
    first = [s for a, s, _ in rows if a == 0]
    later = [s for a, s, _ in rows if a > 0]
    assert first == [0, 1, 2, 3, 4]  # killed before step 5
    assert later == [4, 5, 6, 7]  # from the checkpoint of step 4: step 4 again, then on
    final = {s: loss for _, s, loss in rows}  # the last run of each step
    assert [final[s] for s in range(STEPS)] == pytest.approx(uninterrupted(), rel=1e-6)
    assert [loss for a, s, loss in rows if s == 4] == pytest.approx([final[4]] * 2, rel=1e-6)
    assert checkpoint.read_manifest(ckpt).step == STEPS


def test_init_after_shutdown_meets_again_in_the_same_processes() -> None:
    """Four rounds of init, step and shutdown in one torchrun job, rank 1 a second late to
    each later init: the old code read rank 1's address of the round before from torchrun's
    store and failed to connect (3 runs of 5 over shm)."""
    rounds = 4
    job = os.path.join(os.path.dirname(__file__), "reinit_job.py")
    done = torchrun(job, str(rounds), "shm", "p2p", "shm")
    assert done.returncode == 0, done.stderr[-4000:]
    torch.manual_seed(0)
    net = torch.nn.Sequential(*(torch.nn.Linear(8, 8) for _ in range(4)))
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    with torch.no_grad():
        expected = float(torch.nn.functional.mse_loss(net(x), y))
    losses = [
        float(line.split()[-1]) for line in done.stdout.splitlines() if line.startswith("round")
    ]
    assert losses == pytest.approx([expected] * rounds, rel=1e-6), done.stdout
