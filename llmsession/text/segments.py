"""Prompt text tokenized in segments, each starting at one of the chat template's special tokens,
so that a transcript's earlier turns, which come back every exchange, are not tokenized again.

Why the segments tokenize as the whole text does: llama.cpp first claims every special token's
occurrences in the text, then tokenizes the text between them fragment by fragment. An *anchor*
is a special token that no other special token can overlap (nor another occurrence of itself),
that strips no whitespace on its left, and that neither starts nor ends with whitespace (which
another token's stripping could take from it): wherever its text occurs it is claimed, nothing
straddles its start, and so the text splits there into the same tokens on either side. Only the
first segment gets the BOS. Pure: no bindings.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Iterable, Sequence

from llmsession.text.automaton import Overlaps


def can_overlap(a: str, b: str) -> bool:
    """Whether occurrences of ``a`` and ``b`` can overlap in some text (for ``a == b``: two
    occurrences of it)."""
    if a != b and (a in b or b in a):
        return True
    if b[0] not in a and a[0] not in b:  # (what every overlap below needs: a quick no)
        return False
    return any(a.endswith(b[:k]) or b.endswith(a[:k]) for k in range(1, min(len(a), len(b))))


def anchors(specials: Sequence[tuple[str, bool]], candidates: str) -> list[str]:
    """The special tokens (text, strips-left) spelled in ``candidates`` (a template, a prompt)
    where a text may be cut; none if any special token's text is empty (it would be found
    everywhere) or two tokens share a text."""
    texts = [text for text, _ in specials]
    if not all(texts) or len(set(texts)) != len(texts):
        return []
    found = [
        text
        for text, lstrip in specials
        if not lstrip and not text[0].isspace() and not text[-1].isspace() and text in candidates
    ]
    if not found:
        return []
    overlaps = Overlaps(texts)  # (every pair of ``can_overlap``: 20,000 texts, 2,000 found, 4 minutes)
    return [a for a in found if overlaps.alone(a)]


def anchor_pattern(texts: Iterable[str]) -> re.Pattern[str] | None:
    """A pattern that finds every anchor; None for none."""
    ordered = sorted(texts, key=len, reverse=True)
    return re.compile("|".join(map(re.escape, ordered))) if ordered else None


def segments(text: str, pattern: re.Pattern[str]) -> list[str]:
    """``text`` cut before each anchor: the first segment may be empty, every other one starts
    with an anchor."""
    cuts = [0, *(match.start() for match in pattern.finditer(text) if match.start() > 0), len(text)]
    return [text[start:end] for start, end in itertools.pairwise(cuts)]


def tokenize_in_segments(
    text: str, pattern: re.Pattern[str], tokenize: Callable[[str, bool], Sequence[int]]
) -> list[int]:
    """``text``'s tokens as the concatenation of its segments' (``tokenize(segment, first)``:
    ``first`` adds the BOS)."""
    tokens: list[int] = []
    for index, segment in enumerate(segments(text, pattern)):
        tokens += tokenize(segment, index == 0)
    return tokens
