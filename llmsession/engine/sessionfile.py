"""The saved-session file: a JSON header, binary blobs, and a checksum over everything.

    b"LLMSESS1" | u64 header length | header (JSON) | blobs, in the header's order | sha256

The header holds the format version, what the KV state depends on (llama.cpp commit, state
format version, model and projector digests, context parameters), the item record and the
transcript; images in the transcript are blobs of RGB pixels. ``sessionread.read`` checks the
magic, sizes, JSON shape and every checksum before anything is returned, so a truncated, corrupt
or hostile file is a ``SessionFileError`` and never reaches llama.cpp's state loaders (which
abort the process on bad input). Pure: no native calls.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import struct
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from typing_extensions import Buffer

from llmsession.engine.prefix import ImagePosition, Item
from llmsession.errors import SessionFileError
from llmsession.options import MAX_POSITIONS

MAGIC = b"LLMSESS1"
FORMAT_VERSION = 1
LENGTH = struct.Struct("<Q")
DIGEST_BYTES = 32


@dataclass
class SavedSession:
    """What a file holds. ``compat`` must match the loading model and context for ``state`` to
    be used; ``blobs`` maps a blob name to its bytes (``"state"``, ``"image:<digest>"``)."""

    compat: dict[str, Any]
    settings: dict[str, Any]
    record: list[Item]
    messages: list[dict[str, Any]]
    images: dict[str, tuple[int, int]] = field(default_factory=dict)  # digest -> (width, height)
    blobs: Mapping[str, Buffer] = field(default_factory=dict)
    replies: list[tuple[str, list[int]]] = field(default_factory=list)  # (text, tokens as generated)
    dropped: dict[str, str] = field(default_factory=dict)  # a blob read through, not kept: why


def encode_record(items: Sequence[Item]) -> list[Any]:
    """Tokens as ints; each run of one image's positions as {"image", "n", "from", "count"}."""
    out: list[Any] = []
    for item in items:
        if isinstance(item, ImagePosition):
            last = out[-1] if out else None
            if (
                isinstance(last, dict)
                and last["image"] == item.digest
                and last["n"] == item.n_tokens
                and last["from"] + last["count"] == item.offset
            ):
                last["count"] += 1
            else:
                out.append({"image": item.digest, "n": item.n_tokens, "from": item.offset, "count": 1})
        elif isinstance(item, int):
            out.append(item)
        else:
            raise TypeError(f"cannot save a record item of type {type(item).__name__}")
    return out


def decode_record(encoded: Any, limit: int = MAX_POSITIONS) -> list[Item]:
    """The items of a saved record of at most ``limit`` positions (a loading model's
    ``kv_tokens``: no session of it holds more), counted before any is built: a hostile image
    run's count would build billions."""
    if not isinstance(encoded, list):
        raise SessionFileError("the record is not a list")
    entries = [_record_entry(entry) for entry in encoded]
    positions = sum(1 if isinstance(entry, int) else entry[3] for entry in entries)
    if positions > limit:
        raise SessionFileError(f"the record names {positions} positions; this model holds at most {limit}")
    items: list[Item] = []
    for entry in entries:
        if isinstance(entry, int):
            items.append(entry)
        else:
            digest, n, start, count = entry
            items += [ImagePosition(digest, n, start + i) for i in range(count)]
    return items


def decode_replies(encoded: Any, limit: int = MAX_POSITIONS) -> list[tuple[str, list[int]]]:
    """The replies' texts and the tokens they were generated with, of at most ``limit`` tokens
    in all (the ids checked against the vocabulary where they are used: ``persistence``)."""
    if not isinstance(encoded, list):
        raise SessionFileError("the replies are not a list")
    out, held = [], 0
    for entry in encoded:
        if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str)):
            raise SessionFileError(f"a reply entry is malformed: {entry!r:.80}")
        text, tokens = entry
        if not (isinstance(tokens, list) and all(type(t) is int and 0 <= t < 2**31 for t in tokens)):
            raise SessionFileError(f"a reply's tokens are malformed: {tokens!r:.80}")
        held += len(tokens)
        if held > limit:
            raise SessionFileError(f"the replies hold over {limit} tokens")
        out.append((text, tokens))
    return out


def _record_entry(entry: Any) -> int | tuple[str, int, int, int]:
    """A token, or an image run as (digest, n, from, count), checked."""
    if isinstance(entry, int) and not isinstance(entry, bool):
        return entry
    try:
        digest, n, start, count = entry["image"], entry["n"], entry["from"], entry["count"]
    except (TypeError, KeyError):
        raise SessionFileError(f"a record entry is malformed: {entry!r:.80}") from None
    if not (isinstance(digest, str) and all(type(v) is int for v in (n, start, count))):
        raise SessionFileError(f"a record entry is malformed: {entry!r:.80}")
    if not (start >= 0 and count > 0 and start + count <= n):
        raise SessionFileError(f"an image run is out of range: {entry!r:.80}")
    return digest, n, start, count


def write(path: str | Path, saved: SavedSession) -> None:
    """Write atomically: a new temporary file beside ``path``, fsynced, then renamed over it. A
    symlink is followed (its target is written); a path that exists and is not a regular file
    (a device, a FIFO, a directory) is refused: renaming over it would replace it."""
    path = target_file(path)
    blobs = list(saved.blobs.items())
    header = {
        "format": FORMAT_VERSION,
        "compat": saved.compat,
        "settings": saved.settings,
        "record": encode_record(saved.record),
        "messages": saved.messages,
        "images": {digest: list(size) for digest, size in saved.images.items()},
        "replies": [[text, tokens] for text, tokens in saved.replies],
        "blobs": [
            {"name": n, "size": memoryview(b).nbytes, "sha256": hashlib.sha256(b).hexdigest()}
            for n, b in blobs
        ],
    }
    head = json.dumps(header, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    digest = hashlib.sha256()
    try:
        handle, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as error:
        raise SessionFileError(f"cannot write beside {path}: {error.strerror or error}") from None
    temporary = Path(name)
    try:
        with os.fdopen(handle, "wb") as f:
            for chunk in (MAGIC, LENGTH.pack(len(head)), head, *(b for _, b in blobs)):
                digest.update(chunk)
                f.write(chunk)
            f.write(digest.digest())
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException as error:
        temporary.unlink(missing_ok=True)
        if isinstance(error, OSError):  # a full disk, a read-only file system...
            raise SessionFileError(f"cannot write {path}: {error.strerror or error}") from None
        raise
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def target_file(path: str | Path) -> Path:
    """Where a save writes: ``path`` with symlinks resolved, which must be a regular file if it
    exists, in a directory that exists."""
    resolved = Path(os.path.realpath(path))
    try:
        mode = resolved.stat().st_mode
    except FileNotFoundError:
        mode = None
    except OSError as error:
        raise SessionFileError(f"cannot write {path}: {error.strerror or error}") from None
    if mode is not None and not stat.S_ISREG(mode):
        raise SessionFileError(f"cannot write {path}: it exists and is not a regular file")
    if not resolved.parent.is_dir():
        raise SessionFileError(f"cannot write {path}: {resolved.parent} is not a directory")
    return resolved


def file_digest(path: str | Path) -> str:
    """sha256 of a file (a model's identity), read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()
