"""What a saved KV state belongs to: the sha256 of the model's files, each read once."""

from __future__ import annotations

import os
from pathlib import Path

from llmsession.engine.sessionfile import file_digest
from llmsession.errors import SessionFileError

Pin = tuple[int, int, int, int]  # (device, inode, size, modification time in ns)


def _pin(path: Path) -> Pin | None:
    try:
        info = os.stat(path)
    except OSError:
        return None
    return info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns


class FileIdentities:
    """Each file's sha256, computed on first use (a model file is read in full: seconds for GBs),
    of the file as it was when the model loaded (``paths``): one replaced or rewritten since
    (another inode, size or modification time) is refused, or a state made with the weights in
    memory would be saved, or loaded, under the new weights' name."""

    def __init__(self, *paths: Path | None) -> None:
        self._digests: dict[Path, str] = {}
        self._pins = {path: _pin(path) for path in paths if path is not None}

    def of(self, path: Path) -> str:
        if path not in self._digests:
            pinned = self._pins.get(path, _pin(path))
            try:
                digest = file_digest(path)
            except OSError as error:  # moved or deleted since it was loaded
                raise SessionFileError(f"cannot read {path} to identify it: {error}") from None
            if pinned is None or _pin(path) != pinned:  # (changed before or while it was read)
                raise SessionFileError(f"{path} changed since the model was loaded: it is not its file")
            self._digests[path] = digest
        return self._digests[path]
