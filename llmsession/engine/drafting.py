"""Drafted tokens from the transcript (prompt lookup decoding): when the reply's last few tokens
occurred earlier in the prompt or the reply, what followed them there is proposed as the next
tokens, all verified in one decode. Replies that copy their prompt (edits, fixes, quotes, JSON
echoing its input) accept long drafts; free chat rarely does, and a rejected draft costs the
extra rows of a decode, so ``Drafter`` stops drafting for an exchange whose drafts do not pay.
The index is a dict of n-grams, kept as tokens come: a lookup costs the same at any length.

Verification samples each drafted position with the exchange's own sampler and keeps the draft
while the sample equals it, the first sample that differs being the next token: for a draft
that is one proposed token (not a distribution), that is the standard speculative acceptance
rule, so a reply keeps exactly the distribution of plain decoding (and greedy replies its tokens,
but for the split noise between a batched and a one-token decode on some CPUs).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from llmsession.replies import Usage


class Dropping(Protocol):
    """What memory a reply's tokens are in (a ``Seat``): its last items dropped."""

    def drop_last(self, n_items: int) -> None: ...


LONGEST, SHORTEST = 4, 2  # the n-gram lengths matched, longest first
HISTORY = 4096  # the transcript's last tokens indexed (a lookup begins with the reply's second step)
FIRST_DRAFT, MAX_DRAFT = 2, 7  # tokens proposed at once: first, and at most (doubling on success)
TRIAL = 2  # drafted steps before the drafter judges whether drafting pays
WEIGHT = 0.3  # of the newest drafted step in the running yield


class NgramIndex:
    """Where each n-gram of a token history last ended, kept as tokens are appended."""

    def __init__(self, history: Sequence[int] = ()) -> None:
        self.tokens: list[int] = []
        self._last: dict[tuple[int, ...], int] = {}
        self.extend(history)

    def extend(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            self._index_tail()  # the n-grams ending before ``token``, now that one follows them
            self.tokens.append(int(token))

    def _index_tail(self) -> None:
        tokens, end = self.tokens, len(self.tokens)
        for n in range(SHORTEST, LONGEST + 1):
            if end >= n:
                self._last[tuple(tokens[end - n :])] = end

    def propose(self, limit: int) -> list[int]:
        """Up to ``limit`` tokens that followed the longest earlier match of the history's end."""
        tokens = self.tokens
        for n in range(LONGEST, SHORTEST - 1, -1):
            if len(tokens) < n:
                continue
            end = self._last.get(tuple(tokens[-n:]))
            if end is not None:
                return tokens[end : end + limit]
        return []


class Drafter:
    """An exchange's drafts, how long they are, and whether they still pay: a drafted step's
    yield is the tokens it produced over its time in plain steps (a decode of k tokens costs
    more than one: 1.6x for 2, 4.3x for 8 on the 2-core AMD EPYC here), kept as a running
    average; below 1 after ``TRIAL`` drafted steps, drafting stops for the exchange."""

    def __init__(self, history: Sequence[int], usage: Usage | None = None) -> None:
        """``usage``: the reply's, whose drafted and accepted counts it keeps as it goes (a reply
        closed mid-way says them too)."""
        self._history: Sequence[int] | None = history[-HISTORY:]
        self.usage = usage
        self.index = NgramIndex()
        self.length = FIRST_DRAFT
        self.plain_s: float | None = None  # a step without drafts, running average
        self.yield_: float | None = None
        self.steps = self.proposed = self.accepted = 0
        self.on = True

    def propose(self, pending: Sequence[int], limit: int) -> list[int]:
        """Drafts to follow ``pending`` (the tokens the next step decodes), at most ``limit``."""
        if not self.on:
            return []
        if self._history is not None:  # indexed once the first token is out, not before it
            self.index.extend(self._history)
            self._history = None
        self.index.extend(pending)
        return self.index.propose(min(limit, self.length)) if limit > 0 else []

    def record(self, drafted: int, accepted: Sequence[int], seconds: float) -> None:
        """A step of ``seconds`` decoded ``drafted`` drafts and kept ``accepted``."""
        if not self.on:
            return
        if not drafted:
            self.plain_s = _average(self.plain_s, seconds)
            return
        self.index.extend(accepted)
        full = len(accepted) == drafted
        self.length = min(MAX_DRAFT, 2 * self.length) if full else max(FIRST_DRAFT, len(accepted) + 1)
        self.steps, self.proposed = self.steps + 1, self.proposed + drafted
        self.accepted += len(accepted)
        if self.usage is not None:
            self.usage.drafted_tokens, self.usage.accepted_drafts = self.proposed, self.accepted
        if self.plain_s is not None:
            produced = (1 + len(accepted)) / max(seconds / self.plain_s, 1e-3)
            self.yield_ = _average(self.yield_, produced)
        if self.steps >= TRIAL and self.yield_ is not None and self.yield_ < 1.0:
            self.on = False


def _average(old: float | None, new: float) -> float:
    return new if old is None else (1.0 - WEIGHT) * old + WEIGHT * new


def unhold(seat: Dropping, n_items: int, usage: Usage, *, said: bool) -> None:
    """A reply ended inside its last step's kept drafts, at the first of the last ``n_items``
    (``said``: its last token): memory stops before it, drafts never said are not accepted."""
    if n_items > 0:
        seat.drop_last(n_items)
        usage.accepted_drafts -= n_items - said
