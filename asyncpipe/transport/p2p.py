"""Point-to-point transport over torch.distributed isend/irecv (gloo on CPU, NCCL on CUDA).

A message starts with an int64 header (micro-batch, dtypes, shapes, requires_grad), so
receivers need no shape declarations. Over gloo, a receive may be larger than the message it
gets, so each receive is posted early with a byte buffer as large as the biggest message seen so
far in the same slot (channel and micro-batch), and a message that fits travels *packed*, header
and tensors in one message::

    packed     tag 3c     [ header | pad | tensor 0 | pad | tensor 1 ... ]
    separate   tag 3c     [ header ]            (first time, or when it grew)
               tag 3c+1   [ tensor 0 ] [ tensor 1 ] ...

(plus the pipeline's first tag, which keeps the messages of pipelines sharing a process group
apart: see :data:`CHANNELS`)

Sender and receiver keep the same record of sizes per slot, so both agree on whether a message
fits. A packed buffer is reused for a later message once its send has completed. A receive
posted where the channel's last packed message would fit again makes that message's tensor views
into its buffer at once; when the message comes, a comparison of its header bytes with that
message's (but for the micro-batch fields) replaces the decoding. Only messages up to
``PACK_LIMIT`` bytes are packed: above it, copying the tensors into one buffer costs more than
the second message, so large tensors always go separate, straight from their own memory; the
next large message of a slot has its tensor receives posted before its header comes, into
buffers of the last one's sizes (tag 3c+2, see :class:`_Lane`). NCCL needs receives of the
exact size, in posting order: there every message goes separate, each receive is posted only
when it is due, and each direction between two ranks travels in its own group (see
:class:`P2PTransport`). Gloo moves host memory only: with CUDA tensors over gloo (processes
sharing a GPU), messages are staged through host memory and received tensors are moved to the
transport's device.
"""

from __future__ import annotations

import contextlib
import datetime
import re
import time
import weakref
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from ..group import GroupRef, new_group, release
from .base import GroupTransport, Message, PeerLost, PendingRecv, TransportTimeout
from .frame import (
    EARLY,
    HEADER_BYTES,
    HEADER_SIZE,
    KINDS,
    PACK_LIMIT,
    SEPARATE,
    encode,
    error_header,
    kinds,
    pack,
)
from .p2p_recv import _Expected, _gist, _Lane, _P2PRecv

__all__: list[str] = []


_CLOSED = re.compile(r"closed|reset by peer|broken pipe|refused", re.IGNORECASE)
"""What the backends' errors say when the connection to a peer is gone."""

CHANNELS = 1 << 21
"""Channels of one pipeline: its plan's (below ``2**20``) and the runtime's own just above.
Pipeline ``n`` on a process group sends channel ``c`` with tags from ``3 * (n * CHANNELS +
c)``, so two pipelines on one group never take each other's messages."""

PIPELINES = 256
"""Pipelines numbered apart on one group (then the numbers wrap): gloo's tags are 32-bit
signed integers, and ``3 * PIPELINES * CHANNELS`` stays below ``2**31``."""

_Send = tuple[dist.Work | None, Tensor]
"""A send begun: its work (None: nothing to wait for) and the tensor it sends from."""

_SPARE_BUFFERS = 32
"""Packed buffers of one size kept for reuse once their sends completed (a fresh buffer's
pages are touched for the first time by the copy, which costs more than the copy)."""

_SPARE_BYTES = 64 * 2**20
"""Bytes of spare packed buffers kept in all. A pipeline of fixed shapes reuses buffers of a
few sizes; one whose shapes vary from step to step (sequences of any length) would otherwise
keep buffers of every size it ever sent."""


def _down_group(group: dist.ProcessGroup | None, ranks: list[int]) -> dist.ProcessGroup:
    """A second group over the pipeline's ranks, created by every rank of the world."""
    if dist.get_world_size(group) != dist.get_world_size():
        raise ValueError(
            "the p2p transport's ordered mode (NCCL) sends each direction in its own group: "
            "with a pipeline group smaller than the world, create a second group over the same "
            "ranks on every rank and pass it as down_group"
        )
    down = new_group(ranks)
    return down


@dataclass(frozen=True)
class _Layout:
    """How the messages of one kind of payload (dtypes, requires_grad, shapes) are laid out:
    the header fields (micro-batch fields to be set), the tensors' offsets in a packed message
    and, where no tensor is complex, their sizes in bytes (None otherwise: see
    :func:`~asyncpipe.transport.frame.pack`). Made once per kind, so a message reads no more of
    its tensors than their memory: on a hop's critical path every call into torch counts."""

    fields: list[int]
    offsets: list[int]
    sizes: list[int] | None

    @classmethod
    def of(cls, message: Message, payload: Sequence[Tensor | None]) -> _Layout:
        fields, offsets = encode(message, payload)
        plain = not any(t is not None and t.is_complex() for t in payload)
        sizes = [0 if t is None else t.nbytes for t in payload] if plain else None
        return cls(fields, offsets, sizes)


def _plain(tensor: Tensor) -> Tensor:
    """``tensor`` contiguous, with its conjugate and negative bits resolved: its memory holds
    the values it reads as."""
    return tensor.resolve_conj().resolve_neg().contiguous()


class P2PTransport(GroupTransport):
    """Messages over ``torch.distributed`` point-to-point operations.

    Over NCCL, each pair of ranks runs its operations on one stream in the order they were
    issued, and a send NCCL cannot buffer waits for its receive: two neighbours that both send
    before receiving (1F1B's last warm-up forward crosses the first gradient) would wait for
    each other. So in this *ordered* mode messages to higher pipeline ranks use ``group`` and
    messages to lower ranks a second group over the same ranks (``down_group``): each stream
    then carries one direction, whose sends the peer receives in the plan's order.

    Args:
        group: the process group of the pipeline (default: the whole world); pipeline rank
            ``r`` is the ``r``-th rank of the group.
        device: where received tensors are placed (a CUDA device with NCCL; with gloo, CUDA
            tensors are staged through host memory).
        ordered: send every message as header then tensors, post receives only when due, and
            use a group per direction; default: over NCCL only. ``True`` runs the NCCL protocol
            over gloo (tests do).
        down_group: the group for messages to lower ranks in ordered mode, over the same ranks
            as ``group``. Created here when not given, which is collective over the whole
            world: with several pipelines (data parallelism), create one per pipeline on every
            rank and pass it. One created here is destroyed by :meth:`close`; one passed in
            stays the caller's.
        pipeline: the number of this pipeline among those on ``group`` (the same on every
            rank): pipelines with different numbers keep their messages apart (their tags
            differ). ``AsyncPipe`` numbers the pipelines it builds by name in the order every
            rank builds them.

    Example:
        >>> transport = P2PTransport()  # doctest: +SKIP
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        device: torch.device | None = None,
        ordered: bool | None = None,
        down_group: dist.ProcessGroup | None = None,
        pipeline: int = 0,
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError(
                "the p2p transport needs torch.distributed: call asyncpipe.init() first and "
                "launch with torchrun, e.g. torchrun --standalone --nproc-per-node=2 train.py"
            )
        self._join(group)
        self.tags = 3 * CHANNELS * (pipeline % PIPELINES)
        """The first tag of this pipeline's messages (see :data:`CHANNELS`)."""
        self.device = device or torch.device("cpu")
        nccl = dist.get_backend(group) == "nccl"
        self.ordered = nccl if ordered is None else ordered
        self.early_receives = self.packs = not self.ordered
        self.wire = self.device if nccl else torch.device("cpu")  # where messages live
        self._made: list[weakref.ref[dist.ProcessGroup]] = []  # destroyed by close()
        if self.ordered and down_group is None:
            down_group = _down_group(group, self._ranks)
            self._made.append(weakref.ref(down_group))
        # Held weakly (torch.distributed owns groups; see GroupRef). Host memory (gloo): call
        # the groups' own send and recv, skipping torch.distributed's per-call checks (tens of
        # microseconds each on a hop's critical path).
        self._direct = self.wire.type == "cpu"
        self.rendezvous = self._direct  # gloo (see Transport.rendezvous)
        self._timedelta = (-1.0, datetime.timedelta(0))
        self._up = GroupRef(group)
        self._down = GroupRef(down_group if self.ordered else group)
        self.capacity: dict[tuple[int, int, int], int] = {}
        # the last packed message from each (peer, channel), where received tensors stay in
        # the received buffer (host memory)
        self.expects = self.packs and self.wire == self.device
        self.expected: dict[tuple[int, int], _Expected] = {}
        # how a message is laid out, by its tensors' kinds
        self._layouts: dict[tuple[object, ...], _Layout] = {}
        # packed buffers whose sends have completed, by size, for the next packed sends
        self._spare: dict[int, list[Tensor]] = {}
        self._spare_bytes = 0
        # the packed buffers of pending sends, by id (held, so that no id is reused)
        self._packed: dict[int, Tensor] = {}
        # sends not yet known to be taken, by (peer, channel, slot); buffers live until then
        self._pending: dict[tuple[int, int, int], list[_Send]] = {}
        # sends put off by defer() until the flush after the next one, by receiver
        self._deferred: list[tuple[int, _Send]] = []
        # by (peer, channel, slot): the tensor sizes of the slot's last message received and
        # sent where it was large (each end keeps the same record of a slot; see _Lane). Two
        # tables: some channels carry messages both ways between two ranks.
        self.records: dict[tuple[int, int, int], list[int]] = {}
        self._sent: dict[tuple[int, int, int], list[int]] = {}
        self._lanes: dict[tuple[int, int], _Lane] = {}
        self._stand_in: Tensor | None = None  # made when first needed (never over NCCL)
        self._overdue: list[tuple[int, _Send]] = []
        # sends of a failed step that no peer will take (see flush_failed), kept until close():
        # gloo reads and writes a message through its Work's buffer, and freeing one while its
        # peer may still take it would stall every later message between the two ranks
        self._let_go: list[_Send] = []

    @property
    def group(self) -> dist.ProcessGroup:
        """The pipeline's process group."""
        return self._up()

    @property
    def down_group(self) -> dist.ProcessGroup:
        """The group of messages to lower ranks (``group`` but in ordered mode)."""
        return self._down()

    def group_to(self, dst: int) -> dist.ProcessGroup:
        """The group of messages from this rank to pipeline rank ``dst``."""
        return self._up() if dst > self.rank else self._down()

    def group_from(self, src: int) -> dist.ProcessGroup:
        """The group of messages from pipeline rank ``src`` to this rank."""
        return self._up() if src < self.rank else self._down()

    def timedelta(self, timeout: float) -> datetime.timedelta:
        """``timeout`` seconds (at least a millisecond) as a timedelta, the last one kept: a
        pipeline waits with the same timeout every time."""
        last = self._timedelta
        if last[0] != timeout:
            last = self._timedelta = (timeout, datetime.timedelta(seconds=max(timeout, 0.001)))
        return last[1]

    def grow(self, key: tuple[int, int, int], size: int) -> None:
        """Both ends call this after a separate message: later ones of that size fit."""
        if self.packs and size <= PACK_LIMIT:
            self.capacity[key] = max(self.capacity.get(key, HEADER_BYTES), size)

    def _isend(
        self, tensor: Tensor, key: tuple[int, int, int], tag: int, plain: bool = False
    ) -> None:
        """Send ``tensor`` (``plain``: known not to be complex, a packed buffer)."""
        peer = key[0]
        work: dist.Work | None
        try:
            if self._direct:  # pipeline rank = rank in either group
                wire = tensor if plain or not tensor.is_complex() else torch.view_as_real(tensor)
                work = self.group_to(peer).send([wire], peer, tag)
            else:
                group = self.group_to(peer)
                work = dist.isend(tensor, self.global_rank(peer), group=group, tag=tag)
        except RuntimeError as e:
            self._lost(peer, "sending to it", e)
            raise
        self._pending.setdefault(key, []).append((work, tensor))

    def _lost(self, peer: int, what: str, error: RuntimeError) -> None:
        """Raise a PeerLost for ``error`` from a send or a receive's posting where the backend
        found the connection to ``peer`` closed (its process is gone)."""
        text = str(error)
        if _CLOSED.search(text):
            lost = PeerLost(f"rank {self.rank} lost rank {peer} while {what}: {_gist(text)}", peer)
            raise lost from error

    def irecv(self, buffer: Tensor, src: int, tag: int) -> dist.Work | None:
        """Post a receive of ``buffer`` from pipeline rank ``src``."""
        try:
            if self._direct:
                wire = torch.view_as_real(buffer) if buffer.is_complex() else buffer
                return self.group_from(src).recv([wire], src, tag)
            return dist.irecv(buffer, self.global_rank(src), group=self.group_from(src), tag=tag)
        except RuntimeError as e:
            self._lost(src, "posting a receive from it", e)
            raise

    def _layout(
        self, message: Message, payload: Sequence[Tensor | None]
    ) -> tuple[list[int], _Layout]:
        """:func:`encode_header`'s fields (a fresh list) and the layout of ``payload``, made
        once per kind of payload (a pipeline sends the same shapes at every micro-batch)."""
        kind = kinds(payload)
        known = self._layouts.get(kind)
        if known is None:
            if len(self._layouts) >= KINDS:  # shapes that vary: start afresh
                self._layouts.clear()
            known = self._layouts[kind] = _Layout.of(message, payload)
        fields = list(known.fields)
        fields[3], fields[4] = message.microbatch, message.microbatches
        return fields, known

    def _pack(self, fields: list[int], layout: _Layout, payload: list[Tensor | None]) -> Tensor:
        """A packed message in a spare buffer of its size where one is free."""
        spare = self._spare.get(fields[5])
        buffer = spare.pop() if spare else None
        if buffer is not None:
            self._spare_bytes -= buffer.numel()
        buffer = pack(fields, layout.offsets, payload, buffer, layout.sizes)
        self._packed[id(buffer)] = buffer
        return buffer

    def send(self, dst: int, channel: int, message: Message) -> None:
        key = (dst, channel, message.microbatch)
        if message.error is not None:  # the text rides in the header: one message
            self._isend(
                error_header(message).view(torch.uint8).to(self.wire), key, self.tags + 3 * channel
            )
            self._sent.pop(key, None)  # the pipeline fails: no stand-ins (see wait)
            return
        # The receive of this slot has early buffers of these sizes (see _Lane) when the
        # slot's last message was large: they take this message's tensors if they fit, else
        # a stand-in each.
        record = self._sent.get(key)
        payload = list(message.tensors)
        fields, layout = self._layout(message, payload)
        total = fields[5]
        if total <= self.capacity.get(key, HEADER_BYTES):  # packing is for gloo: host memory
            self._isend(
                self._pack(fields, layout, payload), key, self.tags + 3 * channel, plain=True
            )
            if record is not None:
                self._stand_ins(key, record)
                del self._sent[key]
            return
        # Bytes as they read: a lazily conjugated or negated view (z.conj(), z.conj().imag)
        # materialized, as view_as_real and the wire need.
        tensors = [_plain(t.detach().to(self.wire)) for t in payload if t is not None]
        sizes = [t.nbytes for t in tensors]
        early = record is not None and len(sizes) == len(record)
        early = early and all(n <= r for n, r in zip(sizes, record or ()))
        fields[2] = EARLY if early else SEPARATE
        self.grow(key, total)
        header = torch.zeros(HEADER_SIZE, dtype=torch.int64)
        header[: len(fields)] = torch.tensor(fields)
        tag = self.tags + 3 * channel
        self._isend(header.view(torch.uint8).to(self.wire), key, tag)
        if not early:
            self._stand_ins(key, record)
        for tensor in tensors:
            self._isend(tensor, key, tag + (2 if early else 1))
        self.remember(self._sent, key, sizes, total)

    def _stand_ins(self, key: tuple[int, int, int], record: list[int] | None) -> None:
        """Fill the early buffers of a receive that does not take its tensors from them."""
        for _ in record or ():
            if self._stand_in is None:
                self._stand_in = torch.zeros(1, dtype=torch.uint8, device=self.wire)
            self._isend(self._stand_in, key, self.tags + 3 * key[1] + 2)

    def remember(
        self,
        table: dict[tuple[int, int, int], list[int]],
        key: tuple[int, int, int],
        sizes: list[int],
        total: int,
    ) -> None:
        """Both ends call this after each message of a slot that went separate (the receiver
        with ``records``; a packed one drops the slot's record): a large one makes the slot's
        next receive post early buffers of its tensors' sizes."""
        if self.packs and total > PACK_LIMIT:
            table[key] = sizes
        else:
            table.pop(key, None)

    def lane(self, src: int, channel: int) -> _Lane:
        """The receives from ``src`` on ``channel`` that have early buffers, in posting order."""
        lane = self._lanes.get((src, channel))
        if lane is None:
            lane = self._lanes[(src, channel)] = _Lane()
        return lane

    def recv(self, src: int, channel: int, slot: int = 0) -> PendingRecv:
        return _P2PRecv(self, src, channel, slot)

    def settle(self, dst: int, channel: int, slot: int, timeout: float) -> None:
        sends = self._pending.pop((dst, channel, slot), [])
        self._wait_all(sends, timeout)

    def defer(self, dst: int, channel: int, slot: int) -> None:
        self._deferred += [(dst, send) for send in self._pending.pop((dst, channel, slot), [])]

    def flush(self, timeout: float) -> None:
        sends = [send for _, send in self._owed()]
        self._overdue, self._deferred = self._deferred, []
        self._wait_all(sends, timeout)

    def flush_failed(self, timeout: float, ended: Collection[int] = ()) -> None:
        """:meth:`flush` for a failed step. Gloo has no way to ask whether a send was taken
        but a wait, and a wait that times out closes every connection of the process group;
        so the sends to the ranks in ``ended`` (and those :meth:`defer` put off, which their
        receivers would take only in a later step) are not waited for but kept, unfinished,
        until :meth:`close`: a later pipeline numbers its messages apart, so they never match
        its receives."""
        owed = self._owed()
        self._let_go += [send for _, send in self._deferred]
        self._let_go += [send for peer, send in owed if peer in ended]
        self._overdue, self._deferred = [], []
        with contextlib.suppress(Exception):  # a peer that is gone cannot be told
            self._wait_all([send for peer, send in owed if peer not in ended], timeout)

    def _owed(self) -> list[tuple[int, _Send]]:
        """The sends the next flush waits for, by receiver (taken out of the pending ones)."""
        pending, self._pending = self._pending, {}
        return self._overdue + [(key[0], send) for key, group in pending.items() for send in group]

    def close(self) -> None:
        """Drop the sends kept since a failed step, and destroy the down group this transport
        created (ordered mode without a ``down_group`` passed in), on this rank alone."""
        self._let_go = []
        made, self._made = self._made, []
        release(made)

    def _wait_all(self, sends: list[_Send], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for work, tensor in sends:
            if work is None:
                continue
            left = max(deadline - time.monotonic(), 0.001)
            try:
                work.wait(datetime.timedelta(seconds=left))
            except RuntimeError as e:
                raise TransportTimeout(
                    f"rank {self.rank} could not finish its sends within {timeout:.1f} s: "
                    f"{str(e).splitlines()[0]}"
                ) from e
            if self._packed.get(id(tensor)) is tensor:  # sent: the buffer can carry another
                del self._packed[id(tensor)]
                size = tensor.numel()
                spare = self._spare.setdefault(size, [])
                if len(spare) < _SPARE_BUFFERS and self._spare_bytes + size <= _SPARE_BYTES:
                    spare.append(tensor)
                    self._spare_bytes += size
