"""The parts of ``python -m benchmarks``: which command writes which generated section of which
page, how long it takes, and its quick (smoke-run) form.

Every generated section in ``docs/`` (:mod:`benchmarks.sections`) belongs to exactly one part
here, and every part's command can also run on its own: ``python -m benchmarks.gpipe ...``
prints its tables, and with ``--markdown PAGE`` rewrites its sections of that page.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = ["PARTS", "Part", "by_name"]


@dataclass(frozen=True)
class Part:
    """One generator of measured figures in the docs."""

    name: str
    """What ``--only`` and ``--skip`` call it; also the first word of its sections' keys."""
    module: str
    """The command is ``python -m module``."""
    page: str
    """The page it writes, relative to the docs directory."""
    keys: tuple[str, ...]
    """The keys of the sections it writes in ``page``."""
    what: str
    """One line for the progress report."""
    minutes: float
    """About how long the full run takes on 2 CPU cores."""
    runs: tuple[tuple[str, ...], ...] = ((),)
    """The arguments of each command of a full run; ``{docs}`` stands for the docs directory
    (an option whose value names it is left out of a run that does not write the docs). The
    runner adds ``--markdown PAGE`` when it writes."""
    quick: tuple[tuple[str, ...], ...] = ((),)
    """The same for a quick run: tiny sizes that only show that the part works."""
    device_key: bool = False
    """Its section's key ends in ``device=<cpu|cuda>``: a run writes the key of its device."""

    def commands(self, quick: bool, docs: Path | None, device: str) -> list[list[str]]:
        """The argument lists (after ``python -m module``) of this run, ``--markdown`` aside.

        ``docs`` is the docs directory the run writes, or None for a run that leaves the docs
        alone: then every option whose value lies in it (a picture, the timelines) is left out
        with its value, so the command only prints.
        """
        out = []
        for argv in self.quick if quick else self.runs:
            args: list[str] = []
            for a in argv:
                if "{docs}" not in a:
                    args.append(a)
                elif docs is not None:
                    args.append(a.replace("{docs}", str(docs)))
                elif args and args[-1].startswith("--"):
                    args.pop()  # the option that takes this value goes with it
            if self.device_key:
                args += ["--device", device]
            out.append(args)
        return out

    def key_for(self, device: str) -> list[str]:
        """The keys one run on ``device`` writes."""
        if self.device_key:
            return [k for k in self.keys if k.endswith(f"device={device}")]
        return list(self.keys)


def _args(*commands: str) -> tuple[tuple[str, ...], ...]:
    """Argument lists written as command-line text, one string per command."""
    return tuple(tuple(command.split()) for command in commands)


PARTS: tuple[Part, ...] = (
    Part(
        "suite",
        "benchmarks.suite",
        "benchmark_suite.md",
        ("suite device=cpu", "suite device=cuda"),
        "every schedule and transport against the peers, memory, bandwidth, GPT",
        16.0,
        quick=_args(
            "--quick --stages 2 --chunks 2 --steps 1 --warmup 0 --f-ms 1 --messages 20 "
            "--only reference,bandwidth"
        ),
        device_key=True,
    ),
    Part(
        "gpipe",
        "benchmarks.gpipe",
        "benchmarks.md",
        ("gpipe shape=small", "gpipe shape=large"),
        "GPipe against torch.distributed.pipelining, both activation shapes",
        10.0,
        runs=_args("--rounds 3", "--shape large --rounds 3"),
        quick=_args(
            "--chunks 2 --steps 1 --warmup 0 --f-ms 1 --systems asyncpipe",
            "--shape large --chunks 2 --steps 1 --warmup 0 --f-ms 1 --systems asyncpipe",
        ),
    ),
    Part(
        "schedules",
        "benchmarks.schedules",
        "schedule_benchmarks.md",
        ("schedules",),
        "every schedule over p2p and shm against its simulated ideal and torch's, memory",
        7.0,
        runs=_args("--timelines {docs}/_static"),
        quick=_args(
            "--chunks 2 --steps 1 --warmup 0 --f-ms 1 --rounds 1 --peers none "
            "--schedules 1f1b --memory none --timelines {docs}/_static"
        ),
    ),
    Part(
        "transports",
        "benchmarks.transports",
        "transports.md",
        ("transports",),
        "bandwidth and round trip of p2p, shm and rpc, step time over each against fairscale",
        3.0,
        quick=_args("--processes 2 --messages 20 --trips 20 --bandwidth-only"),
    ),
    Part(
        "parallel",
        "benchmarks.parallel",
        "parallel_benchmarks.md",
        ("parallel",),
        "data parallel x pipeline layouts, bfloat16 activations",
        2.0,
        quick=_args("--steps 1 --f-ms 1 --shape small"),
    ),
    Part(
        "twobw",
        "benchmarks.twobw",
        "2bw.md",
        ("twobw",),
        "PipeDream-2BW against 1F1B in the steady state",
        2.0,
        runs=_args("--runs 3"),
        quick=_args("--ranks 2 --chunks 2 --warmup 1 --steps 1"),
    ),
    Part(
        "convergence",
        "benchmarks.convergence",
        "2bw.md",
        ("convergence",),
        "2BW against 1F1B: training loss of the example GPT",
        8.0,
        quick=_args("--small --steps 3 --lrs 3e-3 --processes 2"),
    ),
    Part(
        "trace_overhead",
        "benchmarks.trace_overhead",
        "tracing.md",
        ("trace_overhead",),
        "what tracing costs per step",
        3.0,
        quick=_args("--rounds 1 --steps 2 --f-ms 1 --chunks 2"),
    ),
    Part(
        "trace_example",
        "benchmarks.trace_example",
        "tracing.md",
        ("trace_example",),
        "a traced run of the example GPT, its summary and timeline picture",
        1.5,
        runs=_args("--picture {docs}/_static/trace_train_lm.png"),
        quick=_args("--small --steps 3 --processes 2 --picture {docs}/_static/trace_train_lm.png"),
    ),
    Part(
        "plan_check",
        "benchmarks.plan_check",
        "cutpoint.md",
        ("plan_check",),
        "balance.plan's predicted step times against measured ones",
        6.0,
        runs=_args("--steps 6 --chunk-options 8 --measure-link --fresh"),
        quick=_args(
            "--world 2 --batch 4 --chunk-options 2 --schedules gpipe --steps 1 --warmup 0 "
            "--repeat 1 --f-ms 1"
        ),
    ),
    Part(
        "failures",
        "benchmarks.failures",
        "reliability.rst",
        ("failures",),
        "how long the other ranks take to raise when one fails",
        3.0,
        quick=_args("--runs 1 --modes forward"),
    ),
)
"""Every part, in the order a full run takes them."""


def by_name(names: list[str]) -> list[Part]:
    """The parts called ``names``, in :data:`PARTS` order.

    Raises:
        ValueError: naming the unknown names and the known ones.
    """
    known = {p.name for p in PARTS}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown parts {unknown}; the parts are {', '.join(sorted(known))}")
    return [p for p in PARTS if p.name in names]
