"""The stage side of single-controller mode: each process's stage, found by remote calls.

The driver on rank 0 calls these functions on every worker with ``torch.distributed.rpc``.
A remote call runs a module-level function, so each process keeps its stages by pipeline name
in :class:`Stages`, the one piece of process-wide state of this mode::

    driver (rank 0)                          worker r
    RemotePipe.step(x, y, loss) ──rpc──> run(name, _step, ...) -> Stages.get(name).step(...)
                                  <──── ("ok", loss) | ("error", what failed, where)
"""

from __future__ import annotations

import threading
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..failure import StageFailure
from ..pipe import AsyncPipe
from ..transport.rpc import RPCTransport

__all__: list[str] = []


class Stages:
    """The AsyncPipe of each driver-built pipeline in this process, by name."""

    _pipes: dict[str, AsyncPipe] = {}
    _optimizers: dict[str, torch.optim.Optimizer] = {}
    _lock = threading.Lock()

    @classmethod
    def add(cls, name: str, pipe: AsyncPipe, optimizer: torch.optim.Optimizer | None) -> None:
        with cls._lock:
            cls._pipes[name] = pipe
            if optimizer is not None:
                cls._optimizers[name] = optimizer

    @classmethod
    def get(cls, name: str) -> AsyncPipe:
        with cls._lock:
            pipe = cls._pipes.get(name)
        if pipe is None:
            raise RuntimeError(f"this process has no stage of pipeline {name!r}")
        return pipe

    @classmethod
    def optimizer(cls, name: str) -> torch.optim.Optimizer:
        with cls._lock:
            optimizer = cls._optimizers.get(name)
        if optimizer is None:
            raise RuntimeError(
                f"pipeline {name!r} has no optimizer: pass RemotePipe an optimizer factory "
                f"that takes the parameters, picklable (it is sent to the workers: not a "
                f"lambda), e.g. optimizer=functools.partial(torch.optim.SGD, lr=0.1)"
            )
        return optimizer

    @classmethod
    def remove(cls, name: str) -> None:
        with cls._lock:
            pipe = cls._pipes.pop(name, None)
            cls._optimizers.pop(name, None)
        if pipe is not None:
            pipe.transport.close()


Outcome = tuple[Any, ...]
"""``("ok", value)`` or ``("error", text, rank, stage, microbatch, action)``."""


def run(name: str, fn: Callable[..., Any], args: tuple[Any, ...]) -> Outcome:
    """Run ``fn(pipe, *args)`` on this process's stage of pipeline ``name``."""
    try:
        return ("ok", fn(Stages.get(name), *args))
    except StageFailure as e:
        return ("error", str(e), e.rank, e.stage, e.microbatch, e.action)
    except BaseException as e:  # the function itself (foreach_worker's, an optimizer's) raised
        # (a SystemExit too: RPC would pass on its bare text without the stage or function)
        rank = Stages.get(name).stage if name in Stages._pipes else -1
        what = getattr(fn, "__name__", repr(fn))
        text = f"stage {rank} (rank {rank}) raised in {what}: {type(e).__name__}: {e}"
        return ("error", f"{text}\n{traceback.format_exc()}", rank, rank, -1, what)


def build(
    name: str,
    module: Any,
    balance: list[int],
    kwargs: dict[str, Any],
    optimizer: Callable[..., torch.optim.Optimizer] | None,
    worker_map: dict[int, str],
) -> Outcome:
    """Build this process's stage of pipeline ``name`` (called by the driver)."""
    try:
        transport = RPCTransport(worker_map, name=name)
        pipe = AsyncPipe(module, balance, transport=transport, **kwargs)
        made = optimizer(pipe.parameters()) if optimizer is not None else None
        Stages.add(name, pipe, made)
        return ("ok", pipe.stage)
    except StageFailure as e:  # another rank's stage failed (its own outcome names it)
        return ("error", f"{type(e).__name__}: {e}", e.rank, e.stage, -1, "constructor")
    except Exception as e:  # this rank's own
        me = dist.get_rank() if dist.is_initialized() else -1
        return ("error", f"{type(e).__name__}: {e}", me, me, -1, "constructor")


class Serving:
    """Set by the driver's shutdown: tells :func:`serve` on this worker to return."""

    released = threading.Event()


def release() -> None:
    Serving.released.set()


def alive() -> bool:
    return True


def drop(name: str) -> Outcome:
    Stages.remove(name)
    return ("ok", None)


# ----- what the driver runs on every stage ----------------------------------------------------


def step(pipe: AsyncPipe, input: Any, target: Any, loss_fn: Any) -> float:
    return pipe.step(input, target, loss_fn)


def no_loss(output: Any, target: Any) -> Any:
    """The loss function of every stage but the last: only the last computes the loss, and
    the driver sends the user's function there alone (where it is the driver's own stage, a
    lambda never has to be pickled); ``AsyncPipe.step`` wants a callable on every rank."""
    raise RuntimeError("only the last stage computes the loss (the driver sent it loss_fn)")


def close(pipe: AsyncPipe) -> None:
    pipe.close()


def forward(pipe: AsyncPipe, input: Any) -> Any:
    with torch.no_grad():
        out = pipe(input)
    return out if pipe.is_last_stage else None


def optimizer_step(pipe: AsyncPipe, name: str) -> None:
    Stages.optimizer(name).step()


def zero_grad(pipe: AsyncPipe, name: str) -> None:
    optimizer = Stages._optimizers.get(name)
    if optimizer is not None:
        optimizer.zero_grad()
    else:
        pipe.zero_grad()


def set_mode(pipe: AsyncPipe, training: bool) -> None:
    pipe.train(training)


def local_state(pipe: AsyncPipe) -> dict[str, torch.Tensor]:
    """This stage's state with the plain model's keys (``AsyncPipe.state_dict``), on the CPU."""
    return {k: v.detach().cpu() for k, v in pipe.state_dict().items()}
