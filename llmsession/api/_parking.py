"""``Models``' plumbing: its settings checked, a folder's models found, a model's footprint, and
its named conversations parked to a private folder when it unloads and kept again when it
reloads."""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from llmsession.engine import parking

if TYPE_CHECKING:
    from llmsession.api.model import Model
    from llmsession.engine.budget import MemoryReport

log = logging.getLogger(__name__)

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}")  # a model's name in requests and paths
MAX_SECONDS = 10 * 365 * 86400.0


def is_name(name: object) -> bool:
    return isinstance(name, str) and NAME.fullmatch(name) is not None and ".." not in name


def checked_name(name: object) -> str:
    if not is_name(name):
        raise ValueError(f"a model's name is 1 to 128 of A-Z a-z 0-9 . _ : / -, got {name!r:.80}")
    assert isinstance(name, str)
    return name


def checked_count(what: str, value: int | None) -> int | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{what} must be a positive int or None, got {value!r}")
    return value


def checked_seconds(what: str, value: float | None) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= MAX_SECONDS:
        raise ValueError(f"{what} must be seconds from 0 to {MAX_SECONDS:.0f}, or None; got {value!r}")
    return float(value)


def checked_keep_alive(value: float | None) -> float | None:
    """A use's ``keep_alive``: None (as the models say), seconds, or -1 (keep)."""
    if value is None or (not isinstance(value, bool) and isinstance(value, int | float) and value == -1):
        return None if value is None else -1.0
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"keep_alive must be finite seconds, 0, or -1; got {value!r}")
    return checked_seconds("keep_alive (or -1: keep)", value)


def file_bytes(*paths: Path | None) -> int:
    """The files' sizes (0 for one that cannot be read: its load will say why)."""
    total = 0
    for path in paths:
        with contextlib.suppress(OSError):
            total += path.stat().st_size if path is not None else 0
    return total


def footprint(report: MemoryReport, *files: Path | None) -> int:
    """What a loaded model holds: its files (weights, projector), its KV cells, llama.cpp's
    compute and output buffers, its host cache."""
    return file_bytes(*files) + report.kv_bytes + report.buffer_bytes + report.host_cache_bytes


def full_message(
    name: str, needed: int, limit: int | None, held: list[tuple[str, int, bool]], *, too_large: bool = False
) -> str:
    """Why ``name`` cannot load: the models held (name, bytes, whether loading or unloading),
    or (``too_large``) the limit, smaller than the model by itself."""
    if too_large and limit is not None:
        return (
            f"model {name!r} ({needed / 2**20:.0f} MiB) is larger than the memory "
            f"limit of {limit / 2**20:.0f} MiB by itself: it cannot load on this server"
        )
    states = {True: "loading or unloading", False: "in use"}
    parts = [f"{other} ({size / 2**20:.0f} MiB, {states[busy]})" for other, size, busy in held]
    within = f" within the memory limit of {limit / 2**20:.0f} MiB" if limit is not None else ""
    return (
        f"model {name!r} ({needed / 2**20:.0f} MiB) cannot load now{within}: "
        f"held: {', '.join(parts) or 'nothing'}"
    )


@dataclass(frozen=True)
class Parked:
    """A named conversation saved when its model unloaded."""

    file: Path
    tenant: str | None
    conversation: str


class Folder:
    """A private folder (0700) for parked conversations (they hold what was said), removed with
    its ``Models`` or at the interpreter's exit; named as the parking lot's folders are
    (``llmsession-<pid>@<host>-*``), so the next process of this host that makes one in the same
    place removes it if its own process was killed."""

    def __init__(self, under: Path | None = None) -> None:
        """In ``under`` (the disk cache folder, made if missing), else the system's temp folder."""
        place = Path(under) if under is not None else Path(tempfile.gettempdir())
        place.mkdir(parents=True, exist_ok=True)
        self.path, self._remove = parking.own_folder(place, self)
        self._numbers = itertools.count(1)  # (atomic: parks run in the sweeper's and loaders' threads)
        self._removed = False

    def next_file(self) -> Path:
        """A new file's name in the folder, made again if it was taken away (a sweep of old
        temporary files: every later park failed); OSError if it is not this user's only, or
        once removed (a park still under way as its models closed leaves nothing behind)."""
        if self._removed:
            raise OSError("the parking folder was removed with its models")
        parking.private_folder(self.path)
        return self.path / f"{next(self._numbers)}.session"

    def remove(self) -> None:
        self._removed = True
        self._remove()


def park(model: Model, folder: Folder) -> list[Parked]:
    """Save the conversations ``model``'s stateless calls named, each with its state, and take
    them out of the model (which closes next). One that cannot be saved is dropped, logged."""
    parked: list[Parked] = []
    try:
        names = model.conversations()
    except Exception as error:  # (a model that closed by itself: nothing to park)
        log.warning("a model's conversations could not be parked before it unloaded: %s", error)
        return parked
    for conversation in names:
        try:
            taken = model.take_conversation(conversation)
        except Exception as error:
            log.warning("a conversation could not be taken before its model unloaded: %s", error)
            continue
        if taken is None:  # (answering a call: it goes with the model)
            continue
        session, tenant = taken
        file = None
        try:
            file = folder.next_file()
            session.save(file)
            parked.append(Parked(file, tenant, conversation))
        except Exception as error:  # (dropped, never the unload)
            log.warning("a conversation could not be parked before its model unloaded: %s", error)
            if file is not None:
                file.unlink(missing_ok=True)
        finally:
            session.close()
    return parked


def restore(model: Model, parked: list[Parked]) -> list[Parked]:
    """Keep the parked conversations again in a reloaded ``model``; each file is removed. What
    cannot be restored is dropped, logged (its next turn decodes its whole prompt)."""
    for item in parked:
        try:
            session = model.load_session(item.file)
            model.keep_conversation(session, tenant=item.tenant, conversation=item.conversation)
        except Exception as error:  # (dropped, never the load)
            log.warning("a parked conversation could not be restored: %s", error)
        finally:
            item.file.unlink(missing_ok=True)
    return []
