"""Where parked KV states wait: host RAM, and a disk tier for the states the RAM budget lets go.

A parked state is the bytes ``llama_state_seq_get_data`` wrote for one session. The engine keeps
them here between exchanges; ``Residency`` decides which stay in RAM. With a disk directory a
state leaving RAM is written there (temporary name, then rename) and read back on demand, checked
against the sha256 taken when it was written: llama.cpp's loaders abort the process on malformed
bytes, so a damaged file is a miss, never handed over. Pure Python: no bindings.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from collections.abc import Hashable
from pathlib import Path

log = logging.getLogger("llmsession")
Key = Hashable


class ParkingLot:
    """Parked states by session key: in RAM, or in files under ``disk_dir``."""

    def __init__(self, disk_dir: str | Path | None = None) -> None:
        self.disk_dir = None if disk_dir is None else Path(disk_dir)
        if self.disk_dir is not None:
            self.disk_dir.mkdir(parents=True, exist_ok=True)
        self._host: dict[Key, bytes] = {}
        self._disk: dict[Key, tuple[Path, str, int]] = {}  # path, sha256, size

    @property
    def host_bytes(self) -> int:
        return sum(len(blob) for blob in self._host.values())

    @property
    def disk_entries(self) -> int:
        return len(self._disk)

    @property
    def disk_bytes(self) -> int:
        return sum(size for _, _, size in self._disk.values())

    def holds(self, key: Key) -> str:
        """ "host", "disk" or ""."""
        return "host" if key in self._host else "disk" if key in self._disk else ""

    def size(self, key: Key) -> int:
        if key in self._host:
            return len(self._host[key])
        return self._disk[key][2] if key in self._disk else 0

    def park(self, key: Key, blob: bytes) -> None:
        self.discard(key)
        self._host[key] = blob

    def spill(self, key: Key) -> bool:
        """The RAM budget lets ``key``'s state go: write it to disk if there is one (True), else
        forget it. A write that fails (disk full) forgets it too, with a log line."""
        blob = self._host.pop(key)
        if self.disk_dir is None:
            return False
        try:
            fd, name = tempfile.mkstemp(prefix="kv-", suffix=".part", dir=self.disk_dir)
            with os.fdopen(fd, "wb") as file:
                file.write(blob)
            path = Path(name).with_suffix(".state")
            os.replace(name, path)
        except OSError as error:
            log.warning("could not write a parked state to %s: %s", self.disk_dir, error)
            return False
        self._disk[key] = (path, hashlib.sha256(blob).hexdigest(), len(blob))
        return True

    def take(self, key: Key) -> bytes | None:
        """The parked state of ``key`` (removed from here), or None if there is none or its file
        no longer matches what was written."""
        blob = self.peek(key)
        self.discard(key)
        return blob

    def peek(self, key: Key) -> bytes | None:
        """The parked state of ``key``, left in place; None as for ``take``."""
        if key in self._host:
            return self._host[key]
        if key not in self._disk:
            return None
        path, digest, _ = self._disk[key]
        try:
            blob = path.read_bytes()
        except OSError as error:
            log.warning("could not read the parked state %s: %s", path, error)
            return None
        if hashlib.sha256(blob).hexdigest() != digest:
            log.warning("the parked state %s changed on disk: not restored", path)
            return None
        return blob

    def discard(self, key: Key) -> None:
        self._host.pop(key, None)
        path, _, _ = self._disk.pop(key, (None, "", 0))
        if path is not None:
            path.unlink(missing_ok=True)

    def close(self) -> None:
        for key in list(self._host) + list(self._disk):
            self.discard(key)
