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
from llmsession.text.ecma import ecma, schemas

_QUIET = re2.Options()
_QUIET.log_errors = False  # (a pattern it refuses is ours to report, not absl's on stderr)


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
    for node in schemas(document):
        pattern, named = node.get("pattern"), node.get("patternProperties")
        for text in ([pattern] if isinstance(pattern, str) else []) + list(
            named if isinstance(named, dict) else ()
        ):
            compiled(text)
        found |= {"pattern"} if named else set()
        found |= {"unevaluated"} if "unevaluatedProperties" in node else set()
    if found >= {"pattern", "unevaluated"}:
        raise GrammarError("json_schema: unevaluatedProperties beside patternProperties is not supported")


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
