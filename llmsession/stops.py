"""Find stop strings in streamed text without rescanning the whole output each step.

Only a short tail is kept: the longest suffix of the text seen so far that could still
grow into a stop string. Everything before it can never be part of a stop and is emitted
at once, so each push costs O(len(text) + longest stop) per stop string.

The cut is always at the earliest occurrence of any stop in the full text, whatever the
split into pushes. So when a stop completes inside a longer stop that started earlier
and may still complete (stops "abcd" and "bc", text "abc"), the decision waits until the
longer one completes or fails, which takes at most ``len(longest stop) - 1`` characters.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    """Streams text through, holding back what may start a stop and cutting at the first
    stop found. An empty stop list passes everything through."""

    def __init__(self, stops: Sequence[str]) -> None:
        if isinstance(stops, str):
            raise TypeError("stops must be a sequence of strings, not a single string")
        if any(not stop for stop in stops):
            raise ValueError("stop strings must be non-empty")
        self._stops = tuple(dict.fromkeys(stops))
        self._prefixes = {stop[:n] for stop in self._stops for n in range(1, len(stop))}
        self._longest_prefix = max((len(stop) - 1 for stop in self._stops), default=0)
        self._held = ""
        self._stopped = False

    @property
    def stopped(self) -> bool:
        """True once a stop string was found; later pushes return ""."""
        return self._stopped

    def push(self, text: str) -> str:
        """Add streamed text; return the part that is safe to emit now."""
        if self._stopped:
            return ""
        buf = self._held + text
        cut = self._first_stop(buf)
        tail = self._tail_start(buf)
        if cut is not None and tail >= cut:
            return self._stop(buf[:cut])
        self._held = buf[tail:]
        return buf[:tail]

    def flush(self) -> str:
        """End of generation: release held text, cut at a stop it contains."""
        if self._stopped:
            return ""
        buf, self._held = self._held, ""
        cut = self._first_stop(buf)
        return buf if cut is None else self._stop(buf[:cut])

    def _stop(self, text: str) -> str:
        self._stopped = True
        self._held = ""
        return text

    def _first_stop(self, buf: str) -> int | None:
        """Start of the earliest complete stop occurrence in buf, if any."""
        found = [i for i in (buf.find(stop) for stop in self._stops) if i >= 0]
        return min(found, default=None)

    def _tail_start(self, buf: str) -> int:
        """Start of the longest suffix of buf that is a proper prefix of some stop."""
        for n in range(min(len(buf), self._longest_prefix), 0, -1):
            if buf[-n:] in self._prefixes:
                return len(buf) - n
        return len(buf)
