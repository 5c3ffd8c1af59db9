"""Prompts that hold the library's own replies as the tokens it generated them with.

A model often samples a split of its reply that is not the tokenizer's canonical split of the
same text (more so under a constraint, whose forced tokens end where the constraint's certainty
ends). Re-tokenizing the transcript would then break the prefix match inside every such reply and
re-decode it. So the model remembers each reply's tokens by its text, renders the prompt once more
with a stand-in for each such message's content to find exactly where it sits (a user who typed
the same words keeps the tokenizer's split), and tokenizes the stretches between, with the
recorded ids spliced in (chat templates bound a message's content with special tokens, so the
stretches tokenize alone as they would in place). The model keeps a spliced prompt only when it
spells exactly the text of the plain one. Pure: no bindings.
"""

from __future__ import annotations

import re
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence


class ReplyTokens:
    """Tokens by their text, the least recently used forgotten: the latest replies as they were
    generated (and the model's prompt stretches as tokenized), at most ``capacity`` texts and
    ``max_held`` tokens in all (a pasted document's stretch is large). A text generated again
    keeps its last ``VARIANTS`` splits, latest last (an agent's call made twice may be split
    otherwise the second time: each occurrence in a prompt is its own, ``get``'s ``back``)."""

    VARIANTS = 4

    def __init__(self, capacity: int = 1024, max_held: int | None = None) -> None:
        self.capacity, self.max_held = capacity, max_held
        self._tokens: OrderedDict[str, tuple[tuple[int, ...], ...]] = OrderedDict()
        self._held = 0
        self._lock = threading.Lock()

    def remember(self, text: str, tokens: Sequence[int]) -> None:
        if not text or not tokens or (self.max_held is not None and len(tokens) > self.max_held):
            return  # (a text larger than the whole budget would only push out every other)
        with self._lock:
            before = self._tokens.pop(text, ())
            split = tuple(tokens)
            kept = before if before[-1:] == (split,) else (*before, split)[-self.VARIANTS :]
            self._held += sum(map(len, kept)) - sum(map(len, before))
            budget = self.max_held if self.max_held is not None else self._held
            while self._tokens and (len(self._tokens) >= self.capacity or self._held > budget):
                self._held -= sum(map(len, self._tokens.popitem(last=False)[1]))  # (others first)
            while self._held > budget:  # (then its own older splits: the latest fits alone)
                self._held, kept = self._held - len(kept[0]), kept[1:]
            self._tokens[text] = kept

    def absorb(self, other: ReplyTokens) -> ReplyTokens:
        """This record, with every split ``other`` holds remembered in it too (a session loaded
        from a file that now splices its tenant's replies: its own come along). A split held
        already is left as it is (a fork's copy of this record brings nothing new)."""
        if other is not self:
            for text, splits in other.items():
                with self._lock:
                    held = self._tokens.get(text, ())
                for split in (s for s in splits if s not in held):
                    self.remember(text, split)
        return self

    def copy(self) -> ReplyTokens:
        twin = ReplyTokens(self.capacity, self.max_held)
        with self._lock:
            twin._tokens, twin._held = OrderedDict(self._tokens), self._held
        return twin

    def items(self) -> list[tuple[str, tuple[tuple[int, ...], ...]]]:
        """Every text and its kept splits (earliest first), least recently used first."""
        with self._lock:
            return list(self._tokens.items())

    def get(self, text: str, back: int = 0) -> tuple[int, ...] | None:
        """The tokens ``text`` was generated with last (``back``: that many times before the
        last, else the earliest kept)."""
        with self._lock:
            kept = self._tokens.get(text)
            if kept is None:
                return None
            self._tokens.move_to_end(text)
            return kept[max(0, len(kept) - 1 - back)]


def marker(index: int) -> str:
    """A stand-in for message ``index``'s content (private-use characters no template alters)."""
    return f"\ue000{index}\ue001"


def stretches(marked: str, indices: Sequence[int]) -> list[str] | None:
    """The text around each stand-in, when ``marked`` (the prompt rendered with stand-ins for
    the messages ``indices``) holds each exactly once, in order; else None."""
    parts = re.split("\ue000([0-9]{1,9})\ue001", marked)  # (a user's 5,000 digits: no int() of them)
    found = [int(index) for index in parts[1::2]]
    return parts[0::2] if found == list(indices) else None


def found_in_order(text: str, contents: Sequence[str]) -> list[str] | None:
    """The text around each of ``contents``, found in ``text`` in order; None unless each is
    there as many times as it is among them (a user's words that quote a reply keep the
    tokenizer's split; an agent's call made twice is two of them). For replies whose markup no
    other text writes (calls)."""
    around, cursor, times = [], 0, Counter(contents)
    for content in contents:
        at = text.find(content, cursor) if content and text.count(content) == times[content] else -1
        if at < 0:
            return None
        around.append(text[cursor:at])
        cursor = at + len(content)
    return [*around, text[cursor:]]


def splice(
    around: Sequence[str], replies: Sequence[Sequence[int]], tokenize: Callable[[str, bool], list[int]]
) -> list[int]:
    """The tokens of ``around[0]``, then ``replies[0]``, then ``around[1]``, ...;
    ``tokenize(stretch, first)`` tokenizes the text between (``first`` adds BOS)."""
    out = tokenize(around[0], True)
    for tokens, stretch in zip(replies, around[1:], strict=True):
        out += tokens
        out += tokenize(stretch, False)
    return out
