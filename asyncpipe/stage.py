"""One rank's stage built from its partition: its LazyModules built, its BatchNorm deferred."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from .batchnorm import DeferredBatchNorm
from .lazy import LazyModule
from .partition import Partition, Segment

__all__: list[str] = []


def build_layers(
    mine: Partition,
    segments: Sequence[Segment],
    names: Sequence[str],
    chunks: int,
    deferred_batch_norm: bool,
) -> list[nn.Module]:
    """The layers of ``mine`` (this rank's partition): the caller's objects, a LazyModule
    built here (the only rank that builds it), and with ``deferred_batch_norm`` each
    BatchNorm replaced, each of its calls a use committed on its own (named by ``names``,
    the model's position names)."""
    built = [layer.build() if isinstance(layer, LazyModule) else layer for layer in mine.layers]
    if deferred_batch_norm:
        runs: list[list[tuple[int, str]]] = [[] for _ in built]
        for seg in segments:
            for inv in seg.invocations:
                if inv.this.stage == mine.stage:
                    runs[inv.this.index].append((seg.index, names[inv.order]))
        built = DeferredBatchNorm._convert_stage(built, chunks, runs)
    return built
