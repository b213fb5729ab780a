"""DeferredBatchNorm: BatchNorm whose running statistics advance once per mini-batch."""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.lazy import LazyModuleMixin
from torch.utils.hooks import RemovableHandle

__all__ = ["DeferredBatchNorm", "commit_all", "paused"]


class _Moments:
    """The per-channel count, mean and M2 (sum of squared deviations) of one use's inputs,
    folded micro-batch by micro-batch."""

    __slots__ = ("count", "m2", "mean", "microbatches")

    def __init__(self) -> None:
        self.count = 0
        self.microbatches = 0
        self.mean: Tensor | None = None
        self.m2: Tensor | None = None

    def fold(self, n: int, mean: Tensor, m2: Tensor) -> None:
        """Chan's parallel combination with a micro-batch of ``n`` values per channel."""
        if self.mean is None or self.m2 is None:
            self.mean, self.m2 = mean, m2
        else:
            acc_mean, acc_m2 = self.mean.to(mean.device), self.m2.to(mean.device)
            total = self.count + n
            delta = mean - acc_mean
            self.mean = acc_mean + delta * (n / total)
            self.m2 = acc_m2 + m2 + delta.square() * (self.count * n / total)
        self.count += n
        self.microbatches += 1


class _UseMarker:
    """Forward hooks of a module whose calls tell the DeferredBatchNorms run inside them apart
    (see :func:`_track_uses`)."""

    def __init__(self, positions: int) -> None:
        self.serial = next(_serials)
        self.positions = positions
        self.calls = 0

    def enter(self, module: nn.Module, args: object) -> None:
        outer = _site.get()
        if outer is None:  # an outermost call: its positions come round in order
            occurrence = self.calls % self.positions
            self.calls += 1
            key: tuple[int, ...] = (self.serial, occurrence)
        else:  # inside another marked call: counted there
            key = (*outer.key, self.serial, outer.next_call(self))
        _site.set(_Site(self, key, outer))

    def leave(self, module: nn.Module, args: object, output: object) -> None:
        site = _site.get()
        while site is not None and site.marker is not self:
            site = site.outer
        if site is not None:
            _site.set(site.outer)


class _Site:
    """One call of a marked module: ``key`` names it among the calls of one forward (its
    markers and their occurrences, outermost first); ``calls`` counts the calls made so far
    within it of each DeferredBatchNorm and marked module."""

    __slots__ = ("calls", "key", "marker", "outer")

    def __init__(self, marker: _UseMarker, key: tuple[int, ...], outer: _Site | None) -> None:
        self.marker = marker
        self.key = key
        self.outer = outer
        self.calls: dict[object, int] = {}

    def next_call(self, caller: object) -> int:
        n = self.calls.get(caller, 0)
        self.calls[caller] = n + 1
        return n


_site: ContextVar[_Site | None] = ContextVar("asyncpipe_batch_norm_site", default=None)
_serials = itertools.count()
_marked: weakref.WeakKeyDictionary[nn.Module, tuple[RemovableHandle, RemovableHandle]] = (
    weakref.WeakKeyDictionary()
)


def _track_uses(module: nn.Module, positions: int = 1) -> None:
    """Make every call of ``module`` tell the DeferredBatchNorms it runs which use each of their
    calls is: the n-th call of a layer within one call of ``module`` is its n-th use there.

    ``positions``: how many times the caller calls ``module`` per forward, in order (a layer
    reused at several positions of one segment), so that each position is a use of its own.
    Marking a module again replaces its hooks.
    """
    old = _marked.pop(module, None)
    if old is not None:
        for handle in old:
            handle.remove()
    marker = _UseMarker(positions)
    _marked[module] = (
        module.register_forward_pre_hook(marker.enter),
        module.register_forward_hook(marker.leave, always_call=True),
    )


class DeferredBatchNorm(_BatchNorm):
    """BatchNorm for micro-batched pipelines: normalise per micro-batch, track per mini-batch.

    In training, each micro-batch is normalised with its own statistics, exactly as
    ``nn.BatchNorm*d`` does on that micro-batch (same output, same gradients), but the running
    statistics are left alone. Instead the layer folds every micro-batch's per-channel count,
    mean and sum of squared deviations into a float64 accumulator (Chan's parallel combination,
    which stays accurate where a plain sum of squares would cancel). :meth:`commit` then moves
    ``running_mean``, ``running_var`` (unbiased) and ``num_batches_tracked`` once, to the values
    a plain BatchNorm would reach after one training forward on the whole mini-batch::

        mini-batch ──chunk──> mb 0     mb 1     ...    mb k-1
        forward                 │        │                │       y = BN(mb; mean/var of mb)
                                ▼        ▼                ▼
        accumulator (float64)  (n, mean, M2) ─ fold ─ fold ─ ... per channel
        recompute (paused)      normalise only, fold nothing
        commit()                running_mean, running_var ← mini-batch mean, M2 / (n - 1)
                                num_batches_tracked += 1; accumulator emptied

    A layer called several times per forward (a BatchNorm shared by several layers, or called
    twice in one) updates its running statistics once per use, as a plain BatchNorm does, each
    use with the statistics of all its micro-batches, in the order of the model. A call's use
    is told by the module it runs in: each call of a layer within one call of a module
    returned by :meth:`convert_deferred_batch_norm` (or of a pipeline layer) is a use of its
    own; calls outside such a module all count as one use.

    In eval mode the running statistics are used as usual and nothing is accumulated. The
    state dict holds exactly the keys of a BatchNorm (``weight``, ``bias``, ``running_mean``,
    ``running_var``, ``num_batches_tracked``); the accumulator is not part of it, and is kept
    only between the first tracked forward of a mini-batch and :meth:`commit`.

    One class serves 1d (2D and 3D inputs), 2d and 3d: any input with at least two dimensions,
    channels in dimension 1, is accepted.

    Args:
        num_features: Number of channels (``C`` of an ``(N, C, ...)`` input).
        eps: Added to the variance for numerical stability.
        momentum: Weight of the new mini-batch in the exponential average of the running
            statistics, or ``None`` for a cumulative moving average.
        affine: Whether the layer has a learnable per-channel scale and shift.
        chunks: Number of micro-batches per mini-batch. More than ``chunks`` tracked training
            forwards of one use without a :meth:`commit` raise ``RuntimeError``: a missing
            commit, a recompute outside :func:`~asyncpipe.batchnorm.paused`, or a layer called
            several times per micro-batch outside a converted module (see above).
        device: Device of the parameters and buffers.
        dtype: Floating-point type of the parameters and buffers.

    Attributes:
        tracking: Whether training forwards fold their statistics into the accumulator. The
            pipeline switches it off around recomputes with
            :func:`~asyncpipe.batchnorm.paused`.

    Example:
        >>> import torch
        >>> bn = DeferredBatchNorm(3, chunks=2)
        >>> x = torch.randn(8, 3)
        >>> y = torch.cat([bn(mb) for mb in x.chunk(2)])
        >>> int(bn.num_batches_tracked)  # nothing committed yet
        0
        >>> bn.commit()
        >>> torch.allclose(bn.running_mean, 0.1 * x.mean(0))
        True
    """

    running_mean: Tensor
    running_var: Tensor
    num_batches_tracked: Tensor

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        *,
        chunks: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
            raise ValueError(f"chunks must be a positive integer (got {chunks!r})")
        super().__init__(num_features, eps, momentum, affine, True, device, dtype)
        self.chunks = chunks
        self.tracking = True
        self._uses: dict[tuple[int, ...] | None, _Moments] = {}
        """By use (``None``: calls outside a marked module), in the order of first calls."""

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(
                f"DeferredBatchNorm expects an (N, C, ...) input with at least 2 dimensions "
                f"(got {input.dim()}D)"
            )
        if input.shape[1] != self.num_features:
            raise ValueError(
                f"DeferredBatchNorm expects {self.num_features} channels in dim 1 "
                f"(got input of shape {tuple(input.shape)})"
            )

    def forward(self, input: Tensor) -> Tensor:
        """Normalise ``input``; in training, with its own statistics, folding them in if tracking.

        Args:
            input: An ``(N, C, ...)`` tensor, ``C == num_features``.

        Returns:
            The normalised (and, if affine, scaled and shifted) input.
        """
        self._check_input_dim(input)
        if not self.training:
            return F.batch_norm(
                input,
                self.running_mean,
                self.running_var,
                self.weight,
                self.bias,
                False,
                0.0,
                self.eps,
            )
        use = self._use() if self.tracking else None
        done = self._uses.get(use) if self.tracking else None
        if done is not None and done.microbatches >= self.chunks:
            raise RuntimeError(
                f"DeferredBatchNorm tracked {done.microbatches} micro-batches of one use without "
                f"a commit() (chunks={self.chunks}): call commit() after each mini-batch, run "
                f"recomputes inside asyncpipe.batchnorm.paused(), or, to call the layer several "
                f"times per micro-batch, call it inside the module that "
                f"convert_deferred_batch_norm returns (each call is then a use of its own)"
            )
        # No running statistics given: normalise with the batch's, update nothing.
        output = F.batch_norm(input, None, None, self.weight, self.bias, True, 0.0, self.eps)
        if self.tracking:
            self._accumulate(use, input.detach())
        return output

    def _use(self) -> tuple[int, ...] | None:
        """Which use this call is: its site's key and how many calls of this layer it made."""
        site = _site.get()
        return None if site is None else (*site.key, site.next_call(self))

    def _accumulate(self, use: tuple[int, ...] | None, input: Tensor) -> None:
        """Fold the per-channel count, mean and M2 of ``input`` into the accumulator of ``use``."""
        with torch.no_grad():
            dims = [0, *range(2, input.dim())]
            if input.dtype not in (torch.float32, torch.float64):
                input = input.float()
            var, mean = torch.var_mean(input, dim=dims, correction=0)
            wide = torch.float32 if input.device.type == "mps" else torch.float64
            n = input.numel() // input.shape[1]
            moments = self._uses.setdefault(use, _Moments())
            moments.fold(n, mean.to(wide), var.to(wide) * n)

    def commit(self) -> None:
        """Move the running statistics once per use, by the micro-batches folded in since the
        last commit.

        Afterwards ``running_mean``, ``running_var`` and ``num_batches_tracked`` equal those of
        a plain BatchNorm run once in training mode on the whole mini-batch (a layer with
        several uses: one update per use, in the order of their first calls). A commit with
        nothing accumulated (no tracked training forward since the last one) changes nothing.

        Example:
            >>> import torch
            >>> bn = DeferredBatchNorm(4, chunks=4)
            >>> for mb in torch.randn(16, 4).chunk(4):
            ...     _ = bn(mb)
            >>> bn.commit()
            >>> int(bn.num_batches_tracked)
            1
        """
        with torch.no_grad():
            device = self.running_mean.device
            for moments in self._uses.values():  # first called first: the model's order
                if moments.count == 0 or moments.mean is None or moments.m2 is None:
                    continue
                mean = moments.mean.to(device)
                var = moments.m2.to(device) / max(moments.count - 1, 1)
                self.num_batches_tracked.add_(1)
                if self.momentum is None:  # cumulative moving average
                    factor = 1.0 / float(self.num_batches_tracked)
                else:
                    factor = self.momentum
                old_mean = self.running_mean.to(mean.dtype)
                old_var = self.running_var.to(var.dtype)
                self.running_mean.copy_(old_mean + (mean - old_mean) * factor)
                self.running_var.copy_(old_var + (var - old_var) * factor)
        self.discard()

    def discard(self) -> None:
        """Empty the accumulator without touching the running statistics (e.g. a failed step)."""
        self._uses = {}

    def reset_running_stats(self) -> None:
        """Reset the running statistics, as BatchNorm does, and empty the accumulator."""
        super().reset_running_stats()
        if "_uses" in self.__dict__:  # not yet set while _BatchNorm.__init__ runs
            self.discard()

    def extra_repr(self) -> str:
        return (
            f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, "
            f"affine={self.affine}, chunks={self.chunks}"
        )

    @classmethod
    def convert_deferred_batch_norm(cls, module: nn.Module, chunks: int) -> nn.Module:
        """Replace every BatchNorm in ``module`` by a DeferredBatchNorm, recursively.

        Each replacement carries the very ``Parameter`` objects and buffer tensors of the layer
        it replaces (so optimizers and callers holding them keep working and see the
        gradients), its ``eps``, ``momentum`` and training mode; the state dict keys are
        unchanged, so checkpoints load both ways. Forward hooks registered on the old layer are
        not carried over. A BatchNorm object found several times in the tree (shared by several
        layers) becomes one DeferredBatchNorm, found at each of its places.

        Each call of the returned module (unless it is the replacement of ``module`` itself)
        marks its uses: a layer called ``k`` times in one forward of it (shared, or called
        twice by one layer) updates its running statistics ``k`` times per :meth:`commit`, as a
        plain BatchNorm does per forward, each time with the statistics of one use over all the
        micro-batches.

        Left as they are:

        * ``nn.SyncBatchNorm``: it synchronises its statistics across data-parallel
          processes, which a DeferredBatchNorm would silently stop doing.
        * BatchNorms built with ``track_running_stats=False``: they keep no running statistics,
          so there is nothing to defer.
        * DeferredBatchNorms: converting twice is harmless.

        Args:
            module: A module tree, or a single BatchNorm.
            chunks: Number of micro-batches per mini-batch (see the class's ``chunks``).

        Returns:
            ``module`` with its BatchNorm children replaced in place, or, if ``module`` itself
            is a BatchNorm, its DeferredBatchNorm replacement.

        Raises:
            ValueError: ``chunks`` is not a positive integer, or a lazy BatchNorm has not been
                initialised yet (run one forward first).

        Example:
            >>> from torch import nn
            >>> model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU())
            >>> model = DeferredBatchNorm.convert_deferred_batch_norm(model, chunks=4)
            >>> type(model[1]).__name__
            'DeferredBatchNorm'
        """
        if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
            raise ValueError(f"chunks must be a positive integer (got {chunks!r})")
        converted = cls._convert(module, chunks, {})
        if not isinstance(converted, _BatchNorm) and _deferred(converted):
            _track_uses(converted)
        return converted

    @classmethod
    def _convert(cls, module: nn.Module, chunks: int, memo: dict[int, nn.Module]) -> nn.Module:
        """``module`` converted, recursively; ``memo``: the replacement of each BatchNorm
        already converted, by ``id``, so that a shared one becomes one DeferredBatchNorm."""
        if isinstance(module, _BatchNorm):
            if id(module) not in memo:
                convertible = cls._convertible(module)
                memo[id(module)] = cls._convert_one(module, chunks) if convertible else module
            return memo[id(module)]
        for name, child in module.named_children():
            converted = cls._convert(child, chunks, memo)
            if converted is not child:
                setattr(module, name, converted)
        return module

    @classmethod
    def _convert_stage(
        cls, layers: Sequence[nn.Module], chunks: int, runs: Sequence[Sequence[tuple[int, str]]]
    ) -> list[nn.Module]:
        """A pipeline stage's layers with every BatchNorm deferred (one DeferredBatchNorm per
        BatchNorm object, however many layers share it) and every layer holding one marked, so
        that each call of a BatchNorm in a micro-batch's forward is a use of its own.

        Args:
            layers: The stage's own layers.
            chunks: Micro-batches per mini-batch.
            runs: For each layer, the segment and position name of each position where it runs,
                in model order.

        Raises:
            ValueError: A layer holding a BatchNorm runs in two segments of the stage: their
                forwards interleave by micro-batch, so its calls cannot be told apart.
        """
        memo: dict[int, nn.Module] = {}
        built = [cls._convert(layer, chunks, memo) for layer in layers]
        for layer, where in zip(built, runs):
            norms = [name for name, m in layer.named_modules() if isinstance(m, DeferredBatchNorm)]
            if not norms:
                continue
            segments = sorted({segment for segment, _ in where})
            if len(segments) > 1:
                names = ", ".join(repr(name) for _, name in where)
                inside = (
                    "is a BatchNorm"
                    if norms == [""]
                    else "holds BatchNorm " + ", ".join(repr(f"{where[0][1]}.{n}") for n in norms)
                )
                raise ValueError(
                    f"deferred_batch_norm: the layer at positions {names} {inside} and runs in "
                    f"separate segments of this stage ({', '.join(map(str, segments))}), whose "
                    f"forwards interleave by micro-batch, so its uses cannot be told apart to "
                    f"update the running statistics once per use; give each position its own "
                    f"layer object (or at least its own BatchNorm), or pass "
                    f"deferred_batch_norm=False"
                )
            _track_uses(layer, len(where))
        return built

    @staticmethod
    def _convertible(bn: _BatchNorm) -> bool:
        if isinstance(bn, (DeferredBatchNorm, nn.SyncBatchNorm)) or not bn.track_running_stats:
            return False
        if isinstance(bn, LazyModuleMixin) and bn.has_uninitialized_params():
            raise ValueError(
                f"cannot convert the uninitialised {type(bn).__name__}: run one forward through "
                f"the model first so that it knows its number of features"
            )
        return True

    @classmethod
    def _convert_one(cls, bn: _BatchNorm, chunks: int) -> DeferredBatchNorm:
        mean, var, tracked = bn.running_mean, bn.running_var, bn.num_batches_tracked
        assert mean is not None and var is not None and tracked is not None
        new = cls(bn.num_features, bn.eps, bn.momentum, bn.affine, chunks=chunks, device="meta")
        new.weight = bn.weight
        new.bias = bn.bias
        new.running_mean, new.running_var, new.num_batches_tracked = mean, var, tracked
        new.train(bn.training)
        return new


def _deferred(modules: nn.Module | Iterable[object]) -> list[DeferredBatchNorm]:
    """Every DeferredBatchNorm in ``modules`` (a module tree or an iterable of layers), once."""
    return [m for m in _norms(modules) if isinstance(m, DeferredBatchNorm)]


def _norms(modules: nn.Module | Iterable[object]) -> list[_BatchNorm]:
    """Every BatchNorm layer (deferred or not) in ``modules``, once."""
    roots = [modules] if isinstance(modules, nn.Module) else list(modules)
    found: dict[int, _BatchNorm] = {}
    for root in roots:
        if isinstance(root, nn.Module):
            for m in root.modules():
                if isinstance(m, _BatchNorm):
                    found.setdefault(id(m), m)
    return list(found.values())


@contextmanager
def paused(modules: nn.Module | Iterable[object]) -> Iterator[None]:
    """Switch off accumulation in every DeferredBatchNorm of ``modules`` for the body, and
    keep every plain BatchNorm's running statistics as they were before it.

    Wrap the recompute of a checkpointed micro-batch in it: the recompute still normalises
    with the micro-batch's statistics (so its outputs and gradients match the first forward)
    but folds nothing in, so the micro-batch counts once, in a DeferredBatchNorm's mini-batch
    statistics as in a plain BatchNorm's running ones (which the recompute's forward updates
    again; they are put back after it). Each layer's ``tracking`` is restored to what it was,
    so pauses nest.

    Args:
        modules: A module tree, or an iterable of layers (objects that are not modules are
            skipped), such as a pipeline stage's list of layers.

    Example:
        >>> import torch
        >>> bn = DeferredBatchNorm(3, chunks=1)
        >>> with paused(bn):
        ...     _ = bn(torch.randn(4, 3))
        >>> bn.commit()
        >>> int(bn.num_batches_tracked)
        0
    """
    norms = _norms(modules)
    layers = [m for m in norms if isinstance(m, DeferredBatchNorm)]
    kept = [
        (buffer, buffer.clone())
        for m in norms
        if not isinstance(m, DeferredBatchNorm) and m.training and m.track_running_stats
        for buffer in (m.running_mean, m.running_var, m.num_batches_tracked)
        if buffer is not None
    ]
    before = [layer.tracking for layer in layers]
    for layer in layers:
        layer.tracking = False
    try:
        yield
    finally:
        for layer, tracking in zip(layers, before):
            layer.tracking = tracking
        for buffer, value in kept:  # as the kernel updates them: unseen by autograd's
            buffer.data.copy_(value)  # version counter (the recompute's graph saved them)


def commit_all(modules: nn.Module | Iterable[object]) -> None:
    """Call :meth:`~asyncpipe.DeferredBatchNorm.commit` on every DeferredBatchNorm of
    ``modules``, once each.

    Args:
        modules: A module tree, or an iterable of layers (objects that are not modules are
            skipped), such as a pipeline stage's list of layers.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> model = DeferredBatchNorm.convert_deferred_batch_norm(
        ...     nn.Sequential(nn.BatchNorm1d(3)), chunks=2
        ... )
        >>> for mb in torch.randn(6, 3).chunk(2):
        ...     _ = model(mb)
        >>> commit_all(model)
        >>> int(model[0].num_batches_tracked)
        1
    """
    for layer in _deferred(modules):
        layer.commit()
