"""Train a GPT-like model written as ordinary PyTorch, split at its cut points automatically.

Run it with::

    torchrun --standalone --nproc-per-node=4 examples/train_cutpoint.py
    torchrun --standalone --nproc-per-node=2 examples/train_cutpoint.py --steps 20 --depth 2

The model is a plain ``nn.Module``: a token embedding whose matrix is also the output head
(tied weights), blocks with residual connections and a causal mask buffer, and a
:class:`~asyncpipe.CutPoint` after the embedding and after each block.
:func:`asyncpipe.sequentialize` turns it into segments, ``balance="auto"`` times the segments
on rank 0 and splits them evenly, and ``shared_weights`` keeps the embedding on the first stage
and the head on the last equal. Rank 0 also prints how :func:`asyncpipe.balance.plan` ranks
other configurations and what it predicts for this one.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

import asyncpipe
from asyncpipe import CutPoint, balance, sequentialize

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_lm import DATA, Corpus  # noqa: E402


class Block(nn.Module):
    """Pre-LayerNorm transformer block whose attention takes an explicit boolean mask."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        """``x`` (batch, seq, dim); ``mask`` (seq, seq), True where a position may attend."""
        batch, seq, dim = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(dim, dim=-1)
        q, k, v = (t.view(batch, seq, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.proj(y.transpose(1, 2).reshape(batch, seq, dim))
        out: Tensor = x + self.mlp(self.ln2(x))
        return out


class GPT(nn.Module):
    """A character-level GPT with a tied embedding/head and a cut point after each block."""

    def __init__(self, vocab: int, dim: int, depth: int, heads: int, seq_len: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq_len, dim) * 0.02)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(depth))
        self.cuts = nn.ModuleList(CutPoint() for _ in range(depth + 1))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied: one matrix embeds and predicts
        causal = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
        self.register_buffer("causal", causal, persistent=False)
        nn.init.normal_(self.tok.weight, std=0.02)

    def forward(self, ids: Tensor) -> Tensor:
        """Token ids (batch, seq_len) to logits (batch, seq_len, vocab)."""
        mask = self.causal  # a buffer: each segment that needs it reads its own copy
        h = self.cuts[0](self.tok(ids) + self.pos)
        for block, cut in zip(self.blocks, self.cuts[1:]):
            h = cut(block(h, mask))
        logits: Tensor = self.head(self.norm(h))
        return logits


def lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean next-character cross-entropy."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0] if __doc__ else None,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--steps", type=int, default=200, help="training steps")
    parser.add_argument("--chunks", type=int, default=4, help="micro-batches per step")
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per step")
    parser.add_argument("--seq-len", type=int, default=64, help="characters per sequence")
    parser.add_argument("--dim", type=int, default=64, help="model width")
    parser.add_argument("--depth", type=int, default=6, help="transformer blocks")
    parser.add_argument("--heads", type=int, default=4, help="attention heads per block")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    parser.add_argument("--log-every", type=int, default=20, help="steps between loss lines")
    parser.add_argument("--data", type=Path, default=DATA, help="a text file to train on")
    args = parser.parse_args(argv)
    for name in ("steps", "chunks", "batch_size", "seq_len", "dim", "depth", "heads", "log_every"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.dim % args.heads:
        parser.error(f"--dim ({args.dim}) must be a multiple of --heads ({args.heads})")
    if args.batch_size % args.chunks:
        parser.error(
            f"--batch-size ({args.batch_size}) must be a multiple of --chunks ({args.chunks}): "
            f"each micro-batch (and the sample the model is cut on) has batch-size / chunks rows"
        )

    asyncpipe.init()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    corpus = Corpus.load(args.data)
    torch.manual_seed(0)  # the same weights on every rank
    model = GPT(len(corpus.chars), args.dim, args.depth, args.heads, args.seq_len)
    generator = torch.Generator().manual_seed(0)  # the same batches on every rank
    sample, _ = corpus.batch(corpus.train, args.batch_size // args.chunks, args.seq_len, generator)

    segments = sequentialize(model, sample)
    pipe = asyncpipe.AsyncPipe(
        segments,
        "auto",
        chunks=args.chunks,
        sample=sample,
        shared_weights=[("tok.weight", "head.weight")],
    )
    predicted = 0.0
    if rank == 0:
        print(f"{len(segments)} segments; balance found by timing them: {pipe.balance}")
        profile = balance.profile(segments, sample)
        ranking = balance.plan(profile, world, args.batch_size, checkpoint=pipe.checkpoint)
        print("how balance.plan ranks configurations for this model:")
        print(ranking.table(3))
        print(ranking.reason)
        this = balance.plan(
            profile, world, args.batch_size, stages=[world], chunks=[args.chunks],
            schedules=[str(pipe.schedule)], checkpoint=pipe.checkpoint,
        )  # fmt: skip
        predicted = this.best.seconds
        print(f"this run: {this.best}")

    optimizer = torch.optim.AdamW(pipe.parameters(), lr=args.lr)
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        ids, targets = corpus.batch(corpus.train, args.batch_size, args.seq_len, generator)
        optimizer.zero_grad()
        loss = pipe.step(ids, targets, lm_loss)
        optimizer.step()
        if rank == 0 and (step % args.log_every == 0 or step == 1):
            print(f"step {step:4d}/{args.steps}  loss {loss:.3f}", flush=True)
    seconds = (time.perf_counter() - start) / args.steps

    # The embedding (first stage) and the head (last stage) are still one matrix.
    copies = [torch.zeros_like(model.tok.weight) for _ in range(world)]
    dist.all_gather(copies, model.tok.weight.detach())
    owners = [pipe.first_rank, pipe.last_rank]
    gap = float((copies[owners[0]] - copies[owners[1]]).abs().max())
    if rank == 0:
        print(
            f"{seconds * 1e3:.1f} ms per step (plan predicted {predicted * 1e3:.1f} ms for the "
            f"pipeline alone); tied copies on ranks {owners} differ by {gap}"
        )
    asyncpipe.shutdown()  # meets every rank, then ends the process group (docs: reliability)


if __name__ == "__main__":
    main()
