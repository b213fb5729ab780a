"""Shared memory between the processes of one host: a byte ring from one rank to another, and
the doorbell that wakes a rank waiting for it.

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
"""

from __future__ import annotations

import _multiprocessing  # type: ignore[import-not-found]  # no stubs; CPython's own
import contextlib
import ctypes
import mmap
import os
from typing import Any

__all__: list[str] = []

_DATA = 4096
_SEMAPHORE = 1  # _multiprocessing's kind for a counting semaphore
_SEM_MAX = 2147483647


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
