"""The fairscale-style forward of AsyncPipe: ``pipe(input)``, then ``backward()`` on the last
stage and ``pipe.back_helper(output)`` on the others."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from .microbatch import gather
from .schedule import Action, Kind
from .work import unwrap

if TYPE_CHECKING:
    from collections.abc import Callable

    from .parallel import GradientAverager
    from .pipe import AsyncPipe
    from .runtime import Runtime
    from .shared import SharedWeights
    from .stream import Stream
    from .work import LossFn, Work

__all__: list[str] = []

_FORWARD_KINDS = (Kind.FORWARD, Kind.SEND_F, Kind.RECV_F)


def _is_forward(action: Action) -> bool:
    return action.kind in _FORWARD_KINDS


def _is_backward(action: Action) -> bool:
    return action.kind not in _FORWARD_KINDS


class _GatherOutputs(torch.autograd.Function):
    """Joins the last stage's micro-batch outputs; its backward runs the rest of the plan.

    The outputs enter detached, with a phony tensor that asks for gradients, so autograd stops
    here and the runtime back-propagates each micro-batch itself::

        outputs[0..M-1] ──cat──> output ──user's loss──> loss
        loss.backward() ──> split grads ──> runtime runs 1B0..1B(M-1), sends grads upstream
    """

    @staticmethod
    def forward(
        ctx: Any,
        pipe: AsyncPipe,
        sizes: list[int],
        scalars: list[bool],
        phony: Tensor,
        *outputs: Tensor,
    ) -> Any:
        ctx.pipe, ctx.sizes, ctx.scalars = pipe, sizes, scalars
        return tuple(o.detach().clone() for o in outputs)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> Any:
        pipe: AsyncPipe = ctx.pipe
        split = [
            None if g is None else g.unbind(0) if scalar else torch.split(g, ctx.sizes)
            for g, scalar in zip(grads, ctx.scalars)
        ]
        per_mb: list[tuple[Tensor | None, ...]] = [
            tuple(None if s is None else s[i] for s in split) for i in range(len(ctx.sizes))
        ]
        pipe._backward_phase(per_mb)
        return (None, None, None, None) + (None,) * len(grads)


class ManualBackward:
    """AsyncPipe's ``forward``, ``back_helper`` and the backward phase they start."""

    _stream: Stream | None
    _pending: Work | None
    _runtime: Runtime
    _last_segment: int
    _shared: SharedWeights
    _averager: GradientAverager | None
    overflow: bool

    if TYPE_CHECKING:  # provided by AsyncPipe (and nn.Module)
        training: bool

        @property
        def is_last_stage(self) -> bool: ...

        def _prepare(
            self, input: object, target: object, loss_fn: LossFn | None, train: bool
        ) -> Callable[[int | None], Work]: ...

        def _run(
            self,
            prepare: Callable[[int | None], Work],
            phase: Callable[[Action], bool] | None = None,
            resume: Work | None = None,
            averages: bool = False,
        ) -> Work: ...

        def _average(self) -> None: ...

        def _traced(
            self, work: Work | None, loss: float | None, window: str | None = None
        ) -> None: ...

    def forward(self, input: object = None) -> Any:
        """Run the forward of one mini-batch through the pipeline (fairscale's style).

        On the last stage it returns the gathered output (a tensor, or a tuple), connected to
        autograd: a ``backward()`` through it runs the backward of every micro-batch and sends
        gradients upstream. The other stages get their local output (detached) and must call
        :meth:`back_helper` with it to take part in the backward. Under ``torch.no_grad()`` or
        in ``eval()`` mode this is a pure inference pipeline: nobody waits for gradients.

        Example:
            >>> out = pipe(x)                                     # doctest: +SKIP
            >>> if pipe.is_last_stage:                            # doctest: +SKIP
            ...     loss_fn(out, y).backward()
            ... else:
            ...     pipe.back_helper(out)
        """
        if self._stream is not None and (self._stream.in_flight or self.training):
            raise RuntimeError(
                "with schedule '2bw', train with pipe.step(x, y, loss_fn, optimizer=...); "
                "pipe(input) runs inference only, in eval() mode after pipe.flush()"
            )
        if self._pending is not None:
            raise RuntimeError(
                "the previous forward still waits for its backward: call backward() on the "
                "last stage's output and back_helper(output) on the other stages first"
            )
        train = self.training and torch.is_grad_enabled()
        if train:  # a pass without loss scale: gradients again, whatever the last step did
            self.overflow = False
        prepare = self._prepare(input, None, None, train=train)
        work = self._run(prepare, _is_forward if train else None, averages=train)
        last = self._last_segment if self.is_last_stage else max(self._runtime.segments)
        outputs = [work.outputs[(last, i)] for i in range(work.microbatches)]
        single = (last, 0) in work.tuples  # a tuple of one tensor stays one
        if not train:
            self._traced(work, None)
            return unwrap(gather(outputs), single)
        self._pending = work
        if not self.is_last_stage:
            return unwrap(gather([tuple(t.detach() for t in out) for out in outputs]), single)
        scalars = [t.dim() == 0 for t in outputs[0]]  # stacked by gather, one per micro-batch
        batched = scalars.index(False) if False in scalars else None
        sizes = [1 if batched is None else out[batched].shape[0] for out in outputs]
        joined = gather([tuple(t.detach() for t in out) for out in outputs])
        phony = torch.empty(0, requires_grad=True)  # makes the output ask for gradients
        joined_out = _GatherOutputs.apply(self, sizes, scalars, phony, *joined)  # type: ignore[no-untyped-call]
        return unwrap(joined_out, single)

    def _backward_phase(self, output_grads: list[tuple[Tensor | None, ...]] | None) -> None:
        work, self._pending = self._pending, None
        if work is None:
            raise RuntimeError(
                "there is no forward waiting for its backward: call pipe(input) first"
            )
        work.output_grads = output_grads
        before = self._shared.snapshot()
        self._run(lambda m: work, _is_backward, resume=work, averages=True)
        if self._averager is not None:
            self._average()
        self._shared.reduce(before)
        self._traced(work, None)

    def back_helper(self, output: object = None) -> None:
        """Take part in the backward of the last :meth:`forward` on a stage other than the last.

        Example:
            >>> out = pipe(x)              # doctest: +SKIP
            >>> pipe.back_helper(out)      # doctest: +SKIP
        """
        if self.is_last_stage:
            raise RuntimeError(
                "back_helper() is for the stages before the last; on the last stage call "
                "backward() on a loss computed from the output of pipe(input)"
            )
        self._backward_phase(None)
