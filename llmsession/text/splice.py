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
from collections import OrderedDict
from collections.abc import Callable, Sequence


class ReplyTokens:
    """Tokens by their text, the least recently used forgotten: the latest replies as they were
    generated (and the model's prompt stretches as tokenized)."""

    def __init__(self, capacity: int = 1024) -> None:
        self.capacity = capacity
        self._tokens: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._lock = threading.Lock()

    def remember(self, text: str, tokens: Sequence[int]) -> None:
        if not text or not tokens:
            return
        with self._lock:
            self._tokens[text] = tuple(tokens)
            self._tokens.move_to_end(text)
            while len(self._tokens) > self.capacity:
                self._tokens.popitem(last=False)

    def copy(self) -> ReplyTokens:
        twin = ReplyTokens(self.capacity)
        with self._lock:
            twin._tokens = OrderedDict(self._tokens)
        return twin

    def get(self, text: str) -> tuple[int, ...] | None:
        with self._lock:
            tokens = self._tokens.get(text)
            if tokens is not None:
                self._tokens.move_to_end(text)
            return tokens


def marker(index: int) -> str:
    """A stand-in for message ``index``'s content (private-use characters no template alters)."""
    return f"\ue000{index}\ue001"


def stretches(marked: str, indices: Sequence[int]) -> list[str] | None:
    """The text around each stand-in, when ``marked`` (the prompt rendered with stand-ins for
    the messages ``indices``) holds each exactly once, in order; else None."""
    parts = re.split("\ue000(\\d+)\ue001", marked)
    found = [int(index) for index in parts[1::2]]
    return parts[0::2] if found == list(indices) else None


def found_in_order(text: str, contents: Sequence[str]) -> list[str] | None:
    """The text around each of ``contents``, found in ``text`` in order; None unless each is
    there exactly once (a user's words that quote a reply keep the tokenizer's split). For
    replies whose markup no other text writes (calls)."""
    around, cursor = [], 0
    for content in contents:
        at = text.find(content, cursor) if content and text.count(content) == 1 else -1
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
