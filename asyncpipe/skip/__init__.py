"""Skip connections: tensors that jump over layers, within a stage or across stages.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from asyncpipe.skip import pop, skippable, stash, verify_skippables
    >>> @skippable(stash=["identity"])
    ... class Remember(nn.Module):
    ...     def forward(self, input):
    ...         yield stash("identity", input)
    ...         return input
    >>> @skippable(pop=["identity"])
    ... class AddBack(nn.Module):
    ...     def forward(self, input):
    ...         identity = yield pop("identity")
    ...         return input + identity
    >>> model = nn.Sequential(Remember(), nn.Linear(4, 4), AddBack())
    >>> verify_skippables(model)
"""

from .layer import Skippable, pop, skippable, stash
from .namespace import Namespace
from .verify import verify_skippables

__all__ = ["Namespace", "Skippable", "pop", "skippable", "stash", "verify_skippables"]
