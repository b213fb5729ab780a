"""``AsyncPipe(balance="auto")``: one rank profiles the model, every rank takes its balance."""

from __future__ import annotations

import torch.distributed as dist
from torch import Tensor, nn

from ..lazy import LazyModule
from ..transport import Transport

__all__: list[str] = []


def auto_balance(
    balance: str,
    module: object,
    sample: Tensor | tuple[Tensor, ...] | None,
    transport: object,
    virtual_stages: int,
    data_parallel_size: int = 1,
) -> list[int]:
    """The balance ``by_time`` finds on rank 0 of the default process group, on every rank:
    one entry per pipeline rank (the world's ranks over ``data_parallel_size`` replicas) times
    ``virtual_stages``.

    Raises ValueError (listing every problem) when it cannot: another string than "auto", no
    sample, LazyModules, or no torch.distributed to share one answer.
    """
    problems = []
    if balance != "auto":
        problems.append(f"balance must be a list of ints or 'auto' (got {balance!r})")
    if sample is None:
        problems.append(
            "balance='auto' profiles the model on a sample: pass sample=<one micro-batch of input>"
        )
    layers = list(module) if isinstance(module, (nn.Sequential, list, tuple)) else []
    if any(isinstance(layer, LazyModule) for layer in layers):
        problems.append("balance='auto' runs every layer, so it cannot take LazyModules")
    if not layers:
        problems.append("balance='auto' needs an nn.Sequential or a list of layers")
    if not dist.is_initialized() or (isinstance(transport, Transport) and not _p2p(transport)):
        problems.append(
            "balance='auto' shares rank 0's answer over torch.distributed; with a transport "
            "that is not built on the process group (in-process), call "
            "asyncpipe.balance.by_time once and pass the list to every rank"
        )
    if problems:
        raise ValueError("; ".join(problems))
    assert sample is not None
    if isinstance(transport, Transport):
        world = transport.world_size
    else:
        world = max(dist.get_world_size() // max(int(data_parallel_size), 1), 1)
    answer: list[object] = [None]
    if dist.get_rank() == 0:
        from . import by_time

        try:
            answer[0] = by_time(layers, sample, world * virtual_stages)
        except Exception as e:  # every rank must learn of it, not only rank 0
            answer[0] = f"{type(e).__name__}: {e}"
    dist.broadcast_object_list(answer, src=0)
    if isinstance(answer[0], str):
        raise ValueError(f"balance='auto' failed on rank 0: {answer[0]}")
    found: list[int] = list(answer[0])  # type: ignore[call-overload]
    return found


def _p2p(transport: Transport) -> bool:
    from ..transport import GroupTransport

    return isinstance(transport, GroupTransport)
