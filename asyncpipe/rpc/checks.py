"""What the driver checks before it sends anything: RemotePipe's arguments, and the batches.

A refusal on the driver leaves nothing behind on the workers, whereas a stage that fails to
build or to split its batch fails the call for every stage (and a step that failed leaves its
pipeline broken), so what the driver can see it checks here, with RemotePipe's own words::

    RemotePipe(module, balance, ...) ─> check_remote: options, balance, shared weights,
                                        what cannot be pickled ─> remote.build on every rank
    pipe.step(x, y, loss_fn)         ─> check_batch(x, y) ─> remote.step on every rank
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch
from torch import nn

from ..arguments import balance_problem, positive_int
from ..lazy import LazyModule
from ..microbatch import as_tensors, scatter
from ..partition import partition
from ..shared import find_shared

__all__: list[str] = []


class _Nowhere:
    """A file that keeps nothing: what :class:`_Probe` writes is only counted."""

    def write(self, data: bytes) -> int:
        return len(data)


class _Probe(pickle.Pickler):
    """Pickles an object into nothing to see whether it can travel to another process, leaving
    out tensors (RPC sends those apart from the pickle, and copying the weights would be the
    whole cost) and the objects in ``skip`` (checked on their own)."""

    def __init__(self, skip: Collection[int] = ()) -> None:
        super().__init__(_Nowhere(), protocol=pickle.HIGHEST_PROTOCOL)
        self.skip = skip

    def persistent_id(self, obj: Any) -> str | None:
        if isinstance(obj, (torch.Tensor, torch.UntypedStorage, torch.TypedStorage)):
            return "tensor"
        return "checked" if id(obj) in self.skip else None


def pickling_error(value: object, skip: Collection[int] = ()) -> str | None:
    """Why ``value`` cannot be pickled (the error's type and first line), or None if it can."""
    try:
        _Probe(skip).dump(value)
    except Exception as e:
        text = str(e).splitlines()[0] if str(e) else ""
        return f"{type(e).__name__}: {text}" if text else type(e).__name__
    return None


def sendable(fn: Callable[..., Any], what: str) -> None:
    """Raise a TypeError with the fix if ``fn`` cannot travel to another process (RPC pickles
    functions by reference: a lambda or a function defined inside another cannot)."""
    error = pickling_error(fn)
    if error is not None:
        raise TypeError(
            f"{what} is sent to other processes, so it must be picklable: a module-level "
            f"function, or a functools.partial of one, not a lambda or a function defined "
            f"inside another ({error})"
        )


def _layers(module: object) -> list[Any] | None:
    """The layers of an ``nn.Sequential`` or a layer list; None for anything else (the
    stages refuse it, with AsyncPipe's message)."""
    if isinstance(module, nn.Sequential):
        return list(module)
    if isinstance(module, (list, tuple)):
        return list(module)
    return None


def _balance_problems(balance: object, stages: int) -> list[Exception]:
    if isinstance(balance, str):
        return [
            ValueError(
                f"RemotePipe takes balance as a list of layer counts, one per stage (got "
                f"{balance!r}): balance='auto' has the first rank profile the model and share "
                f"its answer over the process group, which RemotePipe's stages do not use; the "
                f"driver holds the whole model, so find one here with "
                f"asyncpipe.balance.by_time(model, sample, {stages}) (sample: one micro-batch "
                f"of input) and pass it, or run AsyncPipe(..., balance='auto', sample=...) on "
                f"every rank"
            )
        ]
    problem = balance_problem(balance, [2] * stages)
    return [] if problem is None else [problem[0](problem[1])]


def _shared_problems(
    layers: list[Any], balance: Sequence[int], groups: Any, world: int
) -> list[Exception]:
    """Shared weights that would be on several stages: their gradients are summed with
    collectives of the process group among the stages that own them, and RemotePipe's stages
    talk over RPC (the rpc transport has no such group), so they cannot be kept equal. Groups on
    one stage are kept equal there, as ``AsyncPipe`` does."""
    if (
        sum(balance) != len(layers)
        or len(balance) % world
        or not all(isinstance(layer, (nn.Module, LazyModule)) for layer in layers)
    ):
        return []  # the stages refuse these, with AsyncPipe's messages
    try:
        partitions, _ = partition(layers, balance, world)
        found = find_shared(groups, layers, partitions, 0, {})
    except ValueError as e:  # what every stage would refuse, said before anything is sent
        return [e]
    spread = [f"{list(g.names)} on stages {list(g.owners)}" for g in found if len(g.owners) > 1]
    if not spread:
        return []
    return [
        ValueError(
            f"RemotePipe cannot keep shared weights equal across stages ({'; '.join(spread)}): "
            f"their gradients are summed with collectives of the process group among the "
            f"stages that own them, and RemotePipe's stages talk over RPC; put the layers that "
            f"share them on one stage (a balance that keeps their positions together), or list "
            f"one layer object at each position that uses it (it runs on the stage of its first "
            f"position, so there is one copy), or run AsyncPipe(..., shared_weights=..., "
            f"transport='p2p' or 'shm') on every rank"
        )
    ]


def _pickling_problems(
    module: object,
    layers: list[Any] | None,
    kwargs: dict[str, Any],
    optimizer: Callable[..., torch.optim.Optimizer] | None,
) -> list[Exception]:
    """What the constructor sends to the workers that cannot be pickled, by position and name
    (RPC's own error names neither)."""
    problems: list[Exception] = []
    checked: set[int] = set()
    bad = []
    for position, layer in enumerate(layers or []):
        if id(layer) in checked:  # a layer reused at several positions
            continue
        checked.add(id(layer))
        error = pickling_error(layer)
        if error is not None:
            what = "a LazyModule" if isinstance(layer, LazyModule) else type(layer).__name__
            bad.append(f"position {position}, {what} ({error})")
    if bad:
        problems.append(
            TypeError(
                f"every layer is sent to the workers, so it must be picklable, and these are "
                f"not: {'; '.join(bad)}; give a LazyModule a module-level function or a "
                f"functools.partial of one, not a lambda or a function defined inside another "
                f"(and keep such functions off a layer's attributes)"
            )
        )
    else:
        error = pickling_error(module, skip=checked)  # the container itself (its hooks)
        if error is not None:
            problems.append(
                TypeError(
                    f"the module is sent to the workers, so it must be picklable ({error}); "
                    f"keep lambdas and functions defined inside others off it (hooks included)"
                )
            )
    for key, value in kwargs.items():
        error = pickling_error(value)
        if error is not None:
            problems.append(
                TypeError(
                    f"the argument {key}= is sent to the workers, so it must be picklable ({error})"
                )
            )
    if optimizer is not None:
        try:
            sendable(optimizer, "the optimizer factory")
        except TypeError as e:
            problems.append(e)
    return problems


def check_remote(
    module: object,
    balance: object,
    kwargs: dict[str, Any],
    optimizer: Callable[..., torch.optim.Optimizer] | None,
    world: int,
) -> None:
    """Every problem with RemotePipe's arguments that the driver can see, as one ValueError
    or TypeError (a TypeError only when every problem is one), before anything is sent."""
    problems: list[Exception] = []
    if "transport" in kwargs:
        problems.append(ValueError("RemotePipe always uses the rpc transport; drop transport="))
    if kwargs.get("schedule") == "2bw":
        problems.append(
            ValueError(
                "RemotePipe does not run schedule='2bw' (its updates are applied inside each "
                "step, with the stage's optimizer); run AsyncPipe(..., schedule='2bw') on every "
                "rank instead, or pick another schedule"
            )
        )
    if kwargs.get("data_parallel_size", 1) != 1:
        problems.append(
            ValueError(
                "RemotePipe drives one pipeline over every rank and does not replicate it "
                "(data_parallel_size must be 1); for data parallelism run AsyncPipe(..., "
                "data_parallel_size=N) on every rank"
            )
        )
    virtual = kwargs.get("virtual_stages", 1)
    stages = world * virtual if positive_int(virtual) else world
    found = _balance_problems(balance, stages)
    problems += found
    layers = _layers(module)
    shared = kwargs.get("shared_weights")
    if shared and not found and layers is not None and isinstance(balance, (list, tuple)):
        problems += _shared_problems(layers, balance, shared, world)
    if world > 1:
        problems += _pickling_problems(module, layers, kwargs, optimizer)
    if len(problems) == 1:
        raise problems[0]
    if problems:
        message = "\n  - ".join(["invalid RemotePipe arguments:", *map(str, problems)])
        only_types = all(isinstance(p, TypeError) for p in problems)
        raise (TypeError if only_types else ValueError)(message)


def check_batch(input: object, target: object, chunks: int) -> None:
    """Raise what the first and last stages would for an ``input`` or ``target`` that
    ``AsyncPipe`` cannot split into micro-batches (its own rule: a tensor or a tuple of tensors
    with one size along dim 0, the target into as many micro-batches as the input), before the
    driver sends them: a stage that raised it would leave the pipeline broken. ``target`` may
    be None (``loss_fn`` gets None)."""
    if input is None:
        raise ValueError(
            "the input is needed: the driver sends it to the first stage; pass the mini-batch's "
            "input (a tensor or a tuple of tensors)"
        )
    microbatches = len(scatter(as_tensors(input, "the input"), chunks, "input"))
    if target is None:
        return
    split = len(scatter(as_tensors(target, "the target"), chunks, "target"))
    if split != microbatches:
        raise ValueError(
            f"the target splits into {split} micro-batch{'es' if split != 1 else ''} but the "
            f"input into {microbatches} (torch.chunk into chunks={chunks}); pass an input and "
            f"target of the same batch size"
        )
