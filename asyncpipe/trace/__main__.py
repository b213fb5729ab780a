"""``python -m asyncpipe.trace DIR``: summarize and draw a recorded run."""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Sequence

from .render import render

__all__: list[str] = []


def main(argv: Sequence[str] | None = None) -> int:
    """Print the per-rank summary of a trace directory; write timeline PNG/HTML and trace.json."""
    parser = argparse.ArgumentParser(
        prog="python -m asyncpipe.trace",
        description="Summarize a run recorded with AsyncPipe(trace=DIR) and draw its timeline.",
    )
    parser.add_argument("directory", help="the trace directory of the run")
    parser.add_argument(
        "--step",
        type=int,
        default=None,
        help="step to draw (default: the last of the run's most frequent kind of step)",
    )
    parser.add_argument("--out", default=None, help="where to write (default: the directory)")
    parser.add_argument("--no-png", action="store_true", help="skip the PNG (needs Pillow)")
    args = parser.parse_args(argv)
    with warnings.catch_warnings(record=True) as notes:
        warnings.simplefilter("always")
        try:
            render(args.directory, step=args.step, out=args.out, images=not args.no_png)
        except (FileNotFoundError, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        finally:
            for note in notes:
                print(f"note: {note.message}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
