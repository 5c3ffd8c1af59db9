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
HEX = frozenset("0123456789abcdefABCDEF")
DOT = r"[^\n\r\x{2028}\x{2029}]"  # (ECMA's ``.``: not a line terminator)


def ecma(pattern: str) -> str:
    """An ECMA-262 pattern in the syntax RE2 and Rust's regex share, read as ECMA reads it:
    ``\\uXXXX`` (a surrogate pair joined) and ``\\u{...}`` as ``\\x{...}``; ``\\s`` as ECMA's
    white space (inside a class, a ``-`` beside it a hyphen, as ECMA reads it there, not a
    range), and outside a class ``\\S`` as its complement (inside one, as written); ``.``
    outside a class as anything but a line terminator; the rest as written."""
    out: list[str] = []
    at, in_class = 0, False
    while at < len(pattern):
        char = pattern[at]
        if char == "\\" and at + 1 < len(pattern):
            code, used = _escape(pattern, at)
            if code is not None:
                out.append(f"\\x{{{code:X}}}")
            elif pattern[at + 1] == "s" and in_class:
                if out and out[-1] == "-" and len(out) > 1 and out[-2] not in ("[", "[^"):
                    out[-1] = "\\-"  # (a hyphen before it: no range)
                out.append(SPACE)
                if pattern[at + 2 : at + 3] == "-" and pattern[at + 3 : at + 4] not in ("", "]"):
                    out.append("\\-")  # (a hyphen after it: no range)
                    used += 1
            elif pattern[at + 1] == "s":
                out.append(f"[{SPACE}]")
            elif pattern[at + 1] == "S" and not in_class:
                out.append(f"[^{SPACE}]")
            else:
                out.append(pattern[at : at + used])
            at += used
            continue
        opening = not in_class and char == "["
        if opening and pattern[at + 1 : at + 2] == "^":
            out.append("[^")  # (one item: a hyphen after it begins the class, no range)
            at += 2
        else:
            out.append(DOT if char == "." and not in_class else char)
            at += 1
        in_class = (in_class and char != "]") or opening
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
