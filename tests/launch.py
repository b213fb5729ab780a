"""Run a script on several local processes the way torchrun does (environment variables, one
process per rank), and report each one's exit code and output: for tests of how jobs end."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass

from spawn import free_port, rank_env

__all__ = ["Ended", "run_processes"]


@dataclass(frozen=True)
class Ended:
    """How one process ended: exit code (negative: killed by that signal; None: still running
    when the others had ended, then killed by the test), its output, and when it ended."""

    rank: int
    code: int | None
    stdout: str
    stderr: str
    seconds: float


def run_processes(
    script: str, world: int, *args: str, timeout: float = 60, grace: float = 5
) -> list[Ended]:
    """Start ``python script *args`` as ranks 0..world-1 of a gloo job on loopback.

    Waits until every process ended, or until the last one that will end did (a process still
    running ``timeout`` s after the start, or ``grace`` s after all others ended, is killed and
    reported with ``code=None``).
    """
    port = free_port()
    procs = []
    began = time.monotonic()
    for rank in range(world):
        env = dict(os.environ, **rank_env(rank, world, port))
        procs.append(
            subprocess.Popen(
                [sys.executable, script, *args],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    ended: dict[int, float] = {}
    while len(ended) < world:
        now = time.monotonic()
        for rank, proc in enumerate(procs):
            if rank not in ended and proc.poll() is not None:
                ended[rank] = now - began
        others_done = (
            len(ended) >= world - 1 and ended and now - began - max(ended.values()) > grace
        )
        if now - began > timeout or others_done:
            break
        time.sleep(0.05)
    results = []
    for rank, proc in enumerate(procs):
        code: int | None = proc.poll()
        if code is None:
            proc.kill()
        out, err = proc.communicate()
        results.append(Ended(rank, code, out, err, ended.get(rank, time.monotonic() - began)))
    return results
