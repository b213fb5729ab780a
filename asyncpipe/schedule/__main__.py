"""Command line for schedules: ``python -m asyncpipe.schedule show ...`` prints and draws a plan."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from .action import Plan
from .lower import lower
from .registry import NAMES, build
from .replay import PlanError
from .show import grid, parse_plan, timeline_png, timeline_svg
from .simulate import Costs, Simulation, simulate
from .validate import validate

__all__: list[str] = []

_PROG = "python -m asyncpipe.schedule"

_SHOW_DESCRIPTION = """\
Print a plan as a step-by-rank grid, then its simulated makespan, bubble (idle
fraction) per rank and in total, and peak live activations per rank; optionally
draw the simulated timeline as an SVG or PNG Gantt chart. The plan is a named
schedule (--schedule) or a plan file (--plan)."""

_SHOW_EPILOG = f"""\
examples:
  {_PROG} show --schedule 1f1b --stages 4 --chunks 8
  {_PROG} show --schedule interleaved --stages 4 --chunks 8 --virtual-stages 2
  {_PROG} show --schedule gpipe --stages 4 --chunks 8 --lower --send 0.2 --svg gpipe.svg
  {_PROG} show --plan my_plan.txt --png my_plan.png

A plan file has one line per rank, as format_plan prints it, e.g.
  rank 0: 0F0 0F1 0B0 0B1
  rank 1: 1F0 1B0 1F1 1B1
actions are <stage><kind><micro-batch> (kinds F, B, W, SEND_F, RECV_F, SEND_B, RECV_B; sends
and receives name their peer stage, as in 0SEND_F0->1), "." is an idle slot, and lines that
are blank or start with # are skipped. The plan is validated before it is shown.

exit status: 0 when the plan was shown, 2 on a bad argument or a plan that cannot run."""


class _UsageError(Exception):
    """A bad command line or input: printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (and exit status 2), not a usage dump."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive int (got {text!r})") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive int (got {value})")
    return value


def _cost(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a non-negative number (got {text!r})") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0 (got {text})")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=_PROG,
        description="Look at pipeline schedules: plans are pure data, built, checked and timed "
        "here without torch.distributed.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    show = commands.add_parser(
        "show",
        help="print a plan's step grid and simulated timing; draw its timeline",
        description=_SHOW_DESCRIPTION,
        epilog=_SHOW_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    source = show.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--schedule",
        metavar="NAME",
        help=f"a named schedule, one of: {', '.join(NAMES)}",
    )
    source.add_argument(
        "--plan",
        metavar="FILE",
        type=Path,
        help="a file holding a plan, one line per rank: 'rank 0: 0F0 0F1 0B0 0B1'",
    )
    named = show.add_argument_group("named schedule (with --schedule)")
    named.add_argument(
        "--stages", type=_positive_int, metavar="N", help="pipeline ranks (required)"
    )
    named.add_argument(
        "--chunks", type=_positive_int, metavar="M", help="micro-batches per step (required)"
    )
    named.add_argument(
        "--virtual-stages",
        type=_positive_int,
        default=1,
        metavar="V",
        help="model chunks per rank; more than 1 only for 'interleaved' (default: 1)",
    )
    named.add_argument(
        "--lookahead",
        type=_positive_int,
        default=1,
        metavar="K",
        help="micro-batches each rank's forwards run ahead of the next rank's; more than 1 "
        "only for '2bw' (default: 1)",
    )
    show.add_argument(
        "--lower",
        action="store_true",
        help="add the SEND/RECV actions between ranks before showing and simulating",
    )
    costs = show.add_argument_group("simulated costs (time per action, any unit)")
    costs.add_argument(
        "--forward", type=_cost, default=1.0, metavar="T", help="a forward (default: 1)"
    )
    costs.add_argument(
        "--backward", type=_cost, default=2.0, metavar="T", help="a backward (default: 2)"
    )
    costs.add_argument(
        "--weight",
        type=_cost,
        default=0.0,
        metavar="T",
        help="a weight-gradient action (default: 0)",
    )
    costs.add_argument(
        "--send",
        type=_cost,
        default=0.0,
        metavar="T",
        help="latency of a tensor crossing ranks (default: 0)",
    )
    costs.add_argument(
        "--post",
        type=_cost,
        default=0.0,
        metavar="T",
        help="a send or receive action on its own rank, with --lower (default: 0)",
    )
    pictures = show.add_argument_group("pictures of the simulated timeline")
    pictures.add_argument("--svg", type=Path, metavar="FILE", help="write an SVG Gantt chart")
    pictures.add_argument(
        "--png", type=Path, metavar="FILE", help="write a PNG Gantt chart (needs Pillow)"
    )
    pictures.add_argument("--title", help="heading of the picture (default: describes the plan)")
    return parser


MAX_ACTIONS = 200_000
"""The most forward and backward actions a named plan may have to be shown (64 ranks x 512
micro-batches, 65,536 of them, take seconds)."""


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}es" if noun.endswith("h") else f"{n} {noun}s"


def _named_plan(args: argparse.Namespace) -> tuple[Plan, str]:
    missing = [f for f, v in [("--stages", args.stages), ("--chunks", args.chunks)] if v is None]
    if missing:
        raise _UsageError(
            f"--schedule needs {' and '.join(missing)}, e.g. "
            f"--schedule {args.schedule} --stages 4 --chunks 8"
        )
    actions = args.stages * args.virtual_stages * args.chunks * 2
    if actions > MAX_ACTIONS:
        raise _UsageError(
            f"--stages {args.stages} --chunks {args.chunks} make a plan of about {actions:,} "
            f"actions, more than this command shows ({MAX_ACTIONS:,}: time and memory grow "
            f"with it, to gigabytes); pass fewer, or simulate it from Python with "
            f"asyncpipe.schedule.build and simulate"
        )
    try:
        plan = build(args.schedule, args.stages, args.chunks, args.virtual_stages, args.lookahead)
    except ImportError as e:
        raise _UsageError(
            f"schedule {args.schedule!r} is not available in this installation ({e}); "
            f"choose another of {', '.join(NAMES)}"
        ) from e
    except ValueError as e:
        raise _UsageError(str(e)) from e
    described = (
        f"{args.schedule}: {_count(args.stages, 'rank')}, {_count(args.chunks, 'micro-batch')}"
    )
    if args.virtual_stages != 1:
        described += f", {args.virtual_stages} virtual stages per rank"
    if args.lookahead != 1:
        described += f", lookahead {args.lookahead}"
    return plan, described


def _file_plan(args: argparse.Namespace) -> tuple[Plan, str]:
    given = [
        flag
        for flag, value in [
            ("--stages", args.stages),
            ("--chunks", args.chunks),
            ("--virtual-stages", None if args.virtual_stages == 1 else args.virtual_stages),
            ("--lookahead", None if args.lookahead == 1 else args.lookahead),
        ]
        if value is not None
    ]
    if given:
        raise _UsageError(
            f"{', '.join(given)} {'describes' if len(given) == 1 else 'describe'} a named "
            f"schedule and cannot be used with --plan, whose file fixes them; drop "
            f"{', '.join(given)} or use --schedule"
        )
    path: Path = args.plan
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise _UsageError(f"cannot read plan file {str(path)!r}: {e}") from e
    try:
        plan = parse_plan(text)
    except ValueError as e:
        raise _UsageError(f"plan file {str(path)!r}: {e}") from e
    return plan, f"plan {path.name}"


def _report(simulation: Simulation, args: argparse.Namespace) -> str:
    costs = f"forward {args.forward:g}, backward {args.backward:g}, weight {args.weight:g}, "
    costs += f"send {args.send:g}" + (f", post {args.post:g}" if args.post else "")
    lines = [
        f"simulated with costs {costs}",
        f"makespan: {simulation.makespan:g}",
        f"total bubble: {simulation.total_bubble:.1%}",
        "",
        f"{'rank':<6}{'busy':>8}{'bubble':>9}{'peak activations':>18}",
    ]
    bubble = simulation.bubble
    for rank in sorted(simulation.busy):
        lines.append(
            f"{rank:<6}{simulation.busy[rank]:>8g}{bubble[rank]:>9.1%}"
            f"{simulation.peak_activations.get(rank, 0):>18}"
        )
    return "\n".join(lines)


def _show(args: argparse.Namespace) -> int:
    plan, described = _named_plan(args) if args.schedule is not None else _file_plan(args)
    if args.lower:
        try:
            plan = lower(plan)
        except ValueError as e:
            raise PlanError(str(e)) from e
        described += ", lowered"
    messages = any(
        a is not None and (a.kind.is_send or a.kind.is_recv) for row in plan.values() for a in row
    )
    if args.post and not messages:
        raise _UsageError(
            "--post is the cost of a send or receive action, and this plan has none (a plan "
            "lists them only once lowered): add --lower, or drop --post"
        )
    validate(plan)
    costs = Costs(
        forward=args.forward,
        backward=args.backward,
        weight=args.weight,
        send=args.send,
        post=args.post,
    )
    simulation = simulate(plan, costs)
    print(described)
    print()
    print(grid(plan))
    print()
    print(_report(simulation, args))
    title = described if args.title is None else args.title
    if args.svg is not None or args.png is not None:
        print()
    if args.svg is not None:
        try:
            args.svg.write_text(timeline_svg(simulation, title), encoding="utf-8")
        except OSError as e:
            raise _UsageError(f"cannot write SVG file {str(args.svg)!r}: {e}") from e
        print(f"wrote {args.svg}")
    if args.png is not None:
        try:
            timeline_png(simulation, args.png, title)
        except (OSError, RuntimeError) as e:
            raise _UsageError(f"cannot write PNG file {str(args.png)!r}: {e}") from e
        print(f"wrote {args.png}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line with ``argv`` (default: ``sys.argv[1:]``); return the exit status.

    Example:
        >>> main("show --schedule gpipe --stages 2 --chunks 1".split())  # doctest: +ELLIPSIS
        gpipe: 2 ranks, 1 micro-batch
        ...
        0
    """
    args = _parser().parse_args(argv)
    try:
        if args.command == "show":
            return _show(args)
    except PlanError as e:
        print(f"{_PROG} show: error: the plan cannot run: {e}", file=sys.stderr)
        return 2
    except _UsageError as e:
        print(f"{_PROG} show: error: {e}", file=sys.stderr)
        return 2
    raise AssertionError(f"unhandled command {args.command!r}")


if __name__ == "__main__":
    sys.exit(main())
