"""Where parked KV states wait: host RAM, and a disk tier for the states the RAM budget lets go.

A parked state is the bytes ``llama_state_seq_get_data`` wrote for one session, kept here between
exchanges; ``Residency`` decides which stay in RAM. With a disk directory, a state leaving RAM is
written by a background thread (the exchange does not wait) into a folder of this process's
own, ``llmsession-<pid>@<host>-*``: removed when the model closes or the interpreter exits, and
one left by a killed process is removed by the next one of its host that spills into the same
directory. No descriptor is held per state (a server with thousands of idle sessions would run
out). A state read back comes
into an anonymous mapping of its size, as ``NativeContext.state_get`` makes them (freed whole),
and is checked against the crc32 taken when it was written: llama.cpp's loaders abort the process
on malformed bytes, so a file that changed or came back short is a miss, never handed over.
Pure Python: no bindings.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import logging
import os
import re
import shutil
import socket
import stat
import tempfile
import threading
import time
import weakref
import zlib
from collections import deque
from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from llmsession.buffers import mapping

if TYPE_CHECKING:
    from typing_extensions import Buffer

log = logging.getLogger("llmsession")
Key = Hashable
FOLDER_PREFIX = "llmsession-"
FOREIGN_AGE_S = 7 * 24 * 3600.0  # another host's folder untouched this long: that host is gone


ALIVE = ".alive"  # in a state folder: locked (flock) for as long as its process lives


def running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):  # someone else's, or not a pid: let be
        return True
    return True


def abandoned(folder: Path) -> bool | None:
    """Whether ``folder``'s process has ended, told by its lock (which the system lets go when
    the process ends however: killed, crashed, in a container since restarted with the same pid
    or another pid namespace); None if the folder has no lock this user can read."""
    try:
        fd = os.open(folder / ALIVE, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False  # (held: its process is alive)
    finally:
        os.close(fd)  # (a lock taken goes with it)
    return True


def host_name() -> str:
    """This host's name as a folder name may hold it (a shared directory is several hosts'),
    with its pid namespace's number: two containers of one host name see different processes,
    so each is the other's foreign host (a pid the other cannot see is not a process gone)."""
    name = re.sub(r"[^A-Za-z0-9.]", "", socket.gethostname())[:64] or "host"
    try:
        space = re.sub(r"[^0-9]", "", os.readlink("/proc/self/ns/pid"))
    except OSError:  # (no /proc: the host's name alone)
        return name
    return f"{name}.{space}" if space else name


def sweep(directory: Path) -> None:
    """Remove the state folders of processes that ended without closing their models
    (``llmsession-<pid>@<host>-*``): one whose lock (``ALIVE``) is free, whatever its host; one
    without (an earlier version's) of this host's ended processes, or of another host's long
    untouched. A name not of that pattern is let be (another user's, anything)."""
    for folder in directory.glob(f"{FOLDER_PREFIX}*-*"):
        with contextlib.suppress(Exception):  # (one entry's trouble is not the sweep's)
            _swept(folder)


def _swept(folder: Path) -> None:
    ended = abandoned(folder)
    if ended is not None:
        if ended:
            shutil.rmtree(folder, ignore_errors=True)
        return
    owner = folder.name.removeprefix(FOLDER_PREFIX).rpartition("-")[0]
    pid, at, host = owner.partition("@")
    if at and host != host_name():  # (its host's to sweep, unless that host is long gone)
        if time.time() - folder.stat().st_mtime > FOREIGN_AGE_S:
            shutil.rmtree(folder, ignore_errors=True)
        return
    if pid.isascii() and pid.isdigit() and int(pid) != os.getpid() and not running(int(pid)):
        shutil.rmtree(folder, ignore_errors=True)


def own_folder(directory: Path, owner: object) -> tuple[Path, Callable[[], object]]:
    """A new private folder (0700) in ``directory``, named for this process and host
    (``llmsession-<pid>@<host>-*``) after sweeping the folders of this host's ended processes,
    and what removes it: called by its owner's close, else when ``owner`` is collected or at the
    interpreter's exit. The next process of this host sweeps it if this one is killed."""
    sweep(directory)
    prefix = f"{FOLDER_PREFIX}{os.getpid()}@{host_name()}-"
    folder = Path(tempfile.mkdtemp(prefix=prefix, dir=directory))
    alive = -1
    try:  # (locked before it is named: a sweep never finds it free while this process lives)
        made = folder / f"{ALIVE}.new"
        alive = os.open(made, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        fcntl.flock(alive, fcntl.LOCK_EX | fcntl.LOCK_NB)  # (held until the folder goes, or the process)
        os.rename(made, folder / ALIVE)
    except OSError:
        _remove(folder, alive)
        raise
    return folder, weakref.finalize(owner, _remove, folder, alive)


def _remove(folder: Path, alive: int) -> None:
    shutil.rmtree(folder, ignore_errors=True)
    if alive >= 0:
        with contextlib.suppress(OSError):
            os.close(alive)


def private_folder(folder: Path) -> None:
    """``folder`` made again (0700) if it was taken away, and in any case a directory of this
    user's that no one else may enter: states are never written where another user could read
    or replace them (an OSError if it is not so)."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(folder, 0o700)
    info = os.lstat(folder)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise OSError(f"{folder} is not a private folder of this user's")


def new_file(path: Path) -> BinaryIO:
    """``path`` made for writing, readable by this user only; never one that exists already,
    nor through a symlink."""
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600), "wb")


class ParkingLot:
    """Parked states by session key: in RAM, or in files of a private folder under ``disk_dir``.

    Until its write ends, a state on its way to disk is served from RAM. At most ``MAX_WRITES``
    writes are outstanding (discarded ones included): past that, spilling waits for the oldest."""

    MAX_WRITES = 2

    def __init__(self, disk_dir: str | Path | None = None) -> None:
        self.disk_dir = None if disk_dir is None else Path(disk_dir)
        self._host: dict[Key, Buffer] = {}
        self._writing: dict[Key, Buffer] = {}  # on their way to disk
        self._disk: dict[Key, tuple[Path, int, int]] = {}  # file, size, crc32
        self._outstanding: deque[Future[None]] = deque()
        self._lock = threading.Lock()  # the writer thread's changes against the engine's
        self._writer: ThreadPoolExecutor | None = None
        self._folder: Path | None = None
        self._remove_folder: Callable[[], object] | None = None
        self._names = itertools.count()

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
            writing = sum(memoryview(blob).nbytes for blob in self._writing.values())
            return writing + sum(size for _, size, _ in self._disk.values())

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
                return memoryview(self._writing[key]).nbytes
            return self._disk[key][1] if key in self._disk else 0

    def park(self, key: Key, blob: Buffer) -> None:
        self.discard(key)
        self._host[key] = blob

    def spill(self, key: Key) -> bool:
        """The RAM budget lets ``key``'s state go: to disk if there is one (True), else forgotten.
        A write that fails later (disk full), or a folder that cannot be made for it, forgets it,
        with a log line: a miss, never wrong."""
        blob = self._host.pop(key, None)
        if self.disk_dir is None or blob is None:
            return False
        try:
            folder = self._private_folder()
        except OSError as error:  # (tried again at the next spill: the disk may come back)
            log.warning("parked states cannot go to disk (%s): forgotten instead", error)
            return False
        with self._lock:
            while self._outstanding and self._outstanding[0].done():
                self._outstanding.popleft()
            oldest = self._outstanding[0] if len(self._outstanding) >= self.MAX_WRITES else None
        if oldest is not None:
            wait([oldest])
        path = folder / f"{next(self._names)}.state"
        if self._writer is None:
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="llmsession-disk")
        with self._lock:  # registered before the writer can look
            self._writing[key] = blob
            self._outstanding.append(self._writer.submit(self._write, key, blob, path))
        return True

    def _private_folder(self) -> Path:
        """The lot's folder, made at the first spill (with ``disk_dir``: one that cannot be made,
        a file there or no right to write, was a raw OSError after the weights had loaded; it is
        a spill's miss, as a full disk is)."""
        if self._folder is None:
            assert self.disk_dir is not None
            self.disk_dir.mkdir(parents=True, exist_ok=True)
            self._folder, self._remove_folder = own_folder(self.disk_dir, self)
        return self._folder

    def _current(self, key: Key, blob: Buffer) -> bool:
        return self._writing.get(key) is blob

    def _write(self, key: Key, blob: Buffer, path: Path) -> None:
        with self._lock:
            if not self._current(key, blob):
                return  # discarded or taken back before its turn: nothing to write
        written, digest = False, zlib.crc32(blob)  # here, off the exchange's path
        try:
            private_folder(path.parent)  # (another host's sweep may have taken an idle folder)
            with new_file(path) as file:
                file.write(blob)
            written = True
        except OSError as error:
            log.warning("could not write a parked state to %s: %s", path.parent, error)
        finally:
            with self._lock:
                keep = written and self._current(key, blob)
                if self._current(key, blob):
                    del self._writing[key]
                if keep:
                    self._disk[key] = (path, memoryview(blob).nbytes, digest)
            if not keep:
                path.unlink(missing_ok=True)

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
                return self._writing[key]
            path, size, digest = self._disk.get(key, (None, 0, 0))
        if path is None:
            return None
        if size == 0:
            return b""
        blob, got = mapping(size), 0
        view = memoryview(blob)[:size]
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)  # (a FIFO would hang here)
            with os.fdopen(fd, "rb", buffering=0) as file:
                if not stat.S_ISREG(os.fstat(file.fileno()).st_mode):
                    raise OSError(f"{path} is not a regular file")
                while got < size and (n := file.readinto(view[got:])):
                    got += n
        except OSError as error:
            log.warning("could not read a parked state back from %s: %s", path, error)
            return None
        finally:
            view.release()
        if got != size or zlib.crc32(blob) != digest:  # llama.cpp's loader may abort on bad bytes
            log.warning("a parked state came back short or changed from %s: not restored", path)
            return None
        return blob

    def discard(self, key: Key) -> None:
        with self._lock:
            self._host.pop(key, None)
            self._writing.pop(key, None)  # its writer skips it, or removes the file it wrote
            path, _, _ = self._disk.pop(key, (None, 0, 0))
        if path is not None:
            path.unlink(missing_ok=True)

    def close(self) -> None:
        for key in list(self._host) + list(self._writing) + list(self._disk):
            self.discard(key)
        if self._writer is not None:
            self._writer.shutdown(wait=True)
            self._writer = None
        if self._remove_folder is not None:
            self._remove_folder()
