"""render_gemma4 equals Google's Jinja template, rendered by jinja2, on generated chats.

The reference templates are llama.cpp's, copied under tests/data/templates. The E2B/E4B
("small") template differs from the 31B one only in not closing an empty thought channel
after the generation prompt when thinking is off, so SMALL is derived from the 31B template
by deleting that emission.
"""

from __future__ import annotations

from typing import Any

import pytest
from gemma4_helpers import (
    CANONICAL,
    CONTENT,
    INTERLEAVED,
    SMALL,
    TEXT,
    VARIANTS,
    FakeImage,
    oracle,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from llmsession.errors import TemplateError
from llmsession.text.gemma4 import (
    is_gemma4_template,
    merges_model_turns,
    primes_empty_thought,
    render_gemma4,
    strip_thinking,
)
from llmsession.text.jinja import render_jinja

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
