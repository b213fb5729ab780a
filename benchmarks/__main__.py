"""``python -m benchmarks``: every measured figure of the docs, regenerated in one run.

Runs each part of :data:`benchmarks.parts.PARTS` as its own command (``python -m
benchmarks.gpipe ...``) in a process of its own, one after another, and has it rewrite its
sections of its page. Prints a progress line per part and a summary at the end; a part that
fails is reported and the others still run (the exit status is then 1).
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import torch

from .launch import REPO_ROOT
from .parts import PARTS, Part, by_name
from .sections import find_sections

__all__ = ["main", "parse_args"]

DOCS = REPO_ROOT / "docs"


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Read the command line; ``args.parts`` are the :class:`~benchmarks.parts.Part`\\ s to run."""
    names = ", ".join(p.name for p in PARTS)
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="Regenerate every measured figure in the docs: run each benchmark part "
        "and rewrite its generated sections (date, machine, commit and command included). "
        f"The parts: {names}.",
    )
    parser.add_argument("--only", default="", help="run only these parts (comma-separated)")
    parser.add_argument("--skip", default="", help="run every part but these")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="tiny sizes and few steps, to see that every part works (minutes); writes only "
        "with --docs",
    )
    parser.add_argument(
        "--docs",
        type=Path,
        default=None,
        help="the docs directory whose pages to rewrite (default: docs/ for a full run; a "
        "--quick run writes only where this is given)",
    )
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs alone")
    parser.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="the suite's device (auto: CUDA where available); the other parts run on the CPU",
    )
    parser.add_argument("--list", action="store_true", help="list the parts and their commands")
    args = parser.parse_args(argv)
    try:
        only = by_name(_split(args.only)) if args.only else list(PARTS)
        skip = {p.name for p in by_name(_split(args.skip))}
    except ValueError as exc:
        parser.error(str(exc))
    args.parts = [p for p in only if p.name not in skip]
    if not args.parts:
        parser.error("--only and --skip leave no part to run")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch.cuda.is_available() is False on this machine")
    args.write = not args.no_write and (args.docs is not None or not args.quick)
    args.docs = args.docs or DOCS
    return args


def _split(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def _shown(path: Path) -> str:
    """``path`` relative to the repository when it is inside it (as the command is run)."""
    try:
        return path.resolve().relative_to(REPO_ROOT).as_posix()
    except ValueError:
        return str(path)


def commands(part: Part, args: argparse.Namespace) -> list[list[str]]:
    """The full command lines of ``part`` in this run; one that does not write the docs
    writes no picture into them either."""
    docs = Path(_shown(args.docs)) if args.write else None
    out = []
    for argv in part.commands(args.quick, docs, args.device):
        if docs is not None:
            argv += ["--markdown", (docs / part.page).as_posix()]
        out.append([sys.executable, "-m", part.module, *argv])
    return out


def _minutes(parts: list[Part], quick: bool) -> str:
    if quick:
        return f"{len(parts)} quick parts"
    return f"about {sum(p.minutes for p in parts):.0f} min on 2 CPU cores"


def _sections(page: Path) -> dict[str, str]:
    try:
        return find_sections(page.read_text())
    except (OSError, ValueError):
        return {}


def run_part(part: Part, args: argparse.Namespace) -> tuple[str, float]:
    """Run ``part``'s commands; return its outcome (``ok``, or what went wrong) and seconds."""
    started = time.monotonic()
    page = args.docs / part.page
    before = _sections(page)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    for command in commands(part, args):
        print("$ " + shlex.join(["python", *command[1:]]), file=sys.stderr, flush=True)
        timeout = 600 + 6 * 60 * part.minutes
        try:
            done = subprocess.run(command, cwd=REPO_ROOT, env=env, timeout=timeout, check=False)
        except subprocess.TimeoutExpired:
            return f"timed out after {timeout / 60:.0f} min", time.monotonic() - started
        if done.returncode != 0:
            return f"FAILED (exit status {done.returncode})", time.monotonic() - started
    if args.write:
        after = _sections(page)
        stale = [k for k in part.key_for(args.device) if before.get(k) == after.get(k)]
        if stale:
            return f"FAILED: sections not rewritten: {stale}", time.monotonic() - started
    return "ok", time.monotonic() - started


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.list:  # the parts selected by --only and --skip (all of them without)
        for part in args.parts:
            keys = ", ".join(part.keys)
            print(f"{part.name}: {part.what}; docs/{part.page} ({keys}); ~{part.minutes:g} min")
            for command in commands(part, args):
                print("    " + shlex.join(["python", *command[1:]]))
        return 0
    where = f"rewriting pages in {_shown(args.docs)}" if args.write else "not writing the docs"
    print(
        f"python -m benchmarks: {len(args.parts)} parts, {_minutes(args.parts, args.quick)}, "
        f"{where}",
        file=sys.stderr,
        flush=True,
    )
    started = time.monotonic()
    outcomes: list[tuple[Part, str, float]] = []
    for n, part in enumerate(args.parts, 1):
        left = _minutes(args.parts[n - 1 :], args.quick)
        print(
            f"\n[{n}/{len(args.parts)}] {part.name}: {part.what} -> "
            f"{_shown(args.docs / part.page)} "
            f"({left} left, {(time.monotonic() - started) / 60:.1f} min so far)",
            file=sys.stderr,
            flush=True,
        )
        outcome, seconds = run_part(part, args)
        outcomes.append((part, outcome, seconds))
        print(f"[{n}/{len(args.parts)}] {part.name}: {outcome} in {seconds / 60:.1f} min",
              file=sys.stderr, flush=True)  # fmt: skip
    print(f"\nsummary ({(time.monotonic() - started) / 60:.1f} min):", file=sys.stderr)
    for part, outcome, seconds in outcomes:
        print(f"  {part.name:<15} {outcome} ({seconds / 60:.1f} min)", file=sys.stderr)
    others = [k for p in args.parts for k in p.keys if k not in p.key_for(args.device)]
    if args.write and others:
        print(
            f"  not rewritten by a run on this device ({args.device}): {', '.join(others)}",
            file=sys.stderr,
        )
    return 0 if all(outcome == "ok" for _, outcome, _ in outcomes) else 1


if __name__ == "__main__":
    raise SystemExit(main())
