"""How long the other ranks of a job take to raise when one rank fails.

Runs the three-stage job of ``tests/failure_job.py`` (gloo on loopback) once per way of failing
that ``tests/test_failures.py`` checks: an exception in forward, in backward, in the loss, in an
optimizer hook (the process exits), a killed process and a stuck one. Each other rank measures
from the start of the failing step to the error it raises; the table gives the range over the
other ranks and the runs::

    python -m benchmarks.failures                       # 3 runs of each, about 2 minutes
    python -m benchmarks.failures --runs 1 --modes forward,kill
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from .launch import launch
from .options import count, seconds
from .sections import load, provenance, write_section

__all__ = ["MODES", "main"]

JOB = "tests/failure_job.py"

MODES = {
    "forward": "exception in a layer's forward",
    "backward": "exception in backward (a hook, a custom ``autograd.Function``)",
    "loss": "exception in ``loss_fn`` (last stage)",
    "optimizer": "exception outside the step (an optimizer hook), the process exits",
    "kill": "process killed (``SIGKILL``) in the middle of a step",
    "sleep": "process stuck (sleeps forever)",
}
"""Each way of failing, as the table on the reliability page names it."""

CULPRIT = {"loss": 2}
"""The rank that fails (rank 1 unless named here)."""


def detection_times(mode: str, timeout: float, logs: Path) -> list[float]:
    """Seconds each rank other than the failing one took to raise, in one run of ``mode``.

    Raises:
        RuntimeError: a rank other than the failing one did not report a failure.
    """
    result = launch(JOB, [mode, f"{timeout:g}"], 3, 120.0 + timeout, logs, grace_s=timeout + 5)
    culprit = CULPRIT.get(mode, 1)
    seconds = []
    for rank in range(3):
        if rank == culprit:
            continue
        lines = [
            line[len("RESULT ") :]
            for line in result.log_tail(rank, 100_000).splitlines()
            if line.startswith("RESULT ")
        ]
        report = json.loads(lines[-1]) if lines else {}
        if report.get("type") != "StageFailure":
            raise RuntimeError(
                f"{mode}: rank {rank} did not raise StageFailure ({report or 'no report'}); "
                f"its log ends: {result.log_tail(rank, 600)}"
            )
        seconds.append(float(report["seconds"]))
    return seconds


def _duration(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"


def _span(values: list[float]) -> str:
    low, high = _duration(min(values)), _duration(max(values))
    if low == high:
        return low
    if low.endswith(" ms") == high.endswith(" ms"):
        return f"{low.rsplit(' ', 1)[0]}-{high}"
    return f"{low} to {high}"


def table(times: dict[str, list[float]]) -> str:
    """The reStructuredText list-table: each way of failing and how long the others took."""
    lines = [
        ".. list-table::",
        "   :header-rows: 1",
        "   :widths: 50 30",
        "",
        "   * - failure",
        "     - the other ranks raised after",
    ]
    for mode, values in times.items():
        culprit = CULPRIT.get(mode, 1)
        lines += [f"   * - {MODES[mode]}, rank {culprit}", f"     - {_span(values)}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.failures",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--modes", default=",".join(MODES), help="ways of failing to run")
    parser.add_argument("--runs", type=count, default=3, help="runs of each way")
    parser.add_argument("--timeout", type=seconds, default=3.0, help="AsyncPipe(timeout=...) (s)")
    parser.add_argument("--markdown", type=Path, default=None, help="page to write the table in")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        parser.error(f"--modes: choose from {', '.join(MODES)} (got {args.modes!r})")
    started, load_before = time.monotonic(), load()
    times: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="asyncpipe-failures-") as tmp:
        for mode in modes:
            times[mode] = []
            for run in range(args.runs):
                print(f"{mode}, run {run + 1}/{args.runs}", file=sys.stderr)
                try:
                    times[mode] += detection_times(mode, args.timeout, Path(tmp) / f"{mode}{run}")
                except RuntimeError as exc:
                    print(exc, file=sys.stderr)
                    return 1
    text = table(times)
    print(text)
    if args.markdown is not None:
        lines = [
            line.replace("`", "``")  # reStructuredText's literal text
            for line in provenance("benchmarks.failures", argv, time.monotonic() - started)
        ]
        lines += [
            f"Three processes over gloo on loopback, ``timeout={args.timeout:g}``, the failure "
            f"injected at the second step, {args.runs} run(s) of each; measured on every other "
            "rank from the start of that step to the error it raises",
            f"Load average before: {load_before}; after: {load()}",
        ]
        body = "\n".join(f"- {line}" for line in lines)
        write_section(args.markdown, "failures", body + "\n\n" + text, "When things go wrong")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
