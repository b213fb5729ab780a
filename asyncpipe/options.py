"""Checks of AsyncPipe's keyword options (transport, timeout, precision, data parallelism,
tracing, device), with those that ``schedule="2bw"`` cannot run with."""

from __future__ import annotations

import math
import os

import torch
import torch.distributed as dist

from .precision import DTYPES
from .trace import TraceWriter
from .transport import Transport

__all__: list[str] = []

IN_ORDER = (
    "schedule '2bw' posts receives ahead of their turn, which a transport that matches "
    "messages in posting order (p2p over NCCL) cannot take; pass transport='rpc' or use the "
    "gloo backend"
)
"""Why 2BW refuses a transport that matches messages in posting order."""


def _two_bw_problems(
    transport: object,
    balance: object,
    chunks: object,
    lookahead: object,
    data_parallel_size: object,
    shared_weights: object,
    autocast: object,
) -> list[str]:
    """Every option that ``schedule="2bw"`` cannot run with."""
    problems = []
    ranks = len(balance) if isinstance(balance, (list, tuple)) else 0
    if ranks and isinstance(chunks, int) and isinstance(lookahead, int) and lookahead > 0:
        need = lookahead * (ranks - 1)
        if chunks < need:
            rule = "stages - 1" if lookahead == 1 else f"lookahead * (stages - 1) = {need}"
            problems.append(
                f"schedule '2bw' needs chunks >= {rule} so that a rank holds at most two weight "
                f"versions (stages: {ranks}, chunks: {chunks}); pass chunks={max(need, 1)}"
                + (" or a smaller lookahead" if lookahead > 1 else "")
            )
    if isinstance(data_parallel_size, int) and data_parallel_size > 1:
        problems.append("schedule '2bw' runs one pipeline; pass data_parallel_size=1")
    if shared_weights:
        problems.append("schedule '2bw' does not tie weights across stages; pass no shared_weights")
    if autocast is torch.float16:
        problems.append(
            "schedule '2bw' has no float16 loss scaling; pass autocast=torch.bfloat16 or None"
        )
    if transport == "p2p" and dist.is_initialized() and dist.get_backend() == "nccl":
        problems.append(IN_ORDER)
    return problems


def rpc_running() -> bool:
    """Whether ``torch.distributed.rpc`` is set up in this process."""
    from torch.distributed import rpc

    try:
        rpc.get_worker_info()
    except RuntimeError:
        return False
    return True


def _device(device: object) -> list[str]:
    """What is wrong with ``device`` (None: the default)."""
    if device is None:
        return []
    try:
        where = torch.device(device)  # type: ignore[call-overload]
    except (RuntimeError, TypeError) as e:
        return [f"device must be a torch.device or its name, e.g. 'cuda:0' ({e})"]
    if where.type == "cpu":
        return []
    if where.type != "cuda":
        return [
            f"device {str(where)!r} is not supported: a stage computes on 'cpu' or on a "
            f"CUDA device ('cuda', 'cuda:0', ...); leave device out for the default"
        ]
    if not torch.cuda.is_available():
        return [
            f"device {str(where)!r} is a CUDA device, but this process sees no GPU (torch "
            f"{torch.__version__}); leave device out, or pass device='cpu'"
        ]
    if where.index is not None and where.index >= torch.cuda.device_count():
        return [
            f"device {str(where)!r} does not exist: this process sees "
            f"{torch.cuda.device_count()} GPU(s); pass one of cuda:0 to "
            f"cuda:{torch.cuda.device_count() - 1}"
        ]
    return []


def _positive_finite(value: object) -> bool:
    """Whether ``value`` is a positive, finite int or float (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return math.isfinite(value) and value > 0


def _trace_directory(path: str) -> list[str]:
    """What keeps the trace from being written into ``path`` (nothing is created here)."""
    if not path:
        return ["trace must name a directory (got ''); pass e.g. trace='runs/exp1'"]
    if os.path.exists(path) and not os.path.isdir(path):
        return [f"trace must be a directory, but {path!r} is a file; pass another path"]
    parent = os.path.abspath(path)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return [
            f"trace directory {path!r} cannot be created: {parent!r} is a file; pass another path"
        ]
    if not os.access(parent, os.W_OK | os.X_OK):
        return [f"trace directory {path!r} cannot be written: {parent!r} is not writable"]
    return []


def _processes(balance: object, virtual_stages: object) -> str:
    """The number of processes ``balance`` asks for, for an error's hint ("N" if unclear)."""
    if isinstance(balance, (list, tuple)) and balance and isinstance(virtual_stages, int):
        return str(max(1, len(balance) // max(1, virtual_stages)))
    return "N"


def option_problems(
    *,
    transport: object,
    balance: object,
    virtual_stages: object,
    timeout: object,
    autocast: object,
    loss_scale: object,
    data_parallel_size: object,
    shared_weights: bool,
    trace: object,
    trace_every: object,
    device: object = None,
    reduce_activations: object = False,
    schedule: object = "gpipe",
    chunks: object = 1,
    lookahead: object = 1,
) -> list[str]:
    """Every problem with AsyncPipe's keyword options (for
    :func:`~asyncpipe.arguments.check_arguments`), with those ``schedule="2bw"`` cannot run
    with."""
    problems = _device(device)
    if reduce_activations and autocast is None:
        problems.append(
            "reduce_activations sends float32 activations in the autocast dtype; pass "
            "autocast=torch.bfloat16 (or float16) with it"
        )
    if autocast is not None and autocast not in DTYPES:
        problems.append(
            f"autocast must be None, torch.bfloat16 or torch.float16 (got {autocast!r})"
        )
    if not (isinstance(data_parallel_size, int) and data_parallel_size >= 1):
        problems.append(
            f"data_parallel_size must be a positive integer (got {data_parallel_size!r})"
        )
    elif data_parallel_size > 1 and shared_weights:
        problems.append(
            "shared_weights with data_parallel_size > 1 is not supported yet; tie the "
            "weights on one stage, or run one pipeline"
        )
    elif data_parallel_size > 1 and not isinstance(transport, str):
        problems.append(
            "data_parallel_size > 1 builds its own process groups; pass transport='p2p', "
            "'shm' or 'rpc', not a Transport object"
        )
    if not _positive_finite(loss_scale):
        problems.append(f"loss_scale must be a positive, finite number (got {loss_scale!r})")
    if not _positive_finite(timeout):
        problems.append(
            f"timeout must be a positive, finite number of seconds (got {timeout!r}): every "
            f"wait fails after it, naming the peer it waited for; pass e.g. timeout=600"
        )
    if not (trace is None or isinstance(trace, (str, os.PathLike, TraceWriter))):
        problems.append(
            f"trace must be a directory or a TraceWriter (got {type(trace).__name__}); pass "
            f"e.g. trace='runs/exp1'"
        )
    elif isinstance(trace, (str, os.PathLike)):
        problems += _trace_directory(os.fspath(trace))
    if not (isinstance(trace_every, int) and trace_every > 0):
        problems.append(f"trace_every must be a positive number of steps (got {trace_every!r})")
    if isinstance(transport, str):
        if transport not in ("p2p", "shm", "rpc"):
            problems.append(
                f"transport must be 'p2p', 'shm', 'rpc' or a Transport object (got {transport!r})"
            )
        elif not dist.is_initialized():
            problems.append(
                f"the {transport} transport needs torch.distributed: call asyncpipe.init("
                f"{'rpc=True' if transport == 'rpc' else ''}) first and launch with "
                f"torchrun, e.g. torchrun --standalone "
                f"--nproc-per-node={_processes(balance, virtual_stages)} train.py"
            )
        elif transport == "rpc" and not rpc_running():
            problems.append(
                "the rpc transport needs torch.distributed.rpc: call asyncpipe.init(rpc=True) first"
            )
    elif not isinstance(transport, Transport):
        problems.append(
            f"transport must be 'p2p', 'shm', 'rpc' or a Transport object (got "
            f"{type(transport).__name__})"
        )
    if schedule == "2bw":
        problems += _two_bw_problems(
            transport, balance, chunks, lookahead, data_parallel_size, shared_weights, autocast
        )
    return problems
