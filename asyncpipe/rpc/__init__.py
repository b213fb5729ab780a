"""Single-controller mode: the training loop on rank 0, the stages serving it over RPC.

Example:
    >>> import functools, torch, torch.distributed as dist, asyncpipe     # doctest: +SKIP
    >>> asyncpipe.init(rpc=True)                                          # doctest: +SKIP
    >>> if dist.get_rank() == 0:                                          # doctest: +SKIP
    ...     pipe = asyncpipe.rpc.RemotePipe(
    ...         model, [2, 2], chunks=4,
    ...         optimizer=functools.partial(torch.optim.SGD, lr=0.1))
    ...     loss = pipe.step(x, y, torch.nn.functional.mse_loss)
    ...     pipe.optimizer_step()
    ...     pipe.shutdown()
    ... else:
    ...     asyncpipe.rpc.serve()
"""

from .driver import PipeRPCWrapper, RemotePipe
from .serve import serve

__all__ = ["PipeRPCWrapper", "RemotePipe", "serve"]
