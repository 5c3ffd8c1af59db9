"""A schema's patterns in the after-reply check: RE2 (linear time) with ECMA-262's reading, and
what it refuses before anything decodes. Pure: no model (the hostile pattern over a real reply
is tests/test_hostile.py's)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from llmsession.errors import GrammarError
from llmsession.text.ecma import ecma, masked
from llmsession.text.schemas import checked_schema, violation


def problem(schema: dict[str, Any], value: Any) -> str:
    return violation(checked_schema(json.dumps(schema)), value)


def test_ecmas_escapes_and_white_space_read_as_ecma_reads_them() -> None:
    cjk = {"type": "string", "pattern": "^[\\u4e00-\\u9fa5]+$"}  # (zod's and pydantic's CJK pattern)
    assert problem(cjk, "中文") == "" and "does not match" in problem(cjk, "abc")
    assert problem({"pattern": "^\\u00e9$"}, "é") == "" and problem({"pattern": "^\\u{1F600}$"}, "😀") == ""
    assert problem({"pattern": "^\\uD83D\\uDE00$"}, "😀") == ""  # (a surrogate pair: one code point)
    assert problem({"pattern": "^\\\\u0041$"}, "\\u0041") == ""  # (an escaped backslash stays one)
    for space in ("\u00a0", "\u2003", "\u3000", "\ufeff", "\t"):  # (RE2's \s is ASCII only)
        assert problem({"pattern": "^\\s$"}, space) == "", repr(space)
        assert problem({"pattern": "^[\\s,]$"}, space) == "", repr(space)
        assert "does not match" in problem({"pattern": "^\\S$"}, space), repr(space)
    assert ecma("[^\\S]") == "[^\\S]"  # (inside a class, \S keeps RE2's reading)
    assert problem({"pattern": "^\\d$"}, "٣") != ""  # (ECMA's \d is ASCII, as RE2's)
    assert problem({"pattern": "^a$"}, "a\n") != ""  # ($ ends the text: Python's re let this pass)


def test_a_dot_reads_as_ecma_reads_it_and_a_hyphen_beside_white_space_is_no_range() -> None:
    """ECMA's ``.`` takes no line terminator (RE2's and Rust's took ``\\r`` and U+2028: a reply
    the mask let through passed the check too). Inside a class, a ``-`` beside ``\\s`` is a
    hyphen (ECMA's Annex B), where its expansion made it a range; ``\\d`` and ``\\w`` are ASCII
    in both engines as in ECMA, left as written (a common email pattern, ``[\\w-\\.]``, must
    still compile)."""
    for terminator in ("\r", "\u2028", "\u2029", "\n"):
        assert "does not match" in problem({"pattern": "^.$"}, terminator), repr(terminator)
    assert problem({"pattern": "^.$"}, "\u0085") == problem({"pattern": "^[.]$"}, ".") == ""
    assert ecma("a.[.]\\.") == "a[^\\n\\r\\x{2028}\\x{2029}][.]\\."  # (inside a class, escaped: a dot)
    email = {"type": "string", "pattern": "^[\\w-\\.]+@([\\w-]+\\.)+[\\w-]{2,4}$"}
    assert problem(email, "a-b.c@d-e.fr") == "" and "does not match" in problem(email, "a b@c.fr")
    for hyphened in ("^[\\s-x]+$", "^[x-\\s]+$", "^[^-\\s]+$"):
        checked_schema(json.dumps({"pattern": hyphened}))  # (compiles: no range)
    assert problem({"pattern": "^[\\s-x]+$"}, " -x") == "" and problem({"pattern": "^[\\s-x]+$"}, "a") != ""
    assert problem({"pattern": "^[x-\\s]+$"}, "- x") == "" and problem({"pattern": "^[x-\\s]+$"}, "y") != ""


def test_the_mask_takes_the_patterns_as_the_check_reads_them() -> None:
    """``masked``: every pattern of a schema (and ``patternProperties``' names) as ``ecma``
    spells it, none inside data (``const``, ``enum``), the caller's document untouched; two
    names spelled alike hold both their schemas (a dict would have kept one)."""
    document = {
        "properties": {"a": {"pattern": "^.$"}, "pattern": {"const": {"pattern": "^.$"}}},
        "patternProperties": {
            "^\\s": {"type": "string", "pattern": "."},
            ecma("^\\s"): {"minLength": 2},  # (spelled as the first one will be)
        },
    }
    before = json.dumps(document)
    spelled = masked(document)
    assert json.dumps(document) == before
    assert spelled["properties"]["a"]["pattern"] == ecma("^.$") != "^.$"
    assert spelled["properties"]["pattern"] == {"const": {"pattern": "^.$"}}  # (data: as it was)
    assert spelled["patternProperties"] == {
        ecma("^\\s"): {"allOf": [{"type": "string", "pattern": ecma(".")}, {"minLength": 2}]}
    }


def test_a_lone_surrogate_in_a_reply_is_searched_not_a_failure_to_check() -> None:
    assert problem({"pattern": "^a"}, "a\ud800") == ""
    assert "does not match" in problem({"pattern": "^b"}, "a\ud800")
    assert problem({"patternProperties": {"^a": {"type": "integer"}}}, {"a\udfff": "x"}) != ""


def test_a_backtracking_pattern_is_searched_in_linear_time() -> None:
    evil = {"type": "string", "pattern": "^(?:(a|aa)+)+c$|^a{40}$", "not": {"const": "x"}}
    assert problem(evil, "a" * 40) == ""  # (Python's re: about 2**40 steps)
    assert "does not match" in problem(evil, "a" * 39)
    keys = {"patternProperties": {"^(?:(a|aa)+)+c$": {}}, "additionalProperties": False}
    assert "does not match any of the regexes" in problem(keys, {"a" * 40: 1})


@pytest.mark.parametrize(
    "schema",
    [
        {"pattern": "(?=a)a"},  # a lookaround
        {"pattern": "(a)\\1"},  # a backreference
        {"properties": {"default": {"type": "string", "pattern": "(?<=a)b"}}},  # (a property named default)
        {"patternProperties": {"^x": {}}, "unevaluatedProperties": False},
    ],
)
def test_what_re2_cannot_check_is_refused_before_anything_decodes(schema: dict[str, Any]) -> None:
    with pytest.raises(GrammarError):
        checked_schema(json.dumps(schema))


def test_keywords_spelled_as_property_names_are_names() -> None:
    named = {"properties": {"unevaluatedProperties": {"type": "string"}}, "patternProperties": {"^x": {}}}
    assert problem(named, {"unevaluatedProperties": "y", "xa": 1}) == ""
    assert problem({"properties": {"pattern": {"type": "string"}}}, {"pattern": "(?=a"}) == ""
    extra = {"additionalProperties": False, "properties": {"a": {}}, "patternProperties": {"^b": {}}}
    assert problem(extra, {"a": 1, "bc": 2}) == "" and "'z' does not match" in problem(extra, {"z": 1})


def test_long_patterns_are_kept_few_and_the_longest_refused() -> None:
    """The compiled patterns were kept by count (512) whatever their size: a request's tool
    schema with 500,000-character patterns held 11 MB each, for good (5.5 GB in about forty
    requests). Patterns over 4 KiB are kept 16 at most, over 64 KiB refused; short ones still
    512."""
    from llmsession.text import patterns

    short, long = patterns._remembered.cache_info, patterns._remembered_long.cache_info
    for i in range(20):
        text = f"^x{i}" + "ab" * 5_000 + "$"
        schema = checked_schema(json.dumps({"type": "string", "pattern": text}))
        assert not violation(schema, f"x{i}" + "ab" * 5_000) and violation(schema, "nope")
    assert long().currsize == 16 and long().maxsize == 16
    with pytest.raises(GrammarError, match="longer than this server checks"):
        checked_schema(json.dumps({"type": "string", "pattern": "a" * 70_000}))
    before = short().currsize
    checked_schema(json.dumps({"type": "string", "pattern": "^short-kept$"}))
    assert short().currsize == before + 1
