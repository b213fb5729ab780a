"""Train a small character-level GPT with asyncpipe, one pipeline stage per torchrun process.

Run it with::

    torchrun --standalone --nproc-per-node=4 examples/train_lm.py
    torchrun --standalone --nproc-per-node=2 examples/train_lm.py --steps 3 --dim 32 --depth 2

Every process builds the same model from the same seed, keeps the layers of its own stage and
runs its part of every step; micro-batches stream through the stages.  The corpus is
``examples/data/stdlib_docs.txt`` (see ``examples/data/make_corpus.py``).  Rank 0 prints the
progress (a one-line progress bar in a terminal), and at the end how long a step took and how
much of it each stage sat idle.  The run is traced into ``--trace`` (default ``runs/train_lm``):
open it with ``tensorboard --logdir runs`` or ``python -m asyncpipe.trace runs/train_lm``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import asyncpipe

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpt import build_model, layer_costs, lm_loss  # noqa: E402

DATA = Path(__file__).resolve().parent / "data" / "stdlib_docs.txt"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Read the command line."""
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0] if __doc__ else None,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--steps", type=int, default=400, help="optimizer steps")
    parser.add_argument("--chunks", type=int, default=8, help="micro-batches per step")
    parser.add_argument("--batch-size", type=int, default=32, help="sequences per step")
    parser.add_argument("--seq-len", type=int, default=64, help="characters per sequence")
    parser.add_argument("--dim", type=int, default=128, help="model width")
    parser.add_argument("--depth", type=int, default=4, help="transformer blocks")
    parser.add_argument("--heads", type=int, default=4, help="attention heads per block")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (AdamW)")
    parser.add_argument(
        "--checkpoint",
        choices=("always", "except_last", "never"),
        default="except_last",
        help="which micro-batches recompute their activations in backward",
    )
    parser.add_argument(
        "--schedule",
        choices=("gpipe", "1f1b", "2bw"),
        default="gpipe",
        help="pipeline schedule; 2bw never drains between steps and applies each update one "
        "step late",
    )
    parser.add_argument(
        "--transport",
        choices=("p2p", "shm", "rpc"),
        default="p2p",
        help="how activations and gradients travel: p2p (gloo send/recv), shm (shared memory, "
        "ranks of one host) or rpc (torch.distributed.rpc)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed for weights and batches")
    parser.add_argument(
        "--balance",
        type=str,
        default=None,
        help="layers per stage, e.g. 2,1,1,3 (none given: split by estimated compute)",
    )
    parser.add_argument(
        "--log-every",
        type=int,
        default=0,
        help="steps between progress lines (0: a tenth of --steps)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads per process (0: the CPUs divided by the processes)",
    )
    parser.add_argument(
        "--sample-chars",
        type=int,
        default=200,
        help="characters to generate through the pipeline at the end (0: none)",
    )
    parser.add_argument("--data", type=Path, default=DATA, help="plain-text training corpus")
    parser.add_argument(
        "--trace",
        default="runs/train_lm",
        help="trace directory for TensorBoard and python -m asyncpipe.trace ('' for none)",
    )
    parser.add_argument("--trace-every", type=int, default=50, help="steps between timelines")
    parser.add_argument(
        "--loss-log", type=Path, default=None, help="write 'step loss' lines of every mini-batch"
    )
    args = parser.parse_args(argv)
    at_least = dict.fromkeys(("steps", "chunks", "batch_size", "seq_len", "dim"), 1)
    at_least |= dict.fromkeys(("depth", "heads", "trace_every"), 1)
    at_least |= dict.fromkeys(("threads", "log_every", "sample_chars"), 0)  # 0: see the help
    for name, least in at_least.items():
        if getattr(args, name) < least:
            option = "--" + name.replace("_", "-")
            parser.error(f"{option} must be at least {least} (got {getattr(args, name)})")
    if args.dim % args.heads:
        parser.error(f"--dim ({args.dim}) must be divisible by --heads ({args.heads})")
    return args


# ----- data -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Corpus:
    """A character vocabulary and the encoded text, split into training and validation parts."""

    chars: str
    train: torch.Tensor
    valid: torch.Tensor

    @classmethod
    def load(cls, path: Path, valid_fraction: float = 0.05) -> Corpus:
        """Read ``path`` and encode each character as its index in the sorted vocabulary."""
        text = path.read_text(encoding="utf-8")
        chars = "".join(sorted(set(text)))
        index = {c: i for i, c in enumerate(chars)}
        ids = torch.tensor([index[c] for c in text], dtype=torch.long)
        split = int(len(ids) * (1 - valid_fraction))
        return cls(chars, ids[:split], ids[split:])

    def decode(self, ids: list[int]) -> str:
        """Turn token ids back into text."""
        return "".join(self.chars[i] for i in ids)

    def batch(
        self, data: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample ``batch_size`` windows: inputs (b, seq) and next-character targets (b, seq)."""
        starts = torch.randint(len(data) - seq_len - 1, (batch_size,), generator=generator)
        offsets = torch.arange(seq_len + 1)
        windows = data[starts[:, None] + offsets]
        return windows[:, :-1], windows[:, 1:]


# ----- pipeline layout ------------------------------------------------------------------------


def parse_balance(
    text: str | None, model: nn.Sequential, seq_len: int, stages: int, rank: int
) -> list[int]:
    """Return ``--balance`` as a list, or a compute-balanced split into ``stages`` stages.

    A bad ``--balance`` ends every process; only rank 0 says why.
    """
    if text is None:
        if len(model) < stages:
            problem = f"the model has {len(model)} layers, fewer than the {stages} processes"
            raise SystemExit(f"{problem}; raise --depth" if rank == 0 else 2)
        return asyncpipe.balance.blocks(layer_costs(model, seq_len), stages)
    try:
        balance = [int(part) for part in text.split(",")]
    except ValueError:
        balance = []
    if len(balance) != stages or sum(balance) != len(model) or min(balance) < 1:
        raise SystemExit(
            f"--balance {text} must be {stages} positive integers (one per process) adding up "
            f"to {len(model)} (the model's layers)"
            if rank == 0
            else 2
        )
    return balance


# ----- generation through the pipeline ---------------------------------------------------------


@torch.no_grad()
def evaluate(
    pipe: asyncpipe.AsyncPipe, corpus: Corpus, args: argparse.Namespace, batches: int = 4
) -> float:
    """Mean loss on held-out batches; every rank takes part and gets the value."""
    generator = torch.Generator().manual_seed(args.seed + 2)
    total = torch.zeros(1)
    for _ in range(batches):
        inputs, targets = corpus.batch(corpus.valid, args.batch_size, args.seq_len, generator)
        logits = pipe(inputs if pipe.is_first_stage else None)
        if pipe.is_last_stage:
            total += lm_loss(logits, targets)
    dist.broadcast(total, src=pipe.last_rank)
    return total.item() / batches


@torch.no_grad()
def generate(pipe: asyncpipe.AsyncPipe, corpus: Corpus, args: argparse.Namespace) -> str:
    """Continue a validation-text prompt by ``--sample-chars`` characters, one pipeline pass each.

    The window fed in always holds the last ``seq_len`` characters, so every pass sends tensors
    of the same shape.  The last stage samples the next character and broadcasts it.
    """
    generator = torch.Generator().manual_seed(args.seed + 3)
    window = corpus.valid[: args.seq_len].clone()
    produced: list[int] = []
    last_rank = pipe.last_rank
    for _ in range(args.sample_chars):
        logits = pipe(window[None] if pipe.is_first_stage else None)
        next_id = torch.zeros(1, dtype=torch.long)
        if pipe.is_last_stage:
            probs = torch.softmax(logits[0, -1] / 0.8, dim=-1)
            next_id = torch.multinomial(probs, 1, generator=generator)
        dist.broadcast(next_id, src=last_rank)
        produced.append(int(next_id.item()))
        window = torch.cat([window[1:], next_id])
    return corpus.decode(produced)


# ----- training ---------------------------------------------------------------------------------


@dataclass
class Timing:
    """One rank's step timings, summed over the steps after the first (warm-up) one."""

    stage: int
    steps: int = 0
    wall: float = 0.0  # pipe.step + optimizer, as seen by this rank
    pipe: float = 0.0  # pipe.last_step.seconds
    busy: float = 0.0  # pipe.last_step.busy_seconds


class Progress:
    """A one-line progress bar redrawn with a carriage return (only on a terminal)."""

    def __init__(self, total: int, enabled: bool, width: int = 24) -> None:
        self.total, self.width = total, width
        self.enabled = enabled and sys.stdout.isatty()

    def update(self, step: int, loss: float, seconds: float) -> None:
        if not self.enabled:
            return
        done = round(self.width * step / self.total)
        bar = "#" * done + "." * (self.width - done)
        line = f"[{bar}] step {step}/{self.total}  loss {loss:.4f}  step {seconds * 1e3:6.1f} ms"
        print("\r" + line, end="", flush=True)

    def clear(self) -> None:
        """Wipe the bar before an ordinary line is printed."""
        if self.enabled:
            print("\r" + " " * (self.width + 60) + "\r", end="", flush=True)


def main() -> None:
    """Train, report, sample."""
    args = parse_args()
    threads = args.threads or max(
        1, len(os.sched_getaffinity(0)) // int(os.environ.get("WORLD_SIZE", "1"))
    )
    torch.set_num_threads(threads)

    asyncpipe.init(rpc=args.transport == "rpc")
    rank, world = dist.get_rank(), dist.get_world_size()

    def say(*parts: object, flush: bool = False) -> None:
        """Print on rank 0 only."""
        if rank == 0:
            print(*parts, flush=flush)

    corpus = Corpus.load(args.data)
    torch.manual_seed(args.seed)  # identical on every rank: identical weights everywhere
    model = build_model(len(corpus.chars), args.dim, args.depth, args.heads, args.seq_len)
    total_params = sum(p.numel() for p in model.parameters())
    balance = parse_balance(args.balance, model, args.seq_len, world, rank)
    pipe = asyncpipe.AsyncPipe(
        model,
        balance=balance,
        chunks=args.chunks,
        checkpoint=args.checkpoint,
        schedule=args.schedule,
        transport=args.transport,
        trace=args.trace or None,
        trace_every=args.trace_every,
    )
    del model  # this rank keeps only its stage's layers
    local_params = sum(p.numel() for p in pipe.parameters())
    stage_params: list[int] = [0] * world
    dist.all_gather_object(stage_params, local_params)

    optimizer = torch.optim.AdamW(
        pipe.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1
    )
    steps: int = args.steps
    warmup = max(1, steps // 10)

    def schedule(step: int) -> float:
        """Linear warm-up, then cosine decay to a tenth of the peak learning rate."""
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    pipe.trace_optimizer(optimizer)

    tokens_per_step = args.batch_size * args.seq_len
    say(
        f"corpus: {args.data.name}, {len(corpus.train):,} training characters, "
        f"vocabulary {len(corpus.chars)}"
    )
    say(
        f"model: {total_params:,} parameters (dim {args.dim}, depth {args.depth}, "
        f"heads {args.heads}, seq_len {args.seq_len}), {sum(balance)} layers"
    )
    say(
        f"pipeline: {world} stages, balance {balance}, parameters per stage {stage_params}, "
        f"chunks {args.chunks}, schedule {args.schedule}, checkpoint {args.checkpoint!r}, "
        f"{threads} thread(s) per process"
    )
    say(
        f"training: {args.steps} steps of {args.batch_size} x {args.seq_len} characters, "
        f"lr {args.lr:g}"
    )

    log_every = args.log_every or max(1, args.steps // 10)
    generator = torch.Generator().manual_seed(args.seed + 1)  # same batches on every rank
    timing = Timing(stage=pipe.stage)
    losses: list[float] = []
    progress = Progress(args.steps, enabled=rank == 0)
    started = last_log = time.perf_counter()
    logged = 0
    for step in range(args.steps):
        inputs, targets = corpus.batch(corpus.train, args.batch_size, args.seq_len, generator)
        begun = time.perf_counter()
        # asyncpipe steps the optimizer: at the end of this step, or (2bw) one step late, when
        # it returns the loss of the previous mini-batch (NaN on the first step).
        loss = pipe.step(
            inputs if pipe.is_first_stage else None,
            targets if pipe.is_last_stage else None,
            lm_loss,
            optimizer=optimizer,
        )
        if not (args.schedule == "2bw" and step == 0):  # 2bw's first update comes one step late
            scheduler.step()
        finished = time.perf_counter()
        if args.schedule == "2bw" and step == 0:
            loss = math.nan
        progress.update(step + 1, loss, finished - begun)
        if not math.isnan(loss):
            losses.append(loss)
        report = pipe.last_step
        if step > 0 and report is not None:  # the first step pays for warm-up
            timing.steps += 1
            timing.wall += finished - begun
            timing.pipe += report.seconds
            timing.busy += report.busy_seconds
        if (step + 1) % log_every == 0 or step in (0, args.steps - 1):
            rate = (step + 1 - logged) * tokens_per_step / max(finished - last_log, 1e-9)
            progress.clear()
            say(
                f"step {step + 1:5d}/{args.steps}  loss {loss:.4f}  "
                f"{rate:9,.0f} tokens/s  lr {scheduler.get_last_lr()[0]:.2e}",
                flush=True,
            )
            last_log, logged = finished, step + 1
    if args.schedule == "2bw":
        losses.append(pipe.flush())  # the last mini-batch: its backwards and its update
    total = time.perf_counter() - started
    if rank == 0 and args.loss_log is not None:
        args.loss_log.write_text("".join(f"{n + 1} {v:.6f}\n" for n, v in enumerate(losses)))

    timings: list[Timing | None] = [None] * world
    dist.all_gather_object(timings, timing)
    say(
        f"\ndone: {args.steps} steps in {total:.1f} s, loss {losses[0]:.4f} -> {losses[-1]:.4f} "
        f"(mean of the last {min(10, len(losses))}: "
        f"{sum(losses[-10:]) / len(losses[-10:]):.4f})"
    )
    if timing.steps:
        say(
            f"average step (excluding the first): {timing.wall / timing.steps * 1000:.1f} ms "
            f"on rank 0, {tokens_per_step * timing.steps / timing.wall:,.0f} tokens/s"
        )
        say("stage  layers  params    step ms  busy ms  idle")
        for t in timings:
            assert t is not None
            say(
                f"{t.stage:5d}  {balance[t.stage]:6d}  {stage_params[t.stage]:7,d}  "
                f"{t.pipe / t.steps * 1000:8.1f}  {t.busy / t.steps * 1000:7.1f}  "
                f"{1 - t.busy / t.pipe if t.pipe > 0 else 0.0:5.1%}"
            )
        cores = len(os.sched_getaffinity(0))
        if world * threads > cores:
            say(
                f"note: {world} processes x {threads} thread(s) share {cores} CPU core(s), so "
                f"part of each stage's idle time is spent waiting for a core"
            )
    else:
        say("(run more than one step to see step timings)")

    pipe.eval()
    valid_loss = evaluate(pipe, corpus, args)
    say(f"validation loss: {valid_loss:.4f}")
    if args.sample_chars > 0:
        sample = generate(pipe, corpus, args)
        say(f"sample (prompt: {args.seq_len} characters of validation text):\n---\n{sample}\n---")

    pipe.close()  # rank 0 writes the last step, the timeline and the Chrome trace
    if pipe.trace_directory is not None:
        where = pipe.trace_directory
        say(
            f"trace: {where} (tensorboard --logdir {where}; python -m asyncpipe.trace {where}; "
            f"Chrome trace {where / 'trace.json'})"
        )
    asyncpipe.shutdown()  # meets every rank, then ends the process group (docs: reliability)


if __name__ == "__main__":
    main()
