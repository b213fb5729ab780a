"""The number options of the benchmarks' command lines, checked when the command line is read.

A count of steps, rounds, micro-batches or processes of 0 or less, a negative or infinite
time, or a list of counts with a bad entry is refused by ``argparse`` at once, naming the
option, the rule and the value (they used to run for minutes before failing with a traceback,
or to run something else than asked: ``--timeout 0`` meant the default). Pass these as
``type=`` to ``add_argument``; :func:`count_list` checks an option that holds a
comma-separated list after parsing.
"""

from __future__ import annotations

import argparse
import math

__all__ = ["count", "count_list", "milliseconds", "seconds", "steps"]


def _integer(text: str, least: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = least - 1
    if value < least:
        raise argparse.ArgumentTypeError(f"must be {what} (got {text!r})")
    return value


def count(text: str) -> int:
    """A count of at least 1: micro-batches, timed steps, rounds, processes, messages."""
    return _integer(text, 1, "a whole number of at least 1")


def steps(text: str) -> int:
    """A count that may be 0: warm-up steps, optional repetitions."""
    return _integer(text, 0, "a whole number of at least 0")


def _number(text: str, positive: bool) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        what = "above 0" if positive else "of 0 or more"
        raise argparse.ArgumentTypeError(f"must be a finite number {what} (got {text!r})")
    return value


def milliseconds(text: str) -> float:
    """A duration that may be 0, such as the layers' sleep F (``--f-ms``)."""
    return _number(text, positive=False)


def seconds(text: str) -> float:
    """A time limit, more than 0 seconds."""
    return _number(text, positive=True)


def count_list(parser: argparse.ArgumentParser, option: str, text: str) -> list[int]:
    """The counts of a comma-separated option (``--chunks 4,8,16``); exits through
    ``parser.error`` naming the option and its bad entries if one is not a count of at least
    1 or there is none."""
    entries = [item.strip() for item in text.split(",") if item.strip()]
    bad = []
    for item in entries:
        try:
            count(item)
        except argparse.ArgumentTypeError:
            bad.append(item)
    if bad or not entries:
        parser.error(
            f"argument {option}: must be whole numbers of at least 1, separated by commas "
            f"(got {text!r}" + (f"; bad: {', '.join(bad)})" if bad else ")")
        )
    return [int(item) for item in entries]
