"""Checks of AsyncPipe's arguments, and the plan each schedule argument stands for."""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from .failure import StageFailure
from .lazy import LazyModule
from .partition import Layer
from .recompute import POLICIES
from .schedule import (
    NAMES,
    Kind,
    Plan,
    PlanError,
    build,
    gpipe,
    stage_owners,
    validate,
)
from .skip.routes import SkipRoutes, describe_routes
from .transport import TransportTimeout

__all__: list[str] = []


def positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _positive_number(value: object) -> bool:
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value > 0
    )


def _suggest(layers: int, stages: int) -> list[int]:
    base, extra = divmod(layers, max(stages, 1))
    return [base + (1 if s < extra else 0) for s in range(stages)]


def balance_problem(balance: object, example: object) -> tuple[type[Exception], str] | None:
    """What is wrong with ``balance`` as a list of layer counts, one per stage (its kind and
    text; ``example``: a balance to suggest), or None."""
    if not isinstance(balance, (list, tuple)) or not balance:
        return TypeError, (
            f"balance must be a non-empty list of positive ints, one per stage (got {balance!r}); "
            f"e.g. balance={example}"
        )
    bad = [f"{n}: {b!r}" for n, b in enumerate(balance) if not positive_int(b)]
    if bad:
        return ValueError, (
            f"every entry of balance must be a positive int, the number of layers of a stage "
            f"(bad entries: {', '.join(bad)})"
        )
    return None


def _compiled_whole(module: object) -> str | None:
    """The problem with a whole model given to ``torch.compile`` (None where there is none):
    the pipeline calls each layer on its own, so a compiled call of the whole model never runs
    (``model.compile()`` would silently do nothing) and ``torch.compile(model)``'s wrapper is
    no ``nn.Sequential``."""
    inner = getattr(module, "_orig_mod", None)
    wrapped = isinstance(module, nn.Module) and isinstance(inner, nn.Sequential)
    in_place = getattr(module, "_compiled_call_impl", None) is not None
    if not wrapped and not in_place:
        return None
    what = "torch.compile(model)" if wrapped else "model.compile()"
    return (
        f"module was compiled whole ({what}), but the pipeline calls each layer on its own, so "
        f"a compiled call of the whole model never runs; pass the uncompiled nn.Sequential and "
        f"compile its layers instead (for layer in model: layer.compile()), or pass a list of "
        f"compiled layers"
    )


def check_arguments(
    module: object,
    balance: object,
    chunks: object,
    checkpoint: object,
    schedule: object,
    virtual_stages: object = 1,
    lookahead: object = 1,
    options: Sequence[str] = (),
) -> list[Layer]:
    """Every problem with the constructor's arguments at once, with the ``options`` problems
    that :func:`~asyncpipe.options.option_problems` found, as one ValueError/TypeError."""
    problems: list[str] = []
    kinds: list[type[Exception]] = []
    layers: list[Layer] = []
    compiled = _compiled_whole(module)
    if compiled:
        problems.append(compiled)
        kinds.append(TypeError)
    elif isinstance(module, nn.Sequential):
        layers = list(iter(module))
    elif isinstance(module, (list, tuple)):
        bad = [
            f"{n}: {type(m).__name__}"
            for n, m in enumerate(module)
            if not isinstance(m, (nn.Module, LazyModule))
        ]
        if bad:
            problems.append(
                "every item of a layer list must be an nn.Module or a LazyModule ("
                + ", ".join(bad)
                + "); wrap builders as LazyModule(lambda: layer)"
            )
            kinds.append(TypeError)
        layers = list(module)
    else:
        problems.append(
            f"module must be an nn.Sequential or a list of nn.Module/LazyModule (got "
            f"{type(module).__name__}); wrap your layers with nn.Sequential(...)"
        )
        kinds.append(TypeError)
    if module is not None and not layers and not problems:
        problems.append("module has no layers; a pipeline needs at least one layer per stage")
        kinds.append(ValueError)

    shape = balance_problem(balance, _suggest(len(layers), 2))
    if shape is not None:
        kinds.append(shape[0])
        problems.append(shape[1])
    elif isinstance(balance, (list, tuple)) and layers and sum(balance) != len(layers):
        problems.append(
            f"sum of balance must equal the number of layers (layers: {len(layers)}, sum of "
            f"balance: {sum(balance)}); pass balance={_suggest(len(layers), len(balance))}"
        )
        kinds.append(ValueError)
    if not positive_int(chunks):
        problems.append(
            f"chunks must be a positive int, the number of micro-batches (got {chunks!r})"
        )
        kinds.append(ValueError)
    if checkpoint not in POLICIES:
        problems.append(f"checkpoint must be one of {', '.join(POLICIES)} (got {checkpoint!r})")
        kinds.append(ValueError)
    if isinstance(schedule, dict):
        try:
            validate(schedule)
        except PlanError as e:
            problems.append(f"the schedule plan is not valid: {e}")
            kinds.append(ValueError)
        else:
            messages = sorted(
                str(a) for r in schedule.values() for a in r if a and not a.kind.is_compute
            )
            if messages:
                problems.append(
                    f"the schedule plan holds sends and receives ({', '.join(messages[:3])}"
                    f"{' ...' if len(messages) > 3 else ''}): pass it as a plan of compute "
                    f"actions only (before asyncpipe.schedule.lower), as AsyncPipe adds the "
                    f"messages itself, those of skip connections included"
                )
                kinds.append(ValueError)
            if not any(
                a is not None and a.kind is Kind.BACKWARD for r in schedule.values() for a in r
            ):
                problems.append(
                    "the schedule plan has no backward actions, so pipe.step() would train "
                    "nothing; give each forward its backward (a B action after it on the same "
                    "rank; inference with pipe(input) under torch.no_grad() runs the plan's "
                    "forwards only)"
                )
                kinds.append(ValueError)
            planned = 1 + max(a.microbatch for r in schedule.values() for a in r if a is not None)
            if positive_int(chunks) and chunks != planned:
                problems.append(
                    f"the schedule plan is for {planned} micro-batches but chunks={chunks}; pass "
                    f"chunks={planned} (or a plan over {chunks} micro-batches)"
                )
                kinds.append(ValueError)
    elif schedule not in NAMES:
        problems.append(
            f"schedule must be one of {', '.join(NAMES)} or a plan {{rank: [Action, ...]}} "
            f"(got {schedule!r})"
        )
        kinds.append(ValueError)
    if not positive_int(virtual_stages):
        problems.append(f"virtual_stages must be a positive int (got {virtual_stages!r})")
        kinds.append(ValueError)
    elif virtual_stages != 1 and schedule != "interleaved":
        problems.append(
            f"virtual_stages={virtual_stages} needs schedule='interleaved' (got {schedule!r})"
        )
        kinds.append(ValueError)
    elif (
        isinstance(balance, (list, tuple))
        and balance
        and isinstance(virtual_stages, int)
        and len(balance) % virtual_stages
    ):
        problems.append(
            f"balance needs virtual_stages ({virtual_stages}) entries per rank, a multiple of "
            f"{virtual_stages} (entries: {len(balance)})"
        )
        kinds.append(ValueError)
    if not positive_int(lookahead):
        problems.append(
            f"lookahead must be a positive int, the micro-batches each rank's forwards run ahead "
            f"of the next rank's under schedule='2bw' (got {lookahead!r})"
        )
        kinds.append(ValueError)
    elif lookahead != 1 and schedule != "2bw":
        problems.append(
            f"lookahead={lookahead} needs schedule='2bw' (got {schedule!r}); pass lookahead=1"
        )
        kinds.append(ValueError)
    problems += options
    kinds += [ValueError] * len(options)
    if problems:
        text = (
            "; ".join(problems)
            if len(problems) == 1
            else "\n  - ".join(["invalid AsyncPipe arguments:", *problems])
        )
        raise (TypeError if TypeError in kinds and ValueError not in kinds else ValueError)(text)
    return layers


def _one_block_per_rank(name: str, owners: list[int], ranks: int) -> None:
    if owners != list(range(ranks)):
        raise ValueError(
            f"schedule {name!r} needs each rank to run one consecutive block of layers, in rank "
            f"order (stages per rank: {owners}); a layer reused on another stage splits a block, "
            f"so use schedule='gpipe' for such models"
        )


def plan_factory(
    schedule: str | Plan, owners: list[int], ranks: int, virtual_stages: int
) -> Callable[[int], Plan]:
    """A function from the number of micro-batches of a step to its plan.

    ``owners`` is the rank of every segment (the stages of the plan). Raises ValueError when the
    schedule cannot run this partition.
    """
    if isinstance(schedule, dict):
        plan = schedule
        found = stage_owners(plan)
        if [found.get(s) for s in range(len(owners))] != owners or len(found) != len(owners):
            raise ValueError(
                f"the schedule plan must place stage s on the rank that owns segment s (plan: "
                f"{dict(sorted(found.items()))}, segments: {dict(enumerate(owners))})"
            )
        planned = 1 + max(a.microbatch for row in plan.values() for a in row if a is not None)

        def fixed(microbatches: int) -> Plan:
            if microbatches != planned:
                raise ValueError(
                    f"the schedule plan is for {planned} micro-batches but this batch splits into "
                    f"{microbatches} (torch.chunk into chunks={planned}); pass chunks={planned} "
                    f"and batches whose rows are a multiple of {planned}"
                )
            return plan

        return fixed
    if schedule == "gpipe":  # fill-drain over segments that may share ranks
        return lambda m: gpipe(len(owners), m, ranks=owners)
    if schedule == "interleaved":
        expected = [k % ranks for k in range(ranks * virtual_stages)]
        if owners != expected:
            raise ValueError(
                f"schedule 'interleaved' needs stage k on rank k % {ranks} (stages per rank: "
                f"{owners}); layers reused across stages are not supported with it"
            )
        return lambda m: build("interleaved", ranks, m, virtual_stages)
    _one_block_per_rank(str(schedule), owners, ranks)
    if schedule == "2bw":  # one mini-batch on its own (the stream runs 2BW's windows)
        return lambda m: build("1f1b", ranks, m)
    name = str(schedule)
    return lambda m: build(name, ranks, m)


def check_step(
    loss_fn: object, optimizer: object = None, max_norm: object = None, *, stepped: bool = True
) -> None:
    """What ``step()`` needs on every rank, whatever the schedule. ``stepped=False``: this rank
    has nothing to step (2BW on a rank without parameters), so ``max_norm`` needs no optimizer
    (the rank's share of the norm over every stage is zero)."""
    if max_norm is not None:
        if not _positive_number(max_norm):
            raise ValueError(f"max_norm must be a positive number (got {max_norm!r})")
        if optimizer is None and stepped:
            raise ValueError(
                "max_norm clips the gradient just before step() steps the optimizer, so it "
                "needs one: pass optimizer=optimizer too, or call pipe.clip_grad_norm_(max_norm) "
                "before your own optimizer.step()"
            )
    if not torch.is_grad_enabled():
        raise RuntimeError(
            "step() computes gradients, but gradients are disabled here; call it outside "
            "torch.no_grad(), or use pipe(input) for inference"
        )
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable (got {type(loss_fn).__name__})")


def world_mismatch(world: int, entries: int, virtual_stages: int) -> str:
    """The error for a balance whose length does not fit the pipeline's ranks, with the fixes
    that would work."""
    per = "" if virtual_stages == 1 else f" times virtual_stages ({virtual_stages})"
    fixes = [f"give balance {world * virtual_stages} entries"]
    ranks = entries // virtual_stages if entries % virtual_stages == 0 else 0
    if ranks:
        many = "process" if ranks == 1 else "processes"
        fixes.append(f"launch {ranks} {many} (torchrun --nproc-per-node={ranks})")
        if world > ranks and world % ranks == 0:
            fixes.append(f"run {world // ranks} replicas with data_parallel_size={world // ranks}")
    return (
        f"balance must have one entry per pipeline rank{per} (ranks: {world}, entries in "
        f"balance: {entries}); " + ", or ".join(fixes)
    )


def agree(
    exchange: Callable[[list[float]], list[list[float]]],
    rank: int,
    fields: dict[str, object],
    *,
    extra: float = 0.0,
    rule: str = "every rank of the pipeline must build AsyncPipe with the same arguments",
    fix: str = "pass the same values on every rank",
) -> list[float]:
    """Check that every pipeline rank built ``AsyncPipe`` with the same ``fields`` (name ->
    value): one small exchange of a checksum per field, before any step. Ranks that disagree
    would otherwise run different plans (a wrong loss without an error, or a wait until the
    timeout that blames a peer). Raises ValueError naming each field that differs and the
    ranks it differs on (after the ``rule`` they broke, before the ``fix``), or a StageFailure
    naming the rank whose stage failed to build (it sent its error instead, see
    :func:`~asyncpipe.runtime.refuse_exchange`).

    Returns:
        every rank's ``extra`` (index = rank): a value that travels in the same exchange and
        is not compared, e.g. whether that rank saw a skip connection."""
    names = list(fields)
    mine = [float(zlib.crc32(repr(fields[name]).encode())) for name in names] + [extra]
    try:
        table = exchange(mine)
    except StageFailure as e:  # that rank's constructor failed after connecting
        raise StageFailure(
            f"AsyncPipe cannot be built: its constructor failed on rank {e.rank} (stage "
            f"{e.rank}) with {e} (see the error there); rank {rank} stops too, before any step",
            rank=e.rank,
            stage=e.rank,
            microbatch=-1,
            action="",
        ) from e
    except (TransportTimeout, ConnectionError) as e:
        kind = TransportTimeout if isinstance(e, TransportTimeout) else ConnectionError
        raise kind(
            f"AsyncPipe's constructor compares its arguments across the pipeline's ranks, and "
            f"{e} (did the constructor fail on that rank, or is AsyncPipe not built there?)"
        ) from e
    differ: dict[str, list[int]] = {}
    for peer, row in enumerate(table):
        for name, ours, theirs in zip(names, mine, row):
            if peer != rank and ours != theirs:
                differ.setdefault(name, []).append(peer)
    if differ:
        found = "; ".join(
            f"{name} (here: {fields[name]!r}; other on rank{'s' if len(peers) > 1 else ''} "
            f"{', '.join(map(str, peers))})"
            for name, peers in differ.items()
        )
        raise ValueError(f"{rule}, and rank {rank}'s differ from other ranks' in: {found}; {fix}")
    return [row[len(names)] for row in table]


def agree_routes(
    exchange: Callable[[list[float]], list[list[float]]],
    rank: int,
    routes: SkipRoutes | None,
    find: Callable[[], SkipRoutes],
    refuse: Callable[[str], None],
) -> SkipRoutes:
    """Some rank of the pipeline saw a skip connection (:func:`agree` told every rank): find
    the routes of the skips where this rank has not yet (``routes`` is None: its layers showed
    none, so ``find`` builds the other ranks' LazyModules on the meta device), then check in one
    more exchange that every rank found the same. A rank that cannot find them sends its error
    instead (``refuse``, see :func:`~asyncpipe.runtime.refuse_exchange`) and raises it; the
    others raise a StageFailure naming that rank, at once."""
    if routes is None:
        try:
            routes = find()
        except Exception as e:
            refuse(f"{type(e).__name__}: {e}")
            raise
    agree(
        exchange,
        rank,
        {"skip routes": describe_routes(routes)},
        rule="every rank of the pipeline must find the same skip connections",
        fix="a LazyModule's function must declare the same skips (in namespaces created "
        "outside it) when its owner builds it and when the other ranks build it on the meta "
        "device",
    )
    return routes


def same_everywhere(
    pipe: Any,
    layers: Sequence[Layer],
    schedule: object,
    shared_weights: Sequence[Sequence[str] | str],
    traced: bool,
) -> dict[str, object]:
    """The arguments every rank must give alike, as :func:`agree` compares them, from an
    ``AsyncPipe`` being built: the layers' kinds, the plan (a dict sorted by rank), the shared
    weights, whether it traces, and its options as it keeps them."""
    scale = pipe.scaler.scale if pipe.scaler is not None else None
    return {
        "layers": [type(layer).__name__ for layer in layers],
        "balance": pipe.balance,
        "chunks": pipe.chunks,
        "checkpoint": pipe.checkpoint,
        "schedule": sorted(schedule.items()) if isinstance(schedule, dict) else schedule,
        "virtual_stages": pipe.virtual_stages,
        "lookahead": pipe.lookahead,
        "deferred_batch_norm": pipe.deferred_batch_norm,
        "transport": type(pipe.transport).__name__,
        "data_parallel_size": pipe.data_parallel_size,
        "autocast": pipe.autocast,
        "loss_scale": scale,
        "reduce_activations": pipe.reduce_activations,
        "shared_weights": [w if isinstance(w, str) else tuple(w) for w in shared_weights],
        "trace": traced,
    }
