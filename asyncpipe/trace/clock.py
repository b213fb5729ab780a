"""Clock offsets between ranks, measured once over the pipeline's own transport.

Each rank asks rank 0 for its time a few times; the reply with the shortest round trip gives
the offset (rank 0's clock minus this rank's, assuming the reply was stamped half way)::

    rank r   t1 ──request──>            <──reply(t0)── t2      offset = t0 - (t1 + t2) / 2
    rank 0              t0 = perf_counter()
"""

from __future__ import annotations

import time

import torch

from ..runtime import CLOCK_CHANNEL
from ..transport import Message, Transport

__all__: list[str] = []

ROUNDS = 8


def clock_offset(transport: Transport, timeout: float, device: torch.device) -> float:
    """Seconds to add to this rank's ``time.perf_counter()`` to read rank 0's clock.

    Every rank of ``transport`` must call it at the same point; rank 0 answers the others in
    rank order and gets 0.
    """

    def stamp(value: float) -> Message:
        return Message(0, 0, (torch.tensor([value], dtype=torch.float64, device=device),))

    if transport.rank == 0:
        for peer in range(1, transport.world_size):
            for _ in range(ROUNDS):
                transport.recv(peer, CLOCK_CHANNEL).wait(timeout)
                transport.send(peer, CLOCK_CHANNEL, stamp(time.perf_counter()))
        transport.flush(timeout)
        return 0.0
    best: tuple[float, float] | None = None
    for _ in range(ROUNDS):
        reply = transport.recv(0, CLOCK_CHANNEL)
        sent = time.perf_counter()
        transport.send(0, CLOCK_CHANNEL, stamp(sent))
        message = reply.wait(timeout)
        received = time.perf_counter()
        tensor = message.tensors[0]
        if tensor is None:
            raise RuntimeError(f"rank 0 sent no time stamp to rank {transport.rank}")
        offset = float(tensor.item()) - (sent + received) / 2
        if best is None or received - sent < best[0]:
            best = (received - sent, offset)
    transport.flush_received(timeout)  # rank 0's last reply came after it took every stamp
    assert best is not None
    return best[1]
