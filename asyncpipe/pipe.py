"""AsyncPipe: the user's handle on one rank's part of a pipeline-parallel model."""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .arguments import (
    agree,
    agree_routes,
    check_arguments,
    check_step,
    plan_factory,
    same_everywhere,
    world_mismatch,
)
from .balance.auto import auto_balance
from .batchnorm import DeferredBatchNorm, commit_all
from .compute import to_caller
from .delayed import DelayedUpdates
from .failure import MismatchedBatch, StageFailure, StepReport
from .lazy import LazyModule
from .lifecycle import LifeCycle
from .manual import ManualBackward
from .microbatch import Tensors, as_tensors, scatter
from .names import layer_names, rename_loaded, rename_missing, rename_saved
from .options import option_problems
from .parallel import (
    GradientAverager,
    connect,
    refusal_seconds,
    refuse,
    same_replicas,
)
from .partition import Layer, Partition, Segment, partition
from .precision import LossScaler, clip_norm
from .runtime import Runtime, refuse_exchange
from .schedule import Action, Plan
from .shared import SharedWeights, find_shared
from .skip.routes import SkipRoutes, find_routes, has_skips
from .stage import build_layers
from .stream import Stream, check_two_bw_transport
from .trace import TraceWriter
from .traced import TracedSteps
from .transport import GroupTransport, Transport
from .work import LossFn, Work

__all__: list[str] = []


class AsyncPipe(DelayedUpdates, ManualBackward, TracedSteps, LifeCycle, nn.Module):
    """One rank's part of a model split into pipeline stages that run in separate processes.

    Every process of the pipeline builds ``AsyncPipe`` with the same arguments (the ranks
    compare them before returning; see :doc:`/reliability`); each keeps only the layers of its
    own stage (the caller's objects, not copies) and runs the plan of its
    rank, streaming ``chunks`` micro-batches through the stages. ``state_dict()`` holds this
    rank's layers under the plain model's names (``"3.weight"``), and ``load_state_dict()``
    takes them from any dict with those names, the whole model's included (see
    :mod:`asyncpipe.checkpoint` to save and load every rank at once).

    Args:
        module: an ``nn.Sequential``, or a list of ``nn.Module`` / ``LazyModule`` (built only
            on the rank that owns it; with skip connections, the other ranks build it on the
            meta device to read its skips, see :doc:`/skips`). A layer object listed twice is
            owned by the stage of its first position and runs there at every position (shared
            weights).
        balance: layers per stage, counting positions in ``module`` (a reused layer counts at
            each position); one entry per pipeline rank. ``"auto"``: the pipeline's first
            rank (rank 0 for a transport given by name) finds it with
            :func:`asyncpipe.balance.by_time` on ``sample`` and every rank takes its answer.
        chunks: micro-batches per mini-batch, split with ``torch.chunk`` (fewer when the
            batch's rows are not a multiple of ``chunks``: 6 rows at ``chunks=4`` give 3).
        checkpoint: ``"always"``, ``"except_last"`` (default) or ``"never"``: which
            micro-batches recompute their activations in backward instead of keeping them.
        schedule: ``"gpipe"`` (fill-drain, the default), ``"1f1b"``, ``"interleaved"`` (with
            ``virtual_stages`` > 1), ``"zero_bubble"``, ``"2bw"`` (PipeDream-2BW: no flush
            between mini-batches, each update one step late; see :doc:`/2bw`), or a plan
            ``{rank: [Action, ...]}`` built by hand (validated here; its micro-batch count must
            match each batch's).
        virtual_stages: model chunks per rank for ``schedule="interleaved"``; ``balance`` then
            has ``ranks * virtual_stages`` entries and entry ``k`` runs on rank ``k % ranks``.
        lookahead: for ``schedule="2bw"``: how many micro-batches each rank's forwards run
            ahead of the next rank's. 1 (default) keeps 1F1B's activation memory (rank ``r``
            holds ``stages - r`` micro-batches); 2 lets each rank work on while a message
            travels, at up to ``2 * (stages - r) - 1`` micro-batches, for links whose latency
            is not small against a micro-batch's compute. Needs ``chunks >= lookahead *
            (stages - 1)``.
        deferred_batch_norm: replace this rank's BatchNorm layers by
            :class:`~asyncpipe.DeferredBatchNorm`: each micro-batch is normalised by its own
            statistics, the running statistics are updated once per mini-batch with those of the
            whole mini-batch, once per use for a BatchNorm called several times per forward (a
            BatchNorm layer that is the whole layer is replaced, nested ones are swapped inside
            the caller's layer).
        transport: ``"p2p"`` (torch.distributed send/recv), ``"shm"`` (shared memory
            between the processes of one host, over gloo; see
            :class:`~asyncpipe.transport.ShmTransport`), ``"rpc"`` (torch.distributed.rpc;
            call ``asyncpipe.init(rpc=True)``) or a ``Transport``.
        timeout: seconds any wait for another rank may take before it fails naming that rank.
        device: where this rank computes and receives tensors (default: CPU, or the current
            CUDA device with NCCL). On a CUDA device the rank's own layers are moved there in
            place (the caller's layer objects stay the same) and the input and target are
            moved there before they are split.
        autocast: ``torch.bfloat16`` or ``torch.float16`` to compute every stage under
            ``torch.autocast``; float16 adds a loss scale shared by every stage (an overflow
            on any stage drops the step's gradients everywhere and sets ``pipe.overflow``).
        loss_scale: the first loss scale with float16.
        reduce_activations: with ``autocast``, send float32 activations (and skips) between
            stages in the autocast dtype: half the traffic; their gradients come back in it.
        data_parallel_size: replicas of the pipeline; the world then has
            ``data_parallel_size`` times the pipeline ranks, and each stage's gradients are
            averaged over its replicas after every step.
        sample: one micro-batch of input for ``balance="auto"``.
        shared_weights: groups of parameter names whose copies on different stages must stay
            equal, e.g. ``[("tok.weight", "head.weight")]``, or one name for a parameter that
            several stages use (names in the original model for a
            :func:`~asyncpipe.sequentialize` model, or ``"<position>.<name>"`` in the
            ``nn.Sequential`` or the list of layers, ``LazyModule`` ones included); their
            gradients are summed across the owning stages after each backward.
        trace: a directory, or a :class:`~asyncpipe.trace.TraceWriter`: every rank times each
            action it runs and rank 0 writes TensorBoard scalars, timeline pictures and a
            Chrome trace there (see :mod:`asyncpipe.trace`); call :meth:`close` at the end.
        trace_every: steps between timeline pictures when ``trace`` is a directory.

    Example:
        >>> import asyncpipe, torch                                  # doctest: +SKIP
        >>> asyncpipe.init()                                         # doctest: +SKIP
        >>> model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
        >>> pipe = asyncpipe.AsyncPipe(model, balance=[2, 2], chunks=4)  # doctest: +SKIP
        >>> loss = pipe.step(x, y, torch.nn.functional.mse_loss)     # doctest: +SKIP
    """

    def __init__(
        self,
        module: nn.Sequential | Sequence[nn.Module | LazyModule],
        balance: Sequence[int] | str,
        chunks: int = 1,
        checkpoint: str = "except_last",
        *,
        schedule: str | Plan = "gpipe",
        virtual_stages: int = 1,
        lookahead: int = 1,
        deferred_batch_norm: bool = False,
        transport: str | Transport = "p2p",
        timeout: float = 300.0,
        device: torch.device | str | None = None,
        autocast: torch.dtype | None = None,
        loss_scale: float = 2.0**16,
        data_parallel_size: int = 1,
        reduce_activations: bool = False,
        sample: Tensor | tuple[Tensor, ...] | None = None,
        shared_weights: Sequence[Sequence[str] | str] = (),
        trace: str | os.PathLike[str] | TraceWriter | None = None,
        trace_every: int = 50,
    ) -> None:
        super().__init__()
        if isinstance(balance, str):
            balance = auto_balance(
                balance, module, sample, transport, virtual_stages, data_parallel_size, timeout
            )
        try:
            options = option_problems(
                transport=transport,
                balance=balance,
                virtual_stages=virtual_stages,
                timeout=timeout,
                autocast=autocast,
                loss_scale=loss_scale,
                data_parallel_size=data_parallel_size,
                shared_weights=bool(shared_weights),
                trace=trace,
                trace_every=trace_every,
                device=device,
                reduce_activations=reduce_activations,
                schedule=schedule,
                chunks=chunks,
                lookahead=lookahead,
            )
            layers = check_arguments(
                module, balance, chunks, checkpoint, schedule, virtual_stages, lookahead, options
            )
        except Exception:
            refuse(transport, device, timeout)  # the other ranks learn it at once
            raise
        if device is None:
            use_cuda = dist.is_initialized() and dist.get_backend() == "nccl"
            device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else None
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        ranks = len(balance) // virtual_stages
        self.data_parallel_size = int(data_parallel_size)
        self._owns_transport = isinstance(transport, str)  # built here: close() closes it
        transport, self.data_parallel_rank, data_parallel_group, created = connect(
            transport, ranks, self.data_parallel_size, self.device, float(timeout)
        )
        try:  # a failure from here on releases what connect() created before it raises
            self._averager: GradientAverager | None = None
            self.transport = transport
            self.balance = list(balance)
            self.chunks = int(chunks)
            self.checkpoint = checkpoint
            self.schedule = schedule
            self.lookahead = lookahead
            """Micro-batches each rank's forwards run ahead of the next rank's (``"2bw"``)."""
            self.timeout = float(timeout)
            self.autocast = autocast
            self.reduce_activations = bool(reduce_activations)
            self.scaler = LossScaler(float(loss_scale)) if autocast is torch.float16 else None
            self.overflow = False
            """Whether the last step overflowed in float16 (its gradients were dropped everywhere);
            a training ``pipe(input)`` after it sets it back to False."""
            self.grad_norm = float("nan")
            """The norm over every stage of the gradient that the last ``step(..., max_norm=...)``
            (or ``flush()`` after it) clipped, before clipping; NaN when it clipped none (also
            after a float16 step that overflowed: its gradients were dropped)."""
            self.stage = transport.rank
            self.num_stages = transport.world_size
            self.virtual_stages = virtual_stages
            try:  # this rank's own: a failure here reaches the others in agree() below
                if transport.world_size * virtual_stages != len(balance):
                    raise ValueError(
                        world_mismatch(transport.world_size, len(balance), virtual_stages)
                    )
                partitions, segments = partition(layers, balance, transport.world_size)
                self.partitions: list[Partition] = partitions
                self.segments: list[Segment] = segments
                self._build_stage(module, layers, deferred_batch_norm)  # the only build of its own
                skips = has_skips(layers, list(self.layers))  # no other rank's LazyModule runs here
                routes = find_routes(layers, segments) if skips else None  # else after agree()
                built = {
                    inv.order: self.layers[inv.this.index]
                    for inv in partitions[self.stage].invocations
                }
                shared = find_shared(shared_weights, layers, partitions, self.stage, built)
                owners = [seg.stage for seg in segments]
                plan = plan_factory(schedule, owners, transport.world_size, virtual_stages)
            except Exception as e:
                refuse_exchange(
                    transport, f"{type(e).__name__}: {e}", refusal_seconds(self.timeout)
                )
                raise
            fields = same_everywhere(self, layers, schedule, shared_weights, trace is not None)
            local = {
                seg.index: [self.layers[inv.this.index] for inv in seg.invocations]
                for seg in segments
                if seg.stage == self.stage
            }
            global_rank = (
                {r: transport.global_rank(r) for r in range(transport.world_size)}
                if isinstance(transport, GroupTransport)
                else None
            )
            self._runtime = Runtime(  # its skip routes are set once every rank has agreed
                self.stage, local, owners, plan, transport, self.timeout, self.device
            )
            # before anything waits on the others; it tells every rank whether any saw a skip
            if any(agree(self._runtime.exchange, self.stage, fields, extra=float(skips))):
                routes = agree_routes(  # then check the skips' routes in one more exchange
                    self._runtime.exchange,
                    self.stage,
                    routes,
                    lambda: find_routes(layers, segments),  # other ranks' LazyModules on meta
                    lambda text: refuse_exchange(transport, text, refusal_seconds(self.timeout)),
                )
            self._runtime.routes = self.skip_routes = routes if routes is not None else SkipRoutes()
            if data_parallel_group is not None:  # and across the replicas of this stage
                same_replicas(
                    fields,
                    data_parallel_group,
                    self.data_parallel_size,
                    self.data_parallel_rank,
                    self.timeout,
                )
            if isinstance(schedule, dict):  # the same plan everywhere now: it fails alike, or runs
                self._runtime.check_fixed_plan(self.chunks)
            self._shared = SharedWeights(shared, self.stage, global_rank, self.timeout)
            self._created = [*map(weakref.ref, created), *self._shared.created]
            """The process groups this pipeline created (weakly: torch.distributed owns them, see
            :class:`~asyncpipe.group.GroupRef`), which :meth:`close` destroys."""
            if data_parallel_group is not None:
                self._averager = GradientAverager(
                    list(self.parameters()),
                    data_parallel_group,
                    self.data_parallel_size,
                    self.device,
                    timeout=self.timeout,
                    replica=self.data_parallel_rank,
                    stage=self.stage,
                )
                self._runtime.after_backward = self._averager.start
            self._start_trace(trace, trace_every, schedule, virtual_stages, transport)
            self._stream: Stream | None = None
            if schedule == "2bw":
                check_two_bw_transport(transport)
                self._stream = Stream(
                    self._runtime, list(self.parameters()), len(segments), chunks, lookahead
                )
            self._last_segment = len(segments) - 1
            self._first_rank = segments[0].stage
            self._last_rank = segments[-1].stage
            self._pending: Work | None = None
            self._broken: StageFailure | None = None
            self.last_step: StepReport | None = None
            self._closed = False
        except BaseException:
            self._abandon(transport, created)
            raise

    def _build_stage(self, module: object, layers: list[Layer], deferred_batch_norm: bool) -> None:
        """Build this rank's layers (LazyModules built here, BatchNorm deferred, moved to the
        device) and set the attributes of the local stage."""
        mine = self.partitions[self.stage]
        self.deferred_batch_norm = bool(deferred_batch_norm)
        self.layer_names: list[str] = layer_names(module, len(layers))
        """The name of every position of the model, in order (``nn.Sequential`` keys, or
        ``"0"``, ``"1"``, ... for a list): the prefixes of :meth:`state_dict` keys."""
        built = build_layers(
            mine, self.segments, self.layer_names, self.chunks, self.deferred_batch_norm
        )
        self.layers = nn.ModuleList(built)
        if self.device.type == "cuda":
            self.layers.to(self.device)  # in place: the caller's layer objects stay the same
        self.local_names: list[list[str]] = [[] for _ in built]
        """For each local layer, the names of the positions where it runs (several for a
        reused layer); its state is saved under each."""
        for inv in mine.invocations:
            self.local_names[inv.this.index].append(self.layer_names[inv.order])
        self.register_state_dict_post_hook(rename_saved)  # type: ignore[no-untyped-call]
        self.register_load_state_dict_pre_hook(rename_loaded)  # type: ignore[no-untyped-call]
        self.register_load_state_dict_post_hook(rename_missing)  # type: ignore[no-untyped-call]

    # ----- the local layers --------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.layers)

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(self.layers)

    def __getitem__(self, index: int) -> nn.Module:
        return self.layers[index]

    @property
    def first_rank(self) -> int:
        """The rank that reads the input (it runs the first layer)."""
        return self._first_rank

    @property
    def last_rank(self) -> int:
        """The rank that computes the loss and gets the output (it runs the last layer)."""
        return self._last_rank

    @property
    def is_first_stage(self) -> bool:
        """Whether this rank reads the input (it runs the first layer)."""
        return self.stage == self._first_rank

    @property
    def is_last_stage(self) -> bool:
        """Whether this rank computes the loss (it runs the last layer)."""
        return self.stage == self._last_rank

    # ----- running -----------------------------------------------------------------------

    def _run(
        self,
        prepare: Callable[[int | None], Work],
        phase: Callable[[Action], bool] | None = None,
        resume: Work | None = None,
        averages: bool = False,
    ) -> Work:
        """Run this rank's actions of a step (or of its ``phase``). ``averages``: the step's
        gradients are averaged over the replicas afterwards (in this call's caller or a later
        phase's), so a failure here must reach the other replicas (see
        :meth:`GradientAverager.fail`)."""
        self._guard()
        try:
            if self._recorder is not None:
                self._recorder.begin()
            work, report = self._runtime.run(prepare, phase or (lambda a: True), resume=resume)
            if self.deferred_batch_norm and resume is None:  # the forwards of a mini-batch ran
                commit_all(self.layers)
        except StageFailure as e:
            self._broken = e
            self._tell_replicas(e, averages)
            raise
        except MismatchedBatch as e:  # the step ended cleanly on every rank: nothing is in flight
            if self.deferred_batch_norm:  # its statistics mean nothing either: not committed
                for module in self.layers.modules():
                    if isinstance(module, DeferredBatchNorm):
                        module.discard()
            self._tell_replicas(e, averages)
            raise
        except BaseException as e:
            what = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__  # KeyboardInterrupt
            self._broken = StageFailure(what, rank=self.stage, stage=-1, microbatch=-1, action="")
            if isinstance(e, Exception):
                self._tell_replicas(self._broken, averages)
            raise
        self.last_step = report
        if self._recorder is not None:
            self._recorder.add(report)
        return work

    def _scatter(self, value: object, what: str, microbatches: int | None) -> list[Tensors]:
        return self._split(value, what, microbatches)[1]

    def _split(
        self, value: object, what: str, microbatches: int | None
    ) -> tuple[Tensors, list[Tensors]]:
        """``value``'s tensors (on this rank's device) and their micro-batches."""
        if value is None:
            raise ValueError(
                f"the {what} is needed on stage {self.stage}, which runs the "
                f"{'first' if what == 'input' else 'last'} layer; pass it there (other stages "
                f"may pass None)"
            )
        tensors = as_tensors(value, f"the {what}")
        if self.device.type == "cuda":
            tensors = tuple(t.to(self.device) for t in tensors)
        pieces = scatter(tensors, self.chunks, what)
        if microbatches is not None and len(pieces) != microbatches:
            source = (
                f"schedule '2bw' runs chunks={self.chunks} every step"
                if self._stream is not None
                else f"the input split into {microbatches} on stage 0"
            )
            raise ValueError(
                f"the {what} splits into {len(pieces)} micro-batches (torch.chunk into "
                f"chunks={self.chunks}) but this step runs {microbatches}: {source}; pass an "
                f"input and target of the same batch size"
                + (", a multiple of chunks" if self._stream is not None else "")
            )
        return tensors, pieces

    def _prepare(
        self,
        input: object,
        target: object,
        loss_fn: LossFn | None,
        train: bool,
    ) -> Callable[[int | None], Work]:
        def prepare(microbatches: int | None) -> Work:
            inputs = targets = None
            caller: Tensors = ()
            if self.is_first_stage:
                caller, inputs = self._split(input, "input", None)
                microbatches = len(inputs)
            if self.is_last_stage and loss_fn is not None and target is not None:
                targets = self._scatter(target, "target", microbatches)
                microbatches = len(targets)
            assert microbatches is not None
            policy = self.checkpoint if self.training else "never"
            work = Work(
                microbatches,
                train,
                inputs=inputs,
                targets=targets,
                loss_fn=loss_fn,
                policy=policy,
                autocast=self.autocast,
                send_dtype=self.autocast if self.reduce_activations else None,
                loss_scale=self.scaler.scale if self.scaler and loss_fn is not None else 1.0,
            )
            if inputs and isinstance(input, (tuple, list)) and len(input) == 1:
                work.tuples.update((-1, i) for i in range(microbatches))  # as nn.Sequential
            if targets and isinstance(target, (tuple, list)) and len(target) == 1:
                work.single_target = True  # loss_fn gets each micro-batch's as given
            if train and any(t.requires_grad for t in caller):
                work.caller_inputs = caller
            return work

        return prepare

    def step(
        self,
        input: object,
        target: object,
        loss_fn: LossFn,
        optimizer: torch.optim.Optimizer | None = None,
        max_norm: float | None = None,
    ) -> float:
        """Forward and backward of one mini-batch through the whole pipeline.

        Call it on every rank with the same chunks. ``input`` (a tensor or tuple of tensors) is
        read on the first stage and ``target`` on the last; other ranks may pass ``None``.
        ``loss_fn(output, target)`` runs on the last stage for each micro-batch (with
        ``target=None`` when the last stage passes no target); each loss is
        divided by the number of micro-batches before its backward, so the local parameters
        end up with the gradients of the mean micro-batch loss.

        With ``optimizer`` (this rank's optimizer), the step ends with ``optimizer.step()``
        and ``optimizer.zero_grad()`` (a float16 step that overflowed skips
        ``optimizer.step()``, as ``torch.amp.GradScaler`` does). ``schedule="2bw"`` needs it
        (a rank without parameters passes None) and differs (see :doc:`/2bw`): the step
        runs one window of a pipeline that never drains, applies the previous mini-batch's
        gradient at its end, and returns that mini-batch's loss (NaN on the first step);
        :meth:`flush` drains the last one.

        With ``max_norm`` as well, the gradient is clipped just before ``optimizer.step()``
        to that 2-norm over every stage, as ``torch.nn.utils.clip_grad_norm_`` on the plain
        model (its norm before clipping is then :attr:`grad_norm`). With 2BW this clips the
        gradient that the update applies, the previous mini-batch's.

        Returns:
            the mean micro-batch loss, on every rank (of the previous mini-batch with 2BW).

        Raises:
            StageFailure: on every rank, if any stage failed (it names the stage, micro-batch
                and action).
            MismatchedBatch: on every rank, if input and target had different batch sizes
                (with ``optimizer``, the step's gradients are zeroed first).

        Example:
            >>> loss = pipe.step(x, y, torch.nn.functional.cross_entropy)  # doctest: +SKIP
            >>> optimizer.step()                                           # doctest: +SKIP
        """
        if self._stream is not None:  # its checks run where a failure reaches every rank
            return self._two_bw_step(input, target, loss_fn, optimizer, max_norm)
        check_step(loss_fn, optimizer, max_norm)
        if self._pending is not None:
            raise RuntimeError(
                "a training forward, pipe(input), still waits for its backward: call backward() "
                "on the last stage's output and back_helper(output) on the other stages before "
                "step(), which runs a forward and backward of its own"
            )
        before = self._shared.snapshot()
        try:
            work = self._run(self._prepare(input, target, loss_fn, train=True), averages=True)
        except MismatchedBatch:
            if optimizer is not None:  # it zeroes the step's gradients: none of this one stays
                optimizer.zero_grad()
            raise
        if self._averager is not None:
            self._average()
        self._shared.reduce(before)
        if self.scaler is not None:
            others = self._averager.reduce_max if self._averager is not None else None
            held = [g for _, g in work.caller_grads]  # the caller's input gradient (stage 0)
            self.overflow = self.scaler.settle(
                list(self.parameters()), self._runtime.exchange, others, held
            )
            if not self.overflow:  # else the caller's layers get no gradient, as GradScaler's
                to_caller(work.caller_grads)
            work.caller_grads = []
        loss = work.loss_sum / work.microbatches
        self._traced(work, loss)
        if optimizer is not None:
            if self.overflow:  # no gradient to clip or apply (as GradScaler skips the step)
                self.grad_norm = float("nan")
            else:
                if max_norm is not None:
                    self.grad_norm = float(self.clip_grad_norm_(max_norm))
                optimizer.step()
            optimizer.zero_grad()
        return loss

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> Tensor:
        """Clip the gradients of the whole pipeline by their norm over every stage.

        Call it on every rank after :meth:`step`. It equals ``torch.nn.utils.clip_grad_norm_``
        on the plain model: the norm counts every parameter once, and every stage scales its
        gradients by the same factor.

        Returns:
            the total norm of the gradients before clipping (the same on every rank); NaN
            after a float16 step that overflowed (its gradients were dropped, ``overflow``).

        Example:
            >>> loss = pipe.step(x, y, loss_fn)                # doctest: +SKIP
            >>> norm = pipe.clip_grad_norm_(1.0)               # doctest: +SKIP
            >>> optimizer.step()                               # doctest: +SKIP
        """
        if self._stream is not None:
            raise RuntimeError(
                "clip_grad_norm_ scales .grad, which under schedule '2bw' holds the running "
                "gradient of the mini-batch in flight, not the one the next update applies; "
                "pass max_norm to step() instead, which clips that gradient by its norm over "
                "every stage: pipe.step(x, y, loss_fn, optimizer=optimizer, max_norm=1.0)"
            )
        self._guard()  # a failed pipeline's ranks may hold messages of the failed call
        if self.overflow:  # the same on every rank: the step dropped every stage's gradients
            return torch.tensor(float("nan"))  # as torch's norm of the unscaled inf gradients
        repeated = self._shared.repeated()  # copies of a shared weight count once
        pairs = [(id(p), g.detach()) for p in self.parameters() if (g := p.grad) is not None]
        counted = [g for key, g in pairs if key not in repeated]
        grads = [g for _, g in pairs]
        return clip_norm(grads, self._runtime.exchange, max_norm, norm_type, counted)

    def extra_repr(self) -> str:
        return (
            f"stage={self.stage}/{self.num_stages}, balance={self.balance}, chunks={self.chunks}, "
            f"checkpoint={self.checkpoint!r}, schedule={self.schedule!r}"
        )
