"""Stored responses (``store: true`` on ``/v1/responses``): what ``GET /v1/responses/{id}``
returns and what a ``previous_response_id`` continues. Pure.

Each is kept with the digest of the key that made it: another key's id is unknown (a 404, never
continued, never retrieved). Bounded by count and by bytes (the response's body and its
transcript, as JSON), the least recently used forgotten first; one larger than the byte bound is
not kept. The engine state behind a response is not here: a continuation resends the transcript
to the stateless sessions, whose kept session still holds it (or its parked state), so only the
new input is decoded.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

MAX_RESPONSES = 1024
MAX_BYTES = 64 << 20


@dataclass(frozen=True)
class Stored:
    owner: str | None  # the digest of the key that made it (None: a server without keys)
    body: dict[str, Any]
    transcript: list[dict[str, Any]]  # its conversation, its own reply included (no instructions)
    size: int


class ResponseStore:
    """Responses by id, least recently used first. Used on the event loop's thread only."""

    def __init__(self, count: int = MAX_RESPONSES, size: int = MAX_BYTES) -> None:
        self.count, self.size = count, size
        self.used = 0
        self._kept: OrderedDict[str, Stored] = OrderedDict()

    def __len__(self) -> int:
        return len(self._kept)

    def put(self, owner: str | None, body: dict[str, Any], transcript: list[dict[str, Any]]) -> bool:
        """Keep a response (False: larger than the whole bound, not kept)."""
        size = len(json.dumps(body, ensure_ascii=False)) + len(json.dumps(transcript, ensure_ascii=False))
        if size > self.size:
            return False
        self._drop(body["id"])
        self._kept[body["id"]] = Stored(owner, body, transcript, size)
        self.used += size
        while len(self._kept) > self.count or self.used > self.size:
            self._drop(next(iter(self._kept)))
        return True

    def get(self, ident: str, owner: str | None) -> Stored | None:
        stored = self._kept.get(ident)
        if stored is None or stored.owner != owner:
            return None
        self._kept.move_to_end(ident)
        return stored

    def delete(self, ident: str, owner: str | None) -> bool:
        if self.get(ident, owner) is None:
            return False
        self._drop(ident)
        return True

    def _drop(self, ident: str) -> None:
        stored = self._kept.pop(ident, None)
        if stored is not None:
            self.used -= stored.size
