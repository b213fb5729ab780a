"""``AsyncPipe(balance="auto")``: one rank profiles the model, every rank takes its balance."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..failure import read_text, refusal, write_text
from ..group import collective_device
from ..lazy import LazyModule
from ..parallel import gather_codes, timed_wait
from ..transport import Transport

__all__: list[str] = []


def auto_balance(
    balance: str,
    module: object,
    sample: Tensor | tuple[Tensor, ...] | None,
    transport: object,
    virtual_stages: int,
    data_parallel_size: int = 1,
    timeout: object = 300.0,
) -> list[int]:
    """The balance ``by_time`` finds on rank 0 of the default process group, on every rank:
    one entry per pipeline rank (the world's ranks over ``data_parallel_size`` replicas) times
    ``virtual_stages``.

    Raises ValueError (listing every problem) when it cannot: another string than "auto", no
    sample, LazyModules, or no torch.distributed to share one answer. Every rank first tells
    the others whether it can take part (one small collective): where some rank cannot, that
    rank raises its ValueError and the others a StageFailure naming it, at once, instead of
    waiting for it until ``timeout``. Each wait for the others (that check, then rank 0's
    answer, which includes its profiling) lasts ``timeout`` seconds at most.
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
        raise ValueError("; ".join(problems))
    seconds = float(timeout) if isinstance(timeout, (int, float)) and timeout > 0 else 300.0
    codes = gather_codes(
        int(bool(problems)),
        seconds,
        "the other ranks to reach balance='auto' in AsyncPipe's constructor: is AsyncPipe "
        "built with balance='auto' on every rank?",
    )
    refused = [rank for rank, code in enumerate(codes) if code]
    if problems:
        raise ValueError("; ".join(problems))
    if refused:
        raise refusal("balance='auto' cannot run", refused, dist.get_rank(), "arguments to it")
    assert sample is not None
    if isinstance(transport, Transport):
        world = transport.world_size
    else:
        world = max(dist.get_world_size() // max(int(data_parallel_size), 1), 1)
    answer: list[int] | str = ""
    if dist.get_rank() == 0:
        from . import by_time

        try:
            answer = by_time(layers, sample, world * virtual_stages)
        except Exception as e:  # every rank must learn of it, not only rank 0
            answer = f"{type(e).__name__}: {e}"
    answer = _share(answer, seconds)
    if isinstance(answer, str):
        raise ValueError(f"balance='auto' failed on rank 0: {answer}")
    return answer


_WORDS = 1024
"""int64 words of rank 0's answer as it travels: its kind, its length, then the balance's
entries or an error's text (longer text is cut)."""


def _share(answer: list[int] | str, seconds: float) -> list[int] | str:
    """Rank 0's ``answer`` (a balance, or the text of its error) on every rank."""
    words = torch.zeros(_WORDS, dtype=torch.int64)
    if dist.get_rank() == 0:
        if isinstance(answer, str):
            words[0] = 1
            write_text(words[1:], answer)
        else:
            words[0], words[1] = 0, len(answer)
            words[2 : 2 + len(answer)] = torch.tensor(answer, dtype=torch.int64)
    words = words.to(collective_device())
    timed_wait(
        dist.broadcast(words, src=0, async_op=True),
        seconds,
        "rank 0's balance (balance='auto' times every layer there, within the pipeline's "
        "timeout: raise timeout= if that takes longer)",
    )
    words = words.cpu()
    if int(words[0]) == 1:
        return read_text(words[1:])
    return [int(v) for v in words[2 : 2 + int(words[1])]]


def _p2p(transport: Transport) -> bool:
    from ..transport import GroupTransport

    return isinstance(transport, GroupTransport)
