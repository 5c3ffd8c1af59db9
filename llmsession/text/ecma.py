"""A JSON schema's patterns in ECMA-262's reading, spelled for RE2 (the check after a reply,
``patterns``) and Rust's regex (the token mask, llguidance), which read some of it otherwise:
``.`` takes ``\\r`` and U+2028 in both, ``\\s`` is ASCII's in RE2, and neither knows
``\\uXXXX``. (``\\d`` and ``\\w`` are ASCII in both, as in ECMA.) Pure: no bindings, no regex
engine."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

# Where a schema's values are data, not schemas: a "pattern" there is not a keyword.
DATA = frozenset({"const", "enum", "default", "examples"})
# Keywords whose value maps names to schemas: the names are not keywords.
MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
# ECMA-262's white space and line terminators (its ``\s``; RE2's is ASCII only, Rust's Unicode's).
SPACE = r"\t\n\x{0B}\f\r \x{A0}\x{1680}\x{2000}-\x{200A}\x{2028}\x{2029}\x{202F}\x{205F}\x{3000}\x{FEFF}"
# Its complement, as ranges (RE2 reads ``\\S`` in a class as ASCII's, Rust as Unicode's).
NOT_SPACE = (
    r"\x{0}-\x{8}\x{E}-\x{1F}\x{21}-\x{9F}\x{A1}-\x{167F}\x{1681}-\x{1FFF}\x{200B}-\x{2027}"
    r"\x{202A}-\x{202E}\x{2030}-\x{205E}\x{2060}-\x{2FFF}\x{3001}-\x{FEFE}\x{FF00}-\x{10FFFF}"
)
HEX = frozenset("0123456789abcdefABCDEF")
DOT = r"[^\n\r\x{2028}\x{2029}]"  # (ECMA's ``.``: not a line terminator)


def ecma(pattern: str) -> str:
    """An ECMA-262 pattern in the syntax RE2 and Rust's regex share, read as ECMA reads it:
    ``\\uXXXX`` (a surrogate pair joined) and ``\\u{...}`` as ``\\x{...}``; ``\\s`` and ``\\S``
    as ECMA's white space and its complement; ``.`` as anything but a line terminator; each
    class as ``_class`` spells it; the rest as written (``\\d``, ``\\w`` are ASCII in both, as
    in ECMA)."""
    out: list[str] = []
    at = 0
    while at < len(pattern):
        char = pattern[at]
        if char == "[":
            spelled, at = _class(pattern, at)
            out.append(spelled)
            continue
        if char == "\\" and at + 1 < len(pattern):
            code, used = _escape(pattern, at)
            letter = pattern[at + 1]
            if code is not None:
                out.append(f"\\x{{{code:X}}}")
            elif letter in "sS":
                out.append(f"[{SPACE if letter == 's' else NOT_SPACE}]")
            else:
                out.append(pattern[at : at + used])
            at += used
            continue
        out.append(DOT if char == "." else char)
        at += 1
    return "".join(out)


def _class(pattern: str, at: int) -> tuple[str, int]:
    """The class opening at ``at`` (its ``[``) spelled for both engines, and where it ends, as
    ECMA reads it: a ``-`` beside ``\\d``, ``\\s``, ``\\w`` or their complements a hyphen (its
    Annex B: no range), every other ``-`` not in a range a hyphen too; ``[``, ``&`` and ``~``
    themselves (Rust's nested classes and set operations); ``[]`` nothing, ``[^]`` anything."""
    start, negated = at, pattern[at + 1 : at + 2] == "^"
    at += 2 if negated else 1
    if pattern[at : at + 1] == "]":
        return ("[\\x{0}-\\x{10FFFF}]" if negated else "[^\\x{0}-\\x{10FFFF}]"), at + 1
    items: list[tuple[str, str]] = []  # (its spelling, "atom", "set" or "dash")
    while at < len(pattern) and pattern[at] != "]":
        char = pattern[at]
        if char == "\\" and at + 1 < len(pattern):
            code, used = _escape(pattern, at)
            letter = pattern[at + 1]
            if code is not None:
                items.append((f"\\x{{{code:X}}}", "atom"))
            elif letter in "dDwWsS":
                spelled = SPACE if letter == "s" else NOT_SPACE if letter == "S" else pattern[at : at + 2]
                items.append((spelled, "set"))
            else:
                items.append((pattern[at : at + used], "atom"))
            at += used
            continue
        items.append(("-", "dash") if char == "-" else ("\\" + char if char in "[&~" else char, "atom"))
        at += 1
    if at >= len(pattern):  # (never closed: as written, for the engines to refuse)
        return pattern[start:], len(pattern)
    return "[" + ("^" if negated else "") + _ranges(items) + "]", at + 1


def _ranges(items: list[tuple[str, str]]) -> str:
    """A class's items, left to right as ECMA parses them: ``a-b`` a range of two atoms (a
    ``-`` may be either), a set beside a ``-`` no range (the three are each themselves)."""

    def spelled(item: tuple[str, str]) -> str:
        return "\\-" if item[1] == "dash" else item[0]

    out, i = [], 0
    while i < len(items):
        if i + 2 < len(items) and items[i + 1][1] == "dash":
            first, last = items[i], items[i + 2]
            hyphen = "\\-" if "set" in (first[1], last[1]) else "-"  # (beside a set: no range)
            out.append(spelled(first) + hyphen + spelled(last))
            i += 3
        else:
            out.append(spelled(items[i]))
            i += 1
    return "".join(out)


def _escape(pattern: str, at: int) -> tuple[int | None, int]:
    """The code point a ``\\u`` escape at ``at`` names (None: another escape), and its length."""
    if pattern[at + 1] != "u":
        return None, 2
    if pattern[at + 2 : at + 3] == "{" and (end := pattern.find("}", at + 3)) > at + 3:
        digits = pattern[at + 3 : end]
        return (int(digits, 16), end + 1 - at) if set(digits) <= HEX and len(digits) <= 6 else (None, 2)
    digits = pattern[at + 2 : at + 6]
    if len(digits) < 4 or not set(digits) <= HEX:
        return None, 2
    code, low = int(digits, 16), pattern[at + 8 : at + 12]
    paired = 0xD800 <= code < 0xDC00 and pattern[at + 6 : at + 8] == "\\u" and len(low) == 4
    if paired and set(low) <= HEX and 0xDC00 <= (second := int(low, 16)) < 0xE000:  # (one code point)
        return 0x10000 + ((code - 0xD800) << 10) + (second - 0xDC00), 12
    return code, 6


def schemas(document: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every object in ``document`` but those inside data (``const``, ``enum``...), without
    recursion (the document is within ``MAX_SCHEMA_DEPTH``; its breadth is a body's)."""
    stack: list[Any] = [document]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            yield node
            for key, value in node.items():
                if key in MAPS and isinstance(value, dict):  # (its keys are names: its values schemas)
                    stack += value.values()
                elif key not in DATA:
                    stack.append(value)
        elif isinstance(node, list):
            stack += node


def masked(document: dict[str, Any]) -> dict[str, Any]:
    """``document`` with every pattern (``pattern``, ``patternProperties``' names) as ``ecma``
    spells it, for the mask: Rust's regex would take what ECMA's refuses (``^.$`` a ``"\\r"``)
    and the reply would pass unchecked. Two names spelled alike hold both their schemas."""
    document = copy.deepcopy(document)
    for node in schemas(document):
        if isinstance(node.get("pattern"), str):
            node["pattern"] = ecma(node["pattern"])
        named = node.get("patternProperties")
        if isinstance(named, dict):
            spelled: dict[Any, Any] = {}
            for name, value in named.items():
                key = ecma(name) if isinstance(name, str) else name
                spelled[key] = {"allOf": [spelled[key], value]} if key in spelled else value
            node["patternProperties"] = spelled
    return document
