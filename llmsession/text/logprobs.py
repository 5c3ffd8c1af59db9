"""Each reply token's log-probability, lined up with the reply's text.

A token's ``token`` string is the text it completed, not its piece decoded alone: a token that
ends inside a multi-byte character says "" and the one that completes it says the whole
character, so the strings of a reply's tokens always join up to exactly its text (its raw bytes
are in ``bytes``). A stream releases a token's entry once its text has been streamed, and the
reply's entries stop where its text does (a stop string, a tool call's markup and held-back
bytes are not text).
"""

from __future__ import annotations

from dataclasses import replace

from llmsession.replies import TokenLogprob


class LogprobTrail:
    """The entries of one reply, released as its text is."""

    def __init__(self) -> None:
        self.entries: list[TokenLogprob] = []
        self.ends: list[int] = []  # where each entry's text ends in the generated text
        self.released = 0

    def push(self, entry: TokenLogprob) -> None:
        self.entries.append(entry)
        self.ends.append((self.ends[-1] if self.ends else 0) + len(entry.token))

    def release(self, shown: int) -> tuple[TokenLogprob, ...]:
        """The entries not yet released whose text lies within the first ``shown`` characters."""
        start = self.released
        while self.released < len(self.entries) and self.ends[self.released] <= shown:
            self.released += 1
        return tuple(self.entries[start : self.released])

    def reply(self, text: str) -> tuple[TokenLogprob, ...]:
        """Every entry up to where the reply's ``text`` ends, the last cut to fit, so that their
        strings join up to ``text``'s longest prefix the generated text shares with it (a cut
        entry keeps its token's bytes; entries past the text, of bytes that never became text,
        are left out)."""
        kept: list[TokenLogprob] = []
        at = 0
        for entry in self.entries:
            if at == len(text):  # (what follows the text: a stop string, held-back bytes)
                break
            fits = _shared(entry.token, text, at)
            if fits < len(entry.token):
                if fits:
                    kept.append(replace(entry, token=entry.token[:fits]))
                break
            kept.append(entry)
            at += fits
        return tuple(kept)


def _shared(piece: str, text: str, at: int) -> int:
    """How many leading characters of ``piece`` ``text`` holds from position ``at``."""
    n = 0
    while n < len(piece) and at + n < len(text) and text[at + n] == piece[n]:
        n += 1
    return n
