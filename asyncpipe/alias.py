"""Aliases: what a layer gets in place of a leaf, so that it may modify its input in place.

A segment's inputs (and, in a backward split layer by layer, every layer's input) are fresh
leaves that ask for gradients, and autograd refuses an in-place operation on such a leaf, where
the plain model's layer (``nn.ReLU(inplace=True)``) got a tensor computed by the layer before
and modified it freely. The layer therefore gets an alias: the same storage, but the output
of an identity function, so not a leaf; its gradient flows back to the leaf unchanged::

    leaf x (requires grad) ──Alias──> x' (same storage, not a leaf) ──layer──> out
    backward:   x.grad <──────identity────── x'.grad <──────────────────── out.grad

An in-place operation on ``x'`` changes the data of ``x``, which nothing reads again (the
runtime keeps ``x`` for its gradient only). A checkpointed forward, whose inputs the recompute
reads again, runs on :func:`copies` instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

__all__: list[str] = []


class _Alias(torch.autograd.Function):
    """The identity, returning a tensor that shares the input's storage but is no leaf."""

    @staticmethod
    def forward(ctx: Any, tensor: Tensor) -> Tensor:
        return tensor.detach()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return grad


def alias(tensor: Tensor) -> Tensor:
    """``tensor`` as a layer may get it: an alias when it is a leaf that asks for gradients
    (and gradients are on), else itself."""
    if tensor.requires_grad and tensor.is_leaf and torch.is_grad_enabled():
        out: Tensor = _Alias.apply(tensor)  # type: ignore[no-untyped-call]
        return out
    return tensor


def aliases(tensors: Sequence[Tensor]) -> tuple[Tensor, ...]:
    """:func:`alias` of every tensor."""
    return tuple(alias(t) for t in tensors)


def own_version(tensor: Tensor) -> Tensor:
    """``tensor``'s memory in a tensor with a version counter of its own, where ``tensor`` is a
    plain strided tensor that asks for no gradient (else ``tensor`` itself).

    Views share the version counter of their base: a micro-batch cut from the input by
    ``torch.chunk``, or one of the tensors of a message received in one buffer, would count the
    in-place changes made to its siblings, and autograd would refuse a backward through a
    tensor a layer saved for it when a sibling was changed in place later (a first layer
    ``nn.ReLU(inplace=True)`` changes every micro-batch of the input). The plain model's
    tensors are not views of each other, so the pipeline's must not count each other's changes
    either. No copy is made."""
    if (
        tensor.requires_grad
        or type(tensor) is not Tensor
        or tensor.layout is not torch.strided
        or tensor.is_inference()
    ):
        return tensor
    with torch.no_grad():
        own = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
        return own.set_(
            tensor.untyped_storage(), tensor.storage_offset(), tensor.shape, tensor.stride()
        )


def copies(tensors: Sequence[Tensor]) -> tuple[Tensor, ...]:
    """Copies of ``tensors`` for a forward under ``torch.no_grad()`` whose inputs are read
    again by a recompute: a layer that modifies its input in place then changes the copy."""
    return tuple(t.clone() for t in tensors)


def differentiable(tensor: Tensor) -> bool:
    """Whether autograd can carry a gradient for ``tensor``'s dtype: floating point or complex
    (integer and boolean tensors never require grad)."""
    return tensor.is_floating_point() or tensor.is_complex()
