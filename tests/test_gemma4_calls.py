"""Gemma 4's call arguments: what the grammar lets a model write is what the reader reads and
what the template writes back, character for character (else the next prompt loses the call's
tokens), and nothing else passes the mask: not ``-0``, ``1.50``, ``1e5``, keys out of order or
twice, nor a quote inside a string."""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Callable
from typing import Any

import internals
import llguidance
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmsession import Model
from llmsession.errors import GrammarError
from llmsession.text.gemma4_calls import STRING_BODY, BodyGrammar, body_from_json, read_body, write_body
from llmsession.text.gemma4_tools import QUOTE, format_tool_call
from llmsession.text.tool_grammar import spelled

FIXTURES = ("smollm2-gemma4-template.gguf", "smollm2-gemma4-special.gguf")  # quote as text / as a token


@pytest.fixture(scope="module", params=FIXTURES)
def vocabulary(request: pytest.FixtureRequest, fixture_path: Any) -> Any:
    from llmsession.native.constraints import tokenizer

    with Model(fixture_path(request.param), threads=1, anticipate=False) as model:
        specials = internals.local(model).special_markers(internals.local(model).tool_format())
        yield model, tokenizer(internals.local(model).native), specials


def accepts(vocabulary: Any, schema: dict[str, Any], body: str) -> bool:
    """Whether the mask lets ``body`` through as the whole arguments of a tool with ``schema``."""
    model, tokenizer, specials = vocabulary
    rules = BodyGrammar("g", lambda text: spelled(text, specials))
    lark = "\n".join(["%llguidance {}", "start: " + rules.body(schema), *rules.lines()])
    matcher = llguidance.LLMatcher(tokenizer, llguidance.grammar_from("lark", lark), log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    taken = matcher.consume_tokens(model.tokenize(body, add_special=False))
    return bool(taken) and not matcher.is_error() and bool(matcher.is_accepting())


TEXT = st.text(st.sampled_from(list('ab <|">{}[],:\n\\é')), max_size=8)
LEAVES: list[tuple[dict[str, Any], st.SearchStrategy[Any]]] = [
    ({"type": "string"}, TEXT.filter(lambda t: '<|"|>' not in t)),
    ({"type": "integer"}, st.integers(-(10**15), 10**15)),
    ({"type": "number"}, st.floats(-1e6, 1e6).map(lambda x: round(x, 3))),
    ({"type": "boolean"}, st.booleans()),
    ({"enum": ["x", 2, True]}, st.sampled_from(["x", 2, True])),
    ({"type": "array", "items": {"type": "integer"}}, st.lists(st.integers(-9, 99), max_size=3)),
]


@st.composite
def schemas_and_values(draw: st.DrawFn) -> tuple[dict[str, Any], dict[str, Any]]:
    """An object schema (keys of both cases, some optional, one nested object) and a value."""
    names = draw(st.lists(st.sampled_from(["a", "B", "c", "Dd", "e_1"]), unique=True, min_size=1, max_size=4))
    properties, value, required = {}, {}, []
    for name in names:
        schema, values = draw(st.sampled_from(LEAVES))
        if name == "c":
            schema = {"type": "object", "properties": {"x": schema}, "required": ["x"]}
            values = values.map(lambda v: {"x": v})
        properties[name] = schema
        if draw(st.booleans()):
            required.append(name)
            value[name] = draw(values)
        elif draw(st.booleans()):
            value[name] = draw(values)
    return {"type": "object", "properties": properties, "required": required}, value


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schemas_and_values())
def test_what_the_mask_passes_reads_back_and_renders_the_same(vocabulary: Any, drawn: Any) -> None:
    schema, value = drawn
    body = write_body(value)  # as the template writes the arguments
    assert accepts(vocabulary, schema, body), body
    arguments, end = read_body(body + "}", 0)
    assert end == len(body) and json.loads(arguments) == value
    assert body_from_json(arguments) == body
    call = format_tool_call({"name": "f", "arguments": json.loads(arguments)})
    assert call == f"<|tool_call>call:f{{{body}}}<tool_call|>"


@pytest.mark.parametrize(
    ("schema", "body"),
    [
        ({"type": "integer"}, "-0"),
        ({"type": "integer"}, "07"),
        ({"type": "number"}, "1.50"),
        ({"type": "number"}, "1e5"),
        ({"type": "number"}, "1" * 17),  # (bounded)
        ({"type": "string"}, '<|"|>a<|"|>b<|"|>'),  # a quote inside a string
        ({"type": "string", "maxLength": 2}, '<|"|>abc<|"|>'),
        ({"type": "boolean"}, "True"),
    ],
)
def test_the_mask_passes_only_what_renders_back_the_same(vocabulary: Any, schema: Any, body: str) -> None:
    properties = {"k": schema}
    assert not accepts(vocabulary, {"type": "object", "properties": properties}, f"k:{body}")


def test_keys_come_in_the_templates_order_once(vocabulary: Any) -> None:
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "A": {"type": "integer"}}}
    assert accepts(vocabulary, schema, "A:1,b:2")
    assert not accepts(vocabulary, schema, "b:2,A:1")  # (dictsort: case-insensitive)
    assert not accepts(vocabulary, schema, "A:1,A:1")
    with pytest.raises(ValueError, match="twice"):
        read_body("a:1,a:2}", 0)


def test_values_nest_only_as_deep_as_the_reader_reads(vocabulary: Any) -> None:
    """The reader takes values 32 levels deep: the mask let a model nest free-form arguments
    deeper (a call the reply then failed to read, a 500); a schema that requires more is
    refused before anything decodes."""
    untyped = {"type": "object", "properties": {"k": {}}}
    lists = {n: "k:" + "[" * n + "1" + "]" * n for n in (31, 32)}
    maps = {n: "k:" + "{a:" * n + "1" + "}" * n for n in (31, 32)}
    for deepest, past in ((lists[31], lists[32]), (maps[31], maps[32])):
        assert accepts(vocabulary, untyped, deepest) and read_body(deepest + "}", 0)
        assert accepts(vocabulary, {"type": "object"}, deepest)  # (no properties: any pairs)
        assert not accepts(vocabulary, untyped, past)
        with pytest.raises(ValueError, match="too deep"):
            read_body(past + "}", 0)

    def nested(required: list[str]) -> dict[str, Any]:
        deep: dict[str, Any] = {"type": "integer"}
        for _ in range(33):  # (the innermost's integer at 33: one past)
            deep = {"type": "object", "properties": {"a": deep}, "required": required}
        return deep

    with pytest.raises(GrammarError, match="32 levels deep"):
        BodyGrammar("g", lambda text: spelled(text, {})).body(nested(["a"]))
    deep = nested([])  # (all optional: written empty where the reader stops)
    assert accepts(vocabulary, deep, "a:" + "{a:" * 31 + "{}" + "}" * 31)
    assert not accepts(vocabulary, deep, "a:" + "{a:" * 31 + "{a:1}" + "}" * 31)


def test_deep_and_wide_schemas_stay_small() -> None:
    """An array of arrays names its items once (the grammar grew 2^depth); a thousand
    properties chain without recursion; a key the template cannot write bare is refused."""
    say: Callable[[str], str] = lambda text: spelled(text, {})  # noqa: E731
    deep: dict[str, Any] = {"type": "integer"}
    for _ in range(40):
        deep = {"type": "array", "items": deep}
    rules = BodyGrammar("g", say)
    rules.body({"type": "object", "properties": {"k": deep}})
    assert sum(len(line) for line in rules.lines()) < 20_000
    wide = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(1000)}}
    rules = BodyGrammar("g", say)
    rules.body(wide)
    assert len(rules.lines()) < 2_100
    with pytest.raises(GrammarError, match="bare"):
        BodyGrammar("g", say).body({"type": "object", "properties": {"a:b": {"type": "integer"}}})


def test_a_string_body_is_exactly_the_text_without_a_quote() -> None:
    """Every string of up to 7 characters from ``<|">a`` matches the body's regex exactly when
    it holds no ``<|"|>`` (``<|<`` was once refused; the reader ends a string at a quote)."""
    body = re.compile(STRING_BODY)
    for size in range(8):
        for letters in itertools.product('<|">a', repeat=size):
            text = "".join(letters)
            assert bool(body.fullmatch(text)) == (QUOTE not in text), text
