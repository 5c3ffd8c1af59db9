"""Find stop strings in streamed text without rescanning the whole output each step.

Only a short tail is kept: the longest suffix of the text seen so far that could still
grow into a stop string. Everything before it can never be part of a stop and is emitted
at once.

The cut is always at the earliest occurrence of any stop in the full text, whatever the
split into pushes. So when a stop completes inside a longer stop that started earlier
and may still complete (stops "abcd" and "bc", text "abc"), the decision waits until the
longer one completes or fails, which takes at most ``len(longest stop) - 1`` characters.

Each stop runs as a streaming KMP automaton: its failure function is built once, and its
state is the length of the longest suffix of the text seen so far that is a proper prefix
of the stop. Storing every prefix of every stop instead costs quadratic memory (a
60,000-character stop took 1.8 GB), so this keeps memory linear in the stops and the
held text, and the work amortized O(1) per character per stop.
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Sequence


def _failure(stop: str) -> array[int]:
    """fail[j]: length of the longest proper border of stop[: j + 1] (KMP prefix function)."""
    fail = array("q", [0]) * len(stop)
    k = 0
    for j in range(1, len(stop)):
        while k and stop[j] != stop[k]:
            k = fail[k - 1]
        if stop[j] == stop[k]:
            k += 1
        fail[j] = k
    return fail


class StopMatcher:
    """Streams text through, holding back what may start a stop and cutting at the first
    stop found. An empty stop list passes everything through."""

    def __init__(self, stops: Sequence[str]) -> None:
        if isinstance(stops, str):
            raise TypeError("stops must be a sequence of strings, not a single string")
        if any(not stop for stop in stops):
            raise ValueError("stop strings must be non-empty")
        self._stops = tuple(dict.fromkeys(stops))
        self._fail = [_failure(stop) for stop in self._stops]
        self._state = [0] * len(self._stops)  # live partial-match length per stop
        self._pos = 0  # characters seen so far
        self._held: deque[str] = deque()  # pushed pieces not yet fully emitted
        self._skip = 0  # characters of self._held[0] already emitted
        self._start = 0  # absolute position of the first held character
        self._found: int | None = None  # start of the earliest complete stop seen
        self._matched: str | None = None  # the stop found there
        self._stopped = False

    @property
    def stopped(self) -> bool:
        """True once a stop string was found; later pushes return ""."""
        return self._stopped

    @property
    def matched(self) -> str | None:
        """The stop string the text was cut at (the earliest; of two starting there, the one
        that completed first), once ``stopped``."""
        return self._matched if self._stopped else None

    def push(self, text: str) -> str:
        """Add streamed text; return the part that is safe to emit now."""
        if self._stopped:
            return ""
        if not self._stops:
            return text
        if text:
            self._held.append(text)
        state, pos, found = self._state, self._pos, self._found
        live = max(state)
        for ch in text:
            pos += 1
            live = 0
            for i, stop in enumerate(self._stops):
                k = state[i]
                while k and stop[k] != ch:
                    k = self._fail[i][k - 1]
                if stop[k] == ch:
                    k += 1
                    if k == len(stop):
                        if found is None or pos - k < found:
                            found, self._matched = pos - k, stop
                        k = self._fail[i][k - 1]
                    state[i] = k
                    live = max(live, k)
                else:
                    state[i] = 0
            if found is not None and pos - live >= found:
                # No live partial match starts before it, so nothing can end up earlier.
                return self._stop(self._take(found - self._start))
        self._pos, self._found = pos, found
        return self._take(pos - live - self._start)

    def flush(self) -> str:
        """End of generation: release held text, cut at a stop it contains."""
        if self._stopped:
            return ""
        if self._found is not None:
            return self._stop(self._take(self._found - self._start))
        text = self._take(self._pos - self._start)
        self._state = [0] * len(self._stops)  # as before: a partial match does not span a flush
        return text

    def held(self) -> str:
        """The text held back (from the stop found, once ``stopped``), left held."""
        return "".join(self._held)[self._skip :]

    def disarm(self) -> str:
        """Stop looking for stops: the text held back (from the stop found, if one was: it is
        not a stop after all), and every later push passed through as it is."""
        rest = "".join(self._held)[self._skip :]
        self._held.clear()
        self._stops, self._state, self._skip, self._start = (), [], 0, self._pos
        self._found, self._matched, self._stopped = None, None, False
        return rest

    def _stop(self, text: str) -> str:
        self._stopped = True  # (what is held from the stop on stays, for ``disarm``)
        return text

    def _take(self, n: int) -> str:
        """Remove and return the first n held characters."""
        self._start += n
        pieces = []
        while n:
            piece = self._held[0]
            rest = len(piece) - self._skip
            if rest > n:
                pieces.append(piece[self._skip : self._skip + n])
                self._skip += n
                break
            pieces.append(piece[self._skip :] if self._skip else piece)
            self._held.popleft()
            self._skip = 0
            n -= rest
        return "".join(pieces)
