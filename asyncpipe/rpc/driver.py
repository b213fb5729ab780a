"""Single-controller mode: the training loop on rank 0, the stages serving it over RPC."""

from __future__ import annotations

import contextlib
import itertools
import re
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.rpc as torch_rpc
from torch import Tensor, nn

from ..failure import StageFailure
from ..lazy import LazyModule
from ..transport.rpc import error_line, worker_names
from . import stage as remote
from .checks import check_batch, check_remote, sendable

__all__: list[str] = []

_names = itertools.count()


class RemotePipe:
    """Drive a whole pipeline from rank 0: each rank holds one stage, rank 0 also the loop.

    Every process calls ``asyncpipe.init(rpc=True)``; rank 0 builds a ``RemotePipe`` and the
    other ranks call :func:`asyncpipe.rpc.serve`, which returns when the driver calls
    :meth:`shutdown`. Stages talk to each other over the RPC transport; the driver sends the
    input to the first stage and the target and loss function to the last.

    Args:
        module: an ``nn.Sequential`` or a list of modules / ``LazyModule`` (sent to every
            worker, so a LazyModule's function must be picklable: a module-level function or a
            ``functools.partial``, not a lambda; the driver checks every layer before it
            sends anything and names the positions that are not).
        balance: layers per stage, a list of positive ints with one entry per process (per
            model chunk with ``virtual_stages``). ``"auto"`` is refused: the stages of a
            ``RemotePipe`` do not share a profile over the process group, so find a balance
            on the driver, which holds the model, with :func:`asyncpipe.balance.by_time`.
        worker_map: the RPC worker name of each rank (default: the names RPC was started
            with, ``asyncpipe.init(rpc=True, worker_map=...)``'s, by default
            ``"worker{rank}"``).
        optimizer: a picklable factory ``params -> Optimizer`` (e.g.
            ``functools.partial(torch.optim.SGD, lr=0.1)``) built on every stage.
        **kwargs: what ``AsyncPipe`` takes besides ``transport`` (chunks, checkpoint,
            schedule, ...), picklable, but ``schedule="2bw"``, whose updates need each
            stage's optimizer inside the step, ``data_parallel_size``, and
            ``shared_weights`` whose parameters are on several stages (their gradients are
            summed with collectives of the process group, which RemotePipe's stages do not
            use; a group on one stage is kept equal there); run ``AsyncPipe`` on every rank
            for any of these.

    Raises:
        RuntimeError: on any rank but 0, or when RPC is not running.
        TypeError: ``balance`` not a list of ints, or a layer, keyword argument or the
            optimizer factory that cannot be pickled.
        ValueError: ``transport``, ``schedule="2bw"``, ``data_parallel_size``, a string or
            bad entries in ``balance``, or shared weights across stages given (every
            problem at once, before anything is sent; a ``TypeError`` when all are type
            problems); or a stage that failed to build on its worker.

    Example:
        >>> asyncpipe.init(rpc=True)                                   # doctest: +SKIP
        >>> if dist.get_rank() == 0:                                   # doctest: +SKIP
        ...     pipe = RemotePipe(model, [2, 2], chunks=4,
        ...                       optimizer=functools.partial(torch.optim.SGD, lr=0.1))
        ...     for x, y in data:
        ...         pipe.zero_grad()
        ...         loss = pipe.step(x, y, torch.nn.functional.cross_entropy)
        ...         pipe.optimizer_step()
        ...     pipe.shutdown()
        ... else:
        ...     asyncpipe.rpc.serve()
    """

    def __init__(
        self,
        module: nn.Sequential | Sequence[nn.Module | LazyModule],
        balance: Sequence[int],
        *,
        optimizer: Callable[..., torch.optim.Optimizer] | None = None,
        worker_map: dict[int, str] | None = None,
        **kwargs: Any,
    ) -> None:
        try:
            me = torch_rpc.get_worker_info()
        except RuntimeError as e:
            raise RuntimeError(
                "RemotePipe needs torch.distributed.rpc: call asyncpipe.init(rpc=True) on every "
                "process first"
            ) from e
        if me.id != 0:
            raise RuntimeError(
                f"RemotePipe is the controller and is built on rank 0 only (this is rank "
                f"{me.id}); the other ranks call asyncpipe.rpc.serve()"
            )
        world = dist.get_world_size()
        check_remote(module, balance, kwargs, optimizer, world)
        known = worker_names() if worker_map is None else worker_map
        self.workers = {r: known.get(r, f"worker{r}") for r in range(world)}
        if self.workers[0] != me.name:
            raise ValueError(
                f"worker_map names rank 0 {self.workers[0]!r} but this process is {me.name!r}; "
                f"pass the worker_map given to asyncpipe.init"
            )
        self.name = f"remote-pipe-{next(_names)}"
        self.balance = list(balance)
        futures = [
            torch_rpc.rpc_async(
                self.workers[r],
                remote.build,
                args=(self.name, module, self.balance, kwargs, optimizer, self.workers),
            )
            for r in range(1, world)
        ]
        local = remote.build(self.name, module, self.balance, kwargs, optimizer, self.workers)
        outcomes = [local]
        for r, future in enumerate(futures, start=1):
            try:
                outcomes.append(future.wait())
            except Exception as e:  # the worker is gone, or never served
                outcomes.append(("gone", f"{self.workers[r]} did not answer ({error_line(e)})"))
        failed = [(r, o) for r, o in enumerate(outcomes) if o[0] != "ok"]
        if failed:
            for r in range(world):
                with contextlib.suppress(Exception):  # a rank that is gone needs no cleaning
                    self._call_one(r, remote.drop)
            gone = [(r, o) for r, o in failed if o[0] == "gone"]
            if gone:  # the cause of the others' failures (their stage waited for it)
                listed = "; ".join(f"rank {r}: {o[1]}" for r, o in gone)
                raise RuntimeError(
                    f"building the stages failed: {listed}; every rank but the driver must "
                    f"call asyncpipe.rpc.serve() and stay in it until the driver shuts down "
                    f"(RemotePipe is built on rank 0 only)"
                )
            own = [(r, o) for r, o in failed if o[2] == r]  # not a peer's failure relayed
            rank, outcome = (own or failed)[0]
            raise ValueError(f"building the stage of rank {rank} failed: {outcome[1]}")
        self.pipe = remote.Stages.get(self.name)
        self.stages = world
        self._finished = self._closed = False

    # ----- calls on every stage ---------------------------------------------------------------

    def _call_one(self, rank: int, fn: Callable[..., Any], *args: Any) -> Any:
        if rank == 0:
            return fn(self.name, *args)
        return torch_rpc.rpc_sync(self.workers[rank], fn, args=(self.name, *args))

    def _each(
        self, fn: Callable[..., Any], per_rank: Callable[[int], tuple[Any, ...]]
    ) -> list[Any]:
        """``fn(stage, *per_rank(r))`` on every stage at once; raise the first failure."""
        if self._closed:
            raise RuntimeError("this RemotePipe was shut down")
        futures = {
            r: torch_rpc.rpc_async(self.workers[r], remote.run, args=(self.name, fn, per_rank(r)))
            for r in range(1, self.stages)
        }
        outcomes = [remote.run(self.name, fn, per_rank(0))]
        deadline: float | None = None
        for r in range(1, self.stages):
            if deadline is None and any(o[0] != "ok" for o in outcomes):
                # A stage failed: the others learn of it within the pipeline's timeout, so a
                # worker that has not answered by then is stuck in its own work (a layer that
                # never returns), and its answer is not waited for (RPC's timeout is longer).
                deadline = time.monotonic() + self.pipe.timeout
            if deadline is not None and not _done_by(futures[r], deadline):
                outcomes.append((
                    "error",
                    f"rank {r} ({self.workers[r]}) did not answer within {self.pipe.timeout:.1f} "
                    f"s (the pipeline's timeout) after a stage failed: it is stuck in its "
                    f"stage's work",
                    r, -1, -1, "",
                ))  # fmt: skip
                continue
            try:
                outcomes.append(futures[r].wait())
            except Exception as e:  # the worker itself went away
                outcomes.append(("error", _unanswered(r, self.workers[r], e), r, -1, -1, ""))
        errors = [o for o in outcomes if o[0] != "ok"]
        if errors:
            # The stage that failed first names itself; the others report having seen it. A
            # worker found stuck (it did not answer) comes before a stage's timeout waiting
            # for a neighbour, which may blame that neighbour, itself only waiting upstream.
            _, text, rank, stage, microbatch, action = min(errors, key=_first_cause)
            raise StageFailure(
                f"the pipeline failed: {text}",
                rank=rank,
                stage=stage,
                microbatch=microbatch,
                action=action,
            )
        return [o[1] for o in outcomes]

    def foreach_worker(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        """Run ``fn(stage_pipe, *args)`` on every stage (its local ``AsyncPipe``); return the
        results by rank. ``fn`` must be picklable (a module-level function).

        Example:
            >>> counts = pipe.foreach_worker(count_parameters)         # doctest: +SKIP
        """
        if self.stages > 1:
            sendable(fn, "the function of foreach_worker")
        return self._each(fn, lambda r: args)

    # ----- the training loop ------------------------------------------------------------------

    def step(self, input: object, target: object, loss_fn: Callable[..., Tensor]) -> float:
        """Forward and backward of one mini-batch on every stage; returns the mean loss.

        ``input`` and ``target`` follow ``AsyncPipe.step``'s rule (a tensor or a tuple of
        tensors, the target split into as many micro-batches as the input, or None): the
        driver checks them before it sends anything, so a refused batch leaves the pipeline
        usable. ``loss_fn`` is sent to
        the last stage alone, so it must be picklable where that stage is on another rank (a
        lambda is fine where it is the driver's own).

        Example:
            >>> loss = pipe.step(x, y, torch.nn.functional.mse_loss)      # doctest: +SKIP
        """
        first, last = self.pipe.first_rank, self.pipe.last_rank  # a reused layer may end it
        check_batch(input, target, self.pipe.chunks)
        if last > 0:
            sendable(loss_fn, "loss_fn")
        losses = self._each(
            remote.step,
            lambda r: (
                input if r == first else None,
                target if r == last else None,
                loss_fn if r == last else remote.no_loss,
            ),
        )
        return float(losses[0])

    def forward(self, input: object) -> Any:
        """Inference through the pipeline; returns the last stage's output on the driver.
        ``input`` is checked as :meth:`step` checks it, before anything is sent."""
        first = self.pipe.first_rank
        check_batch(input, None, self.pipe.chunks)
        outputs = self._each(remote.forward, lambda r: (input if r == first else None,))
        return outputs[self.pipe.last_rank]

    __call__ = forward

    def optimizer_step(self) -> None:
        """Run the optimizer of every stage."""
        self._each(remote.optimizer_step, lambda r: (self.name,))

    def zero_grad(self) -> None:
        """Zero the gradients of every stage."""
        self._each(remote.zero_grad, lambda r: (self.name,))

    def train(self, mode: bool = True) -> RemotePipe:
        """Put every stage in training (or evaluation) mode."""
        self._each(remote.set_mode, lambda r: (mode,))
        return self

    def eval(self) -> RemotePipe:
        """Put every stage in evaluation mode."""
        return self.train(False)

    def state_dict(self) -> dict[str, Tensor]:
        """The state of the whole model, gathered from every stage, with the plain model's
        keys (on the CPU)."""
        out: dict[str, Tensor] = {}
        for state in self._each(remote.local_state, lambda r: ()):
            out.update(state)
        return out

    def close(self) -> None:
        """Finish every stage after the last step, as ``AsyncPipe.close()`` does on each: with
        ``trace=DIR``, rank 0 writes the last step and renders the Chrome trace and the
        timelines. :meth:`shutdown` calls it if you did not; call it yourself to have a
        failure raised rather than warned about.

        Example:
            >>> pipe.close()                                               # doctest: +SKIP
            >>> pipe.shutdown()                                            # doctest: +SKIP
        """
        if self._closed or self._finished:
            return
        try:
            self._each(remote.close, lambda r: ())
        finally:
            self._finished = True

    def shutdown(self) -> None:
        """Finish the stages (:meth:`close`, if not done: a failure there is a warning), then
        release them and end RPC and the process group; :func:`serve` returns on the
        workers."""
        if self._closed:
            return
        try:
            self.close()
        except Exception as e:  # a worker that is gone, a trace that could not be written
            warnings.warn(f"closing the stages failed, shutting down anyway: {e}", stacklevel=2)
        self._closed = True
        gone = False
        for r in range(self.stages):
            try:
                self._call_one(r, remote.drop)
                if r:
                    torch_rpc.rpc_sync(self.workers[r], remote.release, args=())
            except Exception:  # a worker that is gone has nothing to release
                gone = True
        from ..group import end

        end(alone=gone)  # with a worker gone, nobody waits for it


_GONE = re.compile(r"\beof\b|closed|reset by peer|broken pipe|refused|shut ?down", re.IGNORECASE)
"""What RPC's errors say when the connection to a worker is gone."""


def _unanswered(rank: int, worker: str, error: Exception) -> str:
    """Why worker ``rank`` gave no answer to a call, from RPC's ``error``."""
    said = error_line(error)
    if _GONE.search(said):
        return (
            f"rank {rank} ({worker}) is gone: its process ended or its connection closed "
            f"(RPC: {said}); a worker must stay in asyncpipe.rpc.serve() until the driver shuts "
            f"down, and a pipeline that lost one cannot go on: start it again (from a "
            f"checkpoint, if you saved one)"
        )
    return f"rank {rank} ({worker}) did not answer: {type(error).__name__}: {said}"


def _done_by(future: torch.futures.Future[Any], deadline: float) -> bool:
    """Whether ``future`` completes before ``deadline`` (a ``time.monotonic()`` reading)."""
    while not future.done():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)
    return True


PipeRPCWrapper = RemotePipe
"""The name fairscale users know."""


def _first_cause(outcome: tuple[Any, ...]) -> tuple[bool, bool, bool]:
    """Orders failed outcomes, the likeliest cause first: a stage's own failure, a worker
    found stuck, a timeout waiting for another stage, then failures relayed from others."""
    text = str(outcome[1])
    relayed = "reported to rank" in text or "see that rank" in text
    return relayed, "sent nothing" in text, "did not answer within" in text
