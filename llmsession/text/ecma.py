"""A JSON schema's patterns in ECMA-262's reading, spelled for RE2 (the check after a reply,
``patterns``) and Rust's regex (the token mask, llguidance), which read some of it otherwise:
``.`` takes ``\\r`` and U+2028 in both, ``\\d``, ``\\w`` and ``\\s`` are Unicode's in Rust's,
and neither knows ``\\uXXXX``. Pure: no bindings, no regex engine."""

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
CLASSES = {"d": "0-9", "w": "A-Za-z0-9_"}  # (ECMA's, ASCII; Rust's are Unicode's)


def ecma(pattern: str) -> str:
    """An ECMA-262 pattern in the syntax RE2 and Rust's regex share, read as ECMA reads it:
    ``\\uXXXX`` (a surrogate pair joined) and ``\\u{...}`` as ``\\x{...}``; ``\\s``, ``\\d``
    and ``\\w`` as ECMA's classes, and outside a class ``\\S``, ``\\D``, ``\\W`` as their
    complements (inside one, as written: RE2's reading is ECMA's there, Rust's Unicode's);
    ``.`` outside a class as anything but a line terminator; the rest as written."""
    out: list[str] = []
    at, in_class = 0, False
    while at < len(pattern):
        char = pattern[at]
        if char == "\\" and at + 1 < len(pattern):
            code, used = _escape(pattern, at)
            letter = pattern[at + 1]
            named = SPACE if letter == "s" else CLASSES.get(letter)
            upper = letter.lower() if letter in "SDW" else None
            if code is not None:
                out.append(f"\\x{{{code:X}}}")
            elif named is not None:
                out.append(named if in_class else f"[{named}]")
            elif upper is not None and not in_class:
                out.append(f"[^{SPACE if upper == 's' else CLASSES[upper]}]")
            else:
                out.append(pattern[at : at + used])
            at += used
            continue
        out.append(DOT if char == "." and not in_class else char)
        in_class = (in_class and char != "]") or (not in_class and char == "[")
        at += 1
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
    spells it, for the mask: Rust's regex would take what ECMA's refuses (``^.$`` a
    ``"\\r"``, ``^\\d$`` an Arabic-Indic digit) and the reply would pass unchecked, or be
    refused after it was made."""
    document = copy.deepcopy(document)
    for node in schemas(document):
        if isinstance(node.get("pattern"), str):
            node["pattern"] = ecma(node["pattern"])
        if isinstance(node.get("patternProperties"), dict):
            node["patternProperties"] = {
                ecma(name) if isinstance(name, str) else name: value
                for name, value in node["patternProperties"].items()
            }
    return document
