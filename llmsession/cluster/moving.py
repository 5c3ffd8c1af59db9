"""Conversations handed from one replica to another with their state, through a folder every
replica sees (``--disk-cache-dir``: a folder on one host, a network filesystem on a cluster).

A replica that lets a conversation go (it is stopping, or the replica the conversation went to
asks for it) saves its session (``Session.save``: the transcript, the KV state and what that
depends on, under a sha256) to a private file and appends a seal: the conversation's tenant and
an HMAC, under the cluster's secret (``load_secret``), of the conversation's key, that tenant
and the file's checksum (as this replica wrote it: nothing read back from the shared folder is
sealed). The sealed file is copied into the folder under a hidden name and renamed to
``<key>.conversation`` when whole, so it is never read half written; a newer one replaces an
older one at once. A file in a conversation's place is opened without following a link, and
only a regular file's is read (a FIFO or a device is refused unread), its seal first.

A replica given a conversation it does not hold claims its file by renaming it to a hidden name
of its own (one rename wins; the others find nothing) and copies it into a private file (in
the temporary folder, named by its process: a sweep removes those of processes gone), out of
reach of anyone who can write the shared one; there it checks the seal (a file someone else
wrote or changed, or one renamed to another conversation, is refused), cuts the seal off and
hands the session file to ``Model.load_session``, which checks every byte against the sealed
checksum and restores the state only for the same model, build and context layout. Files nobody
claims are removed after ``MAX_AGE_S``, and hidden ones a replica that died left behind after
``STALE_S``. Each replica announces itself in the folder (``announce``): a replica gives a
conversation up only to one whose announcement it sees, so a folder that is not shared (one of
each host's own) moves nothing. Pure Python: no Ray, no model.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import hmac
import json
import logging
import os
import re
import secrets
import shutil
import stat
import struct
import tempfile
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from llmsession.engine.parking import running

log = logging.getLogger("llmsession.cluster")
FOLDER = "conversations"  # under the disk cache directory
SUFFIX = ".conversation"
MAX_AGE_S = 24 * 3600.0  # an unclaimed conversation's file, then removed
STALE_S = 3600.0  # a hidden file (being written, or claimed) whose replica died
KEY = re.compile(r"[0-9a-f]{32}")  # a conversation's key (``keys``): the only names made here
MAX_TENANT = 512  # characters of a tenant's name kept in a seal
SECRET_BYTES = 32
COPY = "llmsession-claimed-"  # a claimed file's private copy (then its process's id), until loaded
COPY_S = 600.0  # a private copy whose process is gone, then removed
SEAL_MAGIC = b"LLMSEAL1"
_TAIL = struct.Struct("<I8s32s")  # the seal's length, its magic, the HMAC
_CHECKSUM = 32  # the session file's own sha256, just before the seal


def load_secret(path: Path) -> bytes:
    """The cluster's secret, kept in ``path`` (made on first use, whole at once, readable by
    its owner only): the command that runs the cluster gives it to every replica, so only they
    can seal. A file others may read, or of another size, is refused."""
    if not path.exists():
        fd, name = tempfile.mkstemp(prefix=".secret-", dir=path.parent)  # (0600)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(secrets.token_bytes(SECRET_BYTES))
            with contextlib.suppress(FileExistsError):  # (another command made it first: theirs)
                os.link(name, path)
        finally:
            os.unlink(name)
    if path.stat().st_mode & 0o077:
        raise ValueError(f"{path} may be read by others: chmod 600 it, or remove it")
    secret = path.read_bytes()
    if len(secret) != SECRET_BYTES:
        raise ValueError(f"{path} does not hold a secret of {SECRET_BYTES} bytes: remove it")
    return secret


@dataclass(frozen=True)
class Claimed:
    """A conversation's file this replica claimed: a session file now (the seal cut off), and
    the tenant it was saved for."""

    path: Path
    tenant: str | None


class SharedSpill:
    """The shared folder's conversations, for one replica (``owner``: its name, in its hidden
    files' names). ``refused`` counts the files it refused."""

    def __init__(self, directory: Path, secret: bytes, owner: str) -> None:
        if len(secret) < 16:
            raise ValueError("the cluster's secret is too short")
        self.folder = Path(directory) / FOLDER
        self.folder.mkdir(parents=True, exist_ok=True)
        self.secret = secret
        self.owner = _name(owner)
        self.refused = 0

    def announce(self) -> None:
        """Say that this replica sees the folder (again: an announcement ages out as hidden
        files do, after ``STALE_S``)."""
        path = self.folder / f".replica-{self.owner}"
        for _attempt in range(2):  # (never a link's target: a symlink put in its place is removed)
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
            except OSError as error:
                if error.errno != errno.ELOOP:
                    log.warning("this replica cannot announce itself in %s: %s", self.folder, error)
                    return
                path.unlink(missing_ok=True)
                continue
            try:
                os.utime(fd)
            finally:
                os.close(fd)
            return

    def sees(self, replica: str) -> bool:
        """Whether ``replica`` announced itself here (it sees the files saved here)."""
        return (self.folder / f".replica-{_name(replica)}").exists()

    def put(self, key: str, tenant: str | None, save: Callable[[Path], None]) -> bool:
        """Save a conversation for another replica (``save`` writes a session file to the path
        it is given); False if it cannot be (a key or tenant this folder does not take)."""
        if not KEY.fullmatch(key) or (tenant is not None and len(tenant) > MAX_TENANT):
            return False
        # Saved and sealed where no one else writes: the seal is over the checksum this replica
        # wrote, never one read back from the shared folder.
        fd, mine = _private_file()
        os.close(fd)
        hidden: Path | None = None
        try:
            save(mine)
            with mine.open("r+b") as f:
                f.seek(-_CHECKSUM, os.SEEK_END)
                checksum = f.read(_CHECKSUM)
                seal = json.dumps({"tenant": tenant, "by": self.owner, "at": time.time()}).encode()
                f.seek(0, os.SEEK_END)
                f.write(seal + _TAIL.pack(len(seal), SEAL_MAGIC, self._tag(key, seal, checksum)))
            fd, name = tempfile.mkstemp(prefix=f".writing-{self.owner}-", dir=self.folder)
            hidden = Path(name)
            with os.fdopen(fd, "wb") as out, mine.open("rb") as source:
                shutil.copyfileobj(source, out)
                out.flush()
                os.fsync(out.fileno())
            os.replace(hidden, self.folder / f"{key}{SUFFIX}")  # (whole: a claim never sees it half made)
            return True
        finally:
            mine.unlink(missing_ok=True)
            if hidden is not None:
                hidden.unlink(missing_ok=True)

    def withdraw(self, key: str) -> bool:
        """Take back a file this replica saved (True), unless another claimed it first."""
        hidden = self._grab(key, "withdrawn")
        if hidden is None:
            return False
        hidden.unlink(missing_ok=True)
        return True

    def claim(self, key: str, tenants: Collection[str | None] | None = None) -> Claimed | None:
        """The conversation's file, claimed by this replica and checked, or None (none there,
        another replica claimed it first, it was refused, or, unless ``tenants`` is None, it was
        saved for none of them: left where it is, for a request of its own tenant)."""
        if not KEY.fullmatch(key):
            return None
        if tenants is not None and not self._for(key, tenants):
            return None
        claimed = self._grab(key, "claimed")
        if claimed is None:
            return None
        try:
            source, size = _opened(claimed)
        except (OSError, ValueError) as error:
            return self._refused(claimed, error)
        with source:  # (its seal first: a file no replica sealed is refused unread)
            try:
                self._checked(key, source)
            except (OSError, ValueError) as error:
                return self._refused(claimed, error)
            mine = self._copied(source, size, claimed, key)
        if mine is None:
            return None
        try:  # (0600, made here: what is checked and loaded is this copy, no one else's)
            tenant = self._unsealed(key, mine)
        except (OSError, ValueError) as error:
            mine.unlink(missing_ok=True)
            return self._refused(claimed, error)
        claimed.unlink(missing_ok=True)
        if tenants is not None and tenant not in tenants:  # (replaced since it was read: rare)
            mine.unlink(missing_ok=True)
            self.refused += 1
            return None
        return Claimed(mine, tenant)

    def _copied(self, source: BinaryIO, size: int, claimed: Path, key: str) -> Path | None:
        """A private copy of a claimed file; None if this replica cannot make one (its temporary
        folder full or not writable): the file is then put back, whole, for another replica."""
        mine = None
        try:
            fd, mine = _private_file()
            with os.fdopen(fd, "wb") as out:
                _copy(source, out, size)
            return mine
        except OSError as error:
            if mine is not None:
                mine.unlink(missing_ok=True)
            log.warning(
                "a conversation's file could not be copied here (%s): left for another replica", error
            )
            with contextlib.suppress(OSError):  # (unless a newer one came meanwhile: it stays)
                os.link(claimed, self.folder / f"{key}{SUFFIX}")
            claimed.unlink(missing_ok=True)
            return None

    def _refused(self, claimed: Path, error: Exception) -> Claimed | None:
        """A claimed file that is not a conversation of this cluster's, removed (a directory
        put in its place too, never what its links point to): None."""
        if claimed.is_dir() and not claimed.is_symlink():
            shutil.rmtree(claimed, ignore_errors=True)
        else:
            claimed.unlink(missing_ok=True)
        self.refused += 1
        log.warning("a conversation's file was refused: %s", error)
        return None

    def _for(self, key: str, tenants: Collection[str | None]) -> bool:
        """Whether the conversation's file names one of ``tenants`` in its seal (read, not
        checked: the claim checks it; a file that cannot be read so is claimed and refused)."""
        try:
            source, _size = _opened(self.folder / f"{key}{SUFFIX}")
            with source:
                _body, _checksum, seal, _tag = _sealed(source)
            tenant = _seal_tenant(seal)
        except FileNotFoundError:
            return False
        except (OSError, ValueError):
            return True
        return tenant in tenants

    def _grab(self, key: str, kind: str) -> Path | None:
        """The conversation's file, renamed to a hidden name of this replica's (one rename
        wins), or None if it is not there (or another replica took it first)."""
        hidden = self.folder / f".{kind}-{self.owner}-{secrets.token_hex(8)}"
        try:
            os.rename(self.folder / f"{key}{SUFFIX}", hidden)
        except FileNotFoundError:
            return None
        return hidden

    def _unsealed(self, key: str, path: Path) -> str | None:
        """The tenant a claimed file was sealed for, its seal checked and cut off (ValueError if
        it is not a sealed session file of this cluster's, for this conversation)."""
        with path.open("r+b") as f:
            body, seal = self._checked(key, f)
            f.truncate(body)
        return _seal_tenant(seal)

    def _checked(self, key: str, f: BinaryIO) -> tuple[int, bytes]:
        """Where a sealed file's session file ends, and its seal, checked (ValueError if it is
        not this cluster's for this conversation, or changed)."""
        body, checksum, seal, tag = _sealed(f)
        if not hmac.compare_digest(tag, self._tag(key, seal, checksum)):
            raise ValueError("its seal does not match (not this cluster's, or changed)")
        return body, seal

    def _tag(self, key: str, seal: bytes, checksum: bytes) -> bytes:
        message = b"\0".join((b"llmsession-conversation", key.encode(), seal, checksum))
        return hmac.new(self.secret, message, hashlib.sha256).digest()

    def sweep(self, now: float | None = None) -> int:
        """Remove the files nobody claimed within ``MAX_AGE_S``, and hidden ones left behind,
        and the private copies of claimed files that a process of this host killed before it
        loaded them left in the temporary folder; how many were removed."""
        now = time.time() if now is None else now
        removed = _orphaned_copies(now)
        for entry in os.scandir(self.folder):
            limit = STALE_S if entry.name.startswith(".") else MAX_AGE_S
            try:
                if entry.is_file(follow_symlinks=False) and now - entry.stat().st_mtime > limit:
                    os.unlink(entry.path)
                    removed += 1
            except FileNotFoundError:
                continue  # (claimed or removed meanwhile)
        return removed


def _sealed(f: BinaryIO) -> tuple[int, bytes, bytes, bytes]:
    """A sealed file's parts, read, not checked: where the session file's bytes end, its
    checksum, the seal and its HMAC (ValueError if it is too short or carries no seal)."""
    size = f.seek(0, os.SEEK_END)
    if size < _TAIL.size + _CHECKSUM:
        raise ValueError("it is too short to be sealed")
    f.seek(size - _TAIL.size)
    length, magic, tag = _TAIL.unpack(f.read(_TAIL.size))
    if magic != SEAL_MAGIC or length > min(4096, size - _TAIL.size - _CHECKSUM):
        raise ValueError("it carries no seal")
    body = size - _TAIL.size - length  # (the session file's bytes end here)
    f.seek(body - _CHECKSUM)
    return body, f.read(_CHECKSUM), f.read(length), tag


def _private_file() -> tuple[int, Path]:
    """A new file of this process's own (0600) in the temporary folder, named as the sweep of
    orphaned copies reads it (``COPY``, then the process's id)."""
    fd, name = tempfile.mkstemp(prefix=f"{COPY}{os.getpid()}-", suffix=".llmsession")
    return fd, Path(name)


def _opened(path: Path) -> tuple[BinaryIO, int]:
    """A file of the shared folder, opened for reading, and its size: never a symlink's target,
    a FIFO (whose open would block) or a device (``/dev/zero`` never ends): OSError or ValueError."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError("it is not a regular file")
        return os.fdopen(fd, "rb"), info.st_size
    except BaseException:
        os.close(fd)
        raise


def _copy(source: BinaryIO, out: BinaryIO, size: int) -> None:
    """``size`` bytes of ``source`` from its start (what it held when opened: a file that grows
    meanwhile is copied no further, and is refused by its seal)."""
    source.seek(0)
    while size > 0 and (chunk := source.read(min(size, 1 << 20))):
        out.write(chunk)
        size -= len(chunk)


def _seal_tenant(seal: bytes) -> str | None:
    """The tenant a seal names (ValueError if it names none)."""
    parsed = json.loads(seal)
    tenant = parsed.get("tenant") if isinstance(parsed, dict) else 0
    if tenant is not None and not isinstance(tenant, str):
        raise ValueError("its seal names no tenant")
    return tenant


def _orphaned_copies(now: float) -> int:
    """Remove this user's private copies of claimed files (``COPY``), and of files being saved
    (and the hidden file a save writes beside one), whose process is gone, older than ``COPY_S``
    (a copy lives while its file loads: a process of another pid namespace sharing the folder,
    whose pid this one does not see, is not cut short)."""
    removed = 0
    for entry in os.scandir(tempfile.gettempdir()):
        name = entry.name.removeprefix(".")
        owner = name.removeprefix(COPY).partition("-")[0]
        if not name.startswith(COPY) or not (owner.isascii() and owner.isdigit()) or running(int(owner)):
            continue
        with contextlib.suppress(OSError):  # (another's, or removed meanwhile)
            stat = entry.stat(follow_symlinks=False)
            if (
                entry.is_file(follow_symlinks=False)
                and stat.st_uid == os.getuid()
                and now - stat.st_mtime > COPY_S
            ):
                os.unlink(entry.path)
                removed += 1
    return removed


def _name(replica: str) -> str:
    """A replica's name as a file name holds it."""
    return re.sub(r"[^A-Za-z0-9]", "", replica)[:32] or "replica"
