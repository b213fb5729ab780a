"""Run a function on several local processes over gloo: free port, loopback, hard timeout."""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["free_port", "rank_env", "run_ranks"]


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A loopback TCP port that is free now, for a rendezvous.

    Picked at random below the ephemeral range: the OS hands ports of that range to every
    connecting socket (gloo opens many), so a port it chose for us could be taken by another
    test's connection before our rendezvous binds it; below the range only another rendezvous
    can take it. Restarted jobs use the port + 100 + attempt, so the top 300 are left out.
    """
    top = min(_ephemeral_low(), 65536) - 300
    pick = random.Random(os.getpid() ^ int.from_bytes(os.urandom(4), "little"))
    for _ in range(200):
        port = pick.randrange(max(top - 12000, 1024), top)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # let the OS choose
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_env(rank: int, world: int, port: int) -> dict[str, str]:
    """The environment torchrun gives rank ``rank`` of ``world`` on this host (one thread)."""
    return {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(rank),
        "OMP_NUM_THREADS": "1",
    }


def _worker(
    rank: int, world: int, port: int, out: str, fn: Callable[..., Any], args: tuple, backend: str
) -> None:
    os.environ.update(rank_env(rank, world, port))
    torch.set_num_threads(1)
    try:
        import asyncpipe

        if backend == "nccl":
            torch.cuda.set_device(rank)
        try:
            asyncpipe.init(backend=backend, timeout=60)
        except BaseException:  # the harness's own set-up: the parent starts the job again
            with open(os.path.join(out, f"init-failed{rank}"), "w") as f:
                f.write(traceback.format_exc())
            raise
        result: Any = ("ok", fn(rank, world, *args))
    except BaseException as e:  # report everything to the parent
        result = ("error", f"{type(e).__name__}: {e}", traceback.format_exc())
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))
    try:
        import torch.distributed as dist

        if dist.is_initialized() and result[0] == "ok":
            dist.destroy_process_group()
    finally:
        os._exit(0)


def run_ranks(
    fn: Callable[..., Any], world: int, *args: Any, timeout: float = 120, backend: str = "gloo"
) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` spawned processes; return each rank's
    result, or raise AssertionError naming the ranks that failed or hung.

    A rank that raised comes back as ``("error", text, traceback)`` only if ``fn`` is expected
    to raise; use :func:`run_ranks_raw` for that.
    """
    results = run_ranks_raw(fn, world, *args, timeout=timeout, backend=backend)
    errors = [f"rank {r}: {res[2]}" for r, res in enumerate(results) if res[0] != "ok"]
    if errors:
        raise AssertionError("\n".join(errors))
    return [res[1] for res in results]


def run_ranks_raw(
    fn: Callable[..., Any],
    world: int,
    *args: Any,
    timeout: float = 120,
    backend: str = "gloo",
    may_die: bool = False,
) -> list[Any]:
    """Like :func:`run_ranks`, but return ``("ok", value)`` or ``("error", text, tb)`` per rank;
    a rank that neither finished nor failed within ``timeout`` fails the test. With
    ``may_die``, a rank that exited without a result comes back as ``("died", exit code)``.
    A job whose ranks could not connect (``asyncpipe.init`` failed on a rank) runs again on
    another port, once."""
    for attempt in range(_ATTEMPTS):
        try:
            return _run_once(fn, world, args, timeout, backend, may_die)
        except _SetUpFailed as e:  # gloo could not connect the ranks (a port taken meanwhile)
            if attempt == _ATTEMPTS - 1:
                raise AssertionError(f"the ranks could not connect, {_ATTEMPTS} times: {e}") from e
    raise AssertionError("unreachable")


_ATTEMPTS = 2
"""A job whose ranks fail to connect (the harness's own set-up, before ``fn``) is started
again, on another port, until this many attempts in all."""


class _SetUpFailed(Exception):
    pass


def _run_once(
    fn: Callable[..., Any],
    world: int,
    args: tuple[Any, ...],
    timeout: float,
    backend: str,
    may_die: bool,
) -> list[Any]:
    ctx = mp.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory() as out:
        procs = [
            ctx.Process(target=_worker, args=(r, world, port, out, fn, args, backend), daemon=True)
            for r in range(world)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        while True:
            failed = [name for name in os.listdir(out) if name.startswith("init-failed")]
            if failed:  # the others may wait for the failed rank until init's timeout
                for p in procs:
                    p.kill()
                    p.join()
                with open(os.path.join(out, failed[0])) as f:
                    raise _SetUpFailed(f.read().strip().splitlines()[-1])
            if not any(p.is_alive() for p in procs) or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        if hung:
            raise AssertionError(f"ranks {hung} did not finish within {timeout} s (a hang)")
        results = []
        for r in range(world):
            path = os.path.join(out, f"rank{r}.pt")
            if not os.path.exists(path) and may_die:
                results.append(("died", procs[r].exitcode))
                continue
            if not os.path.exists(path):
                raise AssertionError(
                    f"rank {r} died without a result (exit code {procs[r].exitcode})"
                )
            results.append(torch.load(path, weights_only=False))
        return results
