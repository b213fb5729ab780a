"""Models written as ordinary PyTorch with cut points, for the sequentialize tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from asyncpipe import CutPoint


class ManyCuts(nn.Module):
    """Eight linear layers with a cut point after each but the last (eight segments)."""

    def __init__(self, width: int = 8, depth: int = 8) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.cuts = nn.ModuleList(CutPoint() for _ in range(depth - 1))

    def forward(self, x: Tensor) -> Tensor:
        for n, layer in enumerate(self.layers):
            x = torch.tanh(layer(x))
            if n < len(self.cuts):
                x = self.cuts[n](x)
        return x


class MaskResidual(nn.Module):
    """forward(x, mask): the mask crosses every cut, a residual crosses two, a tuple one."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.a = nn.Linear(width, width)
        self.b = nn.Linear(width, width)
        self.c = nn.Linear(width, width)
        self.out = nn.Linear(width, width)
        self.scale = nn.Parameter(torch.ones(width))
        self.cut0, self.cut1, self.cut2, self.cut3 = CutPoint(), CutPoint(), CutPoint(), CutPoint()

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        h = self.inp(x)
        residual = h
        h = self.cut0(h)
        h = torch.tanh(self.a(h)).masked_fill(~mask, 0.0)
        pair = self.cut1((h, h * self.scale))  # a tuple crosses cut1
        h = torch.tanh(self.b(pair[0]) + pair[1])
        h = self.cut2(h)
        h = torch.tanh(self.c(h)).masked_fill(~mask, 0.0) + residual
        h = self.cut3(h)
        return self.out(h) * self.scale


class TiedLM(nn.Module):
    """A tiny language model whose output head reuses the embedding matrix (tied weights)."""

    def __init__(self, vocab: int = 11, dim: int = 8, depth: int = 3) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim), nn.GELU()) for _ in range(depth)
        )
        self.cuts = nn.ModuleList(CutPoint() for _ in range(depth + 1))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, ids: Tensor) -> Tensor:
        h = self.cuts[0](self.tok(ids))
        for block, cut in zip(self.blocks, self.cuts[1:]):
            h = cut(h + block(h))
        return self.head(self.norm(h))


def lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
