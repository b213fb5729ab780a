"""Double-buffered weights for PipeDream-2BW: the live version and one stashed older version.

The live parameters are the user's own tensors; the optimizer updates them in place. A
micro-batch forwarded before an update and back-propagated after it must see the weights it
was forwarded with, so its forward saves the parameters (and views of them) by reference
and version, and the update first copies the live storages into the stash::

    F (version v):  saved tensor = param or view of it ──pack──> (tensor, v)
    update:         stash <── copy of live storages (version v);  live <── optimizer step (v + 1)
    B (stale):      (tensor, v) ──unpack──> same view of the stash; recompute runs on the stash

Gradients of the two mini-batches in flight are kept apart: when the older one's gradient is
complete it is taken out of ``.grad`` and handed to the optimizer at the update. Between two
steps ``.grad`` holds the running gradient of the newer one; :meth:`WeightVersions.hold` and
:meth:`WeightVersions.check_held` tell when the caller changed it meanwhile (``zero_grad()``).

A stale backward also sees each parameter's ``requires_grad`` as it was when its mini-batch's
forwards began (the caller may freeze or unfreeze parameters between two steps): the flags
are recorded at each window's start and put back for the older mini-batch's backwards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn

__all__: list[str] = []


def _storage_key(tensor: Tensor) -> int | None:
    try:
        return int(tensor.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):  # e.g. tensors without storage
        return None


class WeightVersions:
    """The weight versions and gradients of one rank's parameters under 2BW.

    Args:
        params: the parameters of this rank (the user's objects).

    Example:
        >>> versions = WeightVersions(list(model.parameters()))    # doctest: +SKIP
        >>> with versions.saving():                                # forward at the live version
        ...     loss = model(x).sum()                              # doctest: +SKIP
    """

    def __init__(self, params: Sequence[nn.Parameter]) -> None:
        self.params = list(params)
        self.version = 0
        """How many updates the live parameters have had."""
        self.stash: dict[int, Tensor] | None = None
        """Copies of the live storages (by storage address) from before the last update, while
        some micro-batch still needs them."""
        self.ready: list[Tensor | None] | None = None
        """The complete gradient of the older mini-batch, taken out of ``.grad``."""
        self.peak_versions = 1
        """Most weight versions held at once (live plus stash)."""
        self.held: list[tuple[Tensor | None, int]] | None = None
        """Each parameter's ``.grad`` (and its version counter) left in place by the end of the
        last window: the running gradient of the mini-batch in flight."""

    def _keys(self) -> dict[int, Tensor]:
        out: dict[int, Tensor] = {}
        for p in self.params:
            key = _storage_key(p)
            if key is not None:
                out.setdefault(key, p)
        return out

    # ----- saving and restoring tensors of the forward -----------------------------------

    @contextlib.contextmanager
    def saving(self) -> Iterator[None]:
        """Run a forward whose saved parameters remember the live version."""
        keys = self._keys()
        version = self.version

        def pack(tensor: Tensor) -> Any:
            key = _storage_key(tensor)
            if key is None or key not in keys:
                return tensor
            return (tensor, key, version)

        def unpack(packed: Any) -> Tensor:
            if not isinstance(packed, tuple):
                return packed  # type: ignore[no-any-return]
            tensor, key, saved = packed
            if saved == self.version:
                return tensor  # type: ignore[no-any-return]
            if self.stash is None or saved != self.version - 1:
                raise RuntimeError(
                    f"a micro-batch forwarded at weight version {saved} runs its backward at "
                    f"version {self.version}, but 2BW keeps only the version before the live one; "
                    f"this is a bug in the 2BW plan, please report it"
                )
            old = self.stash[key]
            view = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
            view.set_(
                old.untyped_storage(), tensor.storage_offset(), tensor.size(), tensor.stride()
            )
            return view

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield

    def requires_grad(self) -> list[bool]:
        """Each parameter's ``requires_grad`` now (recorded as a mini-batch's forwards begin)."""
        return [p.requires_grad for p in self.params]

    @contextlib.contextmanager
    def stale(self, flags: list[bool] | None = None) -> Iterator[None]:
        """Run a backward of a micro-batch forwarded before the last update: the parameters
        show the stashed version meanwhile (a recomputed forward uses it too). ``flags``: the
        parameters' ``requires_grad`` when that micro-batch's forwards began, where the caller
        changed some since (its backward accumulates, and its recompute builds its graph, as
        its forward did); the caller's flags are put back after."""
        changed = (
            []
            if flags is None
            else [p for p, flag in zip(self.params, flags) if p.requires_grad != flag]
        )
        if self.stash is None and not changed:
            yield
            return
        live = [p.data for p in self.params] if self.stash is not None else []
        try:
            for p in changed:
                p.requires_grad_(not p.requires_grad)
            if self.stash is not None:
                for p in self.params:
                    key = _storage_key(p)
                    old = self.stash.get(key) if key is not None else None
                    if old is not None:
                        view = torch.empty(0, dtype=p.dtype, device=p.device)
                        view.set_(old.untyped_storage(), p.storage_offset(), p.size(), p.stride())
                        p.data = view
            yield
        finally:
            for p, data in zip(self.params, live):
                p.data = data
            for p in changed:
                p.requires_grad_(not p.requires_grad)

    # ----- gradients and updates ---------------------------------------------------------

    def take_gradient(self) -> None:
        """The older mini-batch's gradient is complete in ``.grad``: keep it aside, and let the
        next mini-batch's gradients start from zero. Its stashed weights are not needed now."""
        self.ready = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None
        self.stash = None

    def update(self, optimizer: torch.optim.Optimizer | None, keep: bool) -> bool:
        """Step ``optimizer`` with the gradient taken by :meth:`take_gradient`, leaving the
        gradients accumulated since in ``.grad``; the live version goes up by one. ``keep``:
        some micro-batch forwarded at the live version runs its backward after this update,
        so copy the live storages into the stash first. ``optimizer`` is None only where there
        are no parameters (nothing to step). Returns whether there was a gradient.
        """
        ready, self.ready = self.ready, None
        if ready is None:
            return False
        if keep:
            self.stash = {key: _copy_storage(p) for key, p in self._keys().items()}
            self.peak_versions = 2
        partial = [p.grad for p in self.params]
        for p, g in zip(self.params, ready):
            p.grad = g
        try:
            if optimizer is not None:
                with torch.no_grad():
                    optimizer.step()
        finally:
            for p, g in zip(self.params, partial):
                p.grad = g
        self.version += 1
        return True

    # ----- the running gradient between two steps ----------------------------------------

    def hold(self) -> None:
        """The end of a window leaves the running gradient of the mini-batch in flight in
        ``.grad``: remember each tensor and its version, which nothing may change before the
        next window (or the drain) adds to it."""
        self.held = [(g, -1 if g is None else g._version) for g in (p.grad for p in self.params)]

    def check_held(self) -> None:
        """Raise if ``.grad`` is not as :meth:`hold` left it: the caller set it to None, zeroed
        it or changed it in place (``optimizer.zero_grad()``), so the gradient of the
        mini-batch in flight is lost. Forgets it either way."""
        held, self.held = self.held, None
        if held is None:
            return
        changed = [
            "set to None"
            if p.grad is None
            else "replaced"
            if p.grad is not g
            else "zeroed or changed in place"
            for p, (g, version) in zip(self.params, held)
            if p.grad is not g or (g is not None and g._version != version)
        ]
        if changed:
            raise RuntimeError(
                f".grad changed between two steps of schedule '2bw' ({len(changed)} of this "
                f"rank's {len(self.params)} parameters: {changed[0]}), e.g. by "
                f"optimizer.zero_grad(); it held the running gradient of the mini-batch in "
                f"flight, which is lost now. Under 2BW pipe.step() applies and clears the "
                f"gradients itself: do not call optimizer.zero_grad() or change .grad between "
                f"steps (call pipe.flush() first). Build the pipeline again, or resume from a "
                f"checkpoint"
            )


def _copy_storage(tensor: Tensor) -> Tensor:
    """A tensor over a copy of ``tensor``'s whole storage (views keep their offsets in it)."""
    storage = tensor.untyped_storage()
    copy = torch.empty(storage.nbytes(), dtype=torch.uint8, device=tensor.device)
    copy.untyped_storage().copy_(storage)
    return copy
