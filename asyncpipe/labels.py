"""Named ``torch.profiler`` ranges for the runtime's actions that cost nothing unprofiled.

``record_function`` enters the profiler's dispatcher even when no profiler runs (tens of
microseconds per action on a small CPU); the runtime labels every action, so it asks first.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.autograd.profiler import record_function

__all__: list[str] = []


def profiler_range(name: str) -> contextlib.AbstractContextManager[Any]:
    """A ``torch.profiler`` range named ``name`` while a profiler runs, else nothing."""
    if torch._C._autograd._profiler_enabled():
        return record_function(name)
    return contextlib.nullcontext()
