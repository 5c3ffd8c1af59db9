"""Gemma 4 prompts end to end: a copy of SmolLM2 carrying Google's Gemma 4 template (and
Gemma's add-BOS setting), which llama.cpp's template engine cannot format, rendered without
jinja (``use_jinja=False``) by our Gemma 4 renderer."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import internals
import pytest

from llmsession import GenerationOptions, Model

GREEDY = GenerationOptions(max_tokens=16, temperature=0)
SYSTEM = "You are terse."


@pytest.fixture(scope="module")
def gemma4_chat(fixture_path: Callable[[str], Path]) -> Iterator[Model]:
    with Model(fixture_path("smollm2-gemma4-template.gguf"), threads=2, use_jinja=False) as model:
        yield model


def test_llama_cpp_really_cannot_format_the_template(gemma4_chat: Model) -> None:
    assert gemma4_chat.template is not None and "<|turn>" in gemma4_chat.template
    assert (
        internals.local(gemma4_chat).native.apply_template(gemma4_chat.template, [("user", "Hi")], True)
        is None
    )


def test_the_session_falls_back_to_the_gemma4_turn_syntax(gemma4_chat: Model) -> None:
    expected = (
        "<|turn>system\nYou are terse.<turn|>\n"
        "<|turn>user\nHello there!<turn|>\n"
        "<|turn>model\n<|channel>thought\n<channel|>"  # the 31B template primes an empty thought
    )
    session = gemma4_chat.session(system=SYSTEM)
    messages = [*session.messages, {"role": "user", "content": "  Hello there!  "}]
    assert gemma4_chat.render(messages) == expected
    bos = internals.local(gemma4_chat).native.bos()
    tokens = gemma4_chat.prompt_tokens(messages)
    assert tokens == [bos, *gemma4_chat.tokenize(expected, add_special=False)]
    assert tokens.count(bos) == 1

    first = session.respond("  Hello there!  ", GREEDY)
    assert first.usage.prompt_tokens == len(tokens)
    assert first.usage.completion_tokens > 0
    second = session.respond("And again?", GREEDY)
    # Turn 2 writes turn 1's reply without the primed empty thought channel (the template strips
    # channels from earlier model turns), so the reuse ends where that channel began.
    opened_model_turn = gemma4_chat.tokenize(expected.removesuffix("<|channel>thought\n<channel|>"))
    assert second.usage.reused_tokens >= len(opened_model_turn)
    assert second.usage.decoded_prompt_tokens == second.usage.prompt_tokens - second.usage.reused_tokens


def test_a_bos_written_by_the_text_is_not_doubled(gemma4_chat: Model) -> None:
    bos_text = internals.local(gemma4_chat).native.token_text(internals.local(gemma4_chat).native.bos())
    tokens = gemma4_chat.tokenize(bos_text + "<|turn>user\nHi<turn|>\n")
    assert tokens.count(internals.local(gemma4_chat).native.bos()) == 1


def test_thinking_opens_the_system_turn_with_the_think_token(gemma4_chat: Model) -> None:
    session = gemma4_chat.session(system=SYSTEM, thinking=True)
    text = gemma4_chat.render([*session.messages, {"role": "user", "content": "Hi"}], thinking=True)
    assert text.startswith("<|turn>system\n<|think|>\nYou are terse.<turn|>\n")
    assert text.endswith("<|turn>model\n")  # no empty thought channel when thinking is on
    assert session.respond("Hi", GREEDY).usage.completion_tokens > 0
