"""gpt-oss's tool calls (the harmony format) in the one spelling its chat template writes. Pure.

gpt-oss names a call's recipient in the message header, in either of two places: its template
writes ``<|start|>assistant to=functions.NAME<|channel|>commentary json<|message|>ARGS`` (the
recipient in the role's header), while the model often writes ``<|start|>assistant<|channel|>
commentary to=functions.NAME <|constrain|>json<|message|>ARGS`` (in the channel's header, the
content type after ``<|constrain|>``). llama-server's parser takes both. A reply's content
reaches the calls' reader without the ``<|start|>assistant`` that opens its message (the
generation prompt wrote it, or the reasoning stage dropped it after the analysis channel), so
the header is read from the channel or the recipient on; the second spelling is rewritten into
the first (``canonical``), whole or as the reply streams (``Headers``), so one reader serves
both, and a call re-rendered by the template spells what a grammar made the model write.
"""

from __future__ import annotations

import re

START = "<|start|>assistant"
MESSAGE = "<|message|>"
TEMPLATE_HEADER = "<|channel|>commentary json" + MESSAGE  # what follows the tool's name
_CHANNEL = r"(?:<\|channel\|>(?:commentary|analysis))"
RECIPIENT = re.compile(
    rf"{_CHANNEL}? ?to=functions\.(?P<name>[^\s<]{{1,128}})"
    rf" ?{_CHANNEL}? ?(?:<\|constrain\|>)?[A-Za-z0-9_-]{{0,32}}{re.escape(MESSAGE)}"
)
BEGINS = re.compile(r"<\|| ?to=functions\.")  # where a header may begin
MAX_HEADER = 320  # characters: longer than any header RECIPIENT matches


def canonical(text: str) -> str:
    """``text`` with each call header spelled as the template writes it."""
    return RECIPIENT.sub(_template_spelling, text)


def _template_spelling(match: re.Match[str]) -> str:
    return f" to=functions.{match['name']}{TEMPLATE_HEADER}"


class Headers:
    """``canonical`` as a reply streams: text from where a header may begin (a marker, or the
    recipient) is held until the header is whole (its ``<|message|>``) or cannot be one, then
    passed on, rewritten if it named a recipient. What ``push`` returns, joined with ``flush``'s,
    is ``canonical`` of all that was pushed."""

    def __init__(self) -> None:
        self._held = ""

    def push(self, text: str) -> str:
        self._held += text
        out: list[str] = []
        while self._held:
            begins = BEGINS.search(self._held)
            if begins is None:  # (its end may begin one)
                keep = max(_partial(self._held, begin) for begin in ("<|", " to=functions.", "to=functions."))
                out.append(self._held[: len(self._held) - keep])
                self._held = self._held[len(self._held) - keep :]
                break
            out.append(self._held[: begins.start()])
            self._held = self._held[begins.start() :]
            whole = MESSAGE in self._held
            if not whole and len(self._held) <= MAX_HEADER:
                break  # (the header is not whole yet)
            match = RECIPIENT.match(self._held) if whole else None
            if match is not None:
                out.append(_template_spelling(match))
                self._held = self._held[match.end() :]
            else:  # (no header begins here: what began it is text, and the rest is read on)
                skip = len(begins.group())
                out.append(self._held[:skip])
                self._held = self._held[skip:]
        return "".join(out)

    def flush(self) -> str:
        held, self._held = self._held, ""
        return canonical(held)


def _partial(text: str, begin: str) -> int:
    """How many characters at the end of ``text`` may begin ``begin``."""
    for size in range(min(len(text), len(begin) - 1), 0, -1):
        if begin.startswith(text[-size:]):
            return size
    return 0
