"""fairscale's pipelines as benchmark peers: ``AsyncPipe`` over RPC and the single-process ``Pipe``.

fairscale is not a dependency of asyncpipe: where it is missing or does not run on this
PyTorch, building a peer raises, and the benchmark reports the error text in place of a time.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .worker import StepFn, _loss

__all__ = ["FAIRSCALE", "fairscale_asyncpipe_step", "fairscale_pipe_step", "fairscale_version"]

FAIRSCALE = {
    "fairscale-asyncpipe": "fairscale AsyncPipe (RPC, fill-drain)",
    "fairscale-pipe": "fairscale Pipe (one process)",
}
"""fairscale's systems and how they show in the tables."""


def fairscale_version() -> str:
    """fairscale's version, or why it cannot be imported."""
    try:
        import fairscale  # type: ignore[import-not-found]
    except Exception as exc:  # ImportError, or a broken install on this torch
        return f"not available ({type(exc).__name__}: {exc})"
    return str(getattr(fairscale, "__version__", "?"))


def fairscale_asyncpipe_step(
    model: nn.Sequential, balance: list[int], chunks: int, x: torch.Tensor, y: torch.Tensor
) -> StepFn:
    """fairscale's ``AsyncPipe`` on every rank of the default group, RPC workers named
    ``worker<rank>`` (asyncpipe's names: call ``asyncpipe.init(rpc=True)`` first), fill-drain,
    no checkpointing."""
    from fairscale.nn.model_parallel.initialize import (  # type: ignore[import-not-found]
        initialize_model_parallel,
        model_parallel_is_initialized,
    )
    from fairscale.nn.pipe import AsyncPipe  # type: ignore[import-not-found]

    world = dist.get_world_size()
    if not model_parallel_is_initialized():
        initialize_model_parallel(1, world)
    pipe = AsyncPipe(
        model,
        balance,
        worker_map={r: f"worker{r}" for r in range(world)},
        chunks=chunks,
        checkpoint="never",
    )

    def step() -> dict[str, Any]:
        out = pipe(x)
        if pipe.final_stage:
            _loss(out, y).backward()
        else:
            pipe.back_helper(out)
        return {}

    return step


def fairscale_pipe_step(
    model: nn.Sequential,
    balance: list[int],
    chunks: int,
    x: torch.Tensor,
    y: torch.Tensor,
    device: torch.device,
) -> StepFn:
    """fairscale's single-process ``Pipe``, every partition on ``device``, no checkpointing.

    fairscale's ``Pipe`` runs one worker thread per device, so with every partition on one
    device the partitions take turns: this is the one-process baseline, not a pipeline.
    """
    from fairscale.nn import Pipe

    pipe = Pipe(model, balance, devices=[device] * len(balance), chunks=chunks, checkpoint="never")

    def step() -> dict[str, Any]:
        _loss(pipe(x), y).backward()
        return {}

    return step
