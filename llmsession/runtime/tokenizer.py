"""A model's prompt tokenizing: BOS as the model adds it, the texts between spliced replies
remembered, and long prompts tokenized in segments (``text.segments``) so that each exchange
tokenizes only what changed since the ones before."""

from __future__ import annotations

import re
import threading
from typing import Protocol

from llmsession.text.segments import anchor_pattern, anchors, tokenize_in_segments
from llmsession.text.splice import ReplyTokens

STRETCHES = 1024  # tokenized texts (between spliced replies, segments), kept for the next prompts
STRETCH_TOKENS = 1 << 19  # and their tokens in all, at most (each memory: about 18 MB of tuples)
LONG_TEXT = 2000  # characters: shorter prompts tokenize in well under a millisecond whole


class Vocabulary(Protocol):
    add_bos: bool

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool = True) -> list[int]: ...
    def bos(self) -> int: ...
    def cuts_in_segments(self) -> bool: ...
    def special_tokens(self) -> list[tuple[str, bool]]: ...


class PromptTokenizer:
    """Tokens for a model's prompts. Remembered tokens serve only prompts that share (a prompt
    kept apart tokenizes afresh: how fast a remembered text came back would tell whether another
    prompt held it)."""

    def __init__(self, vocabulary: Vocabulary, template: str | None) -> None:
        self.vocabulary = vocabulary
        self.template = template or ""
        self._remembered = (ReplyTokens(STRETCHES, STRETCH_TOKENS), ReplyTokens(STRETCHES, STRETCH_TOKENS))
        self._anchors: re.Pattern[str] | None = None
        self._anchors_found = not vocabulary.cuts_in_segments()  # (else found on a first long text)
        self._lock = threading.Lock()

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        """Tokens with special tokens parsed; BOS is added once even if the text starts with it."""
        tokens = self.vocabulary.tokenize(text, add_special=add_special)
        if add_special:
            self.drop_double_bos(tokens)
        return tokens

    def drop_double_bos(self, tokens: list[int]) -> None:
        bos = self.vocabulary.bos()
        if self.vocabulary.add_bos and len(tokens) >= 2 and tokens[0] == tokens[1] == bos:
            del tokens[0]

    def prompt(self, text: str, shared: bool) -> list[int]:
        """A whole prompt's tokens (as ``tokenize``); a long one that shares in segments, each
        remembered."""
        pattern = self._anchor_pattern(text) if shared and len(text) >= LONG_TEXT else None
        if pattern is None:
            return self.tokenize(text)
        return tokenize_in_segments(text, pattern, self.remembered)

    def remembered(self, text: str, first: bool) -> list[int]:
        """``tokenize`` (``first``: with BOS) remembered: a transcript's earlier stretches come
        back every turn, and tokenizing was most of a prompt's cost (7.9 ms of a 933-token one,
        before)."""
        memory = self._remembered[first]
        tokens = memory.get(text)
        if tokens is None:
            tokens = tuple(self.tokenize(text, first))
            memory.remember(text, tokens)
        return list(tokens)

    def _anchor_pattern(self, text: str) -> re.Pattern[str] | None:
        """The anchors, found once, from the template and the first long prompt (the vocabulary's
        special tokens are read then: 40 ms for 49k tokens, 240 ms for 262k)."""
        if not self._anchors_found:
            with self._lock:
                if not self._anchors_found:
                    found = anchors(self.vocabulary.special_tokens(), self.template + text)
                    self._anchors, self._anchors_found = anchor_pattern(found), True
        return self._anchors
