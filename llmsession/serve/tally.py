"""How many requests of each kind are under way (a key's bodies being read, the requests
waiting for a model, or for a model and of a key, the embedding requests waiting for their
turn), each kind bounded where asked: one past its bound is refused with a 503 the client may
retry, and a kind at zero is forgotten (a key's count does not outlive its requests). Used on
the event loop's thread only."""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Hashable, Iterator

from llmsession.serve.errors import busy


def keys_share(key: str | None, most: int) -> int | None:
    """The bound of one key's count: ``most``; none on a server without keys (``key`` None),
    whose one tenant may use every place."""
    return None if key is None else most


class Tally:
    """Counts by kind (``counting``)."""

    def __init__(self) -> None:
        self.counts: collections.Counter[Hashable] = collections.Counter()

    def __getitem__(self, kind: Hashable) -> int:
        return self.counts[kind]

    @contextlib.contextmanager
    def counting(self, *kinds: tuple[Hashable, int | None, str]) -> Iterator[None]:
        """One more of each kind in the block, each ``(kind, most, why)``: refused with
        ``busy(why)`` where ``most`` are under way already (None: no bound), before any of
        them is counted."""
        for kind, most, why in kinds:
            if most is not None and self.counts[kind] >= most:
                raise busy(why)
        for kind, _, _ in kinds:
            self.counts[kind] += 1
        try:
            yield
        finally:
            for kind, _, _ in kinds:
                self.counts[kind] -= 1
                if not self.counts[kind]:
                    del self.counts[kind]
