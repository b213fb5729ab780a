"""The state of one step on one rank: inputs, targets, and every micro-batch in flight."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .alias import differentiable
from .microbatch import Tensors
from .recompute import RNGState
from .schedule import Action
from .skip.namespace import SkipKey
from .split import LayerRun
from .transport import PendingRecv

__all__: list[str] = []

Grads = tuple[Tensor | None, ...]
Skips = dict[SkipKey, Tensor | None]
LossFn = Callable[[object, object], Tensor]


def unwrap(tensors: Tensors, single: bool = False) -> object:
    """What the next layer is called with: a single tensor as itself, several as a tuple, and
    a ``single`` tuple of one tensor as that tuple (as ``nn.Sequential`` would pass it)."""
    return tensors[0] if len(tensors) == 1 and not single else tensors


def leaves(tensors: Sequence[Tensor]) -> Tensors:
    """Detached copies that start a new graph, asking for gradients where the input did."""
    out = []
    for t in tensors:
        leaf = t.detach()
        if t.requires_grad and differentiable(t):
            leaf.requires_grad_(True)
        out.append(leaf)
    return tuple(out)


@dataclass
class Work:
    """What one step needs: inputs, targets and the state of every micro-batch in flight."""

    microbatches: int
    train: bool
    inputs: list[Tensors] | None = None
    caller_inputs: Tensors = ()
    """The step's input as the caller gave it, where some of it requires grad: segment 0 runs
    on leaves of its micro-batches, whose gradients go back into the caller's graph once, when
    every micro-batch's are known (see ``Compute.backward``)."""
    input_grads: dict[int, list[Tensor | None]] = field(default_factory=dict)
    """By micro-batch: the gradients of segment 0's input leaves."""
    caller_grads: list[tuple[Tensor, Tensor]] = field(default_factory=list)
    """Under a float16 loss scale: the caller's input tensors and their joined, unscaled
    gradients, held back until the ranks agree that the step did not overflow (see
    ``compute.to_caller``)."""
    targets: list[Tensors] | None = None
    single_target: bool = False
    """The target was a tuple (or list) of one tensor, which ``loss_fn`` gets as that tuple."""
    loss_fn: LossFn | None = None
    output_grads: list[Grads] | None = None
    policy: str = "never"
    autocast: torch.dtype | None = None
    send_dtype: torch.dtype | None = None
    """Float32 activations travel in this dtype (``AsyncPipe(reduce_activations=True)``)."""
    loss_scale: float = 1.0
    feed: dict[tuple[int, int], Tensors] = field(default_factory=dict)
    saved: dict[tuple[int, int], Tensors] = field(default_factory=dict)
    outputs: dict[tuple[int, int], Tensors] = field(default_factory=dict)
    rng: dict[tuple[int, int], RNGState] = field(default_factory=dict)
    grads: dict[tuple[int, int], Grads] = field(default_factory=dict)
    losses: dict[int, Tensor] = field(default_factory=dict)
    loss_inputs: dict[int, Tensors] = field(default_factory=dict)
    """Split backwards: the leaves (detached outputs) each micro-batch's loss was computed
    on, so that its gradient is the loss's own, not through the last stage's graph."""
    pending: dict[Action, PendingRecv] = field(default_factory=dict)
    unposted: list[Action] = field(default_factory=list)
    split: frozenset[tuple[int, int]] = frozenset()
    settle: dict[Action, list[Action]] = field(default_factory=dict)
    runs: dict[tuple[int, int], list[LayerRun]] = field(default_factory=dict)
    weights: dict[tuple[int, int], list[tuple[LayerRun, list[Tensor | None]]]] = field(
        default_factory=dict
    )
    # Skips, by (segment, micro-batch): what arrived for it, the leaves its forward popped,
    # what it stashed for others, the gradients of those, and the gradients it sends back.
    skip_feed: dict[tuple[int, int], Skips] = field(default_factory=dict)
    skip_saved: dict[tuple[int, int], Skips] = field(default_factory=dict)
    skip_out: dict[tuple[int, int], Skips] = field(default_factory=dict)
    skip_grads: dict[tuple[int, int], Skips] = field(default_factory=dict)
    skip_back: dict[tuple[int, int], Skips] = field(default_factory=dict)
    tuples: set[tuple[int, int]] = field(default_factory=set)
    """(segment, micro-batch) whose output was a tuple (or list) of one tensor, which the next
    segment's first layer (or ``loss_fn``) gets as that tuple; segment -1: the input."""
    loss_sum: float = 0.0
    loss_parts: list[Tensor] = field(default_factory=list)
    """Micro-batch losses not yet added to ``loss_sum`` (see :meth:`local_loss`)."""
    live: int = 0
    peak: int = 0

    def local_loss(self) -> float:
        """The sum of this rank's micro-batch losses so far. The forwards only collect them:
        reading a loss's value waits for the device, so it is done here, once a step."""
        if self.loss_parts:
            total = sum(part.reshape(()).double() for part in self.loss_parts)
            self.loss_sum += float(total)
            self.loss_parts = []
        return self.loss_sum
