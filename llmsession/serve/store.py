"""Stored responses (``store: true`` on ``/v1/responses``): what ``GET /v1/responses/{id}``
returns and what a ``previous_response_id`` continues. Pure.

Each is kept with the digest of the key that made it: another key's id is unknown (a 404, never
continued, never retrieved). Bounded by count and by bytes (the response's body and its
transcript, as JSON); one larger than the byte bound is not kept. Past a bound, the key holding
the most (bytes, or responses when only the count is over) forgets its least recently used
first: a key that floods the store evicts its own responses, never a smaller key's, and a lone
key may use it all. A continuation's transcript is sized as its predecessor's size and its new
part's, so a long chain is never serialized whole on the event loop. The engine state behind a
response is not here: a continuation resends the transcript to the stateless sessions, whose
kept session still holds it (or its parked state), so only the new input is decoded.
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
    size: int  # the body's and the transcript's, as JSON
    transcript_size: int = 0


def json_size(value: object) -> int:
    return len(json.dumps(value, ensure_ascii=False))


class ResponseStore:
    """Responses by id, least recently used first. Used on the event loop's thread only."""

    def __init__(self, count: int = MAX_RESPONSES, size: int = MAX_BYTES) -> None:
        self.count, self.size = count, size
        self.used = 0
        self._kept: OrderedDict[str, Stored] = OrderedDict()
        self._held: dict[str | None, list[int]] = {}  # each key's [responses, bytes]

    def __len__(self) -> int:
        return len(self._kept)

    def put(
        self,
        owner: str | None,
        body: dict[str, Any],
        transcript: list[dict[str, Any]],
        after: Stored | None = None,
    ) -> bool:
        """Keep a response (False: larger than the whole bound, not kept). ``after``: the stored
        response it continues, whose transcript begins this one's (only the rest is sized)."""
        base = 0 if after is None else len(after.transcript)
        rest = transcript[base:]
        spent = (after.transcript_size if after is not None else 0) + json_size(rest)
        size = json_size(body) + spent
        if size > self.size:
            return False
        self._drop(body["id"])
        self._kept[body["id"]] = Stored(owner, body, transcript, size, spent)
        held = self._held.setdefault(owner, [0, 0])
        held[0], held[1] = held[0] + 1, held[1] + size
        self.used += size
        while len(self._kept) > self.count or self.used > self.size:
            self._drop(self._victim(but=body["id"]))
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

    def held(self, owner: str | None) -> tuple[int, int]:
        """How many responses ``owner`` keeps here, and their bytes."""
        count, size = self._held.get(owner, (0, 0))
        return count, size

    def _victim(self, but: str) -> str:
        """The least recently used response of the key holding the most, ``but`` the one just
        kept (a key whose only response it is holds the most: the next key gives way)."""
        by = 1 if self.used > self.size else 0  # (bytes when they are over, else responses)
        for owner in sorted(self._held, key=lambda owner: self._held[owner][by], reverse=True):
            for ident, stored in self._kept.items():
                if stored.owner == owner and ident != but:
                    return ident
        raise AssertionError("over a bound with only the response just kept")

    def _drop(self, ident: str) -> None:
        stored = self._kept.pop(ident, None)
        if stored is not None:
            self.used -= stored.size
            held = self._held[stored.owner]
            held[0], held[1] = held[0] - 1, held[1] - stored.size
            if not held[0]:
                del self._held[stored.owner]
