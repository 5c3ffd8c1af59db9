"""A model's prompt tokenizing: BOS as the model adds it, the texts between spliced replies
remembered, long prompts tokenized in segments (``text.segments``) so that each exchange
tokenizes only what changed since the ones before, and users' and tools' text kept plain
(``text.guard``: a special token's spelling in it is not that token)."""

from __future__ import annotations

import re
import threading
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, Protocol

from llmsession.text.guard import ESCAPED, OPEN, Guard, Guarded
from llmsession.text.segments import anchor_pattern, anchors, tokenize_in_segments
from llmsession.text.splice import ReplyTokens
from llmsession.text.tools import Tools

STRETCHES = 1024  # tokenized texts (between spliced replies, segments), kept for the next prompts
STRETCH_TOKENS = 1 << 19  # and their tokens in all, at most (each memory: about 18 MB of tuples)
LONG_TEXT = 2000  # characters: shorter prompts tokenize in well under a millisecond whole


class Vocabulary(Protocol):
    add_bos: bool

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool = True) -> list[int]: ...
    def bos(self) -> int: ...
    def cuts_in_segments(self) -> bool: ...
    def special_tokens(self) -> list[tuple[str, bool, bool, bool]]: ...


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
        self._guard: Guard | None = None
        self._specials: list[tuple[str, bool, bool, bool]] | None = None  # (``specials``)

    @property
    def guard(self) -> Guard:
        """The placeholders for the vocabulary's control and unknown tokens' texts, made once (its
        special tokens read then, as for the anchors)."""
        if self._guard is None:
            with self._lock:
                if self._guard is None:
                    found = self._special_tokens()
                    self._guard = Guard(
                        [Guarded(text, left, right) for text, left, right, only in found if only]
                    )
        return self._guard

    def marked(self, messages: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
        """The messages to render: their users' and tools' special tokens' texts as placeholders
        (``text.guard``), which the prompt's tokenizing reads as those texts, special tokens off."""
        return self.guard.marked(messages)

    def marked_tools(self, tools: Tools | None) -> Tools | None:
        """``tools`` to render: the opening character of a placeholder in their descriptions and
        schemas as its placeholder, so that the prompt's tokenizing reads them as they are."""
        if tools is None:
            return None
        opened = self.guard.opened
        marked = [
            replace(t, description=opened(t.description), parameters=opened(t.parameters))
            for t in tools.tools
        ]
        if all(
            new.description is old.description and new.parameters is old.parameters
            for new, old in zip(marked, tools.tools, strict=True)
        ):
            return tools
        return replace(tools, tools=tuple(marked))

    def shown(self, text: str) -> str:
        """A rendered prompt as it reads: its placeholders as the texts they stand for."""
        return self.guard.shown(text) if OPEN in text or ESCAPED in text else text

    def pieces(self, text: str) -> list[tuple[str, bool]]:
        """A rendered prompt (or a stretch of one) as pieces to tokenize in turn, each with
        whether it is plain (special tokens off, its placeholders as their texts): the whole
        text, not plain, where it holds no placeholder (``text.guard``)."""
        pieces = self.guard.pieces(text) if OPEN in text or ESCAPED in text else None
        return [(text, False)] if pieces is None else pieces

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
        """A whole rendered prompt's tokens (as ``stretch``); a long one that shares in
        segments, each remembered."""
        pattern = self._anchor_pattern(text) if shared and len(text) >= LONG_TEXT else None
        if pattern is None:
            return self.stretch(text)
        return tokenize_in_segments(text, pattern, self.remembered)

    def stretch(self, text: str, first: bool = True) -> list[int]:
        """A rendered prompt's text, or a stretch of it, tokenized as ``tokenize`` (``first``:
        with BOS), but where it holds placeholders (``marked``): the text around each, up to the
        control tokens on either side, with special tokens off and the placeholders as their
        texts. Without placeholders exactly ``tokenize``."""
        pieces = self.guard.pieces(text) if OPEN in text or ESCAPED in text else None
        if pieces is None:
            return self.tokenize(text, first)
        vocabulary = self.vocabulary
        wrap = vocabulary.tokenize("", add_special=True) if first else []  # (BOS, and any EOS)
        bos = wrap[:1] if wrap[:1] == [vocabulary.bos()] else []
        tokens = list(bos)
        for piece, plain in pieces:
            if piece:
                tokens += vocabulary.tokenize(piece, add_special=False, parse_special=not plain)
        tokens += wrap[len(bos) :]
        if first:
            self.drop_double_bos(tokens)
        return tokens

    def remembered(self, text: str, first: bool) -> list[int]:
        """``stretch`` (``first``: with BOS) remembered: a transcript's earlier stretches come
        back every turn, and tokenizing was most of a prompt's cost (7.9 ms of a 933-token one,
        before)."""
        memory = self._remembered[first]
        tokens = memory.get(text)
        if tokens is None:
            tokens = tuple(self.stretch(text, first))
            memory.remember(text, tokens)
        return list(tokens)

    def _special_tokens(self) -> list[tuple[str, bool, bool, bool]]:
        """The vocabulary's special tokens (``Vocabulary.special_tokens``), read once for the
        guard and the anchors both (called holding the lock)."""
        if self._specials is None:
            self._specials = self.vocabulary.special_tokens()
        return self._specials

    def _anchor_pattern(self, text: str) -> re.Pattern[str] | None:
        """The anchors, found once, from the template and the first long prompt (the vocabulary's
        special tokens are read then: 40 ms for 49k tokens, 240 ms for 262k)."""
        if not self._anchors_found:
            with self._lock:
                if not self._anchors_found:
                    specials = [(spelled, left) for spelled, left, _, _ in self._special_tokens()]
                    found = anchors(specials, self.template + text)
                    self._anchors, self._anchors_found = anchor_pattern(found), True
        return self._anchors
