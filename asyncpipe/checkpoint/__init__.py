"""Checkpoints of a pipeline: save and load one file per stage, reshard, and stop gracefully.

Example:
    Save and load on every rank (onto any balance), then rebuild the plain model in one process:

    >>> from asyncpipe import checkpoint
    >>> checkpoint.save(pipe, optimizer, "ckpt", step=100)  # doctest: +SKIP
    >>> step = checkpoint.load(pipe, optimizer, "ckpt").step  # doctest: +SKIP
    >>> model.load_state_dict(checkpoint.consolidate("ckpt"))  # doctest: +SKIP
"""

from .files import Manifest, read_manifest, save
from .restore import consolidate, load
from .stop import GracefulStop

__all__ = ["GracefulStop", "Manifest", "consolidate", "load", "read_manifest", "save"]
