"""Shared-memory transport: the ranks of one host write messages straight into each other's
memory, with no sockets and no system calls on the way unless a receiver sleeps.

Every ordered pair of ranks has a byte ring (see :mod:`.ring`) that carries that direction's
messages one after another, each as a frame::

    [ length | channel | header | pad | tensor 0 | pad | tensor 1 ... ]
      int64    int64     the p2p transport's packed message (see :mod:`.frame`)

A send copies the frame into the ring and rings the receiver's doorbell; what does not fit
waits in a queue of the sender's, written by its next calls into the transport (every send,
receive, wait and flush moves what it can), so a send never blocks. Any wait reads every
incoming ring to the end, copying each finished frame out into a buffer of its own, and files
its message by (peer, channel): a receive takes the n-th message of its (peer, channel), n
being the order it was posted in. The message's tensors view that buffer, which is reused once
they are gone; buffers kept for reuse, free or in use, come to at most 64 MiB
(``_BUFFER_BYTES``, see :class:`.ring.Buffers`), whatever sizes the messages have. Rings and
doorbells are named with a token of the transport's own, agreed over the process group, and
unlinked as soon as every rank has opened them, so nothing is left behind in ``/dev/shm`` even
when a process is killed.
"""

from __future__ import annotations

import array
import ctypes
import os
import platform
import secrets
import socket
import struct
import sys
import time
from collections import deque
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from ..group import GroupRef
from .base import GroupTransport, Message, PeerLost, PendingRecv, TransportTimeout
from .frame import (
    ERROR,
    HEADER_SIZE,
    KINDS,
    MICROBATCHES,
    decode_header,
    encode,
    error_header,
    error_text,
    kinds,
    layout,
    read_fields,
    views,
)
from .ring import Buffers, Doorbell, Ring, alive, started, unlink_doorbell, unlink_segment

__all__: list[str] = []

_PREFIX = struct.Struct("qq")  # frame length, channel
_SLICE = 0.05
"""Longest sleep of a wait between looks at the rings (a doorbell rung in the instant a
writer's flag was read may be missed; the next look finds what it announced)."""
_LIVENESS = 1.0
"""Seconds between checks that the peer a wait depends on still runs."""
_PAD = ctypes.create_string_buffer(64)
_PAD_ADDRESS = ctypes.addressof(_PAD)
_KEPT = 64
"""Receive buffers of one size kept for reuse (see :class:`.ring.Buffers`)."""
_BUFFER_BYTES = 64 * 2**20
"""Bytes of receive buffers kept for reuse in all, free or still viewed by received tensors,
as the p2p transport keeps its spare buffers: a pipeline of fixed shapes reuses buffers of a
few sizes; one whose shapes vary from step to step (sequences of any length) would otherwise
keep buffers of every size it ever received."""


def _in_place(tensor: Tensor) -> bool:
    """Whether the bytes of ``tensor`` can be copied into a ring as they lie."""
    return tensor.is_cpu and tensor.is_contiguous() and not tensor.is_conj() and not tensor.is_neg()


class _Frame:
    """The layout of a kind of message: ``head`` is its bytes up to the first tensor (prefix,
    header with micro-batch fields to fill in, padding), ``pads[i]`` the padding after tensor
    ``i``, ``size`` all of its bytes in the ring."""

    __slots__ = ("head", "pads", "size")

    def __init__(self, head: bytes, pads: list[int], size: int) -> None:
        self.head, self.pads, self.size = head, pads, size

    @classmethod
    def of(cls, channel: int, message: Message) -> _Frame:
        fields, offsets = encode(message, message.tensors)
        total = fields[5]
        start = offsets[0] if offsets else total
        header = array.array("q", fields).tobytes()
        head = _PREFIX.pack(total, channel) + header + bytes(start - len(header))
        pads = []
        for n, (tensor, offset) in enumerate(zip(message.tensors, offsets)):
            end = offset + (0 if tensor is None else tensor.nbytes)
            pads.append((offsets[n + 1] if n + 1 < len(offsets) else total) - end)
        return cls(head, pads, _PREFIX.size + total)


class _Piece:
    """Bytes of a frame not yet in the ring: ``size`` bytes at ``address`` (kept alive by
    ``keep``), sent to ``dst`` on ``channel`` for ``slot``."""

    __slots__ = ("keep", "address", "size", "key", "deferred")

    def __init__(self, keep: object, address: int, size: int, key: tuple[int, int]) -> None:
        self.keep, self.address, self.size, self.key = keep, address, size, key
        self.deferred = False


class _ShmRecv(PendingRecv):
    def __init__(self, transport: ShmTransport, src: int, key: tuple[int, int], index: int):
        self.transport, self.src, self.key, self.index = transport, src, key, index

    def wait(self, timeout: float) -> Message:
        return self.transport.take(self.src, self.key, self.index, timeout)


class ShmTransport(GroupTransport):
    """Messages through shared memory between the processes of one host.

    For pipelines whose ranks share a host (one machine's CPU, or processes sharing a GPU):
    a message is a copy into the ring and one out, with no socket: a small one's round trip
    between two running processes takes about two thirds of a raw loopback send/recv's and a
    third of the p2p transport's, and large messages move two to five times as fast (a
    receiver that slept still pays its wake-up, as over any transport: see the transport
    benchmarks in the docs). The process group is used once, to agree on the
    names; later messages never touch it, and collectives (data parallelism, shared weights)
    keep using it. Linux on x86-64 only; the group must use gloo. Received tensors view
    buffers that the transport reuses once they are gone; it keeps at most 64 MiB of them,
    in use or free, so shapes that vary from step to step (sequences of any length) leave no
    more behind than fixed ones.

    Args:
        group: the process group of the pipeline (default: the whole world); pipeline rank
            ``r`` is the ``r``-th rank of the group. Collective: every rank of the group
            builds its transport at the same time.
        device: where received tensors are placed (CUDA tensors travel through host memory).
        ring_bytes: bytes of each ring (one per ordered pair of ranks, reserved in
            ``/dev/shm`` when the transport is built). A message larger than a ring still
            goes, in pieces, as the receiver takes them.
        spin: seconds a wait keeps looking at the rings (yielding the processor between
            looks) before it sleeps on its doorbell: waking a sleeping process costs tens of
            microseconds, and a message is often that close.

    Example:
        >>> pipe = asyncpipe.AsyncPipe(model, [2, 2], transport="shm")  # doctest: +SKIP
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        device: torch.device | None = None,
        ring_bytes: int = 8 * 2**20,
        spin: float = 200e-6,
    ) -> None:
        problems = []
        if not dist.is_initialized():
            problems.append(
                "the shm transport agrees on its names over torch.distributed: call "
                "asyncpipe.init() first and launch with torchrun, e.g. torchrun --standalone "
                "--nproc-per-node=2 train.py"
            )
        elif "gloo" not in str(dist.get_backend(group)):
            problems.append(
                f"the shm transport needs a gloo process group (got "
                f"{dist.get_backend(group)}); call asyncpipe.init(backend='gloo'), or use "
                f"transport='p2p' over NCCL"
            )
        machine = platform.machine().lower()
        if not sys.platform.startswith("linux") or machine not in ("x86_64", "amd64"):
            problems.append(
                f"the shm transport runs on Linux on x86-64 only (this is {sys.platform} on "
                f"{machine}); use transport='p2p'"
            )
        elif not os.path.isdir("/dev/shm"):
            problems.append("the shm transport needs /dev/shm; use transport='p2p'")
        if not (isinstance(ring_bytes, int) and ring_bytes >= 2**16):
            problems.append(f"ring_bytes must be an integer of at least 65536 (got {ring_bytes!r})")
        if not (isinstance(spin, (int, float)) and 0 <= spin < 1):
            problems.append(f"spin must be a number of seconds in [0, 1) (got {spin!r})")
        if problems:
            raise ValueError("; ".join(problems))
        self._join(group)
        self._group = GroupRef(group)
        self.device = device or torch.device("cpu")
        self.ring_bytes, self.spin = ring_bytes, float(spin)
        peers = [r for r in range(self.world_size) if r != self.rank]
        self._peers = peers
        self._in: dict[int, Ring] = {}
        self._out: dict[int, Ring] = {}
        self._bells: dict[int, Doorbell] = {}
        self._spill: dict[int, deque[_Piece]] = {peer: deque() for peer in peers}
        self._partial: dict[int, tuple[Tensor, int, int]] = {}
        self._arrived: dict[tuple[int, int], dict[int, Message]] = {}
        self._received: dict[tuple[int, int], int] = {}
        self._posted: dict[tuple[int, int], int] = {}
        self._frames: dict[tuple[object, ...], _Frame] = {}
        self._scratch = (ctypes.c_int64 * (HEADER_SIZE + 16))()  # a frame's head, filled in
        self._decoded: dict[bytes, tuple[list[tuple[int, bool, list[int]]], list[int]]] = {}
        self._prefix = (ctypes.c_int64 * 2)()
        self._buffers = Buffers(_BUFFER_BYTES, _KEPT)
        self._pids = self._connect(group, peers)

    # -- set-up ------------------------------------------------------------------------------

    def _gather(self, group: dist.ProcessGroup | None, value: object) -> list[object]:
        values: list[object] = [None] * self.world_size
        try:
            dist.all_gather_object(values, value, group=group)
        except RuntimeError as e:  # e.g. a rank that built another transport went away
            raise ConnectionError(
                f"rank {self.rank} could not set up the shm transport with the other ranks: "
                f"its set-up is collective, so every rank of the pipeline must build it "
                f"(transport='shm') at the same time, and none may exit meanwhile (gloo cannot "
                f"say which did: look for the rank that failed first) "
                f"({str(e).splitlines()[0] if str(e) else e!r})"
            ) from e
        return values

    def _connect(self, group: dist.ProcessGroup | None, peers: list[int]) -> list[int]:
        """Agree on a token, create this rank's incoming rings and doorbell, open the peers',
        then unlink the names. Returns the peers' process ids, by pipeline rank (0 for a
        peer this process cannot watch)."""
        try:
            with open("/proc/sys/kernel/random/boot_id") as f:
                boot = f.read().strip()
        except OSError:
            boot = ""
        me = (secrets.token_hex(6), socket.gethostname(), boot, os.getpid(), started(os.getpid()))
        infos = self._gather(group, me)
        hosts = [(str(i[1]), str(i[2])) for i in infos]  # type: ignore[index]
        if len(set(hosts)) > 1:
            where = ", ".join(f"rank {r} on {h[0]}" for r, h in enumerate(hosts))
            raise ValueError(
                f"the shm transport moves messages through one host's memory, so every rank of "
                f"the pipeline must run on the same host ({where}); use transport='p2p' across "
                f"hosts"
            )
        token = str(infos[0][0])  # type: ignore[index]
        # a peer is watched only where its process id names that very process here (the
        # same start time): in another PID namespace the id means nothing, or another process
        pids = [
            int(i[3]) if i[4] is not None and started(int(i[3])) == i[4] else 0  # type: ignore[index]
            for i in infos
        ]

        def ring(src: int, dst: int) -> str:
            return f"asyncpipe-{token}-{src}-{dst}"

        try:
            self._check(group, "create", lambda: self._create(ring, token, peers))
            self._check(group, "open", lambda: self._open(ring, token, peers))
        except ConnectionError as e:  # the group broke: most likely a rank is gone
            raise self._lost(pids, e) from e
        finally:
            # every rank has opened every name, or the set-up failed here or elsewhere: drop
            # them all, whoever is first (a rank killed after it made its own names cannot
            # drop them), so none outlives the transport's construction on any rank
            for src in range(self.world_size):
                unlink_doorbell(f"/asyncpipe-{token}-{src}")
                for dst in range(self.world_size):
                    if dst != src:
                        unlink_segment(ring(src, dst))
        return pids

    def _lost(self, pids: list[int], error: ConnectionError) -> ConnectionError:
        """The error for a set-up whose process group broke: a PeerLost naming the ranks whose
        processes are gone, where any is seen to be within a second (gloo says only that a
        connection closed, not whose), else ``error``."""
        deadline = time.monotonic() + _LIVENESS
        while True:
            gone = [r for r, pid in enumerate(pids) if pid and r != self.rank and not alive(pid)]
            if gone or time.monotonic() >= deadline:
                break
            time.sleep(_SLICE)
        if not gone:
            return error
        names = ", ".join(f"rank {r} (process {pids[r]})" for r in gone)
        return PeerLost(
            f"the shm transport's set-up is collective, but {names} exited during it, so rank "
            f"{self.rank} could not finish it; see why in that rank's output, then start the "
            f"job again on every rank",
            gone[0],
        )

    def _create(self, ring: Callable[[int, int], str], token: str, peers: list[int]) -> None:
        for src in peers:
            self._in[src] = Ring(ring(src, self.rank), self.ring_bytes, create=True)
        self._bell = Doorbell(f"/asyncpipe-{token}-{self.rank}", create=True)

    def _open(self, ring: Callable[[int, int], str], token: str, peers: list[int]) -> None:
        for dst in peers:
            self._out[dst] = Ring(ring(self.rank, dst), self.ring_bytes, create=False)
            self._bells[dst] = Doorbell(f"/asyncpipe-{token}-{dst}", create=False)

    def _check(self, group: dist.ProcessGroup | None, what: str, job: Callable[[], None]) -> None:
        """Run ``job`` on every rank; if it failed anywhere, raise the same error everywhere."""
        try:
            job()
            outcome = ""
        except OSError as e:
            outcome = str(e)
        failed = [(r, o) for r, o in enumerate(self._gather(group, outcome)) if o]
        if failed:
            self.close()
            raise RuntimeError(
                f"the shm transport could not {what} its shared memory: "
                + "; ".join(f"rank {r}: {o}" for r, o in failed)
            )

    @property
    def group(self) -> dist.ProcessGroup:
        """The pipeline's process group (used only to set up, and by collectives)."""
        return self._group()

    def check(self) -> None:
        """Raise once the process group is destroyed (``asyncpipe.shutdown()``): the rings
        would still carry messages, but a pipeline runs on its group, as over p2p (see
        :class:`~asyncpipe.group.GroupRef`)."""
        self._group()

    # -- sending -----------------------------------------------------------------------------

    def _frame(self, channel: int, message: Message) -> _Frame:
        """How a message of this channel and these kinds of tensors is laid out, made once
        (a pipeline sends the same shapes at every micro-batch)."""
        kind = (channel, *kinds(message.tensors))
        frame = self._frames.get(kind)
        if frame is None:
            if len(self._frames) >= KINDS:  # shapes that vary: start afresh
                self._frames.clear()
            frame = self._frames[kind] = _Frame.of(channel, message)
        return frame

    def send(self, dst: int, channel: int, message: Message) -> None:
        key = (channel, message.microbatch)
        queue, ring = self._spill[dst], self._out[dst]
        if message.error is not None:  # the text rides in the header
            header = error_header(message).view(torch.uint8)
            prefix = ctypes.create_string_buffer(_PREFIX.pack(header.numel(), channel), 16)
            queue.append(_Piece(prefix, ctypes.addressof(prefix), 16, key))
            queue.append(_Piece(header, header.data_ptr(), header.numel(), key))
            self._push(dst)
            return
        frame = self._frame(channel, message)
        payload = message.tensors
        if (
            not queue
            and ring.room() >= frame.size
            and all(t is None or _in_place(t) for t in payload)
        ):  # all of it fits now: straight into the ring, seen by the reader at once
            scratch = self._scratch
            ctypes.memmove(scratch, frame.head, len(frame.head))
            scratch[5], scratch[6] = message.microbatch, message.microbatches
            ring.put(ctypes.addressof(scratch), len(frame.head))
            for tensor, pad in zip(payload, frame.pads):
                if tensor is not None and tensor.nbytes:
                    ring.put(tensor.data_ptr(), tensor.nbytes)
                if pad:
                    ring.put(_PAD_ADDRESS, pad)
            ring.publish()
            self._bells[dst].ring()
            return
        head = bytearray(frame.head)
        MICROBATCHES.pack_into(head, _PREFIX.size + 24, message.microbatch, message.microbatches)
        keep = (ctypes.c_char * len(head)).from_buffer(head)
        queue.append(_Piece(keep, ctypes.addressof(keep), len(head), key))
        for tensor, pad in zip(payload, frame.pads):
            if tensor is not None:
                data = tensor.detach()
                if not _in_place(data):
                    data = data.resolve_conj().resolve_neg().contiguous().cpu()
                if data.nbytes:
                    queue.append(_Piece(data, data.data_ptr(), data.nbytes, key))
            if pad:
                queue.append(_Piece(_PAD, _PAD_ADDRESS, pad, key))
        self._push(dst)

    def _push(self, dst: int) -> bool:
        """Write what fits of ``dst``'s queue into its ring; whether anything moved."""
        queue, ring = self._spill[dst], self._out[dst]
        moved = False
        while queue:
            piece = queue[0]
            n = ring.write(piece.address, piece.size)
            moved = moved or n > 0
            if n < piece.size:
                piece.address += n
                piece.size -= n
                ring.waiting = True
                break
            queue.popleft()
        else:
            if ring.waiting:
                ring.waiting = False
        if moved:
            self._bells[dst].ring()
        return moved

    # -- receiving ---------------------------------------------------------------------------

    def recv(self, src: int, channel: int, slot: int = 0) -> PendingRecv:
        key = (src, channel)
        index = self._posted.get(key, 0)
        self._posted[key] = index + 1
        return _ShmRecv(self, src, key, index)

    def _drain(self, src: int) -> bool:
        """Read what ``src`` has written; file each finished message. Whether anything moved."""
        ring = self._in[src]
        moved = False
        while True:
            part = self._partial.pop(src, None)
            if part is None:
                if ring.available() < _PREFIX.size:
                    break
                ring.take(ctypes.addressof(self._prefix), _PREFIX.size)
                total, channel = self._prefix[0], self._prefix[1]
                # a buffer another peer's frame is being copied into is not free, though
                # nothing but this transport holds it
                busy = [p[0] for p in self._partial.values()] if self._partial else ()
                part = (self._buffers.take(total, busy), 0, channel)
                moved = True
            buffer, filled, channel = part
            got = ring.take(buffer.data_ptr() + filled, buffer.numel() - filled)
            moved = moved or got > 0
            if filled + got < buffer.numel():
                self._partial[src] = (buffer, filled + got, channel)
                break
            key = (src, channel)
            n = self._received.get(key, 0)
            self._received[key] = n + 1
            self._arrived.setdefault(key, {})[n] = self._decode(buffer)
        if moved and ring.waiting:
            self._bells[src].ring()
        return moved

    def _decode(self, buffer: Tensor) -> Message:
        base = buffer.data_ptr()
        magic_count = (ctypes.c_int64 * 2).from_address(base)
        count = magic_count[1]
        if not 7 <= count <= HEADER_SIZE or 8 * count > buffer.numel():
            read_fields(buffer)  # raises the explanation
        head = ctypes.string_at(base, 8 * count)
        shape = head[:24] + head[40:]
        known = self._decoded.get(shape)
        if known is None:
            fields = read_fields(buffer)
            if fields[2] == ERROR:
                return Message(fields[3], fields[4], (), error=error_text(fields))
            _, _, _, _, specs = decode_header(fields)
            offsets, _ = layout(len(fields), specs)
            known = (specs, offsets)
            if len(self._decoded) < 256:
                self._decoded[shape] = known
        microbatch, microbatches = MICROBATCHES.unpack_from(head, 24)
        specs, offsets = known
        on_host = self.device.type == "cpu"
        tensors = views(buffer, specs, offsets, grad=on_host)
        if not on_host:
            tensors = [t if t is None else t.to(self.device) for t in tensors]
            for tensor, (_, requires_grad, _) in zip(tensors, specs):
                if tensor is not None and requires_grad:
                    tensor.requires_grad_(True)
        return Message(microbatch, microbatches, tuple(tensors))

    def _progress(self) -> bool:
        """Read every incoming ring and write every queue; whether anything moved."""
        moved = False
        for peer in self._peers:
            if self._drain(peer):
                moved = True
            if self._spill[peer] and self._push(peer):
                moved = True
        return moved

    def take(self, src: int, key: tuple[int, int], index: int, timeout: float) -> Message:
        """The ``index``-th message from ``src`` on channel ``key[1]``, waiting for it at most
        ``timeout`` s (a TransportTimeout, or a ConnectionError once ``src`` has exited)."""

        def late() -> str:
            return (
                f"rank {self.rank} timed out after {timeout:.1f} s waiting for a message from "
                f"rank {src}; that rank is slow, stuck or gone (raise the pipeline's timeout if "
                f"its work really takes longer)"
            )

        self._until(
            lambda: index in self._arrived.get(key, ()),
            timeout,
            lambda: [src],
            "a message",
            late,
            self.spin,
        )
        return self._arrived[key].pop(index)

    def _until(
        self,
        ready: Callable[[], bool],
        timeout: float,
        peers: Callable[[], list[int]],
        what: str,
        late: Callable[[], str],
        spin: float = 0.0,
    ) -> None:
        """Move messages both ways until ``ready()``: looking at the rings for ``spin`` s
        (yielding the processor between looks), then sleeping on this rank's doorbell; every
        second, check that the ``peers()`` this depends on still run (waiting for ``what``);
        after ``timeout`` s raise TransportTimeout(``late()``)."""
        now = time.monotonic()
        deadline, check, spinning = now + timeout, now + _LIVENESS, now + spin
        while not ready():
            if self._progress():
                continue
            now = time.monotonic()
            if now < spinning:
                os.sched_yield()
                continue
            if now >= deadline:
                raise TransportTimeout(late())
            if now >= check:
                for peer in peers():
                    self._alive(peer, what)
                check = now + _LIVENESS
            self._bell.wait(min(deadline - now, check - now, _SLICE))

    def _alive(self, peer: int, what: str) -> None:
        pid = self._pids[peer]
        if pid and not alive(pid):
            raise PeerLost(
                f"rank {self.rank} lost rank {peer} (process {pid} exited) while waiting for "
                f"{what}",
                peer,
            )

    # -- completion --------------------------------------------------------------------------

    def defer(self, dst: int, channel: int, slot: int) -> None:
        for piece in self._spill[dst]:
            if piece.key == (channel, slot):
                piece.deferred = True

    def flush(self, timeout: float) -> None:
        """Wait until every message sent so far is in its ring (but those deferred)."""

        def waiting() -> list[int]:
            return [d for d, q in self._spill.items() if any(not p.deferred for p in q)]

        def late() -> str:
            return (
                f"rank {self.rank} could not finish its sends within {timeout:.1f} s: "
                f"rank(s) {waiting()} took no more of them"
            )

        self._progress()
        self._until(lambda: not waiting(), timeout, waiting, "it to take a message", late)
        for queue in self._spill.values():
            for piece in queue:
                piece.deferred = False

    def close(self) -> None:
        for ring in [*self._in.values(), *self._out.values()]:
            ring.close()
        self._in, self._out, self._bells = {}, {}, {}
