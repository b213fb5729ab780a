"""A small GPT-style language model built as an ``nn.Sequential`` of single-tensor layers."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "Block",
    "CausalSelfAttention",
    "Embedding",
    "build_model",
    "layer_costs",
    "lm_loss",
]


class Embedding(nn.Module):
    """Token embedding plus a learned positional embedding: (batch, seq) ids -> (b, s, dim)."""

    def __init__(self, vocab_size: int, dim: int, seq_len: int) -> None:
        super().__init__()
        self.seq_len = seq_len
        self.token = nn.Embedding(vocab_size, dim)
        self.position = nn.Parameter(torch.zeros(seq_len, dim))
        nn.init.normal_(self.token.weight, std=0.02)
        nn.init.normal_(self.position, std=0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Embed ``ids`` of shape (batch, seq) with ``seq <= seq_len``."""
        seq = ids.shape[-1]
        if seq > self.seq_len:
            raise ValueError(f"sequence of length {seq} is longer than seq_len={self.seq_len}")
        tokens: torch.Tensor = self.token(ids)
        return tokens + self.position[:seq]


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention over (batch, seq, dim)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim={dim} is not divisible by heads={heads}")
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Attend each position to itself and the positions before it."""
        batch, seq, dim = x.shape
        q, k, v = self.qkv(x).split(dim, dim=-1)
        shape = (batch, seq, self.heads, dim // self.heads)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out: torch.Tensor = self.proj(y.transpose(1, 2).reshape(batch, seq, dim))
        return out


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the attention and MLP sub-layers with residual connections."""
        x = x + self.attn(self.ln1(x))
        out: torch.Tensor = x + self.mlp(self.ln2(x))
        return out


def build_model(vocab_size: int, dim: int, depth: int, heads: int, seq_len: int) -> nn.Sequential:
    """Return ``Sequential(Embedding, Block * depth, LayerNorm, Linear)`` mapping ids to logits.

    Input: token ids (batch, seq) of dtype long.  Output: logits (batch, seq, vocab_size).
    Weights come from the current torch RNG state, so seeding identically everywhere builds
    identical models everywhere.
    """
    blocks = [Block(dim, heads) for _ in range(depth)]
    head = nn.Linear(dim, vocab_size)
    model = nn.Sequential(Embedding(vocab_size, dim, seq_len), *blocks, nn.LayerNorm(dim), head)
    for module in model.modules():
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
    # Scale the projections that write into the residual stream (GPT-2 style).
    for block in blocks:
        for linear in (block.attn.proj, block.mlp[2]):
            assert isinstance(linear, nn.Linear)
            nn.init.normal_(linear.weight, std=0.02 / math.sqrt(2 * depth))
    return model


def layer_costs(model: nn.Sequential, seq_len: int) -> list[float]:
    """Estimate each layer's relative compute (multiply-adds per token) for balancing stages."""
    costs: list[float] = []
    for layer in model:
        if isinstance(layer, Block):
            dim = layer.ln1.normalized_shape[0]
            costs.append(12.0 * dim * dim + 2.0 * seq_len * dim)
        elif isinstance(layer, nn.Linear):
            costs.append(float(layer.in_features * layer.out_features))
        else:  # embedding lookups and layer norms: cheap elementwise work
            costs.append(float(sum(p.shape[-1] for p in layer.parameters())))
    return costs


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of logits (b, s, vocab) against targets (b, s)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
