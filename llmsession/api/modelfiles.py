"""The files a ``Models`` serves (``ModelFile``: a GGUF and its projector), how a folder's are
found, and what ``Models.status`` says of each (``ModelStatus``)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from llmsession.api import _parking
from llmsession.config import checked_path
from llmsession.errors import ModelLoadError

LOAD_RETRY_SECONDS = 30.0  # a model whose file failed to load is not tried again before this

if TYPE_CHECKING:
    from llmsession.api.model import Model


@dataclass(frozen=True)
class ModelFile:
    """One model of a ``Models``: its GGUF file, and its projector (images) if it has one
    (each a ``Path``, or a str or ``os.PathLike`` made one; anything else is a TypeError)."""

    path: Path
    mmproj_path: Path | None = None

    def __post_init__(self) -> None:
        path = checked_path("path", self.path)
        if path is None:
            raise TypeError("path must be a path (str or os.PathLike), got None")
        object.__setattr__(self, "path", path)
        object.__setattr__(self, "mmproj_path", checked_path("mmproj_path", self.mmproj_path))


@dataclass(frozen=True)
class ModelStatus:
    """``Models.status()``: one model, now."""

    name: str
    path: Path
    loaded: bool
    busy: bool  # loading or unloading now
    users: int  # uses not yet released
    images: bool  # whether it has a projector
    context_size: int | None  # a new session's default context (loaded models)
    resident_bytes: int  # what it counts against ``memory_limit`` (``Models``)
    idle_seconds: float | None  # since its last use (loaded and unused models)
    unloads_in: float | None  # seconds until it unloads unless used again (None: it is kept)
    loads: int  # times it was loaded so far
    kind: str | None = None  # "chat", "embedding" or "reranker" (its GGUF's pooling), once loaded
    unloading: bool = False  # busy unloading (its conversations parked, then closed), not loading


def model_file(spec: ModelFile | str | Path) -> ModelFile:
    if isinstance(spec, str | Path):
        spec = ModelFile(Path(spec))
    if not isinstance(spec, ModelFile):
        raise TypeError(f"a model is a ModelFile or a path, got {type(spec).__name__}")
    return spec


def folder_models(folder: Path) -> dict[str, ModelFile]:
    """Every model in ``folder`` (``Models.from_folder``), by name, sorted."""
    if not folder.is_dir():
        raise ValueError(f"no folder {str(folder)!r:.200}")
    files = sorted(p for p in folder.iterdir() if p.suffix == ".gguf" and p.is_file())
    projectors = {p for p in files if p.name.startswith("mmproj") or p.name.endswith(".mmproj.gguf")}
    found: dict[str, ModelFile] = {}
    for path in files:
        if path in projectors:
            continue
        beside = [folder / f"{path.stem}.mmproj.gguf", folder / f"mmproj-{path.stem}.gguf"]
        mmproj = next((p for p in beside if p in projectors), None)
        if not _parking.is_name(path.stem):
            _parking.log.warning("%s is not served: its name is not a model name", path.name[:200])
            continue
        found[path.stem] = ModelFile(path, mmproj)
    if not found:
        raise ValueError(f"no .gguf model in {str(folder)!r:.200}")
    return found


def kind_of(pooling: str | None) -> str:
    """What a model does, by the pooling its GGUF names (``Model.pooling``)."""
    return "chat" if pooling is None else "reranker" if pooling == "rank" else "embedding"


class Entry:
    """A model's state in ``Models`` (changed under its lock)."""

    def __init__(self, file: ModelFile) -> None:
        self.file = file
        self.model: Model | None = None
        self.busy = False  # loading or unloading: others wait
        self.users = 0
        self.last_used = time.monotonic()
        self.keep_alive: float | None = None  # (None: ``Models.idle_unload``)
        self.footprint = _parking.file_bytes(file.path, file.mmproj_path)
        self.context_size: int | None = None  # (as its last load chose)
        self.loads = 0
        self.pooling: str | None = None  # (as its last load read it: an embedding model's)
        self.parked: list[_parking.Parked] = []
        self._failed: tuple[float, tuple[object, ...], ModelLoadError] | None = None

    def failed_load(self) -> ModelLoadError | None:
        """Its last load's error while ``LOAD_RETRY_SECONDS`` have not passed and its files are
        as they were: a bad file is not loaded again on every request (each load unloaded the
        least recently used idle models first, and failed)."""
        if self._failed is None:
            return None
        until, files, error = self._failed
        if time.monotonic() < until and files == self._signature():
            return error
        self._failed = None
        return None

    def failing(self, error: BaseException, *, remembered: bool) -> None:
        """A load of it failed: a ``ModelLoadError`` is remembered (``failed_load``) where its
        files or this machine's memory are the cause (``remembered``: no RPC server, whose
        "busy" or "cannot be reached" passes)."""
        if remembered and isinstance(error, ModelLoadError):
            self._failed = time.monotonic() + LOAD_RETRY_SECONDS, self._signature(), error

    def _signature(self) -> tuple[object, ...]:
        """Its files as they are now (the model's and its projector's)."""
        return tuple(_stat(path) for path in (self.file.path, self.file.mmproj_path))

    @property
    def idle(self) -> bool:
        return self.model is not None and not self.busy and self.users == 0

    @property
    def unloading(self) -> bool:
        """Busy with a model still set: unloading (a load sets its model once done)."""
        return self.busy and self.model is not None


def _stat(path: Path | None) -> tuple[int, int] | None:
    if path is None:
        return None
    try:
        stat = path.stat()
    except OSError:
        return None
    return stat.st_mtime_ns, stat.st_size
