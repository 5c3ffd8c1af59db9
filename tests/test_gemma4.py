"""render_gemma4 equals Google's Jinja template, rendered by jinja2, on generated chats.

The reference templates are llama.cpp's, copied under tests/data/templates. The E2B/E4B
("small") template differs from the 31B one only in not closing an empty thought channel
after the generation prompt when thinking is off, so SMALL is derived from the 31B template
by deleting that emission.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import find, given, settings
from hypothesis import strategies as st

from llmsession.errors import TemplateError
from llmsession.text import gemma4_tools
from llmsession.text.gemma4 import (
    is_gemma4_template,
    merges_model_turns,
    primes_empty_thought,
    render_gemma4,
    strip_thinking,
)
from llmsession.text.jinja import render_jinja

TEMPLATES = Path(__file__).parent / "data" / "templates"
CANONICAL = (TEMPLATES / "google-gemma-4-31B-it.jinja").read_text(encoding="utf-8")
INTERLEAVED = (TEMPLATES / "google-gemma-4-31B-it-interleaved.jinja").read_text(encoding="utf-8")
EMPTY_THOUGHT_EMISSION = "{{- '<|channel>thought\\n<channel|>' -}}"
assert CANONICAL.count(EMPTY_THOUGHT_EMISSION) == 1
SMALL = CANONICAL.replace(EMPTY_THOUGHT_EMISSION, "")
VARIANTS = {"31B": CANONICAL, "interleaved": INTERLEAVED, "small": SMALL}


class FakeImage:
    """Stands in for llmsession.Image: any part that is neither str nor dict is an image."""


def oracle(
    template: str,
    messages: list[dict[str, Any]],
    *,
    gen: bool,
    thinking: bool,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """The Jinja rendering without its leading BOS."""
    text = render_jinja(
        template,
        messages,
        add_generation_prompt=gen,
        bos_token="<bos>",
        enable_thinking=thinking,
        tools=tools,
    )
    assert text.startswith("<bos>")
    return text.removeprefix("<bos>")


# Text built from pieces that matter to the template: thinking delimiters, Gemma tokens,
# whitespace it trims (including Unicode spaces), NUL and other non-ASCII.
TOKENS = ["<|channel>", "<channel|>", "thought\n", "<|turn>", "<turn|>", "<|image|>", "{{ x }}"]
OTHERS = [" ", "\n", "\t", "\u3000", "\xa0", "\x00", "é", "😀", "\u0301", "hi", "Hello"]
PIECES = st.sampled_from(TOKENS + OTHERS)
TEXT = st.lists(st.one_of(PIECES, st.text(max_size=4)), max_size=6).map("".join)
THOUGHT = TEXT.map(lambda t: f"<|channel>thought\n{t}<channel|>")
MODEL_TEXT = st.lists(st.one_of(TEXT, THOUGHT), max_size=3).map("".join)
PART = st.one_of(
    TEXT.map(lambda t: {"type": "text", "text": t}),
    MODEL_TEXT.map(lambda t: {"type": "text", "text": t}),
    st.just({"type": "image"}),
)
CONTENT = st.one_of(MODEL_TEXT, st.lists(PART, max_size=4))
ROLES = st.sampled_from(["user", "assistant", "model", "system", "developer"])


@st.composite
def chats(draw: st.DrawFn) -> list[dict[str, Any]]:
    """A leading system/developer message or none, then turns in any order (the template
    accepts any), at least one message in all."""
    messages: list[dict[str, Any]] = []
    if draw(st.booleans()):
        role = draw(st.sampled_from(["system", "developer"]))
        messages.append({"role": role, "content": draw(TEXT)})
    body = st.fixed_dictionaries({"role": ROLES, "content": CONTENT})
    messages += draw(st.lists(body, min_size=0 if messages else 1, max_size=6))
    first = messages[0]
    if first["role"] in ("system", "developer") and not isinstance(first["content"], str):
        first["content"] = draw(TEXT)  # list content here is a documented difference
    return messages


@settings(max_examples=200, deadline=None)
@given(
    variant=st.sampled_from(sorted(VARIANTS)),
    messages=chats(),
    gen=st.booleans(),
    thinking=st.booleans(),
)
def test_matches_the_jinja_template(
    variant: str, messages: list[dict[str, Any]], gen: bool, thinking: bool
) -> None:
    template = VARIANTS[variant]
    ours = render_gemma4(messages, template=template, add_generation_prompt=gen, thinking=thinking)
    assert ours == oracle(template, messages, gen=gen, thinking=thinking)


def test_a_plain_chat() -> None:
    messages = [
        {"role": "system", "content": " Be brief. "},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "<|channel>thought\nplan<channel|>Hello!"},
        {"role": "user", "content": "Bye"},
    ]
    assert render_gemma4(messages, template=CANONICAL) == (
        "<|turn>system\nBe brief.<turn|>\n"
        "<|turn>user\nHi<turn|>\n"
        "<|turn>model\nHello!<turn|>\n"
        "<|turn>user\nBye<turn|>\n"
        "<|turn>model\n<|channel>thought\n<channel|>"
    )


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_generation_prompt_opens_a_model_turn(variant: str) -> None:
    template = VARIANTS[variant]
    user = [{"role": "user", "content": "Hi"}]
    thinking = render_gemma4(user, template=template, thinking=True)
    assert thinking == "<|turn>system\n<|think|>\n<turn|>\n<|turn>user\nHi<turn|>\n<|turn>model\n"
    plain = render_gemma4(user, template=template)
    empty_thought = "" if variant == "small" else "<|channel>thought\n<channel|>"
    assert plain == "<|turn>user\nHi<turn|>\n<|turn>model\n" + empty_thought
    closed = render_gemma4(user, template=template, add_generation_prompt=False)
    assert closed == "<|turn>user\nHi<turn|>\n"


def test_variant_detection() -> None:
    assert primes_empty_thought(CANONICAL) and primes_empty_thought(INTERLEAVED)
    assert not primes_empty_thought(SMALL)
    assert merges_model_turns(CANONICAL) and not merges_model_turns(INTERLEAVED)


def test_consecutive_assistant_messages_follow_the_template() -> None:
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "A"},
        {"role": "assistant", "content": "B"},
    ]
    merged = render_gemma4(messages, template=CANONICAL, add_generation_prompt=False)
    assert merged == "<|turn>user\nHi<turn|>\n<|turn>model\nA<turn|>\nB<turn|>\n"
    separate = render_gemma4(messages, template=INTERLEAVED, add_generation_prompt=False)
    assert separate == "<|turn>user\nHi<turn|>\n<|turn>model\nA<turn|>\n<|turn>model\nB<turn|>\n"


def test_assistant_is_written_model() -> None:
    text = render_gemma4([{"role": "assistant", "content": "x"}], template=CANONICAL)
    assert text.startswith("<|turn>model\nx<turn|>\n")
    assert "assistant" not in text


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("a<|channel>thought\nx<channel|>b", "ab"),
        (" <|channel>x<channel|> a <|channel>y<channel|> ", "a"),
        ("a<|channel>unclosed", "a"),
        ("a<channel|>b", "ab"),
        ("no thinking", "no thinking"),
    ],
)
def test_strip_thinking(text: str, expected: str) -> None:
    assert strip_thinking(text) == expected


def test_images_become_the_media_marker() -> None:
    parts: list[object] = [" Look: ", {"type": "image"}, {"type": "image_url"}, FakeImage()]
    messages = [{"role": "user", "content": parts}]
    text = render_gemma4(messages, template=CANONICAL, media_marker="<__media__>")
    assert text.startswith("<|turn>user\nLook:<__media__><__media__><__media__><turn|>\n")
    default = render_gemma4([{"role": "user", "content": [{"type": "image"}]}], template=CANONICAL)
    assert default.startswith("<|turn>user\n<|image|><turn|>\n")


def test_nul_survives() -> None:
    text = render_gemma4([{"role": "user", "content": "a\x00b"}], template=CANONICAL)
    assert "a\x00b" in text


def test_system_parts_are_flattened() -> None:
    """Documented difference: the template writes the repr of a list system content."""
    messages = [{"role": "system", "content": [{"type": "text", "text": " Be brief. "}]}]
    text = render_gemma4(messages, template=CANONICAL, add_generation_prompt=False)
    assert text == "<|turn>system\nBe brief.<turn|>\n"


@pytest.mark.parametrize(
    "messages",
    [
        [],
        [{"role": "tool", "content": "42"}],
        [{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f"}}]}],
        [{"role": "assistant", "content": "", "tool_responses": [{"name": "f"}]}],
        [{"role": "assistant", "content": "", "tool_responses": {"name": "f", "response": 1}}],
        [{"role": "user", "content": [{"type": "audio"}]}],
        [{"role": "user", "content": [{"text": "no type"}]}],
        [{"role": "user", "content": None}],
        [{"role": 1, "content": "x"}],
    ],
)
def test_refuses_what_it_does_not_support(messages: list[dict[str, Any]]) -> None:
    with pytest.raises(TemplateError):
        render_gemma4(messages, template=CANONICAL)


def test_empty_chat_fails_in_jinja_too() -> None:
    with pytest.raises(TemplateError):
        render_jinja(CANONICAL, [])


def test_template_detection() -> None:
    assert is_gemma4_template(CANONICAL) and is_gemma4_template(SMALL)
    assert not is_gemma4_template(None)
    assert not is_gemma4_template("{{ '<start_of_turn>user' }}")
    with pytest.raises(TemplateError, match="Gemma 4"):
        render_gemma4([{"role": "user", "content": "x"}], template="<start_of_turn>")


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

    found = find(st.lists(TOOL, min_size=1, max_size=3), differs, settings=settings(max_examples=2000))
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
