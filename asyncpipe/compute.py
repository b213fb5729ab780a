"""The compute handlers of the runtime: forward, backward and weight-gradient actions.

A segment's forward runs its layers on fresh leaves of its inputs (and of the skips it pops),
under the checkpoint policy, autocast and a skip tracker; its backward back-propagates from its
outputs and the skips it stashed, recomputing first when the forward was checkpointed::

    F: x (leaves), skips in ──layers──> outputs, skips out      (no_grad when checkpointed)
       (the layers get aliases of the leaves, or copies when checkpointed: see ``alias``)
    B: [recompute] backward(outputs + skips out, their grads) ─> x.grad, skips-in grads
    W: weight gradients of a backward that B split (zero-bubble schedules)
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from .alias import alias, aliases, copies, differentiable, own_version
from .batchnorm import paused
from .failure import loss_hint
from .microbatch import Tensors, as_tensors
from .recompute import RNGState, checkpointed
from .schedule import Action
from .skip.routes import SkipRoutes
from .skip.tracker import SkipTracker, use
from .split import Reaches, input_backward, run_cut, weight_backward
from .work import Grads, Skips, Work, leaves, unwrap

__all__: list[str] = []


def warm_autograd() -> None:
    """Run one tiny backward with a given gradient before any step (a fraction of a millisecond
    once warm, so every pipeline runs it rather than keep a flag).

    The first such backward in a process imports what torch's autograd loads lazily for it (its
    shape checks import ``sympy``): about half a second on an idle host, seconds on a loaded
    one. Paid while the pipeline is built, that time no longer lands inside the first step,
    where every other rank would wait for it (and its timeout counts)."""
    leaf = torch.zeros(1, requires_grad=True)
    torch.autograd.backward([leaf * 2], [torch.ones(1)])


class Compute:
    """The compute handlers; :class:`~asyncpipe.runtime.Runtime` adds plans and messages."""

    rank: int
    segments: dict[int, list[torch.nn.Module]]
    owners: list[int]
    routes: SkipRoutes
    device: torch.device
    last: int
    in_place: dict[int, bool]
    """By segment: whether its layers modified their input in place in a checkpointed forward
    (learned at the first, see :meth:`_checkpointed`)."""
    _layer_modules: dict[int, list[torch.nn.Module]] | None = None
    """By segment: every module in its layers, whose training flags a checkpointed forward
    saves for its recompute (listed at the first)."""
    _reaches: Reaches | None = None
    """What each run of layers' first split backward learned from its graph (see ``split``)."""

    def _segment_modules(self, seg: int) -> list[torch.nn.Module]:
        """Every module of segment ``seg``'s layers, once (listed at the first call: the
        forward and the recompute of a micro-batch read the same list)."""
        if self._layer_modules is None:
            self._layer_modules = {}
        found = self._layer_modules.get(seg)
        if found is None:
            found = self._layer_modules[seg] = list(
                {
                    id(m): m
                    for layer in self.segments[seg]
                    if isinstance(layer, torch.nn.Module)
                    for m in layer.modules()
                }.values()
            )
        return found

    def _input(self, work: Work, seg: int, i: int) -> Tensors:
        if seg == 0:
            assert work.inputs is not None
            if work.caller_inputs:  # leaves, whose gradients go back in one go (see backward)
                return tuple(
                    own_version(t.detach()).requires_grad_(True)
                    if t.requires_grad and differentiable(t)
                    else t
                    for t in work.inputs[i]
                )
            return work.inputs[i]
        if (seg, i) in work.feed:
            return leaves(work.feed.pop((seg, i)))
        return leaves(work.outputs[(seg - 1, i)])  # previous segment on this rank

    def _skip_input(self, work: Work, seg: int, i: int) -> Skips:
        """The skips that segment ``seg`` pops from other segments, as fresh leaves."""
        arrived = work.skip_feed.pop((seg, i), {})
        return {k: None if t is None else leaves((t,))[0] for k, t in arrived.items()}

    def _compute(
        self, work: Work, seg: int, i: int, x: Tensors, skips: Skips
    ) -> tuple[Tensors, Skips]:
        """Run segment ``seg`` on ``x``; return its outputs and the skips it stashed for other
        segments."""
        value: object = unwrap(aliases(x), (seg - 1, i) in work.tuples)  # in place is fine
        split = (seg, i) in work.split and torch.is_grad_enabled()
        skips = {k: None if t is None else alias(t) for k, t in skips.items()}
        tracker = SkipTracker(skips, self.routes.crossing(seg), cut=split)
        precision = (
            torch.autocast(self.device.type, dtype=work.autocast)
            if work.autocast is not None
            else contextlib.nullcontext()
        )
        with use(tracker), precision:
            if split:
                value, work.runs[(seg, i)] = run_cut(self.segments[seg], value, tracker)
            else:
                for layer in self.segments[seg]:
                    value = layer(value)
            out = as_tensors(value, f"the output of stage {seg}")
            if len(out) == 1 and isinstance(value, (tuple, list)):
                work.tuples.add((seg, i))
            if seg == self.last and work.train and work.loss_fn is not None:
                # under autocast too, as torch.amp asks: the loss then runs in float32 where
                # autocast's lists say so (mse_loss of a bfloat16 output and a float32 target)
                # A split backward takes the loss's gradient with respect to the outputs on
                # leaves of them: the loss's own partial derivatives, which B then carries
                # through the outputs' graph once (an output computed from another, as an
                # auxiliary value, would otherwise send its part through that graph twice).
                on = out
                if split:
                    on = work.loss_inputs[i] = tuple(
                        o.detach().requires_grad_(o.requires_grad) for o in out
                    )
                work.losses[i] = self._loss(work, on, i, (seg, i) in work.tuples)
        return out, tracker.outgoing

    @staticmethod
    def _loss(work: Work, out: Tensors, i: int, single: bool) -> Tensor:
        """The loss of micro-batch ``i`` from the last stage's output ``out`` (``single``: a
        tuple of one tensor, which ``loss_fn`` gets as that tuple)."""
        assert work.loss_fn is not None
        target = None if work.targets is None else unwrap(work.targets[i], work.single_target)
        try:
            loss = work.loss_fn(unwrap(out, single), target)
        except Exception as e:
            hint = loss_hint(out, None if work.targets is None else work.targets[i])
            if hint is None:
                raise
            raise ValueError(f"loss_fn failed ({type(e).__name__}: {e}); {hint}") from e
        if not isinstance(loss, Tensor) or loss.numel() != 1:
            shape = tuple(loss.shape) if isinstance(loss, Tensor) else ""
            raise TypeError(
                f"loss_fn must return a tensor with one element (got {type(loss).__name__}{shape})"
            )
        return loss

    def forward(self, work: Work, action: Action) -> None:
        seg, i = action.stage, action.microbatch
        x = self._input(work, seg, i)
        skips = self._skip_input(work, seg, i)
        if work.train:
            work.saved[(seg, i)] = x
            work.skip_saved[(seg, i)] = skips
            work.live += 1
            work.peak = max(work.peak, work.live)
            if checkpointed(work.policy, i, work.microbatches):
                work.rng[(seg, i)] = RNGState.save(self.device, self._segment_modules(seg))
                with torch.no_grad():
                    out, stashed = self._checkpointed(work, seg, i, x, skips)
                # Announce the gradients the recomputed outputs will want.
                if self._wants_grad(seg, x, skips):
                    out = _announce(out)
                    stashed = dict(zip(stashed, _announce(tuple(stashed.values()))))
            else:
                out, stashed = self._compute(work, seg, i, x, skips)
        else:
            with torch.no_grad():
                out, stashed = self._compute(work, seg, i, x, skips)
        work.outputs[(seg, i)] = out
        work.skip_out[(seg, i)] = stashed
        for dest, keys in self.routes.outgoing.get(seg, {}).items():
            if self.owners[dest] == self.rank:  # hand over: no message
                work.skip_feed.setdefault((dest, i), {}).update((k, stashed[k]) for k in keys)
        if i in work.losses and seg == self.last:
            work.loss_parts.append(work.losses[i].detach())  # read once a step

    def _checkpointed(
        self, work: Work, seg: int, i: int, x: Tensors, skips: Skips
    ) -> tuple[Tensors, Skips]:
        """A checkpointed forward (under ``no_grad``), which must leave ``x`` and ``skips`` as
        they were: the recompute reads them again. A segment's first one runs on copies, whose
        versions tell whether its layers modify their input in place; such a segment always
        gets copies, the others run on their inputs (no copy), and their inputs' versions are
        checked after each forward: an in-place change there is an error, not a recompute
        from changed inputs."""
        known = self.in_place.get(seg)
        if known is not False:
            x = copies(x)
            skips = {k: None if t is None else copies((t,))[0] for k, t in skips.items()}
        inputs = [*x, *(t for t in skips.values() if t is not None)]
        versions = _versions(inputs)
        result = self._compute(work, seg, i, x, skips)
        changed = _versions(inputs) != versions
        if known is None:
            self.in_place[seg] = changed
        elif changed and not known:
            raise RuntimeError(
                f"stage {seg} modified its input in place in micro-batch {i}, where it had "
                f"not before; activation checkpointing recomputes the stage from that input, "
                f"so it must stay unchanged: make the in-place operation unconditional (or "
                f"out of place), or pass checkpoint='never'"
            )
        return result

    def _wants_grad(self, seg: int, x: Tensors, skips: Skips) -> bool:
        if any(t.requires_grad for t in x):
            return True
        if any(t is not None and t.requires_grad for t in skips.values()):
            return True
        params = (
            p
            for layer in self.segments[seg]
            if isinstance(layer, torch.nn.Module)
            for p in layer.parameters()
        )
        return any(p.requires_grad for p in params)

    def backward(self, work: Work, action: Action) -> None:
        seg, i = action.stage, action.microbatch
        x = work.saved.pop((seg, i))
        skips = work.skip_saved.pop((seg, i))
        out = work.outputs.pop((seg, i))
        stashed = work.skip_out.pop((seg, i))
        rng = work.rng.pop((seg, i), None)
        if rng is not None:  # recompute; autograd may be running us with gradients off
            # in the modes of its forward (the caller may have switched train()/eval() since),
            # set before paused(), which keeps the running statistics of training BatchNorms
            modes = rng.modes(self._segment_modules(seg))
            with rng.restored(), modes, torch.enable_grad(), paused(self.segments[seg]):
                out, stashed = self._compute(work, seg, i, x, skips)
        split = (seg, i) in work.split
        stash_grads = work.skip_grads.pop((seg, i), {})
        # The gradients of the outputs, and what to back-propagate from in a plain backward.
        roots: list[Tensor] = []
        grads: list[Tensor | None] = []
        given: Grads = ()
        if seg == self.last and work.loss_fn is not None:
            loss = work.losses.pop(i) * (work.loss_scale / work.microbatches)
            if not loss.requires_grad:
                raise RuntimeError(
                    f"the loss of micro-batch {i} does not require grad, so no gradient can "
                    f"flow from it, as the plain model's backward would say: loss_fn must "
                    f"compute it from its output argument with autograd on (no .detach(), "
                    f".item() or torch.no_grad() inside), and some layer must have "
                    f"parameters that require grad"
                )
            if split:
                # A plain backward of the loss alone: its graph starts at leaves of the
                # outputs, whose gradients it leaves in them (None where the loss read no
                # part, as of a tuple (logits, aux)), and its own leaves (a learnable
                # parameter of loss_fn) get theirs, as the plain model's backward gives them.
                # retain_graph: a loss that reads a tensor a layer kept goes into that
                # layer's graph, which B and W go through later (see split's ``_arrived``).
                heads = work.loss_inputs.pop(i)
                torch.autograd.backward(loss, retain_graph=True)
                given = tuple(h.grad for h in heads)
                del loss  # its saved tensors (a head's logits, say) go now, not after B
            else:
                roots, grads = [loss], [None]
        else:
            if seg == self.last:
                assert work.output_grads is not None
                given = work.output_grads[i]
            else:
                given = work.grads.pop((seg, i))
            given = tuple(_like(g, o) for o, g in zip(out, given))
            for o, g in zip(out, given):
                if g is not None and o.requires_grad:
                    roots.append(o)
                    grads.append(g)
        x_grads: list[Tensor | None]
        if split:
            if self._reaches is None:
                self._reaches = {}
            x_grads, work.weights[(seg, i)] = input_backward(
                work.runs.pop((seg, i)), given, stash_grads, self._reaches
            )
            skip_grads = stash_grads  # now: the gradients of the skips popped here
        else:
            for key, tensor in stashed.items():
                g = stash_grads.get(key)
                if g is not None and tensor is not None and tensor.requires_grad:
                    roots.append(tensor)
                    grads.append(_like(g, tensor))
            if roots:
                torch.autograd.backward(roots, grads)
            # the leaves' gradients (segment 0's only where the caller's input wants them)
            leaf = seg > 0 or bool(work.caller_inputs)
            x_grads = [t.grad if t.requires_grad and leaf else None for t in x]
            skip_grads = {
                k: t.grad if t is not None and t.requires_grad else None for k, t in skips.items()
            }
            work.live -= 1
        if seg > 0:
            work.grads[(seg - 1, i)] = tuple(x_grads)
        elif work.caller_inputs:
            work.input_grads[i] = x_grads
            if len(work.input_grads) == work.microbatches:
                _to_caller(work)
        for source, keys in self.routes.incoming.get(seg, {}).items():
            back = {k: skip_grads.get(k) for k in keys}
            if self.owners[source] == self.rank:  # hand back: no message
                work.skip_grads.setdefault((source, i), {}).update(back)
            else:
                work.skip_back.setdefault((seg, i), {}).update(back)

    def weight(self, work: Work, action: Action) -> None:
        weight_backward(work.weights.pop((action.stage, action.microbatch)))
        work.live -= 1


def _to_caller(work: Work) -> None:
    """Back-propagate the gradients of segment 0's input leaves, every micro-batch's joined
    along the batch dimension and divided by the loss scale, into the caller's input: one
    backward, as the plain model's, so a graph the caller built before the step (shared by
    every micro-batch) is gone through once. Under a float16 loss scale the joined gradients
    wait in ``work.caller_grads`` instead: the step may overflow, and the caller's layers then
    get no gradient from it (see :func:`to_caller`)."""
    pairs = []
    for n, tensor in enumerate(work.caller_inputs):
        parts = [work.input_grads[i][n] for i in range(work.microbatches)]
        if not tensor.requires_grad or all(g is None for g in parts):
            continue
        pieces = torch.chunk(tensor.detach(), work.microbatches)  # as scatter cut them
        joined = torch.cat([torch.zeros_like(p) if g is None else g for p, g in zip(pieces, parts)])
        pairs.append((tensor, joined / work.loss_scale if work.loss_scale != 1.0 else joined))
    work.input_grads.clear()
    if work.loss_scale != 1.0:
        work.caller_grads = pairs
    else:
        to_caller(pairs)


def to_caller(pairs: Sequence[tuple[Tensor, Tensor]]) -> None:
    """One backward of ``pairs`` (the caller's input tensors and their gradients) into the
    caller's graph; a float16 step calls it once every rank has agreed it did not overflow::

        segment 0, last B: joined = cat(input grads) / scale ──> work.caller_grads
        step, after the step: LossScaler.settle(parameters, joined) ──> any overflow?
            no:  backward(caller inputs, joined)   (the caller's layers get their gradients)
            yes: nothing (the caller's layers get no gradient, as GradScaler skips the step)
    """
    if pairs:
        torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])


def _like(grad: Tensor | None, tensor: Tensor) -> Tensor | None:
    """``grad`` in the dtype of ``tensor`` (a gradient may travel in a reduced dtype)."""
    return grad if grad is None or grad.dtype == tensor.dtype else grad.to(tensor.dtype)


def _announce(tensors: Sequence[Tensor | None]) -> tuple[Any, ...]:
    """Detached floating-point and complex tensors that ask for gradients (others as they
    are)."""
    return tuple(
        t.detach().requires_grad_(True) if t is not None and differentiable(t) else t
        for t in tensors
    )


def _versions(tensors: list[Tensor]) -> list[int]:
    """The version counters of ``tensors`` (each in-place change adds one); -1 for inference
    tensors, which keep none."""
    return [-1 if t.is_inference() else t._version for t in tensors]
