"""Activation checkpointing: which micro-batches drop activations, and replaying RNG and modes.

A checkpointed forward runs under ``torch.no_grad()`` and keeps only its inputs, the random
number generator state and its layers' training flags; its backward first runs the forward
again with that state restored, so dropout masks match and every layer runs in the mode of the
first forward (the caller may switch ``train()``/``eval()`` before the backward: a 2BW
mini-batch in flight, or ``pipe(input)`` before its backward), then back-propagates::

    forward    inputs ──F (no graph)──> outputs          keep: inputs, RNG state, modes
    backward   inputs ──F (graph, same RNG, modes)──> outputs ──backward──> input and weight grads
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

__all__: list[str] = []

# torch's default generators belong to the process, and so does the lock that keeps two threads
# (stages of one process, e.g. over the in-process transport) from saving and restoring them at
# once: torch.get_rng_state and torch.set_rng_state racing in two threads can deadlock, and a
# replay must not see another thread's restored state.
_GENERATORS = threading.RLock()

POLICIES = ("always", "except_last", "never")


def checkpointed(policy: str, microbatch: int, microbatches: int) -> bool:
    """Whether ``microbatch`` drops its activations under ``policy``."""
    if policy == "always":
        return True
    if policy == "except_last":
        return microbatch < microbatches - 1
    return False


@contextmanager
def forked_rng() -> Iterator[None]:
    """``torch.random.fork_rng`` of the CPU generator, one thread at a time."""
    with _GENERATORS, torch.random.fork_rng(devices=[]):
        yield


@dataclass(frozen=True)
class RNGState:
    """The CPU generator state and, where CUDA is in use, the current device's state; with
    the training flags of the modules the forward ran (see :meth:`modes`)."""

    cpu: torch.Tensor
    cuda: torch.Tensor | None
    device: int | None
    training: list[bool] | None = None

    @classmethod
    def save(cls, device: torch.device, modules: Sequence[torch.nn.Module] = ()) -> RNGState:
        training = [m.training for m in modules]
        with _GENERATORS:
            if device.type == "cuda":
                index = device.index if device.index is not None else torch.cuda.current_device()
                return cls(torch.get_rng_state(), torch.cuda.get_rng_state(index), index, training)
            return cls(torch.get_rng_state(), None, None, training)

    @contextmanager
    def modes(self, modules: Sequence[torch.nn.Module]) -> Iterator[None]:
        """Run the body with ``modules`` (those given to :meth:`save`) in the training mode
        they had then, and put back the modes the caller has set since (if any)."""
        saved = self.training or []
        changed = [m for m, mode in zip(modules, saved) if m.training != mode]
        if not changed:  # the usual case: nothing to do
            yield
            return
        for m in changed:
            m.training = not m.training
        try:
            yield
        finally:
            for m in changed:
                m.training = not m.training

    @contextmanager
    def restored(self) -> Iterator[None]:
        """Run the body with this state, then put the generators back as they were."""
        devices = [] if self.device is None else [self.device]
        with _GENERATORS, torch.random.fork_rng(devices=devices):
            torch.set_rng_state(self.cpu)
            if self.cuda is not None and self.device is not None:
                torch.cuda.set_rng_state(self.cuda, self.device)
            yield
