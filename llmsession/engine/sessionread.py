"""Reading a saved-session file (``sessionfile``) and verifying it, its header first.

A file's sizes are its own word, and a sparse file of 4 KiB can say it has 3 GiB: read whole,
it was held in memory before its checksum could refuse it. Here the opening and the header
(bounded by the record a model's positions could need) are read first; the blob table must
fill the file exactly and each blob must be what its name says it can be (an image's pixels as
the image table sizes them, a state at most what the loading model's cells could write), and
all that is kept must fit in the memory the caller says is free (else the state is not kept,
if that is enough); then the blobs are read in order, every byte into the file's checksum and
its blob's, a state the loading model cannot use (another model's or build's) read through in
chunks and never held. Nothing is returned before the file's checksum matches. Pure: no native
calls.
"""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmsession.engine.sessionfile import (
    DIGEST_BYTES,
    FORMAT_VERSION,
    LENGTH,
    MAGIC,
    SavedSession,
    decode_record,
    decode_replies,
)
from llmsession.errors import SessionFileError
from llmsession.files import opened_regular
from llmsession.options import MAX_POSITIONS

if TYPE_CHECKING:
    from typing_extensions import Buffer

MAX_HEADER_BYTES = 1 << 30
MAX_FILE_BYTES = 1 << 40  # a sanity bound: a state of 2**24 positions of a large model fits
CHUNK = 1 << 20  # a blob not kept is read through this much at a time
StateBytes = Callable[[Mapping[str, Any]], int | None]


@dataclass(frozen=True)
class _Blob:
    name: str
    size: int
    sha256: str
    dropped: str = ""  # why it is read through and not kept ("": kept)


def read(
    path: str | Path,
    max_positions: int = MAX_POSITIONS,
    *,
    state_bytes: StateBytes | None = None,
    max_bytes: int | None = None,
) -> SavedSession:
    """Read and verify a file; any defect is a ``SessionFileError`` naming it, a record of more
    than ``max_positions`` (a loading model's ``kv_tokens``) too. ``state_bytes(compat)``: the
    most bytes a state saved under ``compat`` (the header's) may have for the loading model (a
    larger one is refused unread), or None if that model cannot use it at all (then it is read
    through, never held: ``SavedSession.dropped`` says why). ``max_bytes``: the memory free to
    hold what is kept (None: not checked; past it the state is dropped if that is enough)."""
    path = Path(path)
    try:
        f, size = opened_regular(path)  # (a FIFO would block forever, a device never end)
    except OSError as error:
        raise SessionFileError(f"cannot read {path}: {error.strerror or error}") from None
    with f:
        reading = _Reading(f, path)
        header = reading.header(size, header_bytes(max_positions))
        images = _images(header, path)
        plan = _plan(header, images, size - reading.at - DIGEST_BYTES, path, state_bytes)
        if max_bytes is not None:
            plan = _within(plan, reading.at, max_bytes, path)
        blobs = {blob.name: reading.blob(blob) for blob in plan}
        reading.end()
    return SavedSession(
        compat=header["compat"],
        settings=header["settings"],
        record=decode_record(header.get("record"), limit=max_positions),
        messages=header["messages"],
        images=images,
        blobs={name: blob for name, blob in blobs.items() if blob is not None},
        replies=decode_replies(header.get("replies", []), limit=max_positions),
        dropped={blob.name: blob.dropped for blob in plan if blob.dropped},
    )


def header_bytes(max_positions: int) -> int:
    """The longest header a file of a record of ``max_positions`` may have (its tokens, the
    transcript's text and settings: a header bound to them, as its parse costs memory)."""
    return min(MAX_HEADER_BYTES, (16 << 20) + 64 * max_positions)


class _Reading:
    """A file read in order, every byte into its checksum, never past what it said it holds."""

    def __init__(self, f: io.BufferedReader, path: Path) -> None:
        self.f, self.path, self.digest, self.at = f, path, hashlib.sha256(), 0

    def header(self, size: int, most: int) -> dict[str, Any]:
        """The header, parsed: from an opening of our magic and a length of at most ``most``
        (a model's file, or a sparse one of 100 GB, is refused from its first 16 bytes)."""
        path = self.path
        if size > MAX_FILE_BYTES:
            raise SessionFileError(f"{path} has {size} bytes; a session file has at most {MAX_FILE_BYTES}")
        opening = self.f.read(len(MAGIC) + LENGTH.size)
        if size < len(opening) + DIGEST_BYTES or opening[: len(MAGIC)] != MAGIC:
            raise SessionFileError(f"{path} is not an llmsession file (or is truncated)")
        (length,) = LENGTH.unpack_from(opening, len(MAGIC))
        if length > most:
            raise SessionFileError(f"{path}: its header is longer than {most} bytes")
        if length > size - len(opening) - DIGEST_BYTES:
            raise SessionFileError(
                f"{path} is corrupt or truncated (its header length {length} is out of range)"
            )
        self.digest.update(opening)
        self.at = len(opening)
        try:
            header = json.loads(bytes(self.take(length)).decode("utf-8"))
        except (ValueError, RecursionError) as error:  # (ValueError: an int past CPython's digit limit too)
            raise SessionFileError(f"{path}: the header is not valid JSON: {error}") from None
        if not isinstance(header, dict) or header.get("format") != FORMAT_VERSION:
            version = header.get("format") if isinstance(header, dict) else None
            raise SessionFileError(
                f"{path}: unsupported format {version!r} (this version reads {FORMAT_VERSION})"
            )
        compat, settings, messages = (header.get(k) for k in ("compat", "settings", "messages"))
        if not (isinstance(compat, dict) and isinstance(settings, dict) and isinstance(messages, list)):
            raise SessionFileError(f"{path}: the header is missing compat, settings or messages")
        return header

    def take(self, size: int) -> bytearray:
        """The next ``size`` bytes (the caller bounded ``size`` by what it may hold)."""
        data = bytearray(size)
        view, got = memoryview(data), 0
        while got < size and (n := self.f.readinto(view[got:])):
            got += n
        self._read(got == size, data)
        return data

    def blob(self, blob: _Blob) -> Buffer | None:
        """A blob's bytes, checked against its digest; None for one read through, not kept."""
        digest = hashlib.sha256()
        if blob.dropped:
            left, data = blob.size, None
            while left and (chunk := self.f.read(min(left, CHUNK))):
                self._read(True, chunk)
                digest.update(chunk)
                left -= len(chunk)
            self._read(not left, b"")
        else:
            data = memoryview(self.take(blob.size))
            digest.update(data)
        if digest.hexdigest() != blob.sha256:
            raise SessionFileError(f"{self.path}: blob {blob.name!r} is corrupt or truncated")
        return data

    def end(self) -> None:
        """The checksum at the end, and nothing after it."""
        if self.f.read(DIGEST_BYTES) != self.digest.digest():
            raise SessionFileError(f"{self.path} is corrupt or truncated (checksum mismatch)")
        if self.f.read(1):
            raise SessionFileError(f"{self.path} changed while it was read")

    def _read(self, whole: bool, data: Buffer) -> None:
        if not whole:
            raise SessionFileError(f"{self.path} changed while it was read")
        self.digest.update(data)
        self.at += memoryview(data).nbytes


def _images(header: dict[str, Any], path: Path) -> dict[str, tuple[int, int]]:
    images = header.get("images")
    if not isinstance(images, dict) or not all(_is_size(v) for v in images.values()):
        raise SessionFileError(f"{path}: the image table is malformed")
    return {digest: (size[0], size[1]) for digest, size in images.items()}


def _is_size(value: Any) -> bool:
    return isinstance(value, list) and len(value) == 2 and all(isinstance(v, int) and v > 0 for v in value)


def _plan(
    header: dict[str, Any],
    images: Mapping[str, tuple[int, int]],
    room: int,
    path: Path,
    state_bytes: StateBytes | None,
) -> list[_Blob]:
    """The blob table, checked to fill the ``room`` between the header and the checksum, each
    blob what its name allows, and which are kept."""
    table = header.get("blobs")
    if not isinstance(table, list):
        raise SessionFileError(f"{path}: the blob table is missing")
    plan, names = [], set()
    for entry in table:
        try:
            name, size, digest = entry["name"], entry["size"], entry["sha256"]
        except (TypeError, KeyError):
            raise SessionFileError(f"{path}: a blob entry is malformed") from None
        if not (isinstance(name, str) and isinstance(size, int) and isinstance(digest, str)) or size < 0:
            raise SessionFileError(f"{path}: a blob entry is malformed")
        if name in names:
            raise SessionFileError(f"{path}: blob {name!r:.80} is in the table twice")
        names.add(name)
        plan.append(_Blob(name, size, digest, _dropped(name, size, header, images, path, state_bytes)))
    held = sum(blob.size for blob in plan)
    if held != room:
        raise SessionFileError(f"{path} is corrupt or truncated (its blobs take {held} bytes of its {room})")
    return plan


def _within(plan: list[_Blob], header: int, max_bytes: int, path: Path) -> list[_Blob]:
    """``plan`` within ``max_bytes`` of memory: its state read through, not kept, if that is
    enough (the transcript still loads, its next exchange decodes it), else a refusal."""

    def kept(blobs: list[_Blob]) -> int:
        return header + sum(blob.size for blob in blobs if not blob.dropped)

    if kept(plan) <= max_bytes:
        return plan
    lighter = [
        replace(blob, dropped=f"no memory was free to hold it ({blob.size:,} bytes)")
        if blob.name == "state" and not blob.dropped
        else blob
        for blob in plan
    ]
    if kept(lighter) > max_bytes:
        raise SessionFileError(
            f"{path}: loading it takes {kept(lighter):,} bytes of memory, and {max_bytes:,} are free"
        )
    return lighter


def _dropped(
    name: str,
    size: int,
    header: dict[str, Any],
    images: Mapping[str, tuple[int, int]],
    path: Path,
    state_bytes: StateBytes | None,
) -> str:
    """Why a blob is read through and not kept ("": kept); a blob that cannot be what its name
    says is refused. An image is its table's pixels (RGB); a state is at
    most ``state_bytes(compat)`` (None: not kept); a name this version does not write is not kept."""
    if name.startswith("image:"):  # (an ndarray image has no pixel bound: memory bounds it, ``_within``)
        width, height = images.get(name[len("image:") :], (0, 0))
        if size != width * height * 3 or not size:
            raise SessionFileError(f"{path}: blob {name!r:.80} is not an image of the file's image table")
        return ""
    if name != "state":
        return "a blob this version does not read"
    most = state_bytes(header["compat"]) if state_bytes else size
    if most is None:
        return "the saved state is another model's or build's"
    if size > most:  # (not a state this build writes for this model: a file made to look like one)
        raise SessionFileError(
            f"{path}: its state has {size:,} bytes, more than this model's cells hold ({most:,})"
        )
    return ""
