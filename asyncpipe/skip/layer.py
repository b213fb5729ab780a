"""``@skippable``: layers whose forward stashes tensors for later layers and pops them back.

A skippable forward is a generator. ``yield stash(name, tensor)`` hands a tensor to a later
layer; ``tensor = yield pop(name)`` takes one from an earlier layer. The decorator turns such a
class into an ordinary module whose ``forward`` drives the generator against the current skip
tracker, so the layer runs the same in a plain ``nn.Sequential`` and in a pipeline.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

from torch import Tensor, nn

from .namespace import DEFAULT, Namespace, SkipKey
from .tracker import current

__all__: list[str] = []


@dataclass(frozen=True)
class stash:  # noqa: N801 - used as a verb: ``yield stash("x", t)``
    """Yielded from a skippable forward: keep ``tensor`` (or ``None``) under ``name`` for a later
    layer.

    Example:
        >>> import torch
        >>> stash("x", torch.ones(1)).name
        'x'
    """

    name: str
    tensor: Tensor | None


@dataclass(frozen=True)
class pop:  # noqa: N801 - used as a verb: ``t = yield pop("x")``
    """Yielded from a skippable forward: the value of the ``yield`` is the tensor stashed under
    ``name`` by an earlier layer.

    Example:
        >>> pop("x").name
        'x'
    """

    name: str


class Skippable(nn.Module):
    """Base of the classes that :func:`skippable` makes; see there."""

    stash_names: frozenset[str] = frozenset()
    pop_names: frozenset[str] = frozenset()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.namespaces: dict[str, Namespace] = {}

    def isolate(self, namespace: Namespace, *, only: Iterable[str] | None = None) -> Skippable:
        """Put this layer's skip names (or ``only`` those) in ``namespace``; returns ``self``.

        Example:
            >>> ns = Namespace()
            >>> @skippable(stash=["x"])
            ... class Keep(nn.Module):
            ...     def forward(self, input):
            ...         yield stash("x", input)
            ...         return input
            >>> Keep().isolate(ns).key("x")[0] is ns
            True
        """
        if not isinstance(namespace, Namespace):
            raise TypeError(f"isolate() takes a Namespace (got {type(namespace).__name__})")
        names = set(self.stash_names | self.pop_names) if only is None else set(only)
        unknown = names - (self.stash_names | self.pop_names)
        if unknown:
            raise ValueError(
                f"{type(self).__name__} declares no skip named {sorted(unknown)} (declared: "
                f"{sorted(self.stash_names | self.pop_names)})"
            )
        for name in names:
            self.namespaces[name] = namespace
        return self

    def key(self, name: str) -> SkipKey:
        """The skip key of ``name`` for this layer: (its namespace, name)."""
        return (self.namespaces.get(name, DEFAULT), name)

    def stash_keys(self) -> list[SkipKey]:
        return [self.key(n) for n in sorted(self.stash_names)]

    def pop_keys(self) -> list[SkipKey]:
        return [self.key(n) for n in sorted(self.pop_names)]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        generator = self.skip_forward(*args, **kwargs)
        if not isinstance(generator, Generator):
            return generator  # a forward without yield: nothing to stash or pop
        tracker = current()
        reply: Tensor | None = None
        while True:
            try:
                request = generator.send(reply)
            except StopIteration as stop:
                return stop.value
            reply = None
            if isinstance(request, stash):
                self._check(request.name, self.stash_names, "stash")
                tracker.stash(self.key(request.name), request.tensor)
            elif isinstance(request, pop):
                self._check(request.name, self.pop_names, "pop")
                reply = tracker.pop(self.key(request.name))
            else:
                raise TypeError(
                    f"a skippable forward of {type(self).__name__} may only yield stash(name, "
                    f"tensor) or pop(name) (got {type(request).__name__})"
                )

    def skip_forward(self, *args: Any, **kwargs: Any) -> Any:  # replaced by @skippable
        raise NotImplementedError

    def _check(self, name: str, declared: frozenset[str], verb: str) -> None:
        if name not in declared:
            raise RuntimeError(
                f"{type(self).__name__} yielded {verb}({name!r}) but declares "
                f"{verb}={sorted(declared)}; add {name!r} to @skippable({verb}=[...])"
            )


M = TypeVar("M", bound=type[nn.Module])


def skippable(
    stash: Iterable[str] = (), pop: Iterable[str] = ()
) -> Callable[[type[nn.Module]], type[Skippable]]:
    """Class decorator: the layer's forward may ``yield stash(name, t)`` and ``yield pop(name)``.

    Args:
        stash: the names this layer stashes.
        pop: the names this layer pops.

    Example:
        >>> import torch
        >>> @skippable(stash=["skip"])
        ... class Save(nn.Module):
        ...     def forward(self, input):
        ...         yield stash("skip", input)
        ...         return input * 2
        >>> @skippable(pop=["skip"])
        ... class Add(nn.Module):
        ...     def forward(self, input):
        ...         skip = yield pop("skip")
        ...         return input + skip
        >>> nn.Sequential(Save(), Add())(torch.ones(1))
        tensor([3.])
    """
    stash_names, pop_names = _names(stash, "stash"), _names(pop, "pop")

    def decorate(cls: type[nn.Module]) -> type[Skippable]:
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise TypeError(f"@skippable decorates an nn.Module class (got {cls!r})")
        namespace = {
            "stash_names": stash_names,
            "pop_names": pop_names,
            "skip_forward": cls.forward,
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
            "__doc__": cls.__doc__,
        }
        return type(cls.__name__, (Skippable, cls), namespace)

    return decorate


def _names(names: Iterable[str], what: str) -> frozenset[str]:
    if isinstance(names, str):
        raise TypeError(
            f"{what} takes a list of names (got the string {names!r}); write {what}=[{names!r}]"
        )
    out = list(names)
    bad = [n for n in out if not isinstance(n, str)]
    if bad:
        raise TypeError(f"skip names must be strings (got {bad!r} in {what}=...)")
    return frozenset(out)
