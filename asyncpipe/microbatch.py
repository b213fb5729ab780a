"""Micro-batches: split a mini-batch along dim 0 and put the outputs back together."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .alias import own_version

__all__: list[str] = []

Tensors = tuple[Tensor, ...]

_SHOWN = 5
"""Entries of a list that is no tuple of tensors named in its error (the count follows)."""


def as_tensors(value: object, what: str) -> Tensors:
    """A tensor or tuple/list of tensors as a tuple; a clear TypeError for anything else."""
    if isinstance(value, Tensor):
        return (value,)
    if isinstance(value, (tuple, list)) and value and all(isinstance(v, Tensor) for v in value):
        return tuple(value)
    if isinstance(value, (tuple, list)):
        bad = [f"{n}: {type(v).__name__}" for n, v in enumerate(value) if not isinstance(v, Tensor)]
        detail = ", ".join(bad[:_SHOWN]) if bad else "an empty tuple"
        if len(bad) > _SHOWN:
            detail += f", ... ({len(bad)} of {len(value)} entries are no tensor)"
        if bad and all(isinstance(v, (int, float, list, tuple)) for v in value):  # numbers
            fix = "convert it with torch.as_tensor(...) (a list of numbers is one tensor)"
        else:
            fix = "pass other values through layer attributes, or convert them to tensors"
        raise TypeError(f"{what} must be a tensor or a tuple of tensors (got {detail}); {fix}")
    raise TypeError(
        f"{what} must be a tensor or a tuple of tensors (got {type(value).__name__}); "
        f"convert it with torch.as_tensor"
    )


def scatter(batch: Tensors, chunks: int, what: str = "input") -> list[Tensors]:
    """Split every tensor of ``batch`` into at most ``chunks`` micro-batches along dim 0.

    Sizes follow ``torch.chunk``: all but the last are ``ceil(n / chunks)`` rows, so there are
    ``ceil(n / ceil(n / chunks))`` micro-batches: ``chunks`` when ``n`` is a multiple of
    ``chunks``, but fewer for some other sizes (6 rows into 4 gives 3 of 2 rows) and for
    fewer than ``chunks`` rows.

    Example:
        >>> [t[0].shape[0] for t in scatter((torch.zeros(10, 3),), 4)]
        [3, 3, 3, 1]
        >>> [t[0].shape[0] for t in scatter((torch.zeros(6, 3),), 4)]
        [2, 2, 2]
    """
    sizes = {t.shape[0] if t.dim() > 0 else -1 for t in batch}
    if -1 in sizes:
        raise ValueError(f"every tensor of the {what} needs a batch dimension (dim 0) to split")
    if len(sizes) != 1:
        raise ValueError(
            f"every tensor of the {what} must have the same size in dim 0 to be split into "
            f"micro-batches (sizes: {[t.shape[0] for t in batch]})"
        )
    if 0 in sizes:
        raise ValueError(f"the {what} is empty along dim 0; pass at least one sample")
    pieces = [torch.chunk(t, chunks, dim=0) for t in batch]
    # each micro-batch counts its own in-place changes (see own_version)
    return [tuple(own_version(piece[i]) for piece in pieces) for i in range(len(pieces[0]))]


def gather(outputs: Sequence[Tensors]) -> Tensors:
    """Concatenate per-micro-batch outputs along dim 0 (the inverse of :func:`scatter`); a
    tensor without dimensions (say, an auxiliary loss) is stacked, one entry per micro-batch."""
    width = len(outputs[0])
    return tuple(_join([out[n] for out in outputs]) for n in range(width))


def _join(parts: list[Tensor]) -> Tensor:
    return torch.stack(parts) if parts[0].dim() == 0 else torch.cat(parts, dim=0)
