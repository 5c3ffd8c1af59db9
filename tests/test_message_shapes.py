"""Messages in OpenAI's shape, and malformed ones, through every renderer (issue 39, defect 5).

An assistant message that only calls tools comes back from every OpenAI client as
``{"role": "assistant", "content": None, "tool_calls": [...]}``: each renderer (jinja, llama.cpp's
built-in templates, the Gemma 4 renderer) reads it as empty text. A malformed message, whatever
is wrong in it, is a TemplateError (naming the message, when the check finds it), never a
TypeError or an AttributeError from deep inside a renderer."""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import internals
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tool_helpers import WEATHER

from llmsession import GenerationOptions, Model
from llmsession.errors import TemplateError
from llmsession.text.messages import check_messages
from llmsession.text.templates import render_prompt
from llmsession.text.tool_formats import GEMMA4
from llmsession.text.tools import checked_tools

TEMPLATES = Path(__file__).parent / "data" / "templates"
GOOGLE = (TEMPLATES / "google-gemma-4-31B-it.jinja").read_text(encoding="utf-8")
CHATML = (
    "{% for m in messages %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
PARIS = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
CALL = {"id": "call_1", "type": "function", "function": PARIS}
ROUND: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},  # as OpenAI's clients send it
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
]
TOOLS = checked_tools([WEATHER])


def chatml_native(template: str | None, chat: Sequence[tuple[str, str]], gen: bool) -> str:
    """Stands in for llama.cpp's built-in templates (it takes (role, text) pairs)."""
    assert all(isinstance(role, str) and isinstance(text, str) for role, text in chat)
    return "".join(f"<|im_start|>{role}\n{text}<|im_end|>\n" for role, text in chat) + (
        "<|im_start|>assistant\n" if gen else ""
    )


def cannot(template: str | None, chat: Sequence[tuple[str, str]], gen: bool) -> None:
    return None  # llama.cpp does not know Gemma 4's template


RENDERERS: dict[str, dict[str, Any]] = {  # every way a prompt is rendered, with and without tools
    "builtin": {"template": CHATML, "native": chatml_native},
    "builtin, tools": {"template": CHATML, "native": chatml_native, "tools": TOOLS},
    "jinja": {"template": CHATML, "native": cannot, "use_jinja": True},
    "jinja, tools": {"template": CHATML, "native": cannot, "use_jinja": True, "tools": TOOLS},
    "gemma4": {"template": GOOGLE, "native": cannot},
    "gemma4, its tools": {"template": GOOGLE, "native": cannot, "tools": TOOLS, "tool_format": GEMMA4},
    "gemma4 jinja, its tools": {
        "template": GOOGLE,
        "native": cannot,
        "use_jinja": True,
        "tools": TOOLS,
        "tool_format": GEMMA4,
    },
}


def with_content(messages: list[dict[str, Any]], index: int, content: Any) -> list[dict[str, Any]]:
    changed = copy.deepcopy(messages)
    changed[index]["content"] = content
    return changed


@pytest.mark.parametrize("renderer", sorted(RENDERERS))
def test_an_assistant_message_with_calls_and_no_content_reads_as_empty(renderer: str) -> None:
    how = RENDERERS[renderer]
    none = render_prompt(ROUND, **how)
    assert none == render_prompt(with_content(ROUND, 2, ""), **how)
    if how.get("tool_format") is GEMMA4:
        assert "<|tool_call>call:get_weather{" in none
    else:  # (the generic format's calls, written into the assistant's text)
        assert '{"tool_calls": [{"name": "get_weather"' in none


@pytest.mark.parametrize("renderer", sorted(RENDERERS))
@pytest.mark.parametrize(
    ("index", "content"),
    [(2, None), (1, None), (0, None), (3, None)],  # only a message with calls may say nothing
)
def test_content_may_be_none_only_beside_calls(renderer: str, index: int, content: Any) -> None:
    messages = with_content(ROUND, index, content)
    if index == 2:
        render_prompt(messages, **RENDERERS[renderer])
        return
    with pytest.raises(TemplateError, match=f"message {index}"):
        render_prompt(messages, **RENDERERS[renderer])


# -- hostile shapes ------------------------------------------------------------------------------
class Opaque:
    """An object that is no image, no text, nothing a message holds."""


SCALARS = [None, 0, 1.5, True, b"bytes", Opaque(), {1, 2}]
PARTS = [
    *SCALARS,
    [],
    {},
    {"type": "text"},
    {"type": "text", "text": 1},
    {"text": "no type"},
    {"type": 5},
    {"type": ["image"]},
    {"type": "audio"},
    {"type": "text", "text": "fine", "extra": Opaque()},
]
HOSTILE_CALLS = [
    "call",
    {"id": "call_1"},
    [1],
    [None],
    [{}],
    [{"id": "call_1"}],
    [{"id": "call_1", "function": 1}],
    [{"id": "call_1", "function": {}}],
    [{"id": "call_1", "function": {"name": 1}}],
    [{"id": "call_1", "function": {"name": "get_weather", "arguments": 1}}],
    [{"id": "call_1", "function": {"name": "get_weather", "arguments": None}}],
    [{"id": "call_1", "function": {"name": "get_weather", "arguments": {"city": Opaque()}}}],
    [{"id": "call_1", "function": {"name": "get_weather", "arguments": "not json"}}],
    [{"id": "call_1", "function": {"name": "get_weather", "arguments": "[1, 2]"}}],
    [{"id": 1, "function": {"name": "get_weather", "arguments": "{}"}}],
    [{"function": {"name": "get_weather", "arguments": "{}"}}],
]
hostile_value = st.one_of(
    st.sampled_from(SCALARS),
    st.sampled_from(PARTS).map(lambda part: [part]),
    st.sampled_from(PARTS).map(lambda part: ["text", part]),
    st.sampled_from(PARTS),
    st.sampled_from(HOSTILE_CALLS),
    st.text(max_size=3),
)
FIELDS = ["role", "content", "tool_calls", "tool_call_id", "name", "reasoning", "tool_responses"]


@st.composite
def hostile_messages(draw: st.DrawFn) -> tuple[Any, int | None]:
    """The round with one thing wrong in it (or the whole list replaced): the messages and the
    index of the one changed."""
    if draw(st.integers(0, 20)) == 0:
        return draw(st.sampled_from([None, "messages", 5, {"role": "user"}, [None], [[ROUND[1]]]])), None
    messages = copy.deepcopy(ROUND)
    index = draw(st.integers(0, len(messages) - 1))
    field = draw(st.sampled_from(FIELDS))
    if draw(st.booleans()) and field != "role":
        messages[index].pop(field, None)
    else:
        messages[index][field] = draw(hostile_value)
    return messages, index


def outcomes(messages: Any) -> Iterator[tuple[str, BaseException | None]]:
    """Each renderer's outcome for ``messages``: None, or what it raised."""
    for name, how in sorted(RENDERERS.items()):
        for stand_ins in (False, True):
            try:
                text = render_prompt(messages, **how, stand_ins=stand_ins)
            except Exception as error:
                yield name, error
            else:
                assert isinstance(text, str)
                yield name, None


@settings(max_examples=400, deadline=None)
@given(hostile_messages())
def test_a_malformed_message_is_a_template_error_in_every_renderer(hostile: tuple[Any, int | None]) -> None:
    messages, index = hostile
    try:
        check_messages(messages)
    except TemplateError as error:
        if index is not None and isinstance(messages, list) and isinstance(messages[index], dict):
            assert f"message {index}" in str(error) or "answers no earlier call" in str(error), error
    for name, error in outcomes(messages):
        assert error is None or type(error) is TemplateError, (name, repr(error))


@pytest.mark.parametrize("content", [5, {"type": "text", "text": "a"}, [1], [None], [[{"type": "text"}]]])
@pytest.mark.parametrize("role", ["system", "user", "assistant", "tool"])
def test_wrong_content_types_are_refused_naming_the_message(role: str, content: Any) -> None:
    messages = copy.deepcopy(ROUND)
    index = next(i for i, m in enumerate(messages) if m["role"] == role)
    messages[index]["content"] = content
    for name, error in outcomes(messages):
        assert type(error) is TemplateError and f"message {index}" in str(error), (name, error)


@pytest.mark.parametrize("where", ["content", "part", "reasoning_content"])
def test_a_lone_surrogate_is_refused_naming_the_message(where: str) -> None:
    """Text UTF-8 cannot encode could not be tokenized (a UnicodeEncodeError from inside)."""
    messages = copy.deepcopy(ROUND)
    index = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    bad = "fine \ud800 then"
    if where == "part":
        messages[index]["content"] = [{"type": "text", "text": bad}]
    else:
        messages[index][where] = bad
    with pytest.raises(TemplateError, match=f"message {index}.*surrogate"):
        check_messages(messages)
    messages[index][where if where != "part" else "content"] = "fine \u00e9 then"  # (not ASCII: fine)
    check_messages(messages)


@pytest.mark.parametrize(
    "arguments",
    ['{"city": "\\ud800"}', {"city": "\ud800"}, {"\udfff": 1}],  # (escaped: the templates parse it)
)
def test_a_lone_surrogate_in_a_call_or_a_tool_is_refused(arguments: Any) -> None:
    messages = copy.deepcopy(ROUND)
    messages[2]["tool_calls"] = [{**CALL, "function": {"name": "get_weather", "arguments": arguments}}]
    with pytest.raises(TemplateError, match=r"message 2.*surrogate"):
        check_messages(messages)
    paired = '{"city": "\\ud83d\\ude00"}'  # (an escaped pair is one character: fine)
    messages[2]["tool_calls"] = [{**CALL, "function": {"name": "get_weather", "arguments": paired}}]
    check_messages(messages)
    bad_tool = {"type": "function", "function": {"name": "f", "description": "a\ud800"}}
    with pytest.raises(ValueError, match="surrogate"):
        checked_tools([bad_tool])


def test_a_tool_result_is_text_in_the_generic_format() -> None:
    parts = with_content(ROUND, 3, [{"type": "text", "text": '{"temp": 21}'}])
    how = RENDERERS["builtin, tools"]
    assert render_prompt(parts, **how) == render_prompt(ROUND, **how)
    with pytest.raises(TemplateError, match="message 3"):
        render_prompt(with_content(ROUND, 3, ["a", {"type": "image"}]), **how)


# -- the real model, as OpenAI's clients call it ---------------------------------------------------
@pytest.mark.parametrize(
    ("fixture", "use_jinja"),
    [
        (None, False),
        (None, True),
        ("smollm2-gemma4-special.gguf", False),
        ("smollm2-gemma4-special.gguf", True),
        ("smollm2-qwen25-template.gguf", True),
    ],
)
def test_a_chat_sent_back_as_openai_clients_send_it(
    fixture_path: Any, smollm2_path: Path, fixture: str | None, use_jinja: bool
) -> None:
    path = smollm2_path if fixture is None else fixture_path(fixture)
    with Model(path, threads=1, use_jinja=use_jinja, anticipate=False) as model:
        options = GenerationOptions(max_tokens=4, temperature=0, tools=[WEATHER])
        said = model.chat(ROUND, options)
        assert said.finish_reason in ("stop", "length", "tool_calls"), said
        tools = checked_tools([WEATHER])
        assert internals.local(model).render(ROUND, tools=tools) == internals.local(model).render(
            with_content(ROUND, 2, ""), tools=tools
        )
        with pytest.raises(TemplateError, match="message 1"):
            model.chat(with_content(ROUND, 1, None), options)
