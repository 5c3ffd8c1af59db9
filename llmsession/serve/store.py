"""Stored responses (``store: true`` on ``/v1/responses``): what ``GET /v1/responses/{id}``
returns and what a ``previous_response_id`` continues. Pure.

Each is kept with the digest of the key that made it: another key's id is unknown (a 404, never
continued, never retrieved). Each key has a share of its own, by count and by bytes (the
response's body and its transcript, as JSON: non-ASCII escaped, so never less than the text
takes in memory), the bounds over the server's keys: past its share a key forgets its own least
recently used first, and one response larger than the share is not kept (``put`` is False).
Nothing one key does changes what another keeps or sees (a shared pool let a key count the
others' responses by its own that went, and evict them). A continuation's transcript is sized
as its predecessor's size and its new part's, so a long chain is never serialized whole on the
event loop. The engine state behind a
response is not here: a continuation resends the transcript to the stateless sessions, whose
kept session still holds it (or its parked state), so only the new input is decoded. A response
in progress is known by its owner from its start (``begin``, ``end``): retrieved as it began,
deleted (then it is not kept when it ends).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from llmsession.serve.rendering import rendered

MAX_RESPONSES = 1024
MAX_BYTES = 64 << 20


@dataclass(frozen=True)
class Stored:
    owner: str | None  # the digest of the key that made it (None: a server without keys)
    rendered: bytes  # its body, as a ``GET`` answers it (rendered once: one of 8 MiB takes ~80 ms)
    transcript: list[dict[str, Any]]  # its conversation, its own reply included (no instructions)
    size: int  # the body's and the transcript's, as JSON
    transcript_size: int = 0


def json_size(value: object) -> int:
    """Its JSON's length with non-ASCII escaped: at least what its text takes in memory (an emoji
    is 4 bytes and 12 characters escaped; counted unescaped, 1)."""
    return len(json.dumps(value))


def sized_transcript(transcript: list[dict[str, Any]], after: Stored | None) -> tuple[int, int]:
    """``put``'s ``sized`` of a transcript (its messages, not yet its reply) continuing ``after``
    (the stored response whose transcript begins it, or None: sized whole). Slow for a large new
    input (its images' base64): run it off the event loop."""
    base = 0 if after is None else len(after.transcript)
    known = 0 if after is None else after.transcript_size
    return len(transcript), known + json_size(transcript[base:])


class ResponseStore:
    """Responses by id, each key's least recently used first. Used on the event loop's thread
    only."""

    def __init__(self, count: int = MAX_RESPONSES, size: int = MAX_BYTES, owners: int = 1) -> None:
        """``count`` and ``size`` bound all that is kept, each of the server's ``owners`` (its
        keys; 1 without keys) keeping an equal share."""
        self.count, self.size = max(1, count // max(1, owners)), size // max(1, owners)  # (a key's)
        self.used = 0
        self._kept: dict[str, Stored] = {}
        self._lru: dict[str | None, OrderedDict[str, None]] = {}  # each key's ids, oldest first
        self._bytes: dict[str | None, int] = {}
        self._running: dict[str, tuple[str | None, bytes]] = {}  # (owner, body in progress, rendered)
        self._forgotten: set[str] = set()  # deleted while in progress: not kept when they end

    def __len__(self) -> int:
        return len(self._kept)

    def put(
        self,
        owner: str | None,
        body: dict[str, Any],
        transcript: list[dict[str, Any]],
        sized: tuple[int, int] = (0, 0),
        text: bytes | None = None,
    ) -> bool:
        """Keep a response (False: not kept, the module says when). ``sized``: how many of the
        transcript's first messages are sized already, and their size (``sized_transcript``:
        off the event loop; only the rest is sized here, its reply); ``text``: ``body``
        rendered already (off the event loop), else rendered here."""
        base, known = sized
        spent = known + json_size(transcript[base:])
        whole = rendered(body) if text is None else text
        size = len(whole) + spent
        ident = body["id"]
        if size > self.size or ident in self._forgotten:
            return False
        self._drop(ident)
        self._kept[ident] = Stored(owner, whole, transcript, size, spent)
        self._lru.setdefault(owner, OrderedDict())[ident] = None
        self._bytes[owner] = self._bytes.get(owner, 0) + size
        self.used += size
        mine = self._lru[owner]
        while len(mine) > self.count or self._bytes[owner] > self.size:  # (never the one just kept:
            self._drop(next(iter(mine)))  # it is the newest, and alone it is within the share)
        return True

    def get(self, ident: str, owner: str | None) -> Stored | None:
        stored = self._kept.get(ident)
        if stored is None or stored.owner != owner:
            return None
        self._lru[owner].move_to_end(ident)
        return stored

    def delete(self, ident: str, owner: str | None) -> bool:
        """Forget a kept response of ``owner``'s, or one still in progress (not kept when it
        ends); False if it knows neither."""
        if self.running(ident, owner) is not None:  # (kept already, its stream not yet closed: it goes too)
            del self._running[ident]
            self._forgotten.add(ident)
            self._drop(ident)
            return True
        if self.get(ident, owner) is None:
            return False
        self._drop(ident)
        return True

    def begin(self, ident: str, owner: str | None, text: bytes) -> None:
        """A response of ``owner``'s is in progress until ``end``: ``text``, its body as its
        stream began, rendered (a ``GET`` sends that: it rendered the body, 8 MB, each time)."""
        self._running[ident] = (owner, text)

    def end(self, ident: str) -> None:
        """It ended, however (kept with ``put`` before this, or not)."""
        self._running.pop(ident, None)
        self._forgotten.discard(ident)

    def running(self, ident: str, owner: str | None) -> bytes | None:
        """The body of ``owner``'s response in progress under ``ident``, rendered (None: none)."""
        running = self._running.get(ident)
        return running[1] if running is not None and running[0] == owner else None

    def held(self, owner: str | None) -> tuple[int, int]:
        """How many responses ``owner`` keeps here, and their bytes."""
        return len(self._lru.get(owner, ())), self._bytes.get(owner, 0)

    def _drop(self, ident: str) -> None:
        stored = self._kept.pop(ident, None)
        if stored is not None:
            self.used -= stored.size
            owner = stored.owner
            del self._lru[owner][ident]
            self._bytes[owner] -= stored.size
            if not self._lru[owner]:
                del self._lru[owner], self._bytes[owner]
