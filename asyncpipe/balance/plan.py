"""Configuration search: rank (stages, chunks, schedule) choices by the simulator's prediction.

Each candidate gets a balance from the profile (:func:`~asyncpipe.balance.blocks` over forward
plus backward time at its micro-batch size), per-stage costs, and a message latency from
:class:`Link`; :func:`asyncpipe.schedule.simulate` then predicts its step time and how many
micro-batches' activations each rank holds at once. A flushing schedule's step is its plan's
makespan; 2BW's is the steady-state step of its stream (:mod:`asyncpipe.balance.steady`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from ..schedule import NAMES, Costs, PlanError, build, simulate
from .blocks import blocks
from .profile import LayerProfile, Profile
from .steady import steady_step

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
    """Predicted step time. For ``"2bw"`` the steady-state step: the time one more
    mini-batch adds to a long stream, the fill and drain left out (see
    :func:`plan`)."""
    bubble: float
    """Fraction of all ranks' time without compute (for ``"2bw"``, within a steady step)."""
    memory: int
    """Predicted peak bytes on the busiest rank: parameters and their gradients, plus the
    activations of the micro-batches it holds at once (optimizer state not counted; with
    checkpointing, their inputs and one micro-batch's activations, see :func:`plan`). For
    ``"2bw"`` also the stashed weight version and the finished gradient kept beside the next
    mini-batch's, on the ranks that hold them."""
    fits: bool = True
    lookahead: int = 1
    """For ``"2bw"``: the lookahead the prediction is for (see
    :func:`~asyncpipe.schedule.two_bw`)."""

    def __str__(self) -> str:
        name = self.schedule
        if self.virtual_stages > 1:
            name += f" x{self.virtual_stages}"
        if self.lookahead > 1:
            name += f" lookahead {self.lookahead}"
        steady = " (steady state)" if self.schedule == "2bw" else ""
        return (
            f"{name}, {self.stages} stages, {self.chunks} chunks, balance "
            f"{list(self.balance)}: {self.seconds * 1e3:.1f} ms{steady}, bubble "
            f"{self.bubble:.0%}, {_bytes(self.memory)}"
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
) -> tuple[list[float], list[float], list[float], list[int], list[int], list[int], list[int]]:
    """Per stage: forward, backward and weight seconds, parameter bytes, the bytes one
    micro-batch's forward keeps for the backward, the bytes of its input (the stage before's
    output; 0 for the first stage, whose inputs are views of the caller's batch) and of its
    output."""
    forward, backward, weight, params, acts, inputs, out = [], [], [], [], [], [], []
    start = 0
    for size in balance:
        mine = layers[start : start + size]
        inputs.append(layers[start - 1].output if start else 0)
        start += size
        f = sum(m.forward for m in mine)
        b = sum(m.backward for m in mine) + (f if checkpoint else 0.0)
        forward.append(f)
        backward.append(b / 2 if split else b)
        weight.append(b / 2 if split else 0.0)
        params.append(sum(m.params for m in mine))
        acts.append(sum(m.activations for m in mine))
        out.append(mine[-1].output)
    return forward, backward, weight, params, acts, inputs, out


def _activation_bytes(
    held: float, acts: Sequence[int], inputs: Sequence[int], checkpoint: str, chunks: int
) -> int:
    """The activation bytes of one rank whose model chunks keep ``acts`` (and get ``inputs``)
    per micro-batch, holding ``held`` micro-batches in each chunk at once.

    Without checkpointing each held micro-batch keeps its activations. A checkpointed forward
    keeps only its input, and its backward recomputes the forward of one micro-batch at a time:
    the inputs of the held micro-batches plus one micro-batch's activations. With
    ``"except_last"`` the last micro-batch keeps its activations whole, beside a recompute (more
    than one micro-batch)."""
    if checkpoint == "never":
        return round(held * sum(acts))
    kept = round(held * sum(inputs)) + max(acts, default=0)
    if checkpoint == "except_last" and chunks > 1:
        kept += max(acts, default=0)
    return kept


def _evaluate(
    layers: list[LayerProfile],
    stages: int,
    chunks: int,
    schedule: str,
    checkpoint: str,
    link: Link,
    lookahead: int,
) -> Candidate | str:
    """The candidate, or why it cannot be built."""
    virtual = 2 if schedule == "interleaved" else 1
    entries = stages * virtual
    if len(layers) < entries:
        return (
            f"{schedule} on {stages} stages needs at least {entries} layers (one per stage"
            + (", two model chunks per rank" if virtual > 1 else "")
            + f"; layers: {len(layers)})"
        )
    balance = blocks([m.forward + m.backward for m in layers], entries)
    split = schedule == "zero_bubble"
    f, b, w, params, acts, inputs, out = _stage_costs(layers, balance, checkpoint != "never", split)
    costs = Costs(
        forward=dict(enumerate(f)),
        backward=dict(enumerate(b)),
        weight=dict(enumerate(w)),
        send={s: link.seconds(out[s]) for s in range(entries)},
        post=link.post,
    )
    try:
        if schedule == "2bw":
            steady = steady_step(stages, chunks, costs, lookahead)
            seconds, bubble, held = steady.seconds, steady.bubble, steady.peak_activations
        else:
            sim = simulate(build(schedule, stages, chunks, virtual), costs)
            seconds, bubble, held = sim.makespan, sim.total_bubble, sim.peak_activations
    except (PlanError, ValueError) as e:
        return f"{schedule}, {stages} stages, {chunks} chunks: {e}"
    memory = []
    for rank in range(stages):
        mine = range(rank, entries, stages)
        share = held.get(rank, 0) / max(1, len(mine))
        copies = 2  # the parameters and their gradients
        if schedule == "2bw":
            owed = lookahead * (stages - rank - 1)  # backwards a window leaves to the next
            copies += (owed > 0) + (0 < owed < chunks)  # the stash; the finished gradient
        memory.append(
            sum(copies * params[s] for s in mine)
            + _activation_bytes(
                share, [acts[s] for s in mine], [inputs[s] for s in mine], checkpoint, chunks
            )
        )
    return Candidate(
        stages, chunks, schedule, virtual, tuple(balance), seconds, bubble, max(memory),
        lookahead=lookahead if schedule == "2bw" else 1,
    )  # fmt: skip


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _counts(
    name: str, values: object, fix: str
) -> tuple[list[tuple[type[Exception], str]], list[int]]:
    """Problems with a sequence of positive ints (``stages`` or ``chunks``), and its ints."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        what = f"{values!r}" if isinstance(values, (str, bytes)) else type(values).__name__
        return [(TypeError, f"{name} must be a sequence of ints (got {what}); {fix}")], []
    if not values:
        return [(ValueError, f"{name} must hold at least one count (got []); {fix}")], []
    bad = [v for v in values if not _is_int(v) or v < 1]
    if bad:
        kind = TypeError if all(not _is_int(v) for v in bad) else ValueError
        return [(kind, f"{name} must be positive ints (bad: {bad!r}); {fix}")], []
    return [], list(dict.fromkeys(values))


def _check(
    profile: object,
    world_size: object,
    batch_size: object,
    stages: object,
    chunks: object,
    schedules: object,
    checkpoint: object,
    link: object,
    memory_limit: object,
    lookahead: object,
) -> tuple[list[int] | None, list[int] | None, list[str]]:
    """Every problem with :func:`plan`'s arguments at once (one ValueError, or TypeError when
    all are of the wrong type); else the stage counts, chunk counts and schedules to try."""
    problems: list[tuple[type[Exception], str]] = []
    if not isinstance(profile, Profile):
        problems.append((TypeError, (
            f"profile must be a Profile (got {type(profile).__name__}); pass "
            f"asyncpipe.balance.profile(model, sample)"
        )))  # fmt: skip
    elif not profile.layers:
        problems.append((ValueError, "profile has no layers; profile a model with layers"))
    layers = len(profile.layers) if isinstance(profile, Profile) else None
    world, batch = _positive(world_size), _positive(batch_size)
    for name, value, good in (("world_size", world_size, world), ("batch_size", batch_size, batch)):
        if good is None:
            kind = ValueError if _is_int(value) else TypeError
            problems.append((kind, f"{name} must be a positive int (got {value!r})"))
    stage_counts: list[int] | None = None
    if stages is not None:
        top = min(world or 1, layers or world or 1)
        fix = f"pass stage counts from 1 to {top}, or leave stages out to try them all"
        found, stage_counts = _counts("stages", stages, fix)
        problems += found
        over = [s for s in stage_counts if world is not None and s > world]
        if over:
            problems.append((ValueError, (
                f"a pipeline of S stages runs on S processes, so no stage count may exceed "
                f"world_size (world_size: {world}, stages: {stage_counts}); pass stages from 1 "
                f"to {world}"
            )))  # fmt: skip
        many = [s for s in stage_counts if layers is not None and s > layers]
        if many and layers:
            problems.append((ValueError, (
                f"every stage needs at least one layer (layers: {layers}, stages: "
                f"{stage_counts}); pass stage counts up to {layers}"
            )))  # fmt: skip
    chunk_counts: list[int] | None = None
    if chunks is not None:
        divisors = [c for c in range(1, (batch or 0) + 1) if batch and batch % c == 0]
        fix = (
            f"pass divisors of batch_size, e.g. {divisors[:8]}"
            if divisors
            else "pass divisors of batch_size"
        ) + ", or leave chunks out to try every divisor up to 64"
        found, chunk_counts = _counts("chunks", chunks, fix)
        problems += found
        odd = [c for c in chunk_counts if batch is not None and batch % c]
        if odd:
            problems.append((ValueError, (
                f"every chunk count must divide batch_size, so that each micro-batch has "
                f"batch_size / chunks rows as the plan predicts (batch_size: {batch}, not "
                f"dividing: {odd}); {fix}"
            )))  # fmt: skip
    names: list[str] = []
    if isinstance(schedules, (str, bytes)) or not isinstance(schedules, Sequence):
        problems.append((TypeError, (
            f"schedules must be a sequence of schedule names (got {schedules!r}); pass a list "
            f"or tuple, e.g. ('1f1b',)"
        )))  # fmt: skip
    elif not schedules:
        problems.append((ValueError, (
            f"schedules must name at least one schedule (got {schedules!r}); pass some of "
            f"{', '.join(NAMES)}, or leave it out"
        )))  # fmt: skip
    else:
        unknown = [s for s in schedules if s not in NAMES]
        if unknown:
            fixed = [s.lower() if isinstance(s, str) else s for s in schedules]
            kind = TypeError if all(not isinstance(s, str) for s in unknown) else ValueError
            problems.append((kind, (
                f"schedules must be names from {', '.join(NAMES)}, in lower case (unknown: "
                f"{unknown!r}); "
                + (f"pass schedules={fixed!r}" if all(f in NAMES for f in fixed)
                   else "pass names from that list")
            )))  # fmt: skip
        names = list(dict.fromkeys(s for s in schedules if s in NAMES))
    if checkpoint not in ("never", "always", "except_last"):
        problems.append((ValueError, (
            f"checkpoint must be never, always or except_last (got {checkpoint!r})"
        )))  # fmt: skip
    if not isinstance(link, Link):
        problems.append((TypeError, (
            f"link must be an asyncpipe.balance.Link (got {type(link).__name__}); pass "
            f"Link(latency=..., bandwidth=..., post=...) or leave it out"
        )))  # fmt: skip
    elif not (link.latency >= 0 and link.bandwidth > 0 and link.post >= 0):
        problems.append((ValueError, (
            f"link needs latency >= 0, bandwidth > 0 and post >= 0 (got {link}); pass "
            f"measured or default values, e.g. Link()"
        )))  # fmt: skip
    if memory_limit is None:
        pass
    elif not isinstance(memory_limit, (int, float)) or isinstance(memory_limit, bool):
        problems.append((TypeError, (
            f"memory_limit must be a number of bytes or None (got {memory_limit!r})"
        )))  # fmt: skip
    elif not memory_limit > 0:
        problems.append((ValueError, (
            f"memory_limit must be a positive number of bytes (got {memory_limit!r}); pass the "
            f"bytes one rank may use, or None for no limit"
        )))  # fmt: skip
    if _positive(lookahead) is None:
        problems.append((ValueError if _is_int(lookahead) else TypeError, (
            f"lookahead must be a positive int (got {lookahead!r}); pass 1 (1F1B's spacing) "
            f"or 2"
        )))  # fmt: skip
    elif lookahead != 1 and "2bw" not in names:
        problems.append((ValueError, (
            f"lookahead={lookahead} applies to schedule '2bw' only (schedules: "
            f"{list(names)}); add '2bw' to schedules or pass lookahead=1"
        )))  # fmt: skip
    if problems:
        kinds = {kind for kind, _ in problems}
        raise (TypeError if kinds == {TypeError} else ValueError)(
            "; ".join(text for _, text in problems)
        )
    return stage_counts, chunk_counts, names


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
    lookahead: int = 1,
) -> Ranking:
    """Rank pipeline configurations for ``batch_size`` rows on up to ``world_size`` processes.

    Every combination of stage count (default 1 to ``world_size``; a pipeline of S stages runs
    on S processes), chunk count (default: the divisors of ``batch_size`` up to 64) and
    schedule (``"interleaved"`` with two model chunks per rank) is balanced, simulated and
    ranked by predicted step time; candidates whose predicted memory exceeds
    ``memory_limit`` bytes go last.

    A flushing schedule's step is the makespan of its plan. ``"2bw"`` (PipeDream-2BW, not
    tried unless named: it applies each update one step late) never drains between
    mini-batches, so its step is one window of a stream of mini-batches: it is ranked by the
    steady-state step, the time per mini-batch once the windows repeat (window ``t + c``
    runs as window ``t``, ``D`` seconds later, on every rank; the step is then exactly
    ``D / c``), so the stream's one fill and drain are left out. Its memory counts the
    activations 2BW holds in flight (more with ``lookahead=2``) and, on every rank but the
    last, the stashed weight version and the finished gradient kept beside the next one's.

    Args:
        profile: from :func:`asyncpipe.balance.profile`; its sizes should bracket the
            micro-batch sizes considered.
        world_size: the processes available: a pipeline of S stages runs on S of them, so
            the stage counts tried go up to it.
        batch_size: rows of the mini-batch; a candidate with ``c`` chunks is predicted for
            micro-batches of ``batch_size / c`` rows (the profile read at that size, see
            :meth:`~asyncpipe.balance.Profile.at`).
        stages: the stage counts to try, each from 1 to ``world_size`` and at most the number
            of layers.
        chunks: the chunk counts to try, each a divisor of ``batch_size``.
        schedules: names from ``gpipe``, ``1f1b``, ``interleaved``, ``zero_bubble``, ``2bw``.
        checkpoint: the AsyncPipe policy to predict: ``"never"`` keeps activations,
            ``"always"`` / ``"except_last"`` recompute the forward in backward (its time
            counted for every micro-batch). A checkpointed micro-batch keeps only its stage's
            input (nothing extra on the first stage, whose inputs are views of the batch), and
            a rank holds one micro-batch's activations at a time while it recomputes;
            ``"except_last"`` keeps the last micro-batch's activations beside that. The
            default, ``"never"``, is not AsyncPipe's (``"except_last"``): pass the policy the
            pipeline will run with.
        link: what a message between stages costs (see :class:`~asyncpipe.balance.Link`);
            each stage's send is priced by the bytes of its output in the profile. The default
            fits gloo on loopback.
        memory_limit: the bytes one rank may use, or ``None`` for no limit. A candidate whose
            predicted peak on its busiest rank (:attr:`Candidate.memory
            <asyncpipe.balance.Candidate.memory>`) exceeds it is kept, with ``fits=False``,
            and ranked after every candidate that fits.
        lookahead: for ``"2bw"``: the lookahead to predict (see
            :func:`~asyncpipe.schedule.two_bw`; ``lookahead=k`` needs ``chunks >= k * (stages
            - 1)``, fewer chunks are left out).

    Raises:
        ValueError: listing every problem with the arguments at once, before anything is
            simulated (TypeError when all of them are values of the wrong type); or when
            no combination can be built, with the reason of each.

    Example:
        >>> import torch
        >>> from asyncpipe import balance
        >>> model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(4)])
        >>> ranking = balance.plan(balance.profile(model, torch.randn(8, 16)), 2, 8)
        >>> ranking.best.stages in (1, 2)
        True
        >>> fast = balance.Link(latency=0.0, bandwidth=float("inf"), post=0.0)
        >>> flat = balance.Profile((1,), ((balance.LayerProfile(1e-3, 2e-3, 0, 0, 0),),) * 8)
        >>> both = balance.plan(flat, 4, 8, stages=[4], chunks=[8], schedules=["1f1b", "2bw"],
        ...                     link=fast)
        >>> [(c.schedule, round(c.seconds * 1e3)) for c in both.candidates]
        [('2bw', 48), ('1f1b', 66)]
    """
    stage_list, chunk_list, names = _check(
        profile, world_size, batch_size, stages, chunks, schedules, checkpoint, link,
        memory_limit, lookahead,
    )  # fmt: skip
    stage_counts = stage_list or list(range(1, world_size + 1))
    chunk_counts = chunk_list or [
        c for c in range(1, min(batch_size, 64) + 1) if batch_size % c == 0
    ]
    found: list[Candidate] = []
    why: list[str] = []
    for schedule in names:
        for s in stage_counts:
            if schedule == "interleaved" and s < 2:
                why.append("interleaved needs at least 2 stages")
                continue
            for c in chunk_counts:
                layers = profile.at(batch_size / c)
                cand = _evaluate(layers, s, c, schedule, checkpoint, link, lookahead)
                if isinstance(cand, str):
                    why.append(cand)
                    continue
                if memory_limit is not None and cand.memory > memory_limit:
                    cand = replace(cand, fits=False)
                found.append(cand)
    if not found:
        raise ValueError(
            f"no configuration could be built (layers: {len(profile.layers)}, stages: "
            f"{stage_counts}, chunks: {chunk_counts}, schedules: {names}): "
            f"{'; '.join(dict.fromkeys(why))}; allow fewer stages or other chunk counts"
        )
    order = {name: n for n, name in enumerate(names)}
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
