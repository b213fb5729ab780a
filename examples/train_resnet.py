"""Train a small ResNet with BatchNorm and long skip connections, pipeline-parallel on CPU.

Run it with::

    torchrun --standalone --nproc-per-node=3 examples/train_resnet.py
    torchrun --standalone --nproc-per-node=2 examples/train_resnet.py --epochs 1 --schedule gpipe

The images are generated: 16x16 pictures of four shapes (square, disc, cross, ring) at random
places and sizes, with noise. The model is an ``nn.Sequential`` whose residual blocks and one
long skip (from the stem to the classifier head, across every stage) are written with
``asyncpipe.skip``: the long skip travels straight from the first process to the last.
BatchNorm is deferred, so its running statistics are those of whole mini-batches. Rank 0
prints the loss per epoch and the accuracy on held-out images at the end.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

import asyncpipe
from asyncpipe.skip import Namespace, pop, skippable, stash

SHAPES = ("square", "disc", "cross", "ring")


def make_images(count: int, size: int, seed: int) -> tuple[Tensor, Tensor]:
    """``count`` noisy images (count, 1, size, size) of the four shapes, and their labels."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(len(SHAPES), (count,), generator=g)
    ys, xs = torch.meshgrid(torch.arange(size), torch.arange(size), indexing="ij")
    images = torch.zeros(count, 1, size, size)
    for n in range(count):
        r = float(torch.randint(3, size // 3, (1,), generator=g))
        cy, cx = (float(v) for v in torch.randint(int(r), size - int(r), (2,), generator=g))
        dy, dx = ys - cy, xs - cx
        distance = (dy**2 + dx**2).sqrt()
        kind = SHAPES[int(labels[n])]
        if kind == "square":
            mask = (dy.abs() <= r) & (dx.abs() <= r)
        elif kind == "disc":
            mask = distance <= r
        elif kind == "cross":
            mask = ((dy.abs() <= r / 3) & (dx.abs() <= r)) | ((dx.abs() <= r / 3) & (dy.abs() <= r))
        else:
            mask = (distance <= r) & (distance >= r - 1.5)
        images[n, 0] = mask.float()
    images += 0.3 * torch.randn(images.shape, generator=g)
    return images, labels


# ----- the model: an nn.Sequential whose skips are declared with asyncpipe.skip ---------------


@skippable(stash=["stem"])
class Stem(nn.Module):
    """conv-BN-ReLU; stashes its output for the head (a long skip across every stage)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(1, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU()
        )

    def forward(self, x: Tensor) -> Any:
        out = self.body(x)
        yield stash("stem", out)
        return out


@skippable(stash=["identity"])
class Open(nn.Module):
    """Start of a residual block: stash the block's input."""

    def forward(self, x: Tensor) -> Any:
        yield stash("identity", x)
        return x


@skippable(pop=["identity"])
class Close(nn.Module):
    """End of a residual block: add the block's input back, then ReLU."""

    def forward(self, x: Tensor) -> Any:
        identity = yield pop("identity")
        return torch.relu(x + identity)


def conv_bn(width: int, relu: bool = True) -> nn.Sequential:
    layers: list[nn.Module] = [
        nn.Conv2d(width, width, 3, padding=1, bias=False),
        nn.BatchNorm2d(width),
    ]
    return nn.Sequential(*layers, nn.ReLU()) if relu else nn.Sequential(*layers)


def down(width: int) -> nn.Sequential:
    """Halve the resolution and double the channels."""
    return nn.Sequential(
        nn.Conv2d(width, 2 * width, 3, stride=2, padding=1, bias=False),
        nn.BatchNorm2d(2 * width),
        nn.ReLU(),
    )


@skippable(pop=["stem"])
class Head(nn.Module):
    """Pool the last features and the stem's (the long skip), then classify."""

    def __init__(self, width: int, classes: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width * 4 + width, classes)

    def forward(self, x: Tensor) -> Any:
        stem = yield pop("stem")
        pooled = torch.cat([x.mean(dim=(2, 3)), stem.mean(dim=(2, 3))], dim=1)
        return self.linear(pooled)


def build_model(width: int = 16, classes: int = len(SHAPES)) -> nn.Sequential:
    """Twelve layers: stem, three residual blocks (two layers apart), two downsamplings, head."""
    blocks: list[nn.Module] = [Stem(width)]
    for scale in (1, 2, 4):
        if scale > 1:
            blocks.append(down(width * scale // 2))
        ns = Namespace(f"block{scale}")  # one namespace per block: the names repeat
        blocks += [
            Open().isolate(ns),
            conv_bn(width * scale),
            conv_bn(width * scale, relu=False),
            Close().isolate(ns),
        ]
    blocks.append(Head(width, classes))
    return nn.Sequential(*blocks)


# ----- training ---------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0] if __doc__ else None,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--epochs", type=int, default=4, help="passes over the training images")
    parser.add_argument("--train", type=int, default=3072, help="training images")
    parser.add_argument("--test", type=int, default=512, help="held-out images")
    parser.add_argument("--batch-size", type=int, default=64, help="images per step")
    parser.add_argument("--chunks", type=int, default=4, help="micro-batches per step")
    parser.add_argument("--width", type=int, default=16, help="channels of the first stage")
    parser.add_argument(
        "--schedule",
        default="1f1b",
        choices=("gpipe", "1f1b", "interleaved", "zero_bubble"),
        help="pipeline schedule",
    )
    parser.add_argument(
        "--checkpoint",
        choices=("always", "except_last", "never"),
        default="except_last",
        help="which micro-batches recompute their activations in backward",
    )
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (Adam)")
    parser.add_argument("--seed", type=int, default=0, help="seed for weights and data")
    args = parser.parse_args()
    for name in ("epochs", "train", "test", "batch_size", "chunks", "width"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.train < args.batch_size:
        parser.error(
            f"--train ({args.train}) must hold at least one batch of --batch-size "
            f"({args.batch_size}) images: an epoch is --train // --batch-size steps"
        )
    return args


def balance_for(model: nn.Sequential, stages: int) -> list[int]:
    """Cut just before the ``Close`` of a residual block nearest to an even split, so that
    block's skip crosses a stage boundary (and the stem's long skip crosses all of them)."""
    closes = [n for n, layer in enumerate(model) if isinstance(layer, Close)]
    cuts: list[int] = []
    for k in range(1, stages):
        later = [c for c in closes if not cuts or c > cuts[-1]]
        if len(later) < stages - k:  # too few blocks left: split evenly instead
            base, extra = divmod(len(model), stages)
            return [base + (1 if s < extra else 0) for s in range(stages)]
        cuts.append(
            min(
                later[: len(later) - (stages - 1 - k)],
                key=lambda c: abs(c - k * len(model) / stages),
            )
        )
    edges = [0, *cuts, len(model)]
    return [end - start for start, end in zip(edges, edges[1:])]


def main() -> None:
    args = parse_args()
    asyncpipe.init()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    torch.manual_seed(args.seed)
    model = build_model(args.width)
    balance = balance_for(model, world)
    pipe = asyncpipe.AsyncPipe(
        model,
        balance,
        chunks=args.chunks,
        checkpoint=args.checkpoint,
        schedule=args.schedule,
        deferred_batch_norm=True,
    )
    crosses = sorted(pipe.skip_routes.edges())
    if rank == 0:
        print(
            f"{world} stages, balance {balance}, schedule {args.schedule}, chunks {args.chunks}; "
            f"skips crossing stages (from stage, to stage): {crosses}",
            flush=True,
        )
    images, labels = make_images(args.train + args.test, 16, args.seed + 1)
    train_x, train_y = images[: args.train], labels[: args.train]
    test_x, test_y = images[args.train :], labels[args.train :]
    optimizer = torch.optim.Adam(pipe.parameters(), lr=args.lr)
    steps_per_epoch = args.train // args.batch_size
    # Warm up, then anneal: the weights settle at the end, so the running statistics of
    # BatchNorm (updated once per mini-batch) describe the final weights.
    schedule = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, args.lr, total_steps=args.epochs * steps_per_epoch
    )
    loss_fn = nn.functional.cross_entropy
    order = torch.Generator().manual_seed(args.seed + 2)
    started = time.perf_counter()
    for epoch in range(args.epochs):
        pipe.train()
        perm = torch.randperm(args.train, generator=order)
        total, steps = 0.0, 0
        for start in range(0, args.train - args.batch_size + 1, args.batch_size):
            index = perm[start : start + args.batch_size]
            x = train_x[index] if pipe.is_first_stage else None
            y = train_y[index] if pipe.is_last_stage else None
            optimizer.zero_grad()
            total += pipe.step(x, y, loss_fn)
            optimizer.step()
            schedule.step()
            steps += 1
        if rank == 0:
            elapsed = time.perf_counter() - started
            print(
                f"epoch {epoch + 1}/{args.epochs}  loss {total / steps:.4f}  ({elapsed:.0f} s)",
                flush=True,
            )
    pipe.eval()
    correct = torch.zeros(1)
    with torch.no_grad():
        for start in range(0, args.test, args.batch_size):
            x = test_x[start : start + args.batch_size]
            out = pipe(x if pipe.is_first_stage else None)
            if pipe.is_last_stage:
                correct += (out.argmax(dim=1) == test_y[start : start + args.batch_size]).sum()
    dist.broadcast(correct, src=pipe.last_rank)
    if rank == 0:
        print(
            f"test accuracy {correct.item() / args.test:.3f} on {args.test} held-out images",
            flush=True,
        )
    asyncpipe.shutdown()  # meets every rank, then ends the process group (docs: reliability)


if __name__ == "__main__":
    main()
