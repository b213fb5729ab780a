"""Skip trackers: where ``stash`` puts a tensor and ``pop`` finds it during a forward.

Outside a pipeline a skippable layer uses the calling thread's own tracker, so a plain
``nn.Sequential`` of skippable layers runs as it is. Inside a pipeline the runtime installs a
tracker per segment call that knows which names cross to other segments::

    segment s                                   segment t (maybe another rank)
    stash('x', a) ──> outgoing['x'] ──[message or hand-over]──> incoming['x'] ──> pop('x')
    stash('y', b) ──> local['y'] ─────> pop('y')     (same segment: stays in the graph)
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from contextvars import ContextVar

from torch import Tensor

from ..alias import alias, differentiable
from .namespace import SkipKey, describe

__all__: list[str] = []


class SkipTracker:
    """Holds the skip tensors of one forward call.

    Args:
        incoming: tensors stashed by other segments and popped here.
        crossing: names stashed here and popped by another segment (they go to ``outgoing``).
        cut: give every popped tensor to its layer as a fresh leaf and log each stash and pop,
            so a backward split layer by layer can route their gradients (see ``split``).
    """

    def __init__(
        self,
        incoming: dict[SkipKey, Tensor | None] | None = None,
        crossing: frozenset[SkipKey] = frozenset(),
        cut: bool = False,
    ) -> None:
        self.incoming = dict(incoming or {})
        self.crossing = crossing
        self.cut = cut
        self.local: dict[SkipKey, Tensor | None] = {}
        self.outgoing: dict[SkipKey, Tensor | None] = {}
        self.stashed: list[tuple[SkipKey, Tensor | None]] = []
        self.popped: list[tuple[SkipKey, Tensor | None]] = []

    def stash(self, key: SkipKey, tensor: Tensor | None) -> None:
        if tensor is not None and not isinstance(tensor, Tensor):
            raise TypeError(
                f"stash({describe(key)}, ...) takes a tensor or None (got {type(tensor).__name__})"
            )
        target = self.outgoing if key in self.crossing else self.local
        if key in target:
            raise RuntimeError(
                f"skip {describe(key)} was stashed twice before it was popped; give each copy of "
                f"the layer its own Namespace with .isolate(Namespace())"
            )
        target[key] = tensor
        if self.cut:
            self.stashed.append((key, tensor))

    def pop(self, key: SkipKey) -> Tensor | None:
        if key in self.local:
            tensor = self.local.pop(key)
        elif key in self.incoming:
            tensor = self.incoming.pop(key)
        else:
            raise RuntimeError(
                f"skip {describe(key)} was popped before any layer stashed it; run "
                f"asyncpipe.skip.verify_skippables(model) to see the order of stashes and pops"
            )
        if self.cut:
            inner = [n for n, (stashed, _) in enumerate(self.stashed) if stashed == key]
            if inner:  # stashed in the same layer call: that call's own graph links the two
                del self.stashed[inner[0]]
                return tensor
            if tensor is not None and tensor.requires_grad and differentiable(tensor):
                tensor = tensor.detach().requires_grad_(True)
            self.popped.append((key, tensor))
            if tensor is not None:
                tensor = alias(tensor)  # the layer may modify it in place
        return tensor

    def take_log(
        self,
    ) -> tuple[list[tuple[SkipKey, Tensor | None]], list[tuple[SkipKey, Tensor | None]]]:
        """The stashes and pops since the last call (cut mode), and forget them."""
        log = (self.stashed, self.popped)
        self.stashed, self.popped = [], []
        return log


_current: ContextVar[SkipTracker | None] = ContextVar("asyncpipe_skip_tracker", default=None)


class _ThreadDefault(threading.local):
    def __init__(self) -> None:
        self.tracker = SkipTracker()


_default = _ThreadDefault()


def current() -> SkipTracker:
    """The tracker of the running forward: the pipeline's, or this thread's own."""
    tracker = _current.get()
    return _default.tracker if tracker is None else tracker


@contextlib.contextmanager
def use(tracker: SkipTracker) -> Iterator[SkipTracker]:
    """Make ``tracker`` the one that skippable layers see, and restore the previous one."""
    token = _current.set(tracker)
    try:
        yield tracker
    finally:
        _current.reset(token)
