"""``verify_skippables``: check that every stash of a model is popped later, and vice versa."""

from __future__ import annotations

import threading
import warnings
from collections.abc import Iterable, Sequence

import torch
from torch import nn

from ..lazy import LazyModule
from .layer import Skippable
from .namespace import SkipKey, describe

__all__: list[str] = []

_PROBING = threading.Lock()
"""Held while a probe silences warnings: ``warnings.catch_warnings`` swaps the process's filters,
so two probes at once (ranks as threads of one process) would restore each other's and leak
"ignore" or lose it."""


def declarations(layer: object) -> tuple[list[SkipKey], list[SkipKey]]:
    """The skip keys a layer stashes and pops that others pop and stash: a skippable layer's
    own, or those of the skippable modules inside a container, in the order they were
    registered (a ``nn.Sequential`` calls them in that order), less the ones stashed and
    popped inside it."""
    if isinstance(layer, Skippable):
        return layer.stash_keys(), layer.pop_keys()
    stashes: list[SkipKey] = []
    pops: list[SkipKey] = []
    if isinstance(layer, nn.Module):
        for child in layer.children():
            inner_stashes, inner_pops = declarations(child)
            for key in inner_pops:
                if key in stashes:
                    stashes.remove(key)  # stashed and popped inside this layer
                else:
                    pops.append(key)
            stashes += inner_stashes
    return stashes, pops


def skippable_inside(layer: object) -> bool:
    """Whether ``layer`` is skippable or holds a skippable module."""
    return isinstance(layer, nn.Module) and any(isinstance(m, Skippable) for m in layer.modules())


def probe(layer: object, position: int, owner: int | None = None) -> object:
    """The layer whose skip declarations count for ``layer``: itself, or for a LazyModule that
    is not built, a copy built on the meta device (no memory, no random numbers drawn).
    ``owner``: the rank that builds ``layer`` for real (for the error)."""
    if not isinstance(layer, LazyModule):
        return layer
    if layer.built:
        return layer.build()
    try:
        with _PROBING, torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. loading weights into meta tensors is a no-op
            return layer.function()
    except Exception as e:
        whose = "" if owner is None else f" (built for real by rank {owner}, stage {owner})"
        raise ValueError(
            f"cannot read the skip declarations of the LazyModule at position {position}"
            f"{whose}: this model has skip connections, so every rank builds the other ranks' "
            f"LazyModules on the meta device to read them, and its function failed there "
            f"({type(e).__name__}: {e}); make the function runnable on the meta device (no "
            f"reading tensor values), or pass that layer as a module (a layer list may mix "
            f"modules and LazyModules)"
        ) from e


def problems(layers: Sequence[object]) -> list[str]:
    """Every problem with the stashes and pops of ``layers`` (in call order), each with a fix."""
    found: list[str] = []
    stashed: dict[SkipKey, int] = {}
    popped: dict[SkipKey, int] = {}

    def name(position: int) -> str:
        return f"layer {position} ({type(layers[position]).__name__})"

    for position, layer in enumerate(layers):
        stashes, pops = declarations(layer)
        for key in pops:
            if key in popped:
                found.append(
                    f"{name(position)} pops {describe(key)}, which {name(popped[key])} pops "
                    f"already; each stash is popped once: isolate one pair with a new Namespace"
                )
            elif key not in stashed:
                later = [
                    p for p in range(position + 1, len(layers)) if key in declarations(layers[p])[0]
                ]
                fix = (
                    f"move it after {name(later[0])}, which stashes it"
                    if later
                    else "add a layer that stashes it, or remove the pop"
                )
                found.append(f"{name(position)} pops {describe(key)} before any stash; {fix}")
            else:
                popped[key] = position
        for key in stashes:
            if key in stashed:
                found.append(
                    f"{name(position)} stashes {describe(key)}, which {name(stashed[key])} "
                    f"stashes already; give each copy its own namespace with "
                    f".isolate(asyncpipe.skip.Namespace())"
                )
            stashed.setdefault(key, position)
    for key, position in stashed.items():
        if key not in popped:
            found.append(
                f"{name(position)} stashes {describe(key)} but no later layer pops it; add a layer "
                f"that pops it, or remove the stash (a stash nobody pops would leak its tensor)"
            )
    return found


def verify_skippables(module: nn.Sequential | Iterable[object]) -> None:
    """Check the skip connections of a model, listing every problem at once.

    Rules: every stashed name is popped by exactly one later layer; every popped name was
    stashed by exactly one earlier layer; names are scoped by namespaces
    (:meth:`~asyncpipe.skip.Skippable.isolate`).

    Raises:
        TypeError: naming each problem and how to fix it.

    Example:
        >>> import torch
        >>> from asyncpipe.skip import pop, skippable, stash
        >>> @skippable(pop=["x"])
        ... class Add(torch.nn.Module):
        ...     def forward(self, input):
        ...         return input + (yield pop("x"))
        >>> verify_skippables(torch.nn.Sequential(Add()))
        Traceback (most recent call last):
        ...
        TypeError: the skip connections of this model have 1 problem:
          - layer 0 (Add) pops 'x' before any stash; add a layer that stashes it, or remove the pop
    """
    layers = list(module)
    found = problems(layers)
    if found:
        count = f"{len(found)} problem{'s' if len(found) > 1 else ''}"
        raise TypeError(
            f"the skip connections of this model have {count}:\n"
            + "\n".join(f"  - {p}" for p in found)
        )
