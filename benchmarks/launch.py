"""Launch a torchrun-style group of local worker processes with a hard wall-clock timeout."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["LaunchResult", "free_port", "launch", "launch_workers", "read_records"]

REPO_ROOT = Path(__file__).resolve().parent.parent


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class LaunchResult:
    """How a group of workers ended."""

    returncodes: list[int | None]
    """Exit status per rank; ``None`` if the rank had to be killed."""
    timed_out: bool
    seconds: float
    logs: list[Path]
    cpu_seconds: float = 0.0
    """User + system CPU time of all ranks together (start-up included)."""

    @property
    def ok(self) -> bool:
        return not self.timed_out and all(rc == 0 for rc in self.returncodes)

    def log_tail(self, rank: int, chars: int = 2000) -> str:
        try:
            text = self.logs[rank].read_text(errors="replace")
        except OSError as exc:
            return f"<no log: {exc}>"
        return text[-chars:]

    def failure(self) -> str:
        """One line saying why the group failed (empty if it did not)."""
        if self.ok:
            return ""
        if self.timed_out:
            alive = [r for r, rc in enumerate(self.returncodes) if rc is None]
            return f"timed out after {self.seconds:.0f} s (ranks still running: {alive})"
        # The first rank that failed on its own is the interesting one; report its last error.
        for rank, rc in enumerate(self.returncodes):
            if rc not in (0, None):
                return f"rank {rank} exited with {rc}: {_last_error(self.log_tail(rank))}"
        return f"exit codes {self.returncodes}"


def _last_error(log: str) -> str:
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    for line in reversed(lines):
        if "Error" in line or "Exception" in line or line.startswith("error"):
            return line[:400]
    return lines[-1][:400] if lines else "<empty log>"


def _target(module: str) -> list[str]:
    """The interpreter's arguments that run ``module``: a module name or a script path."""
    return [str(REPO_ROOT / module)] if module.endswith(".py") else ["-m", module]


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    # Each worker runs in its own session, so its process group is exactly that worker and
    # whatever it started; nothing else is touched.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def launch(
    module: str,
    args: Sequence[str],
    world_size: int,
    timeout_s: float,
    log_dir: Path,
    grace_s: float = 20.0,
    extra_env: dict[str, str] | None = None,
) -> LaunchResult:
    """Run ``python -m module *args`` as ranks 0..world_size-1 with torchrun's environment
    (``module`` may also be a script's path, relative to the repository, ending in ``.py``).

    Every rank gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1 and a
    MASTER_PORT that was free at launch, one intra-op thread, and a log file in ``log_dir``.
    The whole group is killed after ``timeout_s`` seconds; once a rank fails, the others get
    ``grace_s`` seconds to notice before they are killed.
    """
    log_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    base_env = dict(os.environ)
    base_env.update(
        {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            "GROUP_RANK": "0",
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(
                p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p
            ),
        }
    )
    base_env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if extra_env:
        base_env.update(extra_env)
    procs: list[subprocess.Popen[bytes]] = []
    logs: list[Path] = []
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_before = usage.ru_utime + usage.ru_stime
    start = time.monotonic()
    try:
        for rank in range(world_size):
            env = dict(base_env, RANK=str(rank), LOCAL_RANK=str(rank))
            log = log_dir / f"rank{rank}.log"
            logs.append(log)
            with log.open("wb") as handle:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, *_target(module), *args],
                        cwd=REPO_ROOT,
                        env=env,
                        stdin=subprocess.DEVNULL,
                        stdout=handle,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
        deadline = start + timeout_s
        first_failure: float | None = None
        timed_out = False
        while True:
            codes = [p.poll() for p in procs]
            if all(rc is not None for rc in codes):
                break
            now = time.monotonic()
            if first_failure is None and any(rc not in (0, None) for rc in codes):
                first_failure = now
            if now >= deadline:
                timed_out = True
                break
            if first_failure is not None and now - first_failure >= grace_s:
                break
            time.sleep(0.05)
    finally:
        codes = [p.poll() for p in procs]
        for proc, rc in zip(procs, codes, strict=True):
            if rc is None:
                _kill_group(proc)
        for proc in procs:
            proc.wait()
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = usage.ru_utime + usage.ru_stime - cpu_before
    return LaunchResult(codes, timed_out, time.monotonic() - start, logs, cpu)


def read_records(out: Path, world: int) -> list[dict[str, Any] | None]:
    """The JSON record each of ``world`` ranks wrote into ``out`` (``rank<r>.json``), or None
    for a rank that wrote none (or an unreadable one)."""
    records: list[dict[str, Any] | None] = []
    for rank in range(world):
        try:
            records.append(json.loads((out / f"rank{rank}.json").read_text()))
        except (OSError, ValueError):
            records.append(None)
    return records


def launch_workers(
    module: str, argv: Sequence[str], world: int, ranks: int, timeout_s: float = 900
) -> list[dict[str, Any]]:
    """Run ``python -m module --worker --out DIR *argv`` on ``world`` ranks and return the JSON
    record (``DIR/rank<r>.json``) of each of the first ``ranks`` ranks.

    Raises:
        RuntimeError: saying why the group failed.
    """
    with tempfile.TemporaryDirectory() as work:
        result = launch(
            module, ["--worker", "--out", work, *argv], world, timeout_s, Path(work) / "logs"
        )
        if not result.ok:
            raise RuntimeError(f"the benchmark failed: {result.failure()}")
        return [json.loads((Path(work) / f"rank{r}.json").read_text()) for r in range(ranks)]
