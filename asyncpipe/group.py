"""Process-group set-up from the environment that torchrun gives every process."""

from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import re
import time
import warnings
import weakref
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import PrefixStore
from torch.distributed.rendezvous import rendezvous

__all__: list[str] = []

_TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

_GROUPS = 0

_SHUTDOWN_S = 300.0
"""Seconds :func:`shutdown` waits for the other ranks: the timeout of the last :func:`init`."""
"""Default process groups :func:`init` has set up in this process. Every rank of a job calls
it as often as the others, so the count (with torchrun's restart count) names each new group's
keys alike on every rank."""


def new_group(ranks: list[int], timeout: datetime.timedelta | None = None) -> dist.ProcessGroup:
    """``torch.distributed.new_group(ranks)`` (collective over the world), then, over gloo and
    on its members, a barrier over the new group: once it returns, every member has finished
    connecting. Without it a rank that destroyed a group right after creating it (a constructor
    failing next, see :func:`release`) closed the connections that a slower
    member was still making, whose creation of the group then failed ("Gloo connectFullMesh
    failed ... Connection closed by peer"). Ranks outside ``ranks`` get torch's placeholder."""
    group: dist.ProcessGroup = dist.new_group(ranks, timeout=timeout)
    if (
        isinstance(group, dist.ProcessGroup)
        and len(ranks) > 1
        and dist.get_backend(group) == "gloo"
    ):
        dist.barrier(group=group)
    return group


def release(created: Sequence[weakref.ref[dist.ProcessGroup]]) -> None:
    """Destroy the process groups a pipeline created (held weakly, in the order they were
    created): their connections and worker threads end, which they otherwise did only with
    the default group. Each is destroyed on this rank alone (over gloo this waits for no
    other rank, so a rank whose peers are gone or closed already gets through), skipping one
    already gone (``asyncpipe.shutdown()`` destroys every group). Later groups are still
    created alike on every rank: torch names them by a count that this leaves as it is.
    Never raises: the pipeline is over whatever happens."""
    for ref in created:
        group = ref()
        if group is None:
            continue
        with contextlib.suppress(ValueError, RuntimeError):  # ValueError: destroyed already
            dist.destroy_process_group(group)


def collective_device() -> torch.device:
    """Where the default process group's collectives take their tensors: the current CUDA
    device over NCCL, else host memory."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def wait_at_most(work: dist.Work | None, seconds: float) -> RuntimeError | None:
    """Wait for ``work`` (a collective or point-to-point operation) ``seconds`` at most: None
    once it completed, else the backend's error (it timed out, or a peer is gone), for the
    caller to raise its own explanation from."""
    try:
        assert work is not None
        work.wait(datetime.timedelta(seconds=seconds))
    except RuntimeError as e:
        return e
    return None


def init(
    backend: str | None = None,
    timeout: float | datetime.timedelta = 300.0,
    *,
    rpc: bool = False,
    worker_map: Mapping[int, str] | None = None,
) -> None:
    """Set up the default process group from torchrun's environment, and RPC if asked.

    Harmless when the process group (or RPC) already exists (it is left as it is); after
    :func:`shutdown` it sets them up again (every rank must call it again). The backend
    is NCCL when every process of the node has a GPU of its own, else gloo (no GPU, or more
    processes than GPUs: NCCL refuses two ranks on one GPU). With CUDA, the current device is
    set to GPU ``LOCAL_RANK % torch.cuda.device_count()``, so processes that outnumber the GPUs
    share them; pass ``device=...`` to :class:`~asyncpipe.AsyncPipe` to compute there over gloo
    (the p2p transport then stages messages through host memory).

    Args:
        backend: ``"gloo"``, ``"nccl"`` or ``None`` to choose as above.
        timeout: seconds (or a timedelta) collective operations and RPCs may wait.
        rpc: also start ``torch.distributed.rpc`` (TensorPipe) for ``transport="rpc"`` and
            :mod:`asyncpipe.rpc`; with CUDA, device maps let tensors go GPU to GPU.
        worker_map: RPC worker name of each rank (default ``"worker{rank}"``).

    Raises:
        RuntimeError: if the process was not started by torchrun (the variables are missing).

    Example:
        >>> import asyncpipe
        >>> asyncpipe.init()  # doctest: +SKIP
    """
    global _SHUTDOWN_S
    _SHUTDOWN_S = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
    global _GROUPS
    if not dist.is_initialized():
        _init_group(backend, timeout)
    else:  # the caller's own group: its keys are in torchrun's store too, so a group after it
        _GROUPS = max(_GROUPS, 1)  # (init after shutdown) takes names of its own, as after ours
    pause_at_exit()
    if rpc:
        _init_rpc(timeout, worker_map)


class GroupRef:
    """A process group held without keeping it alive (``None``: the default group).

    ``torch.distributed`` owns its groups: ``destroy_process_group()`` drops them and their
    worker threads stop. A pipeline that held a group kept those threads running into the
    interpreter's exit, where the clean-up of a finished collective could abort the process
    ("terminate called without an active exception"). So the pipeline's parts hold groups
    through this, and a use after the group is gone is a clear error.

    Example:
        >>> ref = GroupRef(group)  # doctest: +SKIP
        >>> ref().rank()  # doctest: +SKIP
        0
    """

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        chosen = group if group is not None else dist.group.WORLD
        if chosen is None:
            raise RuntimeError("torch.distributed is not initialized: call asyncpipe.init()")
        self._ref = weakref.ref(chosen)
        pause_at_exit()

    def __call__(self) -> dist.ProcessGroup:
        group = self._ref()
        if group is None:
            raise RuntimeError(
                "the process group of this pipeline was destroyed (destroy_process_group() or "
                "asyncpipe.shutdown()); a pipeline cannot run after that: call "
                "asyncpipe.init() again (on every rank) and build a new AsyncPipe"
            )
        return group


def choose_backend(gpus: int, local_world_size: int) -> str:
    """The default backend: NCCL when each of the node's processes has a GPU of its own.

    Example:
        >>> choose_backend(0, 4), choose_backend(4, 4), choose_backend(1, 2)
        ('gloo', 'nccl', 'gloo')
    """
    return "nccl" if 0 < local_world_size <= gpus else "gloo"


def _init_group(backend: str | None, timeout: float | datetime.timedelta) -> None:
    missing = [name for name in _TORCHRUN_VARIABLES if name not in os.environ]
    if missing:
        raise RuntimeError(
            "asyncpipe.init() reads the environment that torchrun sets, but "
            f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} missing; launch the "
            "script with torchrun, e.g. torchrun --standalone --nproc-per-node=4 train.py"
        )
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
    if backend is None:
        backend = choose_backend(gpus, local_world)
    if gpus:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % gpus)
    if not isinstance(timeout, datetime.timedelta):
        timeout = datetime.timedelta(seconds=float(timeout))
    global _GROUPS
    restart = _restart()
    if not _GROUPS and not restart:
        dist.init_process_group(backend=backend, timeout=timeout)
    else:
        # Again in this process (after shutdown()), or in a process torchrun restarted: its
        # store outlives the first group and still holds that group's keys (each rank's
        # address, under the same names a new group would use), so a rank could read a peer's
        # old address before the peer wrote the new one and fail to connect. A new group's
        # keys go under a name of their own, the same on every rank of the attempt.
        store, rank, world = next(rendezvous("env://", timeout=timeout))
        store.set_timeout(timeout)
        store = PrefixStore(f"asyncpipe.init.{restart}.{_GROUPS}", store)
        dist.init_process_group(
            backend=backend, store=store, rank=rank, world_size=world, timeout=timeout
        )
    _GROUPS += 1


def _init_rpc(timeout: float | datetime.timedelta, worker_map: Mapping[int, str] | None) -> None:
    from torch.distributed import rpc as torch_rpc

    from .transport.rpc import device_maps

    rank, world = dist.get_rank(), dist.get_world_size()
    names = worker_names(worker_map, world)  # every rank has the same map: all refuse it alike
    try:
        torch_rpc.get_worker_info()
        return  # already running
    except RuntimeError:
        pass
    seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
    options = torch_rpc.TensorPipeRpcBackendOptions(rpc_timeout=float(seconds))
    if torch.cuda.is_available():
        gpus = torch.cuda.device_count()
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
        for worker, mapping in device_maps(rank, world, local_world, names, gpus).items():
            options.set_device_map(worker, dict(mapping.items()))
    _fresh_rpc_keys(_restart())
    torch_rpc.init_rpc(  # type: ignore[no-untyped-call]
        names[rank], rank=rank, world_size=world, rpc_backend_options=options
    )
    atexit.unregister(_end_rpc_at_exit)  # once, after the newest agent (init after shutdown)
    atexit.register(_end_rpc_at_exit)


_WORKER_NAME = re.compile(r"[A-Za-z0-9_:-]+")
"""The RPC worker names torch accepts (``WorkerInfo``: ``^[A-Za-z0-9-_:]*$``, non-empty)."""
_WORKER_NAME_MAX = 127
"""The longest RPC worker name torch accepts (``WorkerInfo``: shorter than 128)."""


def worker_names(worker_map: object, world: int) -> dict[int, str]:
    """The RPC worker name of each of the ``world`` ranks: ``worker_map``'s, ``"worker{rank}"``
    for the ranks it leaves out. A ValueError (a TypeError if it is no mapping) names what torch
    would refuse (on one rank, leaving the others waiting for it) or silently ignore.

    Example:
        >>> worker_names({0: "trainer"}, 2)
        {0: 'trainer', 1: 'worker1'}
        >>> worker_names({"0": "trainer"}, 2)
        Traceback (most recent call last):
        ...
        ValueError: worker_map's keys must be the ranks (ints 0..1), got '0'
    """
    given = {} if worker_map is None else worker_map
    if not isinstance(given, Mapping):
        raise TypeError(
            f"worker_map must map each rank (an int) to its RPC worker name, got "
            f"{type(given).__name__}"
        )
    for key, name in given.items():
        if not isinstance(key, int) or isinstance(key, bool) or not 0 <= key < world:
            raise ValueError(
                f"worker_map's keys must be the ranks (ints 0..{world - 1}), got {key!r}"
            )
        if not isinstance(name, str):
            raise ValueError(f"worker_map[{key}] must be a str, got {type(name).__name__} {name!r}")
        if not _WORKER_NAME.fullmatch(name) or len(name) > _WORKER_NAME_MAX:
            raise ValueError(
                f"worker_map[{key}] = {name!r} is no RPC worker name: torch takes 1 to "
                f"{_WORKER_NAME_MAX} letters, digits, '-', '_' or ':'"
            )
    names = {r: str(given.get(r, f"worker{r}")) for r in range(world)}
    ranks: dict[str, list[int]] = {}
    for r, name in names.items():
        ranks.setdefault(name, []).append(r)
    shared = {name: held for name, held in ranks.items() if len(held) > 1}
    if shared:
        name, held = next(iter(shared.items()))
        raise ValueError(
            f"worker_map gives ranks {held} the same RPC worker name {name!r} (ranks left out "
            f'are named "worker{{rank}}"); each rank needs a name of its own'
        )
    return names


def _restart() -> int:
    """How many times torchrun has restarted this job's workers (0: the first attempt)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def _fresh_rpc_keys(restart: int) -> None:
    """Have ``init_rpc`` of a restarted attempt name its store keys apart from the attempt
    before's. torch names them after a count of this process's ``init_rpc`` calls, which starts
    at 0 again in a restarted process, so the old attempt's addresses (still in torchrun's
    store) were read and refused. The count is torch's private ``rpc._init_counter``: where a
    torch has none, nothing is done."""
    from torch.distributed import rpc as torch_rpc

    if restart and hasattr(torch_rpc, "_init_counter") and hasattr(torch_rpc, "_init_counter_lock"):
        with torch_rpc._init_counter_lock:
            first = restart * 1_000_000  # far above the calls one process makes
            torch_rpc._init_counter = max(torch_rpc._init_counter, first)


def _end_rpc_at_exit() -> None:
    """Stop this process's RPC agent at exit if :func:`shutdown` did not: a process leaving on
    an exception (a failed step, a lost peer) otherwise exits with the agent's threads still
    running, and the C++ runtime aborts it (``terminate called without an active exception``,
    signal 6) instead of the exception's exit status 1. Local (``graceful=False``): the other
    ranks may be gone."""
    from torch.distributed import rpc as torch_rpc

    try:
        torch_rpc.get_worker_info()
    except RuntimeError:
        return  # never started, or shut down
    with contextlib.suppress(Exception):  # an exit must go on whatever the agent's state
        torch_rpc.shutdown(graceful=False)


_RELEASE_S = 0.1
"""How long :func:`shutdown` leaves the default group's worker threads to let go of the work
they finished (see "Ending a job" in the reliability guide)."""


_PAUSING = False


def pause_at_exit() -> None:
    """Have this process pause for a moment at exit if the default group is alive then (the
    script did not call :func:`shutdown`), as :func:`shutdown` does after destroying it: the
    group's worker threads let go of the collectives they finished while the interpreter can
    still serve them, instead of aborting the exiting process (``terminate called without an
    active exception``, signal 6). Registered once, by :func:`init` and by everything that
    holds a group."""
    global _PAUSING
    if not _PAUSING:
        _PAUSING = True
        atexit.register(_pause_if_group_lives)


def _pause_if_group_lives() -> None:
    if dist.is_available() and dist.is_initialized():
        time.sleep(_RELEASE_S)


def shutdown() -> None:
    """End RPC (waiting for every worker to get there) and the default process group, after a
    barrier: every rank's collectives are done, so none is left to clean up at exit; then pause
    for a moment, so that the group's worker threads (which torch may keep alive) have let go
    of the work they finished before the interpreter exits (see "Ending a job" in the
    reliability guide). Each wait for the other ranks lasts the timeout given to
    :func:`init` at most: where a rank is gone or never gets here, this rank warns and ends
    RPC and the group on its own.

    Example:
        >>> asyncpipe.shutdown()  # doctest: +SKIP
    """
    end(alone=False)


def end(alone: bool) -> None:
    """:func:`shutdown`; ``alone``: a rank is known to be gone, so end RPC and the group on
    this rank without waiting for the others."""
    from torch.distributed import rpc as torch_rpc

    try:
        torch_rpc.get_worker_info()
        running = True
    except RuntimeError:
        running = False
    if running and alone:
        torch_rpc.shutdown(graceful=False)
    elif running:
        try:  # torch ends RPC on this rank whatever happens, then raises what did
            torch_rpc.shutdown(graceful=True, timeout=_SHUTDOWN_S)
        except RuntimeError as e:
            warnings.warn(
                f"asyncpipe.shutdown: not every RPC worker reached shutdown within "
                f"{_SHUTDOWN_S:.1f} s (a rank is gone or stuck); RPC ended on this rank alone: "
                f"{str(e).splitlines()[0] if str(e) else type(e).__name__}",
                stacklevel=2,
            )
    if dist.is_initialized():
        error = None if alone else wait_at_most(dist.barrier(async_op=True), _SHUTDOWN_S)
        if error is not None:
            warnings.warn(
                f"asyncpipe.shutdown: the other ranks did not all reach shutdown within "
                f"{_SHUTDOWN_S:.1f} s (a rank is gone or stuck); ending the process group on "
                f"this rank alone: {str(error).splitlines()[0] if str(error) else 'no detail'}",
                stacklevel=2,
            )
        dist.destroy_process_group()
        time.sleep(_RELEASE_S)
