"""What a saved KV state belongs to: the sha256 of the model's files, each read once."""

from __future__ import annotations

from pathlib import Path

from llmsession.engine.sessionfile import file_digest
from llmsession.errors import SessionFileError


class FileIdentities:
    """Each file's sha256, computed on first use (a model file is read in full: seconds for GBs)."""

    def __init__(self) -> None:
        self._digests: dict[Path, str] = {}

    def of(self, path: Path) -> str:
        if path not in self._digests:
            try:
                self._digests[path] = file_digest(path)
            except OSError as error:  # moved or deleted since it was loaded
                raise SessionFileError(f"cannot read {path} to identify it: {error}") from None
        return self._digests[path]
