"""Prompts that hold the library's own replies as the tokens it generated them with.

A model often samples a split of its reply that is not the tokenizer's canonical split of the
same text (more so under a constraint, whose forced tokens end where the constraint's certainty
ends). Re-tokenizing the transcript would then break the prefix match inside every such reply and
re-decode it. So the model remembers each reply's tokens by its text, and a prompt is tokenized
around those texts with their recorded ids spliced in (chat templates bound a message's content
with special tokens, so the stretches between tokenize alone as they would in place). The model
keeps a spliced prompt only when it spells exactly the text of the plain one. Pure: no bindings.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence


class ReplyTokens:
    """The tokens of the latest replies, by their text (least recently used forgotten)."""

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

    def get(self, text: str) -> tuple[int, ...] | None:
        with self._lock:
            tokens = self._tokens.get(text)
            if tokens is not None:
                self._tokens.move_to_end(text)
            return tokens


def splice(
    text: str, replies: Iterable[tuple[str, Sequence[int]]], tokenize: Callable[[str, bool], list[int]]
) -> list[int]:
    """``text``'s tokens with each reply's content, found in order, given as its tokens;
    ``tokenize(stretch, first)`` tokenizes the stretches between (``first`` adds BOS)."""
    out: list[int] = []
    at = 0
    for content, tokens in replies:
        found = text.find(content, at) if content else -1
        if found < 0:
            continue
        out += tokenize(text[at:found], at == 0)
        out += tokens
        at = found + len(content)
    return out + tokenize(text[at:], at == 0)
