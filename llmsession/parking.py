"""Where parked KV states wait: host RAM, and a disk tier for the states the RAM budget lets go.

A parked state is the bytes ``llama_state_seq_get_data`` wrote for one session, kept here between
exchanges; ``Residency`` decides which stay in RAM. With a disk directory, a state leaving RAM is
written, by a background thread, to a file that has no name (``O_TMPFILE``, or unlinked at once):
no other process can open or change it, and the kernel frees it when the process ends, however
it ends, so a crash leaves nothing in the directory. A state read back comes into an anonymous
mapping of its size, as ``NativeContext.state_get`` makes them: freed whole when dropped.
Pure Python: no bindings.
"""

from __future__ import annotations

import logging
import mmap
import os
import tempfile
import threading
from collections.abc import Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing_extensions import Buffer

log = logging.getLogger("llmsession")
Key = Hashable


def mapping(size: int) -> mmap.mmap:
    """An anonymous, prefaulted mapping of ``size`` bytes (at least one: mmap refuses zero)."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
    return mmap.mmap(-1, max(size, 1), flags=flags)


def unnamed_file(directory: Path) -> int:
    """A descriptor of a new file in ``directory`` that has no name."""
    try:
        return os.open(directory, os.O_TMPFILE | os.O_RDWR, 0o600)
    except (AttributeError, OSError):  # no O_TMPFILE here: make a file and unlink it at once
        fd, name = tempfile.mkstemp(prefix="kv-", dir=directory)
        os.unlink(name)
        return fd


class ParkingLot:
    """Parked states by session key: in RAM, or in unnamed files under ``disk_dir``.

    A state the RAM budget lets go is written by a background thread (write-behind), so the
    exchange that caused it does not wait for the disk; until the write ends it is still served
    from RAM. At most ``MAX_WRITES`` wait for the writer: past that, spilling waits for it."""

    MAX_WRITES = 2

    def __init__(self, disk_dir: str | Path | None = None) -> None:
        self.disk_dir = None if disk_dir is None else Path(disk_dir)
        if self.disk_dir is not None:
            self.disk_dir.mkdir(parents=True, exist_ok=True)
        self._host: dict[Key, Buffer] = {}
        self._writing: dict[Key, tuple[Buffer, Future[None]]] = {}  # on their way to disk
        self._disk: dict[Key, tuple[int, int]] = {}  # descriptor of an unnamed file, size
        self._lock = threading.Lock()  # the writer thread's changes against the engine's
        self._writer: ThreadPoolExecutor | None = None

    @property
    def host_bytes(self) -> int:
        return sum(memoryview(blob).nbytes for blob in self._host.values())

    @property
    def disk_entries(self) -> int:
        with self._lock:
            return len(self._disk) + len(self._writing)

    @property
    def disk_bytes(self) -> int:
        with self._lock:
            writing = sum(memoryview(blob).nbytes for blob, _ in self._writing.values())
            return writing + sum(size for _, size in self._disk.values())

    def holds(self, key: Key) -> str:
        """ "host", "disk" (or on its way there) or ""."""
        with self._lock:
            return (
                "host" if key in self._host else "disk" if key in self._disk or key in self._writing else ""
            )

    def size(self, key: Key) -> int:
        with self._lock:
            if key in self._host:
                return memoryview(self._host[key]).nbytes
            if key in self._writing:
                return memoryview(self._writing[key][0]).nbytes
            return self._disk[key][1] if key in self._disk else 0

    def park(self, key: Key, blob: Buffer) -> None:
        self.discard(key)
        self._host[key] = blob

    def spill(self, key: Key) -> bool:
        """The RAM budget lets ``key``'s state go: to disk if there is one (True), else forgotten.
        A write that fails later (disk full) forgets it, with a log line: a miss, never wrong."""
        blob = self._host.pop(key)
        if self.disk_dir is None:
            return False
        with self._lock:
            oldest = (
                next(iter(self._writing.values()), None) if len(self._writing) >= self.MAX_WRITES else None
            )
        if oldest is not None:
            oldest[1].result()
        if self._writer is None:
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="llmsession-disk")
        with self._lock:
            self._writing[key] = (blob, self._writer.submit(self._write, key, blob, self.disk_dir))
        return True

    def _write(self, key: Key, blob: Buffer, directory: Path) -> None:
        view, fd, done = memoryview(blob).cast("B"), -1, 0
        try:
            fd = unnamed_file(directory)
            while done < view.nbytes:
                done += os.pwrite(fd, view[done:], done)
        except OSError as error:
            log.warning("could not write a parked state to %s: %s", directory, error)
        with self._lock:
            if self._writing.get(key, (None,))[0] is blob:
                del self._writing[key]
                if done == view.nbytes:
                    self._disk[key], fd = (fd, view.nbytes), -1
        if fd >= 0:  # failed, or discarded meanwhile
            os.close(fd)

    def take(self, key: Key) -> Buffer | None:
        """The parked state of ``key`` (removed from here), or None if there is none or its file
        could not be read back whole."""
        blob = self.peek(key)
        self.discard(key)
        return blob

    def peek(self, key: Key) -> Buffer | None:
        """The parked state of ``key``, left in place; None as for ``take``."""
        with self._lock:
            if key in self._host:
                return self._host[key]
            if key in self._writing:
                return self._writing[key][0]
            fd, size = self._disk.get(key, (-1, 0))
            if fd < 0:
                return None
            blob = mapping(size)
            try:
                read = os.preadv(fd, [blob], 0)
            except OSError as error:
                log.warning("could not read a parked state back from %s: %s", self.disk_dir, error)
                return None
        if read != size:
            log.warning("a parked state came back short from %s: not restored", self.disk_dir)
            return None
        return blob

    def discard(self, key: Key) -> None:
        with self._lock:
            self._host.pop(key, None)
            self._writing.pop(key, None)  # the writer closes its file when it sees this
            fd, _ = self._disk.pop(key, (-1, 0))
        if fd >= 0:
            os.close(fd)

    def close(self) -> None:
        for key in list(self._host) + list(self._writing) + list(self._disk):
            self.discard(key)
        if self._writer is not None:
            self._writer.shutdown(wait=True)
            self._writer = None
