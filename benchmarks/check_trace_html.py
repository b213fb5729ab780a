"""Open a trace's ``timeline.html`` in headless Chromium: it loads without errors, one row per rank.

Debian: ``apt-get install -y chromium``. Then::

    python -m asyncpipe.trace runs/exp1                 # writes runs/exp1/timeline.html
    python -m benchmarks.check_trace_html runs/exp1/timeline.html --ranks 4

The page's own script counts the rows of the measured timeline once it has loaded and marks
``<body data-status="ok" data-rows="N">``; a script error leaves ``data-status="error"``.
Chromium's ``--dump-dom`` prints the page as it stands after loading.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from pathlib import Path

__all__ = ["check", "main"]


def check(page: Path, ranks: int, browser: str = "chromium") -> list[str]:
    """Problems found (empty when the page is fine)."""
    executable = shutil.which(browser) or browser
    command = [executable, "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom"]
    done = subprocess.run(
        [*command, page.resolve().as_uri()], capture_output=True, text=True, timeout=120
    )
    if done.returncode != 0:
        return [f"{browser} exited with {done.returncode}: {done.stderr[-2000:]}"]
    body = re.search(r"<body[^>]*>", done.stdout)
    if body is None:
        return ["the dumped page has no <body>"]
    problems = []
    if 'data-status="ok"' not in body.group(0):
        problems.append(f"the page's script did not finish cleanly: {body.group(0)}")
    if f'data-rows="{ranks}"' not in body.group(0):
        problems.append(f"expected {ranks} timeline rows: {body.group(0)}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("page", type=Path, help="a timeline.html written by asyncpipe.trace")
    parser.add_argument("--ranks", type=int, required=True, help="ranks the run had")
    parser.add_argument("--browser", default="chromium", help="the Chromium executable")
    args = parser.parse_args(argv)
    problems = check(args.page, args.ranks, args.browser)
    for problem in problems:
        print(problem, file=sys.stderr)
    if not problems:
        print(f"{args.page}: loads without errors, {args.ranks} rows")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
