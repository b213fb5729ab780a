"""Checkpoints of a pipeline: save and load one file per stage, reshard, and stop gracefully.

Example:
    >>> from asyncpipe import checkpoint                                   # doctest: +SKIP
    >>> checkpoint.save(pipe, optimizer, "ckpt", step=100)                 # every rank
    >>> step = checkpoint.load(pipe, optimizer, "ckpt").step               # any balance
    >>> model.load_state_dict(checkpoint.consolidate("ckpt"))              # the plain model
"""

from .files import Manifest, consolidate, load, read_manifest, save
from .stop import GracefulStop

__all__ = ["GracefulStop", "Manifest", "consolidate", "load", "read_manifest", "save"]
