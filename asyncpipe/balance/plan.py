"""Configuration search: rank (stages, chunks, schedule) choices by the simulator's prediction.

Each candidate gets a balance from the profile (:func:`~asyncpipe.balance.blocks` over forward
plus backward time at its micro-batch size), per-stage costs, and a message latency from
:class:`Link`; :func:`asyncpipe.schedule.simulate` then predicts its step time and how many
micro-batches' activations each rank holds at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ..schedule import Costs, PlanError, build, simulate
from .blocks import blocks
from .profile import LayerProfile, Profile

__all__ = ["Candidate", "Link", "Ranking", "plan"]


@dataclass(frozen=True)
class Link:
    """What a message between stages costs: ``latency + bytes / bandwidth`` seconds on the
    critical path, plus ``post`` seconds on each end to hand it over.

    The defaults fit gloo on loopback (about 0.56 ms for 16 KiB and 2.9 ms for 4 MiB).
    """

    latency: float = 0.5e-3
    bandwidth: float = 1.8e9
    post: float = 0.05e-3

    def seconds(self, size: int) -> float:
        """The modelled time of one message of ``size`` bytes: latency plus size / bandwidth."""
        return self.latency + size / self.bandwidth


@dataclass(frozen=True)
class Candidate:
    """One configuration and what the simulator predicts for it."""

    stages: int
    chunks: int
    schedule: str
    virtual_stages: int
    balance: tuple[int, ...]
    seconds: float
    """Predicted step time."""
    bubble: float
    """Fraction of all ranks' time without compute."""
    memory: int
    """Predicted peak bytes on the busiest rank: parameters and their gradients, plus the
    activations of the micro-batches it holds at once (optimizer state not counted)."""
    fits: bool = True

    def __str__(self) -> str:
        virtual = f" x{self.virtual_stages}" if self.virtual_stages > 1 else ""
        return (
            f"{self.schedule}{virtual}, {self.stages} stages, {self.chunks} chunks, balance "
            f"{list(self.balance)}: {self.seconds * 1e3:.1f} ms, bubble {self.bubble:.0%}, "
            f"{_bytes(self.memory)}"
        )


def _bytes(size: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} B"


@dataclass(frozen=True)
class Ranking:
    """Candidates from best to worst (those over the memory limit last), and why the best wins."""

    candidates: tuple[Candidate, ...]
    reason: str = field(default="")

    @property
    def best(self) -> Candidate:
        """The first candidate: the fastest within the memory limit (if none fits, the first
        of those over it)."""
        return self.candidates[0]

    def table(self, top: int = 10) -> str:
        """The first ``top`` candidates, one per line."""
        return "\n".join(f"{n + 1:>3}. {c}" for n, c in enumerate(self.candidates[:top]))


def _stage_costs(
    layers: list[LayerProfile], balance: Sequence[int], checkpoint: bool, split: bool
) -> tuple[list[float], list[float], list[float], list[int], list[int], list[int]]:
    forward, backward, weight, params, acts, out = [], [], [], [], [], []
    start = 0
    for size in balance:
        mine = layers[start : start + size]
        start += size
        f = sum(m.forward for m in mine)
        b = sum(m.backward for m in mine) + (f if checkpoint else 0.0)
        forward.append(f)
        backward.append(b / 2 if split else b)
        weight.append(b / 2 if split else 0.0)
        params.append(sum(m.params for m in mine))
        acts.append(sum(m.output if checkpoint else m.activations for m in mine))
        out.append(mine[-1].output)
    return forward, backward, weight, params, acts, out


def _evaluate(
    layers: list[LayerProfile],
    stages: int,
    chunks: int,
    schedule: str,
    virtual: int,
    checkpoint: bool,
    link: Link,
) -> Candidate | None:
    entries = stages * virtual
    if len(layers) < entries:
        return None
    balance = blocks([m.forward + m.backward for m in layers], entries)
    split = schedule == "zero_bubble"
    f, b, w, params, acts, out = _stage_costs(layers, balance, checkpoint, split)
    try:
        plan = build(schedule, stages, chunks, virtual)
    except (PlanError, ValueError):
        return None
    costs = Costs(
        forward=dict(enumerate(f)),
        backward=dict(enumerate(b)),
        weight=dict(enumerate(w)),
        send={s: link.seconds(out[s]) for s in range(entries)},
        post=link.post,
    )
    sim = simulate(plan, costs)
    memory = []
    for rank in range(stages):
        mine = range(rank, entries, stages)
        held = sim.peak_activations.get(rank, 0) / max(1, len(mine))
        memory.append(sum(2 * params[s] + round(held * acts[s]) for s in mine))
    return Candidate(
        stages, chunks, schedule, virtual, tuple(balance), sim.makespan, sim.total_bubble,
        max(memory),
    )  # fmt: skip


def plan(
    profile: Profile,
    world_size: int,
    batch_size: int,
    *,
    stages: Sequence[int] | None = None,
    chunks: Sequence[int] | None = None,
    schedules: Sequence[str] = ("gpipe", "1f1b", "zero_bubble", "interleaved"),
    checkpoint: str = "never",
    link: Link = Link(),
    memory_limit: int | None = None,
) -> Ranking:
    """Rank pipeline configurations for ``batch_size`` rows on up to ``world_size`` processes.

    Every combination of stage count (default 1 to ``world_size``; a pipeline of S stages runs
    on S processes), chunk count (default: the divisors of ``batch_size`` up to 64) and
    schedule (``"interleaved"`` with two model chunks per rank) is balanced, simulated and
    ranked by predicted step time; candidates whose predicted memory exceeds
    ``memory_limit`` bytes go last.

    Args:
        profile: from :func:`asyncpipe.balance.profile`; its sizes should bracket the
            micro-batch sizes considered.
        checkpoint: the AsyncPipe policy to predict: ``"never"`` keeps activations,
            ``"always"`` / ``"except_last"`` recompute the forward in backward (counted for
            every micro-batch).

    Example:
        >>> import torch
        >>> from asyncpipe import balance
        >>> model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(4)])
        >>> ranking = balance.plan(balance.profile(model, torch.randn(8, 16)), 2, 8)
        >>> ranking.best.stages in (1, 2)
        True
    """
    problems = []
    if not (isinstance(world_size, int) and world_size > 0):
        problems.append(f"world_size must be a positive int (got {world_size!r})")
    if not (isinstance(batch_size, int) and batch_size > 0):
        problems.append(f"batch_size must be a positive int (got {batch_size!r})")
    if checkpoint not in ("never", "always", "except_last"):
        problems.append(f"checkpoint must be never, always or except_last (got {checkpoint!r})")
    if problems:
        raise ValueError("; ".join(problems))
    stage_counts = list(stages) if stages is not None else list(range(1, world_size + 1))
    chunk_counts = (
        list(chunks)
        if chunks is not None
        else [c for c in range(1, min(batch_size, 64) + 1) if batch_size % c == 0]
    )
    found: list[Candidate] = []
    for schedule in schedules:
        virtual = 2 if schedule == "interleaved" else 1
        for s in stage_counts:
            if s > world_size or (virtual > 1 and s < 2):
                continue
            for c in chunk_counts:
                layers = profile.at(batch_size / c)
                cand = _evaluate(layers, s, c, schedule, virtual, checkpoint != "never", link)
                if cand is not None:
                    if memory_limit is not None and cand.memory > memory_limit:
                        cand = Candidate(**{**cand.__dict__, "fits": False})
                    found.append(cand)
    if not found:
        raise ValueError(
            f"no configuration could be built (layers: {len(profile.layers)}, stages: "
            f"{stage_counts}, chunks: {chunk_counts}, schedules: {list(schedules)}); allow "
            f"fewer stages or other chunk counts"
        )
    order = {name: n for n, name in enumerate(schedules)}
    found.sort(
        key=lambda c: (not c.fits, c.seconds, c.memory, order[c.schedule], c.stages, c.chunks)
    )
    return Ranking(tuple(found), _reason(found, memory_limit))


def _reason(ranked: list[Candidate], memory_limit: int | None) -> str:
    best = ranked[0]
    text = f"best: {best}"
    if not best.fits:
        return text + f"; no candidate fits in {memory_limit} bytes, this one needs the least time"
    others = [c for c in ranked[1:] if c.fits]
    if others:
        runner = others[0]
        gain = runner.seconds / best.seconds - 1 if best.seconds > 0 else 0.0
        if gain < 5e-4:
            why = (
                "it needs less memory"
                if best.memory < runner.memory
                else "ties go to the earlier schedule in schedules, then fewer stages and chunks"
            )
            text += f"; as fast as the runner-up ({runner}); {why}"
        else:
            text += f"; {gain:.1%} faster than the runner-up ({runner})"
        if best.schedule != runner.schedule and best.bubble < runner.bubble:
            text += f", with a smaller bubble ({best.bubble:.0%} against {runner.bubble:.0%})"
        one = [c for c in ranked if c.stages == 1 and c.fits]
        if one and best.stages > 1:
            text += f"; {one[0].seconds / best.seconds:.2f}x faster than one stage"
    over = sum(1 for c in ranked if not c.fits)
    if over:
        text += f"; {over} candidates need more than {memory_limit} bytes"
    return text
