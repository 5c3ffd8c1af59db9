"""render_gemma4 with tools equals Google's Jinja template, rendered by jinja2: declarations,
calls and results on generated chats, and one full tool round written out.

The reference templates are llama.cpp's, copied under tests/data/templates. The E2B/E4B
("small") template differs from the 31B one only in not closing an empty thought channel
after the generation prompt when thinking is off, so SMALL is derived from the 31B template
by deleting that emission.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from gemma4_helpers import (
    CANONICAL,
    CONTENT,
    INTERLEAVED,
    OTHERS,
    TEXT,
    TOKENS,
    VARIANTS,
    FakeImage,
    oracle,
)
from hypothesis import Phase, find, given, settings
from hypothesis import strategies as st

from llmsession.errors import TemplateError
from llmsession.text import gemma4_tools
from llmsession.text.gemma4 import (
    render_gemma4,
)

# Tools. Schemas are generated freely (mixed-case and list types, properties named like schema
# keywords, objects without properties, None inside items, keys differing only in case) so the
# template's quirks are exercised along with ordinary schemas.
QUOTING = ['"', "'", "\\", "\n", '<|"|>', "{", "}", ",", ":", "[", "]", "<|tool_call>", "<tool|>"]
STRING = st.lists(st.one_of(st.sampled_from(QUOTING + TOKENS + OTHERS), st.text(max_size=4)), max_size=5).map(
    "".join
)
KEYWORDS = ["type", "description", "required", "properties", "nullable", "items", "enum"]
KEY = st.one_of(
    st.sampled_from(["a", "A", "b", "B", "city", "City", "unit", "_x", "Zeta", "é", "É", *KEYWORDS]),
    st.text(max_size=4),
)
NUMBER = st.one_of(st.integers(-(10**12), 10**12), st.floats())
JSON = st.recursive(
    st.one_of(st.none(), st.booleans(), NUMBER, STRING),
    lambda children: st.one_of(st.lists(children, max_size=3), st.dictionaries(KEY, children, max_size=3)),
    max_leaves=8,
)
NAME = st.from_regex(r"[A-Za-z_][A-Za-z0-9_.\-]{0,8}", fullmatch=True)
TYPE = st.one_of(
    st.sampled_from(["string", "number", "integer", "boolean", "array", "object", "null", "STRING", "Array"]),
    st.lists(st.sampled_from(["string", "null", "integer"]), min_size=1, max_size=2),
)
SCHEMA_FIELDS = {
    "description": st.one_of(STRING, st.just("")),
    "enum": st.lists(st.one_of(STRING, NUMBER), max_size=3),
    "nullable": st.booleans(),
    "required": st.lists(KEY, max_size=2),
    "default": JSON,
}
DESCRIBED = {"description": STRING, "nullable": st.booleans()}
STRING_SCHEMA = st.fixed_dictionaries(
    {"type": st.sampled_from(["string", "STRING"])},
    optional={**DESCRIBED, "enum": st.lists(STRING, min_size=1, max_size=3)},
)
SCALAR_SCHEMA = st.fixed_dictionaries(
    {"type": st.sampled_from(["number", "integer", "boolean", "null"])}, optional=DESCRIBED
)


def schema_of(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Ordinary arrays and objects over ``children``, or any mix of schema fields."""
    array = st.fixed_dictionaries({"type": st.just("array"), "items": children}, optional=DESCRIBED)
    properties = st.dictionaries(KEY, children, min_size=1, max_size=3)
    required = st.lists(KEY, max_size=2)
    members = {"type": st.sampled_from(["object", "Object"]), "properties": properties}
    an_object = st.fixed_dictionaries(members, optional={**DESCRIBED, "required": required})
    nested = {"items": children, "properties": st.dictionaries(KEY, children, max_size=3)}
    anything = st.fixed_dictionaries({}, optional={"type": TYPE, **SCHEMA_FIELDS, **nested})
    return st.one_of(array, an_object, anything)


LEAF_SCHEMA = st.one_of(
    STRING_SCHEMA,
    SCALAR_SCHEMA,
    st.fixed_dictionaries({"type": TYPE}, optional=SCHEMA_FIELDS),
    st.sampled_from(["string", {}, None]),
)
SCHEMA = st.recursive(LEAF_SCHEMA, schema_of, max_leaves=6)
PARAMETERS = st.one_of(
    st.fixed_dictionaries(
        {"type": st.just("object"), "properties": st.dictionaries(KEY, SCHEMA, min_size=1, max_size=4)},
        optional={"required": st.lists(KEY, max_size=3)},
    ),
    st.fixed_dictionaries(
        {},
        optional={
            "type": st.sampled_from(["object", "OBJECT"]),
            "properties": st.dictionaries(KEY, SCHEMA, max_size=4),
            "required": st.lists(KEY, max_size=3),
        },
    ),
)
FUNCTION = st.fixed_dictionaries(
    {"name": NAME},
    optional={
        "description": st.one_of(STRING, st.none()),
        "parameters": PARAMETERS,
        "response": st.fixed_dictionaries(
            {}, optional={"description": STRING, "type": st.sampled_from(["object", "OBJECT", "string"])}
        ),
    },
)
TOOL = FUNCTION.map(lambda function: {"type": "function", "function": function})
TOOLS = st.one_of(st.none(), st.just([]), st.lists(TOOL, min_size=1, max_size=3))
OBJECT = st.dictionaries(KEY, JSON, max_size=4)
ARGUMENTS = st.one_of(
    OBJECT,
    OBJECT,
    OBJECT.map(json.dumps),
    OBJECT.map(lambda arguments: json.dumps(arguments, ensure_ascii=False)),
    STRING,
)
RESULT = st.one_of(STRING, st.lists(STRING.map(lambda t: {"type": "text", "text": t}), max_size=3))
REASONING = st.fixed_dictionaries({}, optional={"reasoning": TEXT, "reasoning_content": TEXT})


@st.composite
def tool_chats(draw: st.DrawFn) -> list[dict[str, Any]]:
    """Chats with calls (arguments as objects or as text), the tool messages answering them
    (by id, named or not, some answering earlier calls or straying after other messages),
    Gemma's own ``tool_responses``, reasoning on assistant messages, and plain turns."""
    messages: list[dict[str, Any]] = []
    if draw(st.booleans()):
        messages.append({"role": draw(st.sampled_from(["system", "developer"])), "content": draw(TEXT)})
    ids: list[str] = []
    for _ in range(draw(st.integers(1, 5))):
        kind = draw(st.sampled_from(["user", "assistant", "call", "call", "legacy", "stray"]))
        if kind in ("user", "assistant"):
            role = kind if kind == "user" else draw(st.sampled_from(["assistant", "model"]))
            messages.append({"role": role, "content": draw(CONTENT), **draw(REASONING)})
        elif kind == "call":
            calls = []
            for _ in range(draw(st.integers(1, 3))):
                ids.append(f"call_{len(ids)}")
                function = draw(st.fixed_dictionaries({"name": NAME}, optional={"arguments": ARGUMENTS}))
                calls.append({"id": ids[-1], "type": "function", "function": function})
            content = draw(st.one_of(st.none(), st.just(""), CONTENT))
            messages.append({"role": "assistant", "content": content, "tool_calls": calls, **draw(REASONING)})
            for _ in range(draw(st.integers(0, 3))):
                answered = draw(st.sampled_from(ids[-len(calls) :] * 3 + ids))
                result = {"role": "tool", "tool_call_id": answered, "content": draw(RESULT)}
                if answered not in ids[-len(calls) :] or draw(st.booleans()):
                    result["name"] = draw(NAME)  # (unnamed, it would fail the template)
                messages.append(result)
        elif kind == "legacy":
            response = st.fixed_dictionaries({"response": JSON}, optional={"name": NAME})
            role = draw(st.sampled_from(["assistant", "user"]))
            responses = draw(st.lists(response, min_size=1, max_size=2))
            messages.append(
                {"role": role, "content": draw(st.one_of(st.just(""), CONTENT)), "tool_responses": responses}
            )
        elif ids:  # a tool message that follows no call message is not written
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": draw(st.sampled_from(ids)),
                    "name": draw(NAME),
                    "content": draw(RESULT),
                }
            )
    return messages or [{"role": "user", "content": draw(TEXT)}]


@settings(max_examples=200, deadline=None)
@given(
    variant=st.sampled_from(["31B", "small"]),
    messages=tool_chats(),
    tools=TOOLS,
    gen=st.booleans(),
    thinking=st.booleans(),
)
def test_tools_match_the_jinja_template(
    variant: str,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    gen: bool,
    thinking: bool,
) -> None:
    template = VARIANTS[variant]
    ours = render_gemma4(
        messages, template=template, add_generation_prompt=gen, thinking=thinking, tools=tools
    )
    assert ours == oracle(template, messages, gen=gen, thinking=thinking, tools=tools)


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "city": {"type": "string", "description": "City name"},
            },
            "required": ["city"],
        },
    },
}
CALL = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
ROUND = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 21}'},
    {"role": "assistant", "content": "21 °C."},
]
ROUND_TEXT = (
    "<|turn>system\nBe brief."
    '<|tool>declaration:get_weather{description:<|"|>Current weather in a city.<|"|>,'
    'parameters:{properties:{city:{description:<|"|>City name<|"|>,type:<|"|>STRING<|"|>},'
    'unit:{enum:[<|"|>celsius<|"|>,<|"|>fahrenheit<|"|>],type:<|"|>STRING<|"|>}},'
    'required:[<|"|>city<|"|>],type:<|"|>OBJECT<|"|>}}<tool|><turn|>\n'
    "<|turn>user\nWeather in Paris?<turn|>\n"
    '<|turn>model\n<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>'
    '<|tool_response>response:get_weather{value:<|"|>{"temp": 21}<|"|>}<tool_response|>'
    "21 °C.<turn|>\n"
    "<|turn>model\n<|channel>thought\n<channel|>"
)


def test_a_tool_round() -> None:
    """The call's results, and the answer after them, stay in the call's model turn."""
    assert render_gemma4(ROUND, template=CANONICAL, tools=[WEATHER]) == ROUND_TEXT
    assert oracle(CANONICAL, ROUND, gen=True, thinking=False, tools=[WEATHER]) == ROUND_TEXT


def test_the_prompts_inside_a_tool_round() -> None:
    """After a result the model answers in the same turn; after a call without results it
    writes them: no generation prompt either way."""
    answer = render_gemma4(ROUND[:4], template=CANONICAL, tools=[WEATHER])
    assert answer == ROUND_TEXT.split("21 °C.")[0]
    results = render_gemma4(ROUND[:3], template=CANONICAL, tools=[WEATHER])
    assert results == ROUND_TEXT.split("<|tool_response>response")[0] + "<|tool_response>"
    for messages in (ROUND[:3], ROUND[:4]):
        assert render_gemma4(messages, template=CANONICAL, tools=[WEATHER]) == oracle(
            CANONICAL, messages, gen=True, thinking=False, tools=[WEATHER]
        )


def test_the_oracle_catches_a_changed_quote(monkeypatch: pytest.MonkeyPatch) -> None:
    """A variant that must fail: with the string quote written as JSON's, the comparison differs."""
    monkeypatch.setattr(gemma4_tools, "QUOTE", '"')
    ours = render_gemma4(ROUND, template=CANONICAL, tools=[WEATHER])
    assert ours != oracle(CANONICAL, ROUND, gen=True, thinking=False, tools=[WEATHER])
    assert 'city:"Paris"' in ours


def test_the_property_catches_a_case_sensitive_key_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """A variant that must fail: hypothesis finds tools on which a renderer sorting keys
    case-sensitively (Python's default) differs from jinja's dictsort."""

    def case_sensitive(mapping: Any) -> list[tuple[str, Any]]:
        return sorted(mapping.items())

    monkeypatch.setattr(gemma4_tools, "dictsort", case_sensitive)
    user = [{"role": "user", "content": "Hi"}]

    def differs(tools: list[dict[str, Any]]) -> bool:
        ours = render_gemma4(user, template=CANONICAL, tools=tools)
        return ours != oracle(CANONICAL, user, gen=True, thinking=False, tools=tools)

    found = find(
        st.lists(TOOL, min_size=1, max_size=3),
        differs,
        settings=settings(max_examples=2000, derandomize=True, phases=[Phase.generate]),
    )
    assert differs(found)


def test_arguments_given_as_text_are_written_as_they_are() -> None:
    call = {**CALL, "function": {"name": "f", "arguments": '{"a": "x\\ny", "b": [1, true]}'}}
    messages = [{"role": "user", "content": "Go"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    text = render_gemma4(messages, template=CANONICAL)
    assert text.endswith(
        '<|turn>model\n<|tool_call>call:f{{"a": "x\\ny", "b": [1, true]}}<tool_call|><|tool_response>'
    )
    assert text == oracle(CANONICAL, messages, gen=True, thinking=False)


def test_object_arguments_and_results_use_gemma_syntax() -> None:
    arguments = {"b": [1, 2.5, None, True], "A": {"q": 'say "hi"\n', "é": False}}
    call = {**CALL, "function": {"name": "f", "arguments": arguments}}
    messages = [
        {"role": "assistant", "content": "", "tool_calls": [call], "reasoning": "look it up"},
        {
            "role": "tool",
            "tool_call_id": "c1",
            "content": [{"type": "text", "text": "o"}, {"type": "text", "text": "k"}],
        },
    ]
    text = render_gemma4(messages, template=CANONICAL, add_generation_prompt=False)
    assert text == (
        "<|turn>model\n<|channel>thought\nlook it up\n<channel|>"
        '<|tool_call>call:f{A:{q:<|"|>say "hi"\n<|"|>,é:false},b:[1,2.5,None,true]}<tool_call|>'
        '<|tool_response>response:f{value:<|"|>ok<|"|>}<tool_response|>'
    )
    assert text == oracle(CANONICAL, messages, gen=False, thinking=False)


def test_gemma_tool_responses_field() -> None:
    messages = [
        {"role": "user", "content": "Go"},
        {
            "role": "assistant",
            "content": "",
            "tool_responses": [{"name": "f", "response": {"n": 1}}, {"response": "x"}],
        },
    ]
    text = render_gemma4(messages, template=CANONICAL)
    assert text.endswith(
        '<|tool_response>response:f{n:1}<tool_response|><|tool_response>response:unknown{value:<|"|>x<|"|>}<tool_response|>'
    )
    assert text == oracle(CANONICAL, messages, gen=True, thinking=False)


def test_a_result_without_a_name_for_it_fails_as_in_the_template() -> None:
    first = {**CALL, "id": "c0"}
    messages = [
        {"role": "assistant", "content": "", "tool_calls": [first]},
        {"role": "user", "content": "and?"},
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "c0", "content": "late"},
    ]
    with pytest.raises(TemplateError):
        oracle(CANONICAL, messages, gen=True, thinking=False)
    with pytest.raises(TemplateError, match="no name"):
        render_gemma4(messages, template=CANONICAL)


def test_older_templates_refuse_tools() -> None:
    with pytest.raises(TemplateError, match="use_jinja"):
        render_gemma4([{"role": "user", "content": "Hi"}], template=INTERLEAVED, tools=[WEATHER])
    with pytest.raises(TemplateError, match="use_jinja"):
        render_gemma4(ROUND, template=INTERLEAVED)
    assert render_gemma4([{"role": "user", "content": "Hi"}], template=INTERLEAVED, tools=[]).startswith(
        "<|turn>user\n"
    )


@pytest.mark.parametrize(
    "content",
    [[{"type": "image"}], [{"type": "text", "text": "a"}, FakeImage()], [{"type": "audio"}]],
)
def test_tool_results_are_text_only(content: list[object]) -> None:
    messages = [
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "c1", "content": content},
    ]
    with pytest.raises(TemplateError):
        render_gemma4(messages, template=CANONICAL)
