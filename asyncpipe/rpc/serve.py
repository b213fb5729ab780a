"""``serve()``: what every rank but the controller runs in single-controller mode."""

from __future__ import annotations

import torch.distributed.rpc as torch_rpc

from ..group import shutdown
from ..transport.rpc import worker_names
from .stage import Serving, alive

__all__: list[str] = []


def serve(driver: str | None = None, check_every: float = 2.0, timeout: float = 10.0) -> None:
    """Serve the driver's calls until it shuts down, then end RPC and the process group.

    Every ``check_every`` seconds the worker asks the driver whether it is still there; if it
    does not answer within ``timeout`` seconds (it died), ``serve`` raises instead of waiting
    forever.

    Args:
        driver: the RPC worker name of the controller (default: RPC worker 0's, the name
            ``asyncpipe.init(rpc=True, worker_map=...)`` gave rank 0, ``"worker0"`` by
            default).
        check_every: seconds between checks that the driver is alive.
        timeout: seconds one check may take.

    Raises:
        RuntimeError: if RPC is not running, this is the driver's own process, or the driver
            went away without shutting down.

    Example:
        >>> asyncpipe.init(rpc=True)   # doctest: +SKIP
        >>> asyncpipe.rpc.serve()      # doctest: +SKIP
    """
    try:
        me = torch_rpc.get_worker_info()
    except RuntimeError as e:
        raise RuntimeError(
            "serve() needs torch.distributed.rpc: call asyncpipe.init(rpc=True) first"
        ) from e
    if driver is None:
        driver = worker_names()[0]
    if me.name == driver:
        raise RuntimeError(
            f"serve() runs on the workers; this process is the driver ({driver!r}): build an "
            f"asyncpipe.rpc.RemotePipe here instead"
        )
    while not Serving.released.wait(check_every):
        try:
            torch_rpc.rpc_sync(driver, alive, args=(), timeout=timeout)
        except Exception as e:
            raise RuntimeError(
                f"the driver ({driver!r}) went away without shutting down, so worker "
                f"{me.name!r} stops serving: {str(e).splitlines()[0] if str(e) else e!r}"
            ) from e
    Serving.released.clear()
    shutdown()
