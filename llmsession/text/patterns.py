"""A schema's patterns checked in linear time, for the check a reply gets after it is made.

``jsonschema``'s own keywords search with Python's ``re``, which backtracks: a pattern such as
``^(?:(a|aa)+)+c$|^a{30}$`` on the thirty a's a token mask lets through takes hours, holding the
interpreter (and a server's event loop) all that while, and nothing can stop it. Here the
keywords that read patterns (``pattern``, ``patternProperties``, and ``additionalProperties``,
which skips the properties a pattern names) search with RE2 instead: time linear in the text,
and ECMA-262's matching (``\\d`` is ASCII, ``$`` ends the text; ``\\uXXXX`` and ``\\s``, which
RE2 spells otherwise or reads as ASCII, are translated: ``ecma``). A pattern RE2 cannot take (a
lookaround, a backreference: what Rust's regex, the mask's, cannot take either) is refused
before anything decodes, and so is ``unevaluatedProperties`` beside a ``patternProperties``
(jsonschema matches those with ``re`` inside its own walk).

Pure: no bindings; loaded with a schema's validator, not with llmsession.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import re2  # type: ignore[import-untyped]  # google-re2
from jsonschema.exceptions import ValidationError

from llmsession.errors import GrammarError

_QUIET = re2.Options()
_QUIET.log_errors = False  # (a pattern it refuses is ours to report, not absl's on stderr)
# Where a schema's values are data, not schemas: a "pattern" there is not a keyword.
DATA = frozenset({"const", "enum", "default", "examples"})
# Keywords whose value maps names to schemas: the names are not keywords.
MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
# ECMA-262's white space and line terminators (its ``\s``; RE2's is ASCII only).
SPACE = r"\t\n\x{0B}\f\r \x{A0}\x{1680}\x{2000}-\x{200A}\x{2028}\x{2029}\x{202F}\x{205F}\x{3000}\x{FEFF}"
HEX = frozenset("0123456789abcdefABCDEF")


SHORT_PATTERN_CHARS = 4096  # the last 512 patterns this long or shorter are kept compiled
MAX_PATTERN_CHARS = 65536  # longer ones are refused; the last 16 of those between are kept


def compiled(pattern: str) -> Any:
    """RE2's compiled ``pattern`` (its ``search`` is unanchored, as a schema's patterns are);
    GrammarError if RE2 cannot take it. Kept compiled by size: a 500,000-character pattern a
    request sent held 11 MB, and 512 of them 5.5 GB for good (a pattern is checked against each
    string or name of a reply, so one that was not kept would be compiled again for each)."""
    if len(pattern) <= SHORT_PATTERN_CHARS:
        return _remembered(pattern)
    if len(pattern) <= MAX_PATTERN_CHARS:
        return _remembered_long(pattern)
    raise GrammarError(
        f"json_schema: a pattern of {len(pattern)} characters is longer than this server checks "
        f"({MAX_PATTERN_CHARS})"
    )


@functools.lru_cache(maxsize=512)
def _remembered(pattern: str) -> Any:
    return _compiled(pattern)


@functools.lru_cache(maxsize=16)
def _remembered_long(pattern: str) -> Any:
    return _compiled(pattern)


def _compiled(pattern: str) -> Any:
    try:
        return re2.compile(ecma(pattern), _QUIET)
    except re2.error as error:
        said = error.args[0] if error.args else str(error)
        said = said.decode(errors="replace") if isinstance(said, bytes) else str(said)
        raise GrammarError(
            f"json_schema: the pattern {pattern[:200]!r} is not one this server checks ({said[:200]}; "
            "lookarounds and backreferences are not supported)"
        ) from None


def ecma(pattern: str) -> str:
    """An ECMA-262 pattern in RE2's syntax: ``\\uXXXX`` (a surrogate pair joined) and
    ``\\u{...}`` as ``\\x{...}``, ``\\s`` as ECMA's white space, ``\\S`` outside a class as
    its complement (inside one, RE2's ASCII reading stays); the rest as written."""
    out: list[str] = []
    at, in_class = 0, False
    while at < len(pattern):
        char = pattern[at]
        if char == "\\" and at + 1 < len(pattern):
            code, used = _escape(pattern, at)
            if code is not None:
                out.append(f"\\x{{{code:X}}}")
            elif pattern[at + 1] == "s":
                out.append(SPACE if in_class else f"[{SPACE}]")
            elif pattern[at + 1] == "S" and not in_class:
                out.append(f"[^{SPACE}]")
            else:
                out.append(pattern[at : at + used])
            at += used
            continue
        in_class = (in_class and char != "]") or (not in_class and char == "[")
        out.append(char)
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


def _subject(text: str) -> str:
    """``text`` as RE2 can take it: a lone surrogate (JSON can spell one) as U+FFFD."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return text.encode("utf-8", "surrogatepass").decode("utf-8", "replace")
    return text


def check_patterns(document: dict[str, Any]) -> None:
    """GrammarError for a pattern RE2 cannot take anywhere in the schema, or for
    ``unevaluatedProperties`` beside a ``patternProperties`` (checked with ``re``)."""
    found: set[str] = set()
    for node in _schemas(document):
        pattern, named = node.get("pattern"), node.get("patternProperties")
        for text in ([pattern] if isinstance(pattern, str) else []) + list(
            named if isinstance(named, dict) else ()
        ):
            compiled(text)
        found |= {"pattern"} if named else set()
        found |= {"unevaluated"} if "unevaluatedProperties" in node else set()
    if found >= {"pattern", "unevaluated"}:
        raise GrammarError("json_schema: unevaluatedProperties beside patternProperties is not supported")


def _schemas(document: dict[str, Any]) -> Iterator[dict[str, Any]]:
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


def pattern(validator: Any, patrn: str, instance: Any, schema: Any) -> Iterator[ValidationError]:
    """jsonschema's ``pattern``, searched with RE2."""
    if validator.is_type(instance, "string") and not compiled(patrn).search(_subject(instance)):
        yield ValidationError(f"{instance!r} does not match {patrn!r}")


def pattern_properties(
    validator: Any, patterns: dict[str, Any], instance: Any, schema: Any
) -> Iterator[ValidationError]:
    """jsonschema's ``patternProperties``, searched with RE2."""
    if not validator.is_type(instance, "object"):
        return
    for patrn, subschema in patterns.items():
        for key, value in instance.items():
            if compiled(patrn).search(_subject(key)):
                yield from validator.descend(value, subschema, path=key, schema_path=patrn)


def additional_properties(
    validator: Any, extra: Any, instance: Any, schema: Any
) -> Iterator[ValidationError]:
    """jsonschema's ``additionalProperties``, the properties a pattern names found with RE2."""
    if not validator.is_type(instance, "object"):
        return
    named, patterns = schema.get("properties", {}), list(schema.get("patternProperties", {}))
    extras = sorted(
        (
            key
            for key in instance
            if key not in named and not any(compiled(p).search(_subject(key)) for p in patterns)
        ),
        key=str,
    )
    if validator.is_type(extra, "object"):
        for key in extras:
            yield from validator.descend(instance[key], extra, path=key)
    elif not extra and extras:
        listed = ", ".join(repr(key) for key in extras)
        if patterns:
            verb = "does" if len(extras) == 1 else "do"
            regexes = ", ".join(map(repr, sorted(patterns)))
            yield ValidationError(f"{listed} {verb} not match any of the regexes: {regexes}")
        else:
            verb = "was" if len(extras) == 1 else "were"
            yield ValidationError(f"Additional properties are not allowed ({listed} {verb} unexpected)")


KEYWORDS = {
    "pattern": pattern,
    "patternProperties": pattern_properties,
    "additionalProperties": additional_properties,
}
