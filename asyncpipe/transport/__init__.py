"""Transports: one interface, several carriers (point-to-point, in-process)."""

from .base import Message, PendingRecv, Transport, TransportTimeout
from .inprocess import InProcessHub, InProcessTransport
from .p2p import P2PTransport

__all__ = [
    "InProcessHub",
    "InProcessTransport",
    "Message",
    "P2PTransport",
    "PendingRecv",
    "Transport",
    "TransportTimeout",
]
