"""gpt-oss's tool calls (the harmony format) in the one spelling its chat template writes. Pure.

gpt-oss names a call's recipient in the message header, in either of two places: its template
writes ``<|start|>assistant to=functions.NAME<|channel|>commentary json<|message|>ARGS`` (the
recipient in the role's header), while the model often writes ``<|start|>assistant<|channel|>
commentary to=functions.NAME <|constrain|>json<|message|>ARGS`` (in the channel's header, the
content type after ``<|constrain|>``). llama-server's parser takes both. A reply's content
reaches the calls' reader without the ``<|start|>assistant`` that opens its message (the
generation prompt wrote it, or the reasoning stage dropped it after the analysis channel), so
the header is read from the channel or the recipient on, where the content opens (calls open
it or are not made); the second spelling is rewritten into the first (``canonical``), whole or
as the reply streams (``Opening``), so one reader serves both, and a call re-rendered by the
template spells what a grammar made the model write. Nothing after the header is rewritten.
"""

from __future__ import annotations

import re

START = "<|start|>assistant"  # a new message of the assistant's
MESSAGE = "<|message|>"
FINAL = "<|channel|>final" + MESSAGE  # the answer's channel
TO = " to=functions."  # a call's recipient, before the tool's name
TEMPLATE_HEADER = "<|channel|>commentary json" + MESSAGE  # what follows the tool's name
_CHANNEL = r"(?:<\|channel\|>(?:commentary|analysis))"
RECIPIENT = re.compile(
    rf"{_CHANNEL}? ?to=functions\.(?P<name>[^\s<]{{1,128}})"
    rf" ?{_CHANNEL}? ?(?:<\|constrain\|>)?[A-Za-z0-9_-]{{0,32}}{re.escape(MESSAGE)}"
)
OPENINGS = ("<|channel|>", TO, TO.lstrip())  # what a call's header begins with
MAX_HEADER = 320  # characters: longer than any header RECIPIENT matches


def canonical(text: str) -> str:
    """``text`` with the call header it opens with, if any, spelled as the template writes it
    (the rest as it is: a call's arguments, or text, may hold anything)."""
    match = RECIPIENT.match(text)
    return text if match is None else _template_spelling(match) + text[match.end() :]


def _template_spelling(match: re.Match[str]) -> str:
    return f"{TO}{match['name']}{TEMPLATE_HEADER}"


class Opening:
    """``canonical`` as a reply streams: its opening is held until it is known to be a call's
    header (then passed on rewritten) or not (then as it is); the rest passes at once. What
    ``push`` returns, joined with ``flush``'s, is ``canonical`` of all that was pushed."""

    def __init__(self) -> None:
        self._held: str | None = ""  # None once the opening is known

    def push(self, text: str) -> str:
        if self._held is None:
            return text
        held = self._held + text
        may_be = any(o.startswith(held[: len(o)]) for o in OPENINGS)
        if may_be and MESSAGE not in held and len(held) <= MAX_HEADER:
            self._held = held  # (its header is not whole yet)
            return ""
        self._held = None
        return canonical(held)

    def flush(self) -> str:
        held, self._held = self._held or "", None
        return canonical(held)

    @property
    def names_a_tool(self) -> bool:
        """Whether the opening it holds is a call's header that has named its recipient."""
        return self._held is not None and TO.lstrip() in self._held
