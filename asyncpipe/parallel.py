"""Data parallelism across pipelines: rank layout, process groups and gradient averaging.

With ``data_parallel_size=D`` and ``S`` pipeline ranks, the world holds ``D`` replicas of the
pipeline, each on ``S`` consecutive ranks; a stage's copies form its data-parallel group::

    world rank   0   1   2   3   4   5        S = 3 stages, D = 2 replicas
    replica      0   0   0   1   1   1        pipeline groups: {0, 1, 2}, {3, 4, 5}
    stage        0   1   2   0   1   2        data-parallel groups: {0, 3}, {1, 4}, {2, 5}

A rank averages its gradients with its data-parallel group in buckets, started as soon as its
own last backward of the step is done, so the all-reduce runs while the rank would otherwise
wait for the rest of the pipeline to finish the step.
"""

from __future__ import annotations

import contextlib
import datetime
import weakref
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .failure import StageFailure, read_text, refusal, write_text
from .group import GroupRef, collective_device, new_group, release, wait_at_most
from .transport import P2PTransport, RPCTransport, ShmTransport, Transport, TransportTimeout
from .transport.rpc import worker_names

__all__: list[str] = []

BUCKET_BYTES = 25 * 2**20


@dataclass(frozen=True)
class Layout:
    """Where a world rank sits: ``stages`` pipeline ranks per replica, ``replicas`` replicas."""

    stages: int
    replicas: int

    def stage(self, rank: int) -> int:
        return rank % self.stages

    def replica(self, rank: int) -> int:
        return rank // self.stages

    def pipeline_ranks(self, replica: int) -> list[int]:
        return [replica * self.stages + s for s in range(self.stages)]

    def data_parallel_ranks(self, stage: int) -> list[int]:
        return [d * self.stages + stage for d in range(self.replicas)]


def group_timeout(timeout: float) -> datetime.timedelta:
    """The backend's own timeout for the groups asyncpipe makes for a pipeline whose timeout
    is ``timeout``: longer than asyncpipe's longest bounded wait on them (twice the timeout,
    see :class:`GradientAverager`), so that wait reports first, naming what it waited for,
    yet bounded by the pipeline's timeout rather than torch's default (30 minutes)."""
    return datetime.timedelta(seconds=2 * timeout + 60)


def groups(
    layout: Layout, rank: int, down: bool = False, timeout: float = 300.0
) -> tuple[dist.ProcessGroup, dist.ProcessGroup, dist.ProcessGroup | None]:
    """This rank's pipeline group, data-parallel group and, with ``down``, a second group over
    its pipeline's ranks for the messages to lower ranks (the p2p transport's ordered mode).
    Every rank creates every group, in the same order (creating a group is collective), with
    the backend timeout :func:`group_timeout` of the pipeline's ``timeout``."""
    pipeline = data_parallel = second = None
    limit = group_timeout(timeout)
    for replica in range(layout.replicas):
        group = new_group(layout.pipeline_ranks(replica), timeout=limit)
        if replica == layout.replica(rank):
            pipeline = group
    for stage in range(layout.stages):
        group = new_group(layout.data_parallel_ranks(stage), timeout=limit)
        if stage == layout.stage(rank):
            data_parallel = group
    for replica in range(layout.replicas if down else 0):
        group = new_group(layout.pipeline_ranks(replica), timeout=limit)
        if replica == layout.replica(rank):
            second = group
    assert pipeline is not None and data_parallel is not None
    return pipeline, data_parallel, second


_NEWS_WORDS = 64
"""int64 words of a rank's news to its data-parallel group at the end of a step: outcome, stop
asked, the failed stage, micro-batch and pipeline rank, then the failure's text (cut)."""


class GradientAverager:
    """Averages the gradients of ``parameters`` over ``group`` (``size`` ranks, one per
    replica, ``replica`` this one's index) in buckets, and tells the replicas how each one's
    step ended: a replica that failed (every rank of it raises) takes part in the averaging with
    that news, so the others raise a StageFailure naming it instead of waiting for it.

    ``timeout``: the pipeline's. A rank waits twice that for the other replicas at the end of a
    step (a replica may take its whole timeout to find that a stage of it is stuck)."""

    def __init__(
        self,
        parameters: Sequence[nn.Parameter],
        group: dist.ProcessGroup,
        size: int,
        device: torch.device,
        timeout: float = 300.0,
        replica: int = 0,
        stage: int = 0,
        bucket_bytes: int = BUCKET_BYTES,
    ) -> None:
        self._group = GroupRef(group)  # torch.distributed owns it (see GroupRef)
        self.size, self.device = size, device
        self.timeout, self.replica, self.stage = timeout, replica, stage
        self.buckets: list[list[nn.Parameter]] = []
        current: list[nn.Parameter] = []
        used = 0
        for p in (p for p in parameters if p.requires_grad):
            if current and (
                used + p.numel() * p.element_size() > bucket_bytes or p.dtype != current[0].dtype
            ):
                self.buckets.append(current)
                current, used = [], 0
            current.append(p)
            used += p.numel() * p.element_size()
        if current:
            self.buckets.append(current)
        self._params = [p for bucket in self.buckets for p in bucket]
        self._present = torch.zeros(len(self._params), dtype=torch.int64)
        """Which parameters had a gradient here when the step's averaging started (1), which
        got zeros to take part (0): told to the other replicas with the news, so that one
        without a gradient on every replica keeps none, as in the plain model."""
        self._running: list[tuple[list[nn.Parameter], Tensor, dist.Work | None]] = []
        self.stop_asked = False
        """Whether any replica's ranks had asked to stop when the last step ended."""

    def start(self, zeros: bool = False) -> None:
        """Launch the all-reduce of every bucket (non-blocking); ``zeros``: of zeros in place
        of the gradients (a failed step's part, whose gradients mean nothing)."""
        self._present = torch.tensor(
            [0 if zeros or p.grad is None else 1 for p in self._params], dtype=torch.int64
        )
        for bucket in self.buckets:
            if zeros:
                size = sum(p.numel() for p in bucket)
                flat = torch.zeros(size, dtype=bucket[0].dtype, device=bucket[0].device)
            else:
                for p in bucket:
                    if p.grad is None:  # unused here: its copies may have gradients
                        p.grad = torch.zeros_like(p)
                flat = torch.cat([p.grad.reshape(-1) for p in bucket if p.grad is not None])
            work = dist.all_reduce(flat, group=self._group(), async_op=True)
            self._running.append((bucket, flat, work))

    def _wait(
        self, work: dist.Work | None, seconds: float, what: str = "average the step's gradients"
    ) -> None:
        error = None if work is None else wait_at_most(work, seconds)
        if error is not None:
            try:  # the group's members, in replica order
                ranks = dist.get_process_group_ranks(self._group())
                others = ", ".join(
                    f"replica {n} on global rank {r}"
                    for n, r in enumerate(ranks)
                    if n != self.replica
                )
            except Exception:  # the group is gone: name no rank
                others = "the others"
            raise StageFailure(
                f"stage {self.stage} of replica {self.replica} waited for the other replicas "
                f"of its stage ({others}) to {what} (at most {seconds:.1f} s, twice "
                f"the pipeline's timeout) and none came or one was lost: a replica is stuck or "
                f"gone, or its ranks did not all call step() ({str(error).splitlines()[0]})",
                rank=-1,
                stage=self.stage,
                microbatch=-1,
                action="",
            ) from error

    def _news(self, failure: BaseException | None, stop: bool, seconds: float) -> list[Tensor]:
        """Every replica's news of its step (see :data:`_NEWS_WORDS`), by replica."""
        words = torch.zeros(_NEWS_WORDS, dtype=torch.int64)
        words[1] = int(stop)
        if failure is not None:
            words[0] = 1
            if isinstance(failure, StageFailure):
                words[2], words[3], words[4] = failure.stage, failure.microbatch, failure.rank
            else:
                words[2], words[3], words[4] = -1, -1, -1
            write_text(words[5:], str(failure) or type(failure).__name__)
        words = torch.cat([words, self._present])
        group = self._group()
        where = self.device if dist.get_backend(group) == "nccl" else torch.device("cpu")
        words = words.to(where)
        everyone = [torch.zeros_like(words) for _ in range(self.size)]
        self._wait(dist.all_gather(everyone, words, group=group, async_op=True), seconds)
        return [w.cpu() for w in everyone]

    def finish(self, stop: bool = False) -> None:
        """Wait for the all-reduces, learn how every replica's step ended and, where all went
        well, write the averages back into the gradients; else raise a StageFailure naming the
        replica that failed. ``stop``: this replica's ranks asked to stop (see
        :attr:`stop_asked`)."""
        running, self._running = self._running, []
        seconds = 2 * self.timeout
        for _, _, work in running:
            self._wait(work, seconds)
        news = self._news(None, stop, seconds)
        self.stop_asked = any(bool(w[1]) for w in news)
        failed = [(replica, w) for replica, w in enumerate(news) if w[0]]
        if failed:
            replica, w = failed[0]
            stage, microbatch, rank = (int(v) for v in w[2:5])
            text = read_text(w[5:_NEWS_WORDS])
            raise StageFailure(
                f"replica {replica} of the pipeline failed in this step ({text}); stage "
                f"{self.stage} of replica {self.replica} stops too: the replicas' gradients of "
                f"this step cannot be averaged",
                rank=rank,
                stage=stage,
                microbatch=microbatch,
                action="",
            )
        for bucket, flat, _ in running:
            flat.div_(self.size)
            offset = 0
            for p in bucket:
                assert p.grad is not None
                n = p.numel()
                p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
                offset += n
        present = torch.stack([w[_NEWS_WORDS:] for w in news]).sum(0)
        for p, count in zip(self._params, present.tolist()):
            if not count:  # no replica computed a gradient of it: none, as in the plain model
                p.grad = None

    def fail(self, failure: BaseException) -> None:
        """This replica's step failed (every rank of it raises): take part in the averaging that
        the other replicas wait in, with zeros for gradients and the news of ``failure``, so
        they raise a StageFailure naming it. Waits the pipeline's timeout at most and never
        raises: ``failure`` is what the caller raises."""
        with contextlib.suppress(Exception):
            if not self._running:
                self.start(zeros=True)
            running, self._running = self._running, []
            for _, _, work in running:
                self._wait(work, self.timeout)
            self._news(failure, False, self.timeout)
        self._running = []

    def reduce_max(self, value: float) -> float:
        """The largest ``value`` over the group (e.g. an overflow flag)."""
        tensor = torch.tensor([value], dtype=torch.float64, device=self.device)
        work = dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self._group(), async_op=True)
        self._wait(work, 2 * self.timeout, "agree on a flag (a float16 overflow, a save)")
        return float(tensor.item())


_NAMES = ("p2p", "shm", "rpc")
_REFUSED = -1  # the code of a rank that rejected its own arguments
AUTO = -2  # the code of a rank in the first collective of balance="auto" (it meets this one)


def timed_wait(work: dist.Work | None, seconds: float, what: str) -> None:
    """Wait ``seconds`` at most for ``work`` (a collective of AsyncPipe's constructor), else
    raise a TransportTimeout saying what this rank waited ``for``."""
    error = wait_at_most(work, seconds)
    if error is not None:
        raise TransportTimeout(
            f"rank {dist.get_rank()} waited for {what} (at most {seconds:.1f} s, the "
            f"pipeline's timeout): {str(error).splitlines()[0]}"
        ) from error


def gather_codes(code: int, seconds: float, what: str) -> list[int]:
    """Every rank's ``code`` (index: rank), in one all_gather over the world that waits
    ``seconds`` at most for ``what`` (see :func:`timed_wait`)."""
    mine = torch.tensor([code], dtype=torch.int64, device=collective_device())
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    timed_wait(dist.all_gather(everyone, mine, async_op=True), seconds, what)
    return [int(t.item()) for t in everyone]


_BUILT: list[object] = [None, 0]
"""The default group (weakly) and how many pipelines this process built by transport name on
it: :func:`same_transport` numbers them, alike on every rank."""

_SERIAL = 1 << 32
"""Where the pipeline's number starts in the code :func:`same_transport` gathers."""


def built_before() -> int:
    """Pipelines built by transport name on the current default group in this process."""
    world = dist.group.WORLD
    ref, count = _BUILT
    if world is None or not isinstance(ref, weakref.ref) or ref() is not world:
        return 0  # none yet, or a new default group (after shutdown() and init()): count anew
    assert isinstance(count, int)
    return count


def same_transport(name: str | None, timeout: float, replicas: int = 1) -> int | None:
    """Check, in one collective over the world, that every rank builds the transport ``name``
    and as many pipeline replicas (``data_parallel_size``): a rank building another transport
    would wait in its own set-up (shm's is collective) or for messages that never come, one
    with other replicas in the collective creation of their groups, until the timeout. Raises
    ValueError naming each rank's choices.

    Also numbers the pipeline: every rank must have built as many pipelines by name on this
    default group before this one (ValueError otherwise). Returns that number, which keeps
    the pipeline's messages apart from those of the others (two pipelines on one group would
    take each other's messages, a rank stepping one while its peer steps the other running a
    silent mix of both models).

    ``name=None``: this rank rejected its own arguments and takes part only to tell the others,
    which raise a StageFailure naming it at once instead of waiting here until the timeout
    (returns None)."""
    kinds = len(_NAMES)
    serial = built_before()
    codes = gather_codes(
        _REFUSED
        if name is None
        else _NAMES.index(name) + kinds * (replicas - 1) + _SERIAL * serial,
        timeout,
        "the other ranks in AsyncPipe's constructor, which compares the transport every rank "
        "builds: did the constructor fail on some rank, or is AsyncPipe not built there?",
    )
    refused = [rank for rank, c in enumerate(codes) if c == _REFUSED]
    if name is None:
        return None
    if refused:
        raise refusal("AsyncPipe cannot be built", refused, dist.get_rank())
    auto = [rank for rank, c in enumerate(codes) if c == AUTO]
    if auto:  # they wait for an answer to balance='auto' that this rank would never give
        from .balance.auto import mixed_balance

        raise ValueError(mixed_balance(auto, [r for r in range(len(codes)) if r not in auto]))
    serials = [c // _SERIAL for c in codes]
    codes = [c % _SERIAL for c in codes]
    names = [_NAMES[c % kinds] for c in codes]
    if len(set(names)) > 1:
        listed = ", ".join(f"rank {rank}: {n!r}" for rank, n in enumerate(names))
        raise ValueError(
            f"every rank must build the same transport ({listed}); pass the same transport= "
            f"on every rank"
        )
    sizes = [c // kinds + 1 for c in codes]
    if len(set(sizes)) > 1:
        listed = ", ".join(f"rank {rank}: {n}" for rank, n in enumerate(sizes))
        raise ValueError(
            f"every rank must pass the same data_parallel_size ({listed}); pass the same "
            f"data_parallel_size= (and a balance for as many pipeline ranks) on every rank"
        )
    if len(set(serials)) > 1:
        listed = ", ".join(f"rank {rank}: {n}" for rank, n in enumerate(serials))
        raise ValueError(
            f"the ranks built different numbers of pipelines before this one ({listed}): "
            f"every rank must build the same pipelines, in the same order (each pipeline's "
            f"messages are told apart by its place in that order; pipelines built in another "
            f"order on some rank would take each other's messages)"
        )
    _BUILT[:] = [weakref.ref(dist.group.WORLD), serial + 1]
    return serial


def same_replicas(
    fields: dict[str, object],
    group: dist.ProcessGroup,
    size: int,
    replica: int,
    timeout: float,
) -> None:
    """Check, in one all_gather over this stage's replicas, that every replica built
    ``AsyncPipe`` with the same ``fields`` (those :func:`~asyncpipe.arguments.agree` compares
    within a pipeline): replicas built differently average gradients of other shapes (the
    backend aborts the process) or scaled otherwise (they drift apart without an error). Raises
    ValueError on every rank naming the fields that differ."""
    names = [name for name in fields if name != "trace"]  # tracing may differ by replica
    codes = [zlib.crc32(repr(fields[name]).encode()) for name in names]
    mine = torch.tensor(codes, dtype=torch.int64, device=collective_device())
    everyone = [torch.zeros_like(mine) for _ in range(size)]
    timed_wait(
        dist.all_gather(everyone, mine, group=group, async_op=True),
        timeout,
        "the other replicas of its stage in AsyncPipe's constructor, which compares their "
        "arguments: did the constructor fail on a rank of another replica?",
    )
    differ = [name for k, name in enumerate(names) if len({int(t[k]) for t in everyone}) > 1]
    if differ:
        others = [r for r, t in enumerate(everyone) if not torch.equal(t, mine)]
        found = "; ".join(f"{name} (here: {fields[name]!r})" for name in differ)
        raise ValueError(
            f"every replica of the pipeline must build AsyncPipe with the same arguments, and "
            f"replica {replica}'s differ from those of replica{'s' if len(others) > 1 else ''} "
            f"{', '.join(map(str, others))} in: {found}; pass the same values on every rank"
        )


REFUSAL_SECONDS = 10.0
"""How long a rank whose constructor failed waits for the others to hear it (they may never
build AsyncPipe)."""


def refusal_seconds(timeout: object) -> float:
    """How long a failed constructor waits for the others to hear of it: the pipeline's
    ``timeout`` (which may be the argument it rejected), at most :data:`REFUSAL_SECONDS`."""
    if isinstance(timeout, (int, float)) and 0 < timeout < REFUSAL_SECONDS:
        return float(timeout)
    return REFUSAL_SECONDS


def refuse(transport: object, device: object, timeout: object) -> None:
    """Tell the other ranks that this rank's constructor rejected its arguments (the caller
    raises its error after), in the collective where they meet it first
    (:func:`same_transport`): they raise a StageFailure naming this rank at once instead of
    waiting until the timeout. Waits :data:`REFUSAL_SECONDS` at most (the others may never
    build AsyncPipe) and never raises: this rank's own error is what its caller must see.
    Nothing where the others do not meet there (no torch.distributed, or a ready Transport,
    whose first exchange is the argument check's: a message there would stay unread for a
    later pipeline where every rank failed)."""
    if not isinstance(transport, str) or not dist.is_initialized():
        return
    with contextlib.suppress(Exception):
        same_transport(None, refusal_seconds(timeout))


def connect(
    transport: str | Transport,
    ranks: int,
    data_parallel_size: int,
    device: torch.device,
    timeout: float,
) -> tuple[Transport, int, dist.ProcessGroup | None, list[dist.ProcessGroup]]:
    """The transport of this rank's pipeline, its replica, its data-parallel group (None
    with one replica), and the process groups created here that this rank belongs to (for
    :func:`release` when the pipeline closes). ``transport`` is a name or a ready Transport
    (one replica only); every rank of the world must name the same one (checked first)."""
    serial = 0
    if isinstance(transport, str):
        serial = same_transport(transport, timeout, data_parallel_size) or 0
    layout = Layout(ranks, data_parallel_size)
    data_parallel_rank = 0
    pipeline_group = data_parallel_group = down_group = None
    if data_parallel_size > 1:
        world = dist.get_world_size()
        if world != data_parallel_size * ranks:
            raise ValueError(
                f"the world must hold data_parallel_size x pipeline ranks processes (world: "
                f"{world}, data_parallel_size: {data_parallel_size}, pipeline ranks: "
                f"{ranks}); launch {data_parallel_size * ranks} processes or change "
                f"data_parallel_size"
            )
        me = dist.get_rank()
        ordered = transport == "p2p" and dist.get_backend() == "nccl"
        pipeline_group, data_parallel_group, down_group = groups(layout, me, ordered, timeout)
        data_parallel_rank = layout.replica(me)
    created = [g for g in (pipeline_group, data_parallel_group, down_group) if g is not None]
    try:  # a transport that fails to build (a rank lost in the shm set-up) leaves no group
        if transport == "rpc":
            if pipeline_group is None:  # a mailbox of the pipeline's own (see same_transport)
                return RPCTransport(name=f"pipe{serial}"), 0, None, created
            ranks_of = layout.pipeline_ranks(data_parallel_rank)
            names = worker_names()
            rpc = RPCTransport(
                {s: names.get(r, f"worker{r}") for s, r in enumerate(ranks_of)},
                name=f"pipe{serial}-replica{data_parallel_rank}",
            )
            return rpc, data_parallel_rank, data_parallel_group, created
        if transport == "shm":
            transport = ShmTransport(group=pipeline_group, device=device)
        elif isinstance(transport, str):
            transport = P2PTransport(
                group=pipeline_group, device=device, down_group=down_group, pipeline=serial
            )
    except BaseException:
        release([weakref.ref(g) for g in created])
        raise
    return transport, data_parallel_rank, data_parallel_group, created
