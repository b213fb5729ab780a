"""Shared memory between the processes of one host: a byte ring from one rank to another, the
doorbell that wakes a rank waiting for it, and the buffers a reader copies messages out into.

A ring is a file in ``/dev/shm`` that both processes map. Only the writer moves ``head`` (bytes
written so far) and only the reader moves ``tail`` (bytes read so far); each reads the other's
counter to learn how much it may write or read::

    offset 0     head     (u64, the writer's)
    offset 64    tail     (u64, the reader's)
    offset 128   waiting  (u64: the writer has bytes that did not fit, ring its doorbell)
    offset 4096  data     (capacity bytes, used as a circle: byte n lives at n % capacity)

The data are copied in before ``head`` moves past them and out before ``tail`` does. On x86-64
stores become visible to other cores in program order, so a reader that sees ``head`` also sees
the bytes before it; the transport refuses other processors rather than add fences that Python
cannot express.

A doorbell is a named POSIX semaphore, one per rank: a writer posts the reader's after each
message, and a reader posts the writer's when it frees room the writer waits for. Posting one
nobody waits on is an atomic increment, with no system call.

A reader copies each message out of its ring into a buffer of the message's size, which the
message's tensors then view; :class:`Buffers` keeps such buffers for reuse, within a budget.
"""

from __future__ import annotations

import _multiprocessing  # type: ignore[import-not-found]  # no stubs; CPython's own
import contextlib
import ctypes
import mmap
import os
from collections import OrderedDict, deque
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

__all__: list[str] = []

_DATA = 4096
_SEMAPHORE = 1  # _multiprocessing's kind for a counting semaphore
_SEM_MAX = 2147483647
_use_count = getattr(torch._C, "_storage_Use_Count", None)


def segment_path(name: str) -> str:
    return os.path.join("/dev/shm", name)


class Ring:
    """One direction of a byte stream between two processes, in a mapped file.

    ``create`` makes the file (reserving its memory, so a full ``/dev/shm`` fails here with a
    clear error instead of a bus error later); otherwise it opens the peer's.
    """

    def __init__(self, name: str, capacity: int, create: bool) -> None:
        self.name, self.capacity = name, capacity
        path = segment_path(name)
        size = _DATA + capacity
        if create:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                os.close(fd)
                os.unlink(path)
                raise OSError(
                    f"could not reserve {size / 2**20:.1f} MiB of shared memory in /dev/shm "
                    f"({e.strerror}); free some, make /dev/shm larger (docker: --shm-size), or "
                    f"pass a smaller ring_bytes"
                ) from e
        else:
            fd = os.open(path, os.O_RDWR)
        try:
            # mapped with its pages in place: a page's first touch would cost a fault inside
            # some message's copy
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            self._map: mmap.mmap | None = mmap.mmap(fd, size, flags=flags)
        finally:
            os.close(fd)
        base = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        self._counters: Any = (ctypes.c_uint64 * 3).from_buffer(self._map)
        self.data = base + _DATA
        self.written = 0  # the writer's own copy of head
        self.read = 0  # the reader's own copy of tail

    def room(self) -> int:
        """Bytes the writer may write now."""
        return self.capacity - (self.written - int(self._counters[1]))

    def available(self) -> int:
        """Bytes the reader may read now."""
        return int(self._counters[0]) - self.read

    def write(self, address: int, size: int) -> int:
        """Copy up to ``size`` bytes from ``address`` in; returns how many fitted."""
        size = min(size, self.room())
        if size <= 0:
            return 0
        self.put(address, size)
        self.publish()
        return size

    def put(self, address: int, size: int) -> None:
        """Copy ``size`` bytes in, which the caller knows fit (:meth:`room`), without showing
        them to the reader yet (:meth:`publish`)."""
        at = self.written % self.capacity
        first = min(size, self.capacity - at)
        ctypes.memmove(self.data + at, address, first)
        if size > first:
            ctypes.memmove(self.data, address + first, size - first)
        self.written += size

    def publish(self) -> None:
        """Show the reader everything put in so far."""
        self._counters[0] = self.written

    def take(self, address: int, size: int) -> int:
        """Copy up to ``size`` bytes out to ``address``; returns how many there were."""
        size = min(size, self.available())
        if size <= 0:
            return 0
        at = self.read % self.capacity
        first = min(size, self.capacity - at)
        ctypes.memmove(address, self.data + at, first)
        if size > first:
            ctypes.memmove(address + first, self.data, size - first)
        self.read += size
        self._counters[1] = self.read
        return size

    @property
    def waiting(self) -> bool:
        """Whether the writer holds bytes that did not fit (set by the writer)."""
        return bool(self._counters[2])

    @waiting.setter
    def waiting(self, value: bool) -> None:
        self._counters[2] = int(value)

    def unlink(self) -> None:
        """Remove the file's name; the mappings stay valid until closed."""
        unlink_segment(self.name)

    def close(self) -> None:
        self._counters = None
        if self._map is not None:
            self._map.close()
            self._map = None


class Doorbell:
    """A named counting semaphore: :meth:`ring` wakes one :meth:`wait` (or the next)."""

    def __init__(self, name: str, create: bool) -> None:
        self.name = name
        if create:
            self._sem = _multiprocessing.SemLock(_SEMAPHORE, 0, _SEM_MAX, name, False)
        else:
            self._sem = _multiprocessing.SemLock._rebuild(0, _SEMAPHORE, _SEM_MAX, name)

    def ring(self) -> None:
        self._sem.release()

    def wait(self, seconds: float) -> bool:
        """Block until rung or ``seconds`` have passed; whether it was rung."""
        return bool(self._sem.acquire(True, max(seconds, 0.0)))

    def unlink(self) -> None:
        unlink_doorbell(self.name)


class Buffers(OrderedDict[int, deque[Tensor]]):
    """Buffers that messages were copied out into, kept for reuse: by size in bytes, the size
    used least recently first (a new buffer's pages are touched for the first time by the copy
    out of the ring, which costs more than the copy).

    A buffer stays in its size's entry while the tensors of its message use it, and is handed
    out again once nothing else holds its memory. ``bytes`` counts every buffer kept, free or
    in use, and never exceeds ``limit``: a new buffer is kept after dropping whole sizes used
    least recently (as a rule those of old messages, free by now, so their memory goes back),
    and not kept where its size's own buffers leave no room, nor beyond ``per_size`` of one
    size; a buffer not kept lives as long as its message's tensors. A pipeline of fixed
    shapes reuses buffers of a few sizes, with nothing dropped; one whose shapes vary from step
    to step (sequences of any length) would otherwise keep buffers of every size it received.
    """

    def __init__(self, limit: int, per_size: int) -> None:
        super().__init__()
        self.limit, self.per_size, self.bytes = limit, per_size, 0

    def take(self, size: int, busy: Sequence[Tensor] = ()) -> Tensor:
        """A buffer of ``size`` bytes that nothing uses (not one of ``busy``, still being
        filled), else a new one."""
        kept = self.get(size)
        if kept is not None and _use_count is not None:
            self.move_to_end(size)
            for _ in range(min(len(kept), 4)):  # oldest first: the likeliest to be free
                buffer = kept[0]
                kept.rotate(-1)
                # two references: ``buffer`` and the storage object asked about
                if _use_count(buffer.untyped_storage()._cdata) == 2 and (
                    not busy or all(b is not buffer for b in busy)
                ):
                    return buffer
        buffer = torch.empty(size, dtype=torch.uint8)
        if _use_count is not None:  # else a buffer could never be known to be free
            self._keep(size, buffer, kept)
        return buffer

    def _keep(self, size: int, buffer: Tensor, kept: deque[Tensor] | None) -> None:
        if kept is not None and len(kept) >= self.per_size:
            kept.popleft()
            self.bytes -= size
        own = 0 if kept is None else size * len(kept)
        if own + size > self.limit:  # dropping the other sizes would not make room
            return
        while self.bytes + size > self.limit:  # this size is the last: others come first
            oldest, dropped = self.popitem(last=False)
            self.bytes -= oldest * len(dropped)
        if kept is None:
            kept = self[size] = deque()
        kept.append(buffer)
        self.bytes += size


def unlink_segment(name: str) -> None:
    """Remove a ring's name (done already by another rank: nothing to do)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(segment_path(name))


def unlink_doorbell(name: str) -> None:
    """Remove a doorbell's name (done already by another rank: nothing to do)."""
    with contextlib.suppress(FileNotFoundError):
        _multiprocessing.sem_unlink(name)


def started(pid: int) -> int | None:
    """When process ``pid`` of this host started (clock ticks since boot), or None where this
    process cannot see it (gone, or in another PID namespace)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def alive(pid: int) -> bool:
    """Whether process ``pid`` of this host still runs (a zombie does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return True
