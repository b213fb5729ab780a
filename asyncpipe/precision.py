"""Mixed precision and gradient norms: a loss scale shared by every stage, clipping over all.

With float16 the last stage multiplies each micro-batch loss by the scale before its backward,
so small gradients survive; after the step every stage checks its own gradients and the ranks
exchange one flag. An overflow anywhere skips the step everywhere::

    last stage: backward(loss * scale)  ──gradients (scaled)──> every stage
    every stage: finite = all(isfinite(grad))  ──exchange──> any overflow?
        yes: grads = None on every stage (optimizer.step() skips them), scale *= backoff
        no:  grads /= scale; after growth_interval clean steps, scale *= growth

The caller's layers before the pipeline (``pipe.step(embed(x), ...)``) count too: their input
gradient waits on the first stage, counts in its flag, and goes into their graph only if no
rank overflowed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .transport import Message, PendingRecv, Transport, TransportTimeout

__all__: list[str] = []

DTYPES = (torch.bfloat16, torch.float16)


@dataclass
class LossScaler:
    """A dynamic loss scale (float16 training). Same on every rank: each rank applies the same
    update from the same exchanged overflow flag."""

    scale: float = 2.0**16
    growth: float = 2.0
    backoff: float = 0.5
    growth_interval: int = 2000
    clean_steps: int = 0

    def settle(
        self,
        parameters: list[nn.Parameter],
        exchange: Callable[[Sequence[float]], list[list[float]]],
        replicas: Callable[[float], float] | None = None,
        held: Sequence[Tensor] = (),
    ) -> bool:
        """After a step: agree with every rank (``exchange``) and replica (``replicas``, the
        largest value over them) whether any gradient overflowed; drop this rank's gradients if
        so, else unscale them; update the scale. Returns whether the step overflowed.
        ``held``: unscaled gradients not yet in any parameter (the caller's input gradient)
        that count in the flag; the caller applies them only if the step did not overflow."""
        finite = all_finite(parameters) and all(bool(torch.isfinite(g).all()) for g in held)
        table = exchange([0.0 if finite else 1.0])
        overflow = any(row[0] for row in table)
        if replicas is not None:  # replicas agree (their averaged gradients do anyway)
            overflow = replicas(float(overflow)) > 0
        if overflow:
            drop_(parameters)
        else:
            unscale_(parameters, self.scale)
        self.update(overflow)
        return overflow

    def state_dict(self) -> dict[str, float]:
        """The scale and its progress towards the next growth (saved in checkpoints)."""
        return {"scale": self.scale, "clean_steps": float(self.clean_steps)}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.scale = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])

    def update(self, overflow: bool) -> None:
        if overflow:
            self.scale *= self.backoff
            self.clean_steps = 0
            return
        self.clean_steps += 1
        if self.clean_steps >= self.growth_interval:
            self.scale *= self.growth
            self.clean_steps = 0


def all_finite(parameters: Iterable[nn.Parameter]) -> bool:
    """Whether every gradient of ``parameters`` is free of inf and NaN."""
    checks = [torch.isfinite(p.grad).all() for p in parameters if p.grad is not None]
    return bool(torch.stack(checks).all()) if checks else True


def unscale_(parameters: Iterable[nn.Parameter], scale: float) -> None:
    """Divide every gradient by ``scale`` in place."""
    for p in parameters:
        if p.grad is not None:
            p.grad.div_(scale)


def drop_(parameters: Iterable[nn.Parameter]) -> None:
    """Forget every gradient, so the optimizer skips this step."""
    for p in parameters:
        p.grad = None


def partial_norm(grads: Sequence[Tensor | None], norm_type: float = 2.0) -> float:
    """This rank's part of a norm over every rank: the sum of ``|g| ** p`` (the largest
    ``|g|`` for the infinity norm), in float64, as ``torch.nn.utils.clip_grad_norm_`` counts
    it: the modulus of a complex gradient, and NaN if any gradient holds one."""
    present = [g for g in grads if g is not None]
    if not present:
        return 0.0
    device = present[0].device
    norms = torch.stack([_norm64(g, norm_type).to(device) for g in present])
    # tensor reductions: Python's max() keeps or drops a NaN depending on where it stands
    return float(norms.max() if norm_type == math.inf else norms.pow(norm_type).sum())


def _norm64(g: Tensor, norm_type: float) -> Tensor:
    """The ``norm_type``-norm of ``g`` computed in float64 (``.double()`` would drop the
    imaginary part of a complex ``g``; its norm is taken over ``|g|``)."""
    dtype = torch.complex128 if g.is_complex() else torch.float64
    norm: Tensor = torch.linalg.vector_norm(g, norm_type, dtype=dtype)
    return norm


def total_norm(parts: Sequence[float], norm_type: float = 2.0) -> float:
    """The norm over every rank from each rank's :func:`partial_norm`; NaN if any part is."""
    if any(math.isnan(part) for part in parts):
        return math.nan
    return max(parts) if norm_type == math.inf else float(sum(parts) ** (1.0 / norm_type))


def scale_to(grads: Sequence[Tensor | None], max_norm: float, total: float) -> None:
    """Scale ``grads`` in place so that a total norm of ``total`` becomes at most
    ``max_norm``, as ``torch.nn.utils.clip_grad_norm_`` does (a NaN ``total`` makes them
    NaN, an infinite one zero and its inf entries NaN, as there)."""
    coefficient = max_norm / (total + 1e-6)
    if coefficient > 1.0:  # not min(): a NaN stays NaN, as torch.clamp(max=1.0) keeps it
        coefficient = 1.0
    for g in grads:
        if g is not None:
            g.mul_(coefficient)


def clip_norm(
    grads: list[Tensor],
    exchange: Callable[[Sequence[float]], list[list[float]]],
    max_norm: float,
    norm_type: float,
    counted: list[Tensor] | None = None,
) -> Tensor:
    """Clip ``grads`` (this rank's) by the norm over every rank, found with one ``exchange``
    of each rank's partial sum of ``counted`` (default: ``grads``; copies of a shared weight
    but one are left out of it); returns that norm."""
    if not (isinstance(max_norm, (int, float)) and max_norm > 0):
        raise ValueError(f"max_norm must be a positive number (got {max_norm!r})")
    norm_type = float(norm_type)
    if not norm_type > 0:  # a NaN too
        raise ValueError(
            f"norm_type must be a positive number or math.inf (got {norm_type!r}); 2.0 is "
            f"the usual one"
        )
    table = exchange([partial_norm(grads if counted is None else counted, norm_type)])
    total = total_norm([row[0] for row in table], norm_type)
    scale_to(grads, max_norm, total)
    return torch.tensor(total)


class SpreadNorm:
    """The 2-norm over every rank of a gradient that each rank completes at its own time
    (2BW's), without waiting where it is completed: each rank sends its part as soon as its
    gradient is complete and reads the others' only when it clips, just before its update::

        every rank:  post receives ── ... ── gradient complete: send |g|^2 to every rank
                     ... ── update: wait for the others' parts, clip by the total, step

    Args:
        transport: the pipeline's transport.
        channel: the channel that carries the parts (one message per peer and gradient).
        timeout: seconds to wait for a peer's part.
        device: where message tensors live.
    """

    def __init__(
        self, transport: Transport, channel: int, timeout: float, device: torch.device
    ) -> None:
        self.transport, self.channel, self.timeout = transport, channel, timeout
        self.device = device
        self._pending: dict[int, PendingRecv] = {}
        self._part: float | None = None

    def post(self) -> None:
        """Post the receives of the others' parts of the next gradient."""
        peers = [r for r in range(self.transport.world_size) if r != self.transport.rank]
        self._pending = {peer: self.transport.recv(peer, self.channel) for peer in peers}

    def send(self, grads: Sequence[Tensor | None]) -> None:
        """This rank's gradient is complete: send its part to every other rank."""
        self._part = partial_norm(grads)
        value = torch.tensor([self._part], dtype=torch.float64, device=self.device)
        for peer in self._pending:
            self.transport.send(peer, self.channel, Message(0, 0, (value,)))

    def clip(self, grads: Sequence[Tensor | None], max_norm: float) -> float:
        """Scale ``grads`` (this rank's) to a total norm of at most ``max_norm`` over every
        rank; returns the total norm before clipping."""
        parts = [self._part if self._part is not None else partial_norm(grads)]
        pending, self._pending, self._part = self._pending, {}, None
        for peer, receive in pending.items():
            try:
                message = receive.wait(self.timeout)
            except TransportTimeout as e:
                raise TransportTimeout(
                    f"rank {peer} sent no part of the gradient norm within {self.timeout:.1f} s: "
                    f"it is stuck or gone, or it called step() without max_norm (pass the same "
                    f"max_norm on every rank)"
                ) from e
            parts += message.values(peer, "part of the gradient norm")
        total = total_norm(parts)
        scale_to(grads, max_norm, total)
        return total
