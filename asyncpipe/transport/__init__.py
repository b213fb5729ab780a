"""Transports: one interface, several carriers (point-to-point, shared memory, RPC,
in-process)."""

from .base import GroupTransport, Message, PeerLost, PendingRecv, Transport, TransportTimeout
from .inprocess import InProcessHub, InProcessTransport
from .p2p import P2PTransport
from .rpc import RPCTransport
from .shm import ShmTransport

__all__ = [
    "GroupTransport",
    "InProcessHub",
    "InProcessTransport",
    "Message",
    "P2PTransport",
    "PeerLost",
    "PendingRecv",
    "RPCTransport",
    "ShmTransport",
    "Transport",
    "TransportTimeout",
]
