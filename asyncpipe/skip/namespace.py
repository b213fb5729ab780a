"""Namespace: keeps the skip names of one copy of a skippable layer apart from another's."""

from __future__ import annotations

__all__: list[str] = []


class Namespace:
    """A scope for skip names; two namespaces are equal only if they are the same object.

    Reusing a skippable class twice in one model would stash the same name twice. Give each
    pair of stash and pop layers its own namespace with :meth:`Skippable.isolate`.

    Example:
        >>> ns1, ns2 = Namespace(), Namespace()
        >>> ns1 == ns2, ns1 == ns1
        (False, True)
    """

    __slots__ = ("label",)

    def __init__(self, label: str = "") -> None:
        self.label = label

    def __repr__(self) -> str:
        name = f" {self.label!r}" if self.label else ""
        return f"<Namespace{name} at 0x{id(self):x}>"


DEFAULT = Namespace("default")
"""The namespace of every skip name that was not isolated."""

SkipKey = tuple[Namespace, str]
"""A skip name in its namespace: what a stash and its pop agree on."""


def describe(key: SkipKey) -> str:
    """A skip key as users wrote it: the name, and the namespace when it is not the default."""
    namespace, name = key
    return repr(name) if namespace is DEFAULT else f"{name!r} in {namespace!r}"
