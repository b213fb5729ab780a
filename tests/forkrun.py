"""Run a script as every rank of a local gloo job, forked from an interpreter that has already
imported torch and asyncpipe (no interpreter start per rank).

``python tests/forkrun.py WORLD TIMEOUT SCRIPT`` forks WORLD processes; each gets the environment
torchrun gives its workers (``spawn.rank_env``), writes its output to ``rank<r>.out`` and
``rank<r>.err`` in the current directory and runs ``SCRIPT`` as ``__main__``, as ``python
SCRIPT`` would. A rank still running ``TIMEOUT`` seconds after the start, or 10 seconds after
another rank failed, is killed. The last line printed is a JSON list of the ranks' exit codes
(``null``: killed by this runner).

``python tests/forkrun.py --serve`` runs one job per line of JSON read from stdin
(``{"cwd": ..., "world": ..., "timeout": ..., "script": ...}``) and answers each with the line of
exit codes, so a test session starts the interpreter once.
"""

from __future__ import annotations

import json
import os
import runpy
import signal
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402  (imported once, before any fork)
from spawn import free_port, rank_env  # noqa: E402

import asyncpipe  # noqa: E402, F401

__all__: list[str] = []

GRACE = 10.0


def _child(rank: int, world: int, port: int, script: str) -> None:
    """Become rank ``rank`` and run the script; never returns (the process exits)."""
    os.environ.update(rank_env(rank, world, port))
    with open(f"rank{rank}.out", "w") as out, open(f"rank{rank}.err", "w") as err:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
    sys.stdin.close()
    sys.argv = [script]
    sys.path[0] = str(Path(script).resolve().parent)  # as `python SCRIPT` has it, not tests/
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    raise SystemExit(code)  # a normal exit, with atexit handlers, as the script would have


def run(world: int, timeout: float, script: str) -> list[int | None]:
    """Fork the ranks, wait for them (killing stragglers) and return their exit codes."""
    sys.stdout.flush()
    sys.stderr.flush()
    port = free_port()
    pids = []
    for rank in range(world):
        pid = os.fork()
        if pid == 0:
            _child(rank, world, port, script)
        pids.append(pid)
    codes: list[int | None] = [None] * world
    began, failed_at = time.monotonic(), None
    while any(c is None for c in codes):
        for rank, pid in enumerate(pids):
            if codes[rank] is None:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes[rank] = os.waitstatus_to_exitcode(status)
                    if codes[rank] != 0 and failed_at is None:
                        failed_at = time.monotonic()
        now = time.monotonic()
        if now - began > timeout or (failed_at is not None and now - failed_at > GRACE):
            break
        time.sleep(0.02)
    for rank, pid in enumerate(pids):
        if codes[rank] is None:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    return codes


def serve() -> None:
    """Run the jobs read from stdin, one JSON line each, answering each with its codes."""
    home = os.getcwd()
    for line in sys.stdin:
        job = json.loads(line)
        os.chdir(job["cwd"])
        codes = run(int(job["world"]), float(job["timeout"]), job["script"])
        os.chdir(home)
        print(json.dumps(codes), flush=True)


def main(argv: list[str]) -> int:
    torch.set_num_threads(1)
    if argv == ["--serve"]:
        serve()
        return 0
    print(json.dumps(run(int(argv[0]), float(argv[1]), argv[2])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
