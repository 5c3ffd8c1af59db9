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
    assert problem({"pattern": "^[^\\S]$"}, "\u00a0") == ""  # (inside a class too: ECMA's, not RE2's ASCII)
    assert problem({"pattern": "^\\d$"}, "٣") != ""  # (ECMA's \d is ASCII, as RE2's)
    assert problem({"pattern": "^a$"}, "a\n") != ""  # ($ ends the text: Python's re let this pass)


# (pattern, what it takes, what it refuses), as ECMA-262 (Node's RegExp, Annex B) reads them
CLASSES = [
    ("^.$", ["x", "\u0085"], ["\r", "\u2028", "\n"]),  # (RE2 and Rust took \r and U+2028)
    ("^\\[.\\]$", ["[x]"], ["[\r]"]),
    ("^[.]$", ["."], ["x"]),
    ("^[\\w-\\.]+$", ["a-b.c"], ["a b", "a/b"]),  # (a common email pattern's class)
    ("^[+-\\d]+$", ["+-5"], [",", ".", "/"]),  # (beside \\d, \\w, \\s: a hyphen, no range)
    ("^[.-\\w]+$", [".-a_"], ["/", "@"]),
    ("^[x-\\d]+$", ["x-5"], ["y"]),
    ("^[\\s--x]+$", [" -x"], ["a", "5", "/"]),
    ("^[\\s-a-z]+$", [" -az"], ["b", "y"]),
    ("^[a-z-\\s]+$", ["q- "], ["A"]),
    ("^[[-\\s]+$", ["[- "], ["a"]),
    ("^[--x]+$", ["-x", "a"], ["y"]),  # (a range from a hyphen)
    ("^[!--]+$", ["!", ",", "-"], ["."]),  # (a range to one)
    ("^[a-]+$", ["a-"], ["b"]),
    ("^[[]+$", ["["], ["a"]),  # (Rust read [ as a nested class)
    ("^[a&&b]+$", ["a&b"], ["c"]),  # (and && as an intersection)
    ("^[^]$", ["a", "\n"], []),  # (anything)
    ("^[\\S]+$", ["a"], ["\u00a0", "\ufeff", "\u2028", " "]),  # (RE2 read \\S there as ASCII's)
    ("^[^\\S]+$", [" \u00a0"], ["a"]),
    ("^[[:alpha:]]$", ["a]", ":]"], ["b]"]),  # (no POSIX class: [, :, a, l, p, h, then ])
]


@pytest.mark.parametrize(("pattern", "taken", "refused"), CLASSES)
def test_a_pattern_reads_as_ecma_reads_it_in_the_check_and_compiles_for_the_mask(
    pattern: str, taken: list[str], refused: list[str]
) -> None:
    """The check (RE2) reads each pattern as ECMA does, and the mask (llguidance, Rust's regex)
    compiles it as ``ecma`` spells it (``test_structured`` holds the mask to it on a model)."""
    import llguidance

    schema = {"type": "string", "pattern": pattern}
    for text in taken:
        assert problem(schema, text) == "", (pattern, text, ecma(pattern))
    for text in refused:
        assert "does not match" in problem(schema, text), (pattern, text, ecma(pattern))
    grammar = llguidance.LLMatcher.grammar_from_json_schema({"type": "string", "pattern": ecma(pattern)})
    assert llguidance.LLMatcher.validate_grammar(grammar) == "", (pattern, ecma(pattern))


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
        {"pattern": "[abc"},  # a class never closed (ecma() must not close it)
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


def test_unique_items_are_checked_in_linear_time_as_json_schema_compares_them() -> None:
    """jsonschema compares every pair of items it cannot sort (objects): 2,000 distinct objects
    took 4 s in one of its keyword steps, after the reply (llguidance does not hold a reply to
    ``uniqueItems``). Each item's canonical form now: 1 and 1.0 alike, true and 1 not, an
    object's keys in any order."""
    import time

    from hypothesis import given, settings
    from hypothesis import strategies as st
    from jsonschema import Draft202012Validator

    validator = checked_schema('{"type": "array", "uniqueItems": true}')
    began = time.monotonic()
    assert violation(validator, [{"a": i, "b": [i, {"c": str(i)}]} for i in range(20_000)]) == ""
    assert time.monotonic() - began < 2
    assert violation(validator, [{"a": 1, "b": 2}, {"b": 2, "a": 1.0}]) != ""
    assert violation(validator, [1, True, "1", None, False, 0, [1], {"1": 1}]) == ""
    plain = Draft202012Validator({"type": "array", "uniqueItems": True})
    json_values = st.recursive(
        st.none()
        | st.booleans()
        | st.integers(-3, 3)
        | st.sampled_from([0.0, 1.0, 2.5])
        | st.sampled_from("ab"),
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from("xy"), inner, max_size=2),
        max_leaves=6,
    )

    @settings(max_examples=300, deadline=None)
    @given(st.lists(json_values, max_size=5))
    def as_jsonschema_says(items: list[Any]) -> None:
        assert (violation(validator, items) == "") == plain.is_valid(items), items

    as_jsonschema_says()
