"""The traced example run shown on the tracing page and the front page.

Trains ``examples/train_lm.py`` on 4 processes with ``--trace``, then runs
``python -m asyncpipe.trace`` on the recorded run: its printed summary goes into the tracing
page and its timeline picture into ``--picture``::

    python -m benchmarks.trace_example                  # 40 steps, about a minute
    python -m benchmarks.trace_example --markdown docs/tracing.md \\
        --picture docs/_static/trace_train_lm.png
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .launch import REPO_ROOT, launch
from .options import count
from .sections import load, provenance, write_section

__all__ = ["main"]

SCRIPT = "examples/train_lm.py"
RUN = "runs/train_lm"
"""The trace directory as the page shows it, relative to where the summary is made."""


def summary(directory: Path) -> str:
    """What ``python -m asyncpipe.trace runs/train_lm`` prints for the run in ``directory``
    (which must end in ``runs/train_lm``); it also writes the timelines there."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    done = subprocess.run(
        [sys.executable, "-m", "asyncpipe.trace", RUN],
        cwd=directory.parent.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if done.returncode != 0:
        raise RuntimeError(f"python -m asyncpipe.trace failed: {done.stderr[-2000:]}")
    return done.stdout.rstrip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.trace_example",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--steps", type=count, default=40, help="training steps")
    parser.add_argument("--processes", type=count, default=4, help="pipeline stages")
    parser.add_argument(
        "--small", action="store_true", help="a tiny model (dim 32, depth 2): a smoke run"
    )
    parser.add_argument("--markdown", type=Path, default=None, help="page to write the summary in")
    parser.add_argument("--picture", type=Path, default=None, help="where to copy timeline.png")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    started, load_before = time.monotonic(), load()
    with tempfile.TemporaryDirectory(prefix="asyncpipe-trace-example-") as tmp:
        trace = Path(tmp) / RUN
        train = ["--steps", str(args.steps), "--trace", str(trace), "--sample-chars", "0"]
        if args.small:
            train += ["--dim", "32", "--depth", "2", "--batch-size", "16", "--seq-len", "16"]
        print(f"training {SCRIPT} on {args.processes} processes ...", file=sys.stderr)
        result = launch(SCRIPT, train, args.processes, 900.0, Path(tmp) / "logs")
        if not result.ok:
            print(f"{SCRIPT}: {result.failure()}\n{result.log_tail(0)}", file=sys.stderr)
            return 1
        text = summary(trace)
        print(text)
        if args.picture is not None and (trace / "timeline.png").exists():
            args.picture.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(trace / "timeline.png", args.picture)
            print(f"wrote {args.picture}")
    if args.markdown is not None:
        model = "dim 32, depth 2" if args.small else "its default model"
        body = [
            *(f"- {line}" for line in provenance("benchmarks.trace_example", argv)),
            f"- `{SCRIPT} --steps {args.steps}` ({model}) on {args.processes} processes, "
            f"traced; load average before: {load_before}; after: {load()}",
            "",
            f"<!-- test: skip the output of a {args.steps}-step traced run of {SCRIPT}, "
            "written by python -m benchmarks.trace_example: its times change from run to run -->",
            "```console",
            f"$ python -m asyncpipe.trace {RUN}",
            text,
            "```",
        ]
        body += ["", f"(the run and the summary took {(time.monotonic() - started):.0f} s)"]
        write_section(args.markdown, "trace_example", "\n".join(body), "Tracing a run")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
