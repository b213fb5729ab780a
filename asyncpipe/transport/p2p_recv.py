"""The receiving end of the p2p transport: a posted receive, and early buffers of large ones.

:class:`_P2PRecv` is one posted receive; :class:`_Lane` holds the receives of one peer and
channel that post their tensors' buffers before the header comes. The message format and the
protocol are described in :mod:`asyncpipe.transport.p2p`.
"""

from __future__ import annotations

import ctypes
import re
import time
from array import array
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor

from .base import Message, PeerLost, PendingRecv, TransportTimeout
from .frame import (
    DTYPES,
    EARLY,
    ERROR,
    HEADER_BYTES,
    MICROBATCHES,
    PACKED,
    Spec,
    decode_header,
    error_text,
    layout,
    nbytes,
    read_fields,
    views,
)

if TYPE_CHECKING:
    from .p2p import P2PTransport

__all__: list[str] = []


_EARLY_WINDOW = 2
"""Receives of one peer and channel whose large tensors may be posted before their header has
come (see :class:`_Lane`): enough to take the header's round trip off a stream of large
messages, few enough that a step's receives, all posted at once, do not hold every
micro-batch's tensor buffers at once."""


def _gist(text: str) -> str:
    """The backend's own words from an error: its first line without the source location and
    the generic advice that follows."""
    line = re.sub(r"\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", text.splitlines()[0] if text else "")
    return line.split(". This is typically")[0].strip() or "unknown error"


def _completed(work: dist.Work, timeout: float) -> None:
    """Block the host until ``work`` is complete, or raise a timeout error after ``timeout`` s.

    An NCCL receive's ``wait`` makes the current CUDA stream wait and returns at once; the host
    would then block, without a timeout, in the first copy of the message to host memory."""
    deadline = time.monotonic() + timeout
    pause = 1e-5
    while not work.is_completed():
        if time.monotonic() > deadline:
            raise RuntimeError(f"Timed out after {timeout:.1f} s")
        time.sleep(pause)
        pause = min(pause * 2, 1e-3)


@dataclass(frozen=True)
class _Expected:
    """The last packed message of a channel, for receiving the next one without decoding its
    header: a pipeline sends the same kinds of tensors at every micro-batch. A message matches
    when its header's bytes equal these but for the micro-batch fields; anything else (an
    error, other shapes) takes the full decoding."""

    start: bytes  # header bytes 0..24: magic, field count, kind
    end: bytes  # header bytes from 40 on: total size, tensor count, tensor specs
    size: int  # header bytes
    total: int  # message bytes
    specs: list[Spec]
    offsets: list[int]

    @classmethod
    def of(cls, fields: Sequence[int], specs: list[Spec], offsets: list[int]) -> _Expected:
        """The expectation of a packed message with header ``fields`` (decoded: ``specs``,
        ``offsets``)."""
        raw = array("q", fields).tobytes()
        return cls(raw[:24], raw[40:], len(raw), fields[5], specs, offsets)


class _Lane:
    """The receives from one peer on one channel whose slot's last message was large (more
    than ``PACK_LIMIT`` bytes, so it went separate, header then tensors), in posting order.

    Both ends keep the tensor sizes of that message (``P2PTransport.records``, and the
    sender's own record of what it sent). The receiver posts the next message's tensor
    receives into buffers of those sizes without waiting for its header, so the tensors travel
    as soon as they are sent instead of a round trip after the header: ::

        separate   tag 3c     [ header ]         receiver posts tag 3c+1 on reading it
                   tag 3c+1   [ tensor 0 ] ...
        early      tag 3c     [ header ]         kind EARLY: the tensors fit the record
                   tag 3c+2   [ tensor 0 ] ...   into buffers posted with the header's

    A message whose tensors do not fit the record (more of them, or larger), or that goes
    packed, sends a one-byte stand-in on tag 3c+2 for each early buffer, which the receiver
    takes and drops. Only ``_EARLY_WINDOW`` receives of a lane have their buffers posted at a
    time (a step posts all its receives at once); the next is posted when one is taken, and a
    receive waited on out of turn posts those before it first, since a tag's messages are
    matched to its receives in posting order.
    """

    def __init__(self) -> None:
        self.queued: deque[_P2PRecv] = deque()
        self.posted = 0

    def queue(self, recv: _P2PRecv) -> None:
        self.queued.append(recv)
        self.promote()

    def promote(self, until: _P2PRecv | None = None) -> None:
        """Post the early buffers of queued receives while fewer than the window are posted,
        and up to ``until`` in any case."""
        while self.queued:
            if self.posted >= _EARLY_WINDOW and (until is None or until.early is not None):
                return
            self.queued.popleft().post_early()
            self.posted += 1

    def done(self) -> None:
        """A receive took its early buffers: post the next queued one's."""
        self.posted -= 1
        self.promote()


class _P2PRecv(PendingRecv):
    def __init__(self, transport: P2PTransport, src: int, channel: int, slot: int) -> None:
        self.transport, self.src, self.channel, self.slot = transport, src, channel, slot
        self.tag = transport.tags + 3 * channel  # the channel's tags: this pipeline's
        capacity = transport.capacity.get((src, channel, slot), HEADER_BYTES)
        self.buffer = torch.empty(capacity, dtype=torch.uint8, device=transport.wire)
        self.work: dist.Work | None = transport.irecv(self.buffer, src, self.tag)
        # A slot whose last message was large: the next one's tensors are received into
        # buffers of that message's sizes, posted before the header comes (see _Lane).
        key = (src, channel, slot)
        self.record = transport.records.get(key) if transport.packs else None
        self.early: list[Tensor] | None = None
        self.early_works: list[dist.Work | None] = []
        if self.record is not None:
            transport.lane(src, channel).queue(self)
        # The message this channel sent last time, if this one fits packed: its tensors' views
        # are made now, while the rank has nothing better to do, and wait() only checks that
        # the header is the expected one (see _Expected).
        expected = transport.expected.get((src, channel))
        if expected is None or expected.total > capacity or self.record is not None:
            expected = None
        self.expected = expected
        self.views: tuple[Tensor | None, ...] = ()
        self.address = 0
        if self.expected is not None:
            specs, offsets = self.expected.specs, self.expected.offsets
            self.views = tuple(views(self.buffer, specs, offsets, grad=True))
            self.address = self.buffer.data_ptr()

    def _wait(self, work: dist.Work | None, timeout: float, what: str) -> None:
        assert work is not None  # point-to-point operations always return a Work
        try:
            if not self.transport._direct:
                _completed(work, timeout)  # NCCL's wait only orders the current stream
            work.wait(self.transport.timedelta(timeout))
        except RuntimeError as e:
            text = str(e)
            me = self.transport.rank
            if "Timed out" in text or "timeout" in text.lower():
                raise TransportTimeout(
                    f"rank {me} timed out after {timeout:.1f} s waiting for {what} from rank "
                    f"{self.src}; that rank is slow, stuck or gone (raise the pipeline's timeout "
                    f"if its work really takes longer)"
                ) from e
            raise PeerLost(
                f"rank {me} lost rank {self.src} while waiting for {what}: {_gist(text)}",
                self.src,
            ) from e

    def post_early(self) -> None:
        """Post the receives of this message's tensors, sized by its slot's record."""
        assert self.record is not None and self.early is None
        transport = self.transport
        self.early = [torch.empty(n, dtype=torch.uint8, device=transport.wire) for n in self.record]
        tag = self.tag + 2
        self.early_works = [transport.irecv(buffer, self.src, tag) for buffer in self.early]

    def _take_early(self, timeout: float, what: str) -> list[Tensor]:
        """Wait for what came into the early buffers (the tensors, or the sender's stand-ins
        where they did not fit) and let the lane post the next receive's."""
        lane = self.transport.lane(self.src, self.channel)
        if self.early is None:
            lane.promote(until=self)
        assert self.early is not None
        for work in self.early_works:
            self._wait(work, timeout, what)
        self.early_works = []
        lane.done()
        return self.early

    def wait(self, timeout: float) -> Message:
        self._wait(self.work, timeout, "a message")
        self.work = None  # hold no finished Work: gloo may abort on them at interpreter exit
        expected = self.expected
        if expected is not None:
            head = ctypes.string_at(self.address, expected.size)
            if head[:24] == expected.start and head[40:] == expected.end:
                microbatch, microbatches = MICROBATCHES.unpack_from(head, 24)
                return Message(microbatch, microbatches, self.views)
        fields = read_fields(
            self.buffer if self.buffer.device.type == "cpu" else self.buffer[:HEADER_BYTES].cpu()
        )
        transport = self.transport
        key = (self.src, self.channel, self.slot)
        if fields[2] == ERROR:  # the pipeline fails: no stand-ins come, the record goes
            transport.records.pop(key, None)
            return Message(fields[3], fields[4], (), error=error_text(fields))
        kind, microbatch, microbatches, total, specs = decode_header(fields)
        what = f"the tensors of micro-batch {microbatch}"
        if kind == EARLY and self.record is None:
            raise RuntimeError(
                f"rank {transport.rank} got a message from rank {self.src} whose tensors were "
                f"sent to buffers it never posted: the two ranks' records of channel "
                f"{self.channel} differ (did the ranks run different pipelines?)"
            )
        if self.record is not None and kind != EARLY:
            self._take_early(timeout, what)  # stand-ins: the tensors did not fit or go packed
        tensors: list[Tensor | None] = []
        if kind == PACKED:
            offsets, _ = layout(len(fields), specs)
            tensors = views(self.buffer, specs, offsets, grad=False)
            if transport.expects:
                expected = _Expected.of(fields, specs, offsets)
                transport.expected[(self.src, self.channel)] = expected
        elif kind == EARLY:
            buffers = iter(self._take_early(timeout, what))
            for code, _, shape in specs:
                if code < 0:
                    tensors.append(None)
                    continue
                data = next(buffers)[: nbytes(code, shape)]
                tensors.append(data.view(DTYPES[code]).view(shape))
        else:
            works = []
            for code, _, shape in specs:
                if code < 0:
                    tensors.append(None)
                    continue
                buffer = torch.empty(shape, dtype=DTYPES[code], device=transport.wire)
                works.append(transport.irecv(buffer, self.src, self.tag + 1))
                tensors.append(buffer)
            for work in works:
                self._wait(work, timeout, what)
        if kind == PACKED:
            transport.records.pop(key, None)
        else:
            transport.grow(key, total)
            sizes = [nbytes(code, shape) for code, _, shape in specs if code >= 0]
            transport.remember(transport.records, key, sizes, total)
        if transport.wire != transport.device:
            tensors = [t if t is None else t.to(transport.device) for t in tensors]
        for tensor, (_, requires_grad, _) in zip(tensors, specs):
            if tensor is not None and requires_grad:
                tensor.requires_grad_(True)
        return Message(microbatch, microbatches, tuple(tensors))
