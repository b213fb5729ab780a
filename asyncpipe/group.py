"""Process-group set-up from the environment that torchrun gives every process."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

__all__: list[str] = []

_TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def init(backend: str | None = None, timeout: float | datetime.timedelta = 300.0) -> None:
    """Set up the default process group from torchrun's environment.

    Harmless when the process group already exists (it is left as it is). The backend is
    NCCL when CUDA is available, else gloo; with NCCL the current CUDA device is set to
    ``LOCAL_RANK``.

    Args:
        backend: ``"gloo"``, ``"nccl"`` or ``None`` to choose as above.
        timeout: seconds (or a timedelta) collective operations may wait.

    Raises:
        RuntimeError: if the process was not started by torchrun (the variables are missing).

    Example:
        >>> import asyncpipe
        >>> asyncpipe.init()  # doctest: +SKIP
    """
    if dist.is_initialized():
        return
    missing = [name for name in _TORCHRUN_VARIABLES if name not in os.environ]
    if missing:
        raise RuntimeError(
            "asyncpipe.init() reads the environment that torchrun sets, but "
            f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} missing; launch the "
            "script with torchrun, e.g. torchrun --standalone --nproc-per-node=4 train.py"
        )
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not isinstance(timeout, datetime.timedelta):
        timeout = datetime.timedelta(seconds=float(timeout))
    dist.init_process_group(backend=backend, timeout=timeout)
