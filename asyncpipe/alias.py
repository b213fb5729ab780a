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


def copies(tensors: Sequence[Tensor]) -> tuple[Tensor, ...]:
    """Copies of ``tensors`` for a forward under ``torch.no_grad()`` whose inputs are read
    again by a recompute: a layer that modifies its input in place then changes the copy."""
    return tuple(t.clone() for t in tensors)
