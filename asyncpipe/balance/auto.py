"""``AsyncPipe(balance="auto")``: one rank profiles the model, every rank takes its balance.

The ranks that decide together are those of the pipeline's process group: the world for a
transport given by name (all data-parallel replicas included, as they must agree), else the
group a :class:`~asyncpipe.transport.GroupTransport` (p2p, shm) was built on, so pipelines on
separate process groups each profile their own model, on their own first rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..arguments import positive_int
from ..failure import read_text, refusal, write_text
from ..lazy import LazyModule
from ..options import option_problems
from ..parallel import _REFUSED as REFUSED
from ..parallel import AUTO, timed_wait
from ..transport import GroupTransport, Transport

__all__: list[str] = []


def auto_balance(
    balance: str,
    module: object,
    sample: Tensor | tuple[Tensor, ...] | None,
    transport: object,
    virtual_stages: object,
    data_parallel_size: object = 1,
    timeout: object = 300.0,
) -> list[int]:
    """The balance ``by_time`` finds on the first rank of the pipeline's process group (rank 0
    of the world for a transport given by name), on every rank of that group: one entry per
    pipeline rank (the world's ranks over ``data_parallel_size`` replicas, or the transport's
    ranks) times ``virtual_stages``.

    Raises ValueError (listing every problem) when it cannot: another string than "auto", no
    sample, LazyModules, options that AsyncPipe would refuse (``virtual_stages``,
    ``data_parallel_size``, ``timeout``, ``transport``, with AsyncPipe's words), or no
    torch.distributed to share one answer. Every rank first tells the others whether it can
    take part (one small collective): where some rank cannot, that rank raises its ValueError
    and the others a StageFailure naming it, at once, instead of waiting for it until
    ``timeout``. A rank given a list as its balance meets that collective in its own first one
    (the transport check, for a transport given by name), so both sides raise a ValueError
    naming the ranks that pass "auto" and those that do not, at once. Each wait for the
    others (that check, then the first rank's answer, which includes its profiling) lasts
    ``timeout`` seconds at most.
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
    if not positive_int(virtual_stages):  # as check_arguments says it
        problems.append(f"virtual_stages must be a positive int (got {virtual_stages!r})")
    problems += option_problems(  # those of the options that balance='auto' uses
        transport=transport,
        balance=None,
        virtual_stages=virtual_stages,
        timeout=timeout,
        autocast=None,
        loss_scale=1.0,
        data_parallel_size=data_parallel_size,
        shared_weights=False,
        trace=None,
        trace_every=1,
        device=None,
    )
    shared = dist.is_initialized() and (
        not isinstance(transport, Transport) or isinstance(transport, GroupTransport)
    )
    if not shared:
        if isinstance(transport, Transport) or dist.is_initialized():
            problems.append(
                "balance='auto' shares one rank's answer over torch.distributed; with a "
                "transport that is not built on the process group (in-process), call "
                "asyncpipe.balance.by_time once and pass the list to every rank"
            )
        raise ValueError("; ".join(problems))  # option_problems says to call asyncpipe.init()
    found = _pipeline_group(transport)
    if found is None:
        problems.append(
            f"balance='auto' shares one rank's answer over the pipeline's process group, but "
            f"{type(transport).__name__} does not say its group (a 'group' property); call "
            f"asyncpipe.balance.by_time once and pass the list to every rank"
        )
        raise ValueError("; ".join(problems))
    group, ranks = found
    seconds = float(timeout) if isinstance(timeout, (int, float)) and timeout > 0 else 300.0
    codes = _gather(
        REFUSED if problems else AUTO,
        group,
        len(ranks),
        seconds,
        "the other ranks to reach balance='auto' in AsyncPipe's constructor: is AsyncPipe "
        "built with balance='auto' on every rank?",
    )
    auto = [ranks[n] for n, code in enumerate(codes) if code == AUTO]
    refused = [ranks[n] for n, code in enumerate(codes) if code == REFUSED]
    listed = [r for r in ranks if r not in auto and r not in refused]  # in the transport check
    if problems:
        raise ValueError("; ".join(problems))
    if listed:
        raise ValueError(mixed_balance(auto, listed))
    if refused:
        raise refusal("balance='auto' cannot run", refused, dist.get_rank(), "arguments to it")
    assert sample is not None and isinstance(virtual_stages, int)
    assert isinstance(data_parallel_size, int)
    if isinstance(transport, Transport):
        world = transport.world_size
    else:  # the pipeline ranks of each replica
        world = max(dist.get_world_size() // data_parallel_size, 1)
    answer: list[int] | str = ""
    if dist.get_rank() == ranks[0]:
        from . import by_time

        try:
            answer = by_time(layers, sample, world * virtual_stages)
        except Exception as e:  # every rank must learn of it, not only the first
            answer = f"{type(e).__name__}: {e}"
    answer = _share(answer, group, ranks[0], seconds)
    if isinstance(answer, str):
        raise ValueError(f"balance='auto' failed on rank {ranks[0]}: {answer}")
    return answer


def mixed_balance(auto: list[int], listed: list[int]) -> str:
    """The error of every rank when ranks ``auto`` build AsyncPipe with ``balance='auto'`` and
    ranks ``listed`` with a list (they would wait for each other until the timeout)."""

    def ranks(found: list[int]) -> str:
        return f"rank{'s' if len(found) > 1 else ''} {', '.join(map(str, found))}"

    return (
        f"every rank must build AsyncPipe with the same balance, but {ranks(auto)} "
        f"{'pass' if len(auto) > 1 else 'passes'} balance='auto' and {ranks(listed)} a list; "
        f"pass balance='auto' (with sample=) on every rank, or the same list on every rank"
    )


def _pipeline_group(transport: object) -> tuple[dist.ProcessGroup | None, list[int]] | None:
    """The process group that decides the balance (None: the world) and its ranks in the
    world, in order; None for a GroupTransport that does not say its group."""
    if not isinstance(transport, GroupTransport):
        return None, list(range(dist.get_world_size()))
    ranks = [transport.global_rank(r) for r in range(transport.world_size)]
    group = getattr(transport, "group", None)  # p2p's and shm's process group
    if isinstance(group, dist.ProcessGroup):
        return group, ranks
    return (None, ranks) if ranks == list(range(dist.get_world_size())) else None


def _device(group: dist.ProcessGroup | None) -> torch.device:
    """Where ``group``'s collectives take their tensors: the current CUDA device over NCCL,
    else host memory."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _gather(
    code: int, group: dist.ProcessGroup | None, size: int, seconds: float, what: str
) -> list[int]:
    """Every rank's ``code`` in ``group`` (index: its rank there), in one all_gather that waits
    ``seconds`` at most. Over the world it is the collective that
    :func:`asyncpipe.parallel.same_transport` runs, so a rank given a list meets it there."""
    mine = torch.tensor([code], dtype=torch.int64, device=_device(group))
    everyone = [torch.zeros_like(mine) for _ in range(size)]
    timed_wait(dist.all_gather(everyone, mine, group=group, async_op=True), seconds, what)
    return [int(t.item()) for t in everyone]


_WORDS = 1024
"""int64 words of the first rank's answer as it travels: its kind, its length, then the
balance's entries or an error's text (longer text is cut)."""


def _share(
    answer: list[int] | str, group: dist.ProcessGroup | None, source: int, seconds: float
) -> list[int] | str:
    """Rank ``source``'s ``answer`` (a balance, or the text of its error) on every rank of
    ``group``."""
    words = torch.zeros(_WORDS, dtype=torch.int64)
    if dist.get_rank() == source:
        if isinstance(answer, str):
            words[0] = 1
            write_text(words[1:], answer)
        else:
            words[0], words[1] = 0, len(answer)
            words[2 : 2 + len(answer)] = torch.tensor(answer, dtype=torch.int64)
    words = words.to(_device(group))
    timed_wait(
        dist.broadcast(words, src=source, group=group, async_op=True),
        seconds,
        f"rank {source}'s balance (balance='auto' times every layer there, within the "
        f"pipeline's timeout: raise timeout= if that takes longer)",
    )
    words = words.cpu()
    if int(words[0]) == 1:
        return read_text(words[1:])
    return [int(v) for v in words[2 : 2 + int(words[1])]]
