"""PipeDream-2BW against 1F1B on a real model: the training loss, step by step.

Trains ``examples/train_lm.py`` (the character-level GPT, 4 processes, default model) with
``--schedule 1f1b`` and ``--schedule 2bw`` at each learning rate, with the same seed and batches,
and tabulates the loss of the mini-batch at every few steps::

    python -m benchmarks.convergence                    # 200 steps, 4 runs, about 8 minutes
    python -m benchmarks.convergence --steps 20 --lrs 3e-3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from .launch import launch
from .options import count, seconds
from .sections import load, provenance, write_section

__all__ = ["main", "table"]

SCRIPT = "examples/train_lm.py"
SCHEDULES = ("1f1b", "2bw")


def marks(steps: int) -> list[int]:
    """The steps the table shows: the first, the twentieth part of the run, every tenth part,
    and the last."""
    every = max(1, steps // 10)
    return sorted({1, max(1, every // 2), *range(every, steps + 1, every), steps})


def table(curves: dict[str, list[float]], steps: int, tail: int = 10) -> str:
    """A markdown table: the loss of each run at :func:`marks`, and its mean over the last
    ``tail`` steps."""
    names = list(curves)
    lines = ["| step | " + " | ".join(names) + " |", "|---:|" + "---:|" * len(names)]
    for step in marks(steps):
        lines.append(
            f"| {step} | " + " | ".join(f"{curves[n][step - 1]:.4f}" for n in names) + " |"
        )
    tail = min(tail, steps)
    means = [statistics.fmean(curves[n][-tail:]) for n in names]
    lines.append(f"| mean, last {tail} | " + " | ".join(f"{m:.4f}" for m in means) + " |")
    return "\n".join(lines)


def curve(schedule: str, lr: str, args: argparse.Namespace, work: Path) -> list[float]:
    """The loss of every mini-batch of one training run."""
    log = work / f"{schedule}-{lr}.txt"
    train = ["--steps", str(args.steps), "--schedule", schedule, "--lr", lr, "--trace", ""]
    train += ["--sample-chars", "0", "--loss-log", str(log), *args.model]
    result = launch(SCRIPT, train, args.processes, 3600.0, work / f"logs-{schedule}-{lr}")
    if not result.ok:
        raise RuntimeError(f"{SCRIPT} {' '.join(train)}: {result.failure()}")
    return [float(line.split()[1]) for line in log.read_text().splitlines()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.convergence",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--steps", type=count, default=200, help="training steps per run")
    parser.add_argument("--lrs", default="3e-3,1e-3", help="peak learning rates")
    parser.add_argument("--processes", type=count, default=4, help="pipeline stages")
    parser.add_argument(
        "--small", action="store_true", help="a tiny model (dim 32, depth 2): a smoke run"
    )
    parser.add_argument("--markdown", type=Path, default=None, help="page to write the table in")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    args.lr_list = [lr.strip() for lr in args.lrs.split(",") if lr.strip()]
    bad = []
    for lr in args.lr_list:
        try:
            seconds(lr)  # a finite number above 0, as a learning rate must be
        except argparse.ArgumentTypeError:
            bad.append(lr)
    if bad or not args.lr_list:
        parser.error(
            f"argument --lrs: must be numbers above 0, separated by commas, e.g. 3e-3,1e-3 "
            f"(got {args.lrs!r})"
        )
    args.model = (
        ["--dim", "32", "--depth", "2", "--batch-size", "16", "--seq-len", "16"]
        if args.small
        else []
    )
    started, load_before = time.monotonic(), load()
    curves: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="asyncpipe-convergence-") as tmp:
        for lr in args.lr_list:
            for schedule in SCHEDULES:
                print(f"training with {schedule}, lr {lr} ...", file=sys.stderr)
                try:
                    curves[f"{schedule}, lr {lr}"] = curve(schedule, lr, args, Path(tmp))
                except RuntimeError as exc:
                    print(exc, file=sys.stderr)
                    return 1
    text = table(curves, args.steps)
    print(text)
    if args.markdown is not None:
        model = "dim 32, depth 2, batch 16 x 16 characters" if args.small else "its default model"
        body = [
            *(f"- {line}" for line in provenance("benchmarks.convergence", argv)),
            f"- `{SCRIPT} --steps {args.steps}` ({model}) on {args.processes} processes, once per "
            f"schedule and peak learning rate, the same seed and batches; the loss of the "
            f"mini-batch at each step",
            f"- Load average before: {load_before}; after: {load()}; "
            f"{(time.monotonic() - started) / 60:.1f} min in all",
            "",
            text,
        ]
        write_section(args.markdown, "convergence", "\n".join(body), "PipeDream-2BW")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
