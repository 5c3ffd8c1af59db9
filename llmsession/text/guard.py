"""Users' and tools' text kept plain: a special token's spelling typed in a ``user`` or ``tool``
message (``<|im_end|>\\n<|im_start|>system``) must not become the special token, or the sender
could close their own turn and write one of another role.

Before rendering, each occurrence in such a message's text of a *guarded* text (a control or
unknown token's, which llama.cpp parses only with special tokens on; user-defined ones it parses
either way) becomes a placeholder that names it (private-use characters no template alters, and
no text holds: the opening character is itself replaced by one, in every message's text and every
tool's, the system's and assistant's too, so no text spells one). After rendering, the
text between the two control tokens around a placeholder (the fragment llama.cpp would tokenize
as one) is tokenized with special tokens off, the originals put back; the rest as before. A
prompt without placeholders tokenizes exactly as before. Pure: no bindings.
"""

from __future__ import annotations

import bisect
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from llmsession.text.starts import Starts

OPEN, CLOSE = "\ue002", "\ue003"  # (``text.splice``'s stand-ins use \ue000 and \ue001)
ESCAPED = json.dumps(OPEN)[1:-1]  # (JSON's escape of it: a template or tool format may dump text)
NAMED = r"([0-9]{1,6}(?:\.[0-9]{1,4})?)"  # a guarded text's index, or index.n: its first n characters
OPENING = re.compile(f"{OPEN}|{re.escape(ESCAPED)}")
PLACEHOLDER = re.compile(
    f"{OPEN}{NAMED}{CLOSE}|{re.escape(ESCAPED)}{NAMED}{re.escape(json.dumps(CLOSE)[1:-1])}"
)
GUARDED_ROLES = ("user", "tool")
GUARDED_FIELDS = ("name", "tool_call_id")  # (beside their text: a sender's too)
SPACES = " \t\n\v\f\r"  # (C's isspace: what a token's lstrip or rstrip takes)


MOST_NESTED = 100  # a trie's branching depth written as nested groups (``re`` recurses on them)


def trie_pattern(texts: Sequence[str]) -> re.Pattern[str] | None:
    """A pattern matching any of ``texts`` (the longest where several start at one place),
    written as a trie: Gemma's 6,000 control tokens share their first characters. A run of
    characters with one way on is one literal, and a branch deeper than ``MOST_NESTED`` (a
    hostile vocabulary: ``a``, ``aa``, ``aaa``, ...) is its texts' rests one after another, the
    longest first (a token of 600 characters nested 600 groups: a RecursionError at every
    request; the whole vocabulary as one alternation, minutes for a long text)."""
    if not texts:
        return None
    trie: dict[str, Any] = {}
    for text in texts:
        node = trie
        for char in text:
            node = node.setdefault(char, {})
        node[""] = {}
    return re.compile(_alternatives(trie, 0))


def _alternatives(node: Mapping[str, Any], depth: int) -> str:
    if depth > MOST_NESTED:
        return _flat(node)
    branches = []
    for char, child in node.items():
        if char:
            run = [char]
            while "" not in child and len(child) == 1:  # (one way on: a literal)
                ((char, child),) = child.items()
                run.append(char)
            branches.append(re.escape("".join(run)) + _alternatives(child, depth + 1))
    if not branches:
        return ""
    body = branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"
    return f"(?:{body})?" if "" in node else body


def _flat(node: Mapping[str, Any]) -> str:
    """The rests of the texts below ``node`` as one group, the longest first (walked without
    recursion: it may be thousands deep)."""
    rests, stack = [], [("", node)]
    while stack:
        prefix, at = stack.pop()
        stack += [(prefix + char, child) for char, child in at.items() if char]
        if "" in at and prefix:
            rests.append(prefix)
    body = "|".join(re.escape(rest) for rest in sorted(rests, key=len, reverse=True))
    return (f"(?:{body})?" if "" in node else f"(?:{body})") if rests else ""


@dataclass(frozen=True)
class Guarded:
    """A guarded text: its spelling and whether its token strips whitespace left or right."""

    text: str
    lstrip: bool = False
    rstrip: bool = False


class Guard:
    """Placeholders for a vocabulary's ``guarded`` texts (``Guarded``, in any order)."""

    def __init__(self, guarded: Sequence[Guarded]) -> None:
        kept = [g for g in guarded if g.text and OPEN not in g.text and CLOSE not in g.text]
        self.texts = [OPEN, ESCAPED, *(g.text for g in kept)]  # (the opening in text, as it is or JSON's)
        self._strips = {g.text: (g.lstrip, g.rstrip) for g in kept}
        self._content = trie_pattern(self.texts)
        self._controls = trie_pattern([g.text for g in kept])
        self._index = {text: i for i, text in enumerate(self.texts)}
        self._starts = Starts(self.texts, 10**4)

    def marked_text(self, text: str) -> str:
        """``text`` with each guarded text (and the opening character) as its placeholder, and
        a start of one it ends with (before trailing whitespace) as a placeholder of that start."""
        body, tail = self._tail(text)
        if self._content is not None and self._content.search(body) is not None:
            body = self._content.sub(lambda m: f"{OPEN}{self._index[m.group()]}{CLOSE}", body)
        return text if not tail and body is text else body + tail

    def _tail(self, text: str) -> tuple[str, str]:
        """``text`` cut before the longest start of a guarded text it ends with, that start as
        its placeholder and the whitespace after it; (``text``, "") where it ends with none."""
        end = len(text.rstrip())  # (Python's whitespace: what a template's ``trim`` takes)
        start = self._starts.ending(text, end)
        if start is None:
            return text, ""
        return text[: end - start[0]], f"{OPEN}{start[1]}{CLOSE}{text[end:]}"

    def marked(self, messages: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
        """The messages with their users' and tools' text parts, names and call ids
        ``marked_text``, and the opening character ``opened`` wherever else it is (others as
        they are)."""
        return [self._marked_message(m) for m in messages]

    def _marked_message(self, message: Mapping[str, Any]) -> Mapping[str, Any]:
        guarded = message.get("role") in GUARDED_ROLES
        changes: dict[str, Any] = {}
        for key, value in message.items():
            new: Any
            if key == "tool_calls" and isinstance(value, list | tuple):
                new = [self._marked_call(call) for call in value]
                new = value if all(a is b for a, b in zip(new, value, strict=True)) else new
            elif guarded and key == "content":
                new = self._marked_content(value)
            elif guarded and key in GUARDED_FIELDS and isinstance(value, str):
                new = self.marked_text(value)  # (a template may write them in the turn's header)
            else:
                new = self.opened(value)
            if new is not value:
                changes[key] = new
        return {**message, **changes} if changes else message

    def _marked_call(self, call: Any) -> Any:
        """A call with its id marked as its result's ``tool_call_id`` is (so that a renderer
        matching the two, Gemma 4's, still finds them equal), the rest ``opened``."""
        if not isinstance(call, Mapping) or not isinstance(call.get("id"), str):
            return self.opened(call)
        rest = self.opened({key: value for key, value in call.items() if key != "id"})
        marked = self.marked_text(call["id"])
        return (
            call if marked is call["id"] and all(rest[k] is call[k] for k in rest) else {**rest, "id": marked}
        )

    def _marked_content(self, content: Any) -> Any:
        if isinstance(content, str):
            return self.marked_text(content)
        if not isinstance(content, list | tuple):
            return self.opened(content)
        marked = [self._marked_part(part) for part in content]
        return content if all(a is b for a, b in zip(marked, content, strict=True)) else marked

    def _marked_part(self, part: Any) -> Any:
        if isinstance(part, str):
            return self.marked_text(part)
        if isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str):
            text = self.marked_text(part["text"])
            return part if text is part["text"] else {**part, "text": text}
        return self.opened(part)

    def opened(self, value: Any) -> Any:
        """``value`` (a system or assistant message's field, a tool's schema: text, or lists and
        mappings of it) with the opening character, as it is or JSON's, as its placeholder in
        every string (so that text spelling a placeholder is read as it is, not as what the
        placeholder names); the same object where nothing holds it."""
        if isinstance(value, str):
            if OPEN not in value and ESCAPED not in value:
                return value
            return OPENING.sub(lambda m: f"{OPEN}{self._index[m.group()]}{CLOSE}", value)
        if isinstance(value, Mapping):
            items = [(self.opened(key), self.opened(item)) for key, item in value.items()]
            same = all(a is b and c is d for (a, c), (b, d) in zip(items, value.items(), strict=True))
            return value if same else dict(items)
        if isinstance(value, list | tuple):
            marked = [self.opened(item) for item in value]
            return value if all(a is b for a, b in zip(marked, value, strict=True)) else marked
        return value

    def shown(self, text: str) -> str:
        """``text`` with its placeholders as what they stand for (in JSON's escapes where the
        placeholder was written in them)."""
        if OPEN not in text and ESCAPED not in text:
            return text
        return PLACEHOLDER.sub(self._original, text)

    def _original(self, match: re.Match[str]) -> str:
        text = self._named(match)
        if text is None:
            return match.group()
        return text if match.group(1) else json.dumps(text)[1:-1]

    def _named(self, match: re.Match[str]) -> str | None:
        """What a placeholder stands for (None: it names nothing, so it is text)."""
        index, _, n = (match.group(1) or match.group(2)).partition(".")
        if int(index) >= len(self.texts):
            return None
        text = self.texts[int(index)]
        return text if not n else text[: int(n)] if 0 < int(n) < len(text) else None

    def pieces(self, text: str) -> list[tuple[str, bool]] | None:
        """``text`` (a rendered prompt, or a stretch of one) as pieces to tokenize in turn,
        each with whether it is plain (special tokens off; its placeholders as what they stand
        for); None where it holds no placeholder."""
        if OPEN not in text and ESCAPED not in text:
            return None
        found = [m for m in PLACEHOLDER.finditer(text) if self._named(m) is not None]
        if not found:
            return None
        controls = [] if self._controls is None else list(self._controls.finditer(text))
        starts = [m.start() for m in controls]
        out: list[tuple[str, bool]] = []
        cursor = 0
        for placeholder in found:
            if placeholder.start() < cursor:
                continue  # (in the fragment just taken)
            after = bisect.bisect_left(starts, placeholder.start())
            start = controls[after - 1].end() if after else 0
            end = controls[after].start() if after < len(controls) else len(text)
            if after and self._strips[controls[after - 1].group()][1]:
                start = end - len(text[start:end].lstrip(SPACES))
            if after < len(controls) and self._strips[controls[after].group()][0]:
                end = start + len(text[start:end].rstrip(SPACES))
            out += [(text[cursor:start], False), (self.shown(text[start:end]), True)]
            cursor = end
        out.append((text[cursor:], False))
        return out
