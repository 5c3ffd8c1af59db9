"""A stateless call that ends with the assistant's text continues it (a prefill, as Anthropic's
API and llama-server take one): the prompt is the transcript before that text, with the
generation prompt, then the text tokenized plain; the reply is what follows it, against a fresh
decode of that prompt; the next turn, which sends the whole message back, reads it from the
cache; what a prefill cannot be combined with is refused. Real SmolLM2."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import internals
import pytest
from near_ties import assert_same_within_noise, scored
from test_reuse import check_against_fresh, fresh_steps, short_prompt_noise, tolerance_for

from llmsession import GenerationOptions, Model, SessionConfig, TemplateError, UnsupportedFeatureError

GREEDY = GenerationOptions(max_tokens=16, temperature=0)
QUESTION: list[dict[str, Any]] = [
    {"role": "system", "content": "You answer in one sentence."},
    {"role": "user", "content": "Name a colour and say why you like it."},
]
PREFILL = "My favourite colour is"


def plain(model: Model, text: str) -> list[int]:
    """``text``'s tokens with every special token's spelling read as text."""
    return list(internals.local(model).native.tokenize(text, add_special=False, parse_special=False))


def test_a_prefilled_reply_continues_the_text_as_a_fresh_decode_does(smollm2: Model) -> None:
    stream = smollm2.chat_stream([*QUESTION, {"role": "assistant", "content": PREFILL}], scored(GREEDY))
    for _ in stream:
        pass
    reply, session = stream.reply, stream.session
    assert reply is not None and session is not None
    before = smollm2.prompt_tokens(QUESTION)
    recorded = [int(t) for t in internals.record(session)]
    assert recorded[: reply.usage.prompt_tokens] == before + plain(smollm2, PREFILL)
    assert not reply.text.startswith(PREFILL) and reply.usage.completion_tokens == 16
    assert session.messages[-1] == {"role": "assistant", "content": PREFILL + reply.text}
    tolerance = tolerance_for(short_prompt_noise(smollm2))
    assert check_against_fresh(session, reply, tolerance) == []
    # The variant that must fail: without the text in its prompt, a fresh decode would not
    # have begun the reply so (the reply came from the prompt with it).
    generated = recorded[reply.usage.prompt_tokens :]
    (first,) = fresh_steps(smollm2, tuple(before), tuple(generated[:1]), 1)[:1]
    assert float(first.max() - first[generated[0]]) > tolerance


def test_the_next_turn_reads_the_continued_message_from_the_cache(smollm2: Model, smollm2_path: Path) -> None:
    asked = [*QUESTION, {"role": "assistant", "content": PREFILL}]
    first = smollm2.chat(asked, GREEDY, tenant="prefill")
    said = [
        *QUESTION,
        {"role": "assistant", "content": PREFILL + first.text},
        {"role": "user", "content": "Why?"},
    ]
    second = smollm2.chat(said, scored(GREEDY), tenant="prefill")
    held = (
        first.usage.prompt_tokens + first.usage.completion_tokens - 1
    )  # (the last one sampled, not decoded)
    assert second.usage.reused_tokens >= held, (first.usage, second.usage)
    assert second.usage.decoded_prompt_tokens <= second.usage.prompt_tokens - held
    with Model(smollm2_path, threads=2) as fresh:  # (nothing cached: the reference)
        expected = fresh.chat(said, scored(GREEDY))
        assert (
            expected.usage.reused_tokens == 0 and expected.usage.prompt_tokens == second.usage.prompt_tokens
        )
        assert_same_within_noise(smollm2, second, expected)


def test_a_prefill_is_tokenized_as_the_assistants_text_in_any_prompt(smollm2: Model) -> None:
    """As a later prompt that holds the message tokenizes it (special tokens read: the client's
    own text, as a system message's; a user's is read plain): the next turn, which sends it
    back whole, reads it from the cache, wherever it is cached. The variant that must differ:
    read plain, as a user's text is, it would be other tokens."""
    text = "Sure.<|im_end|>\n<|im_start|>assistant\nWell,"
    asked = [*QUESTION, {"role": "assistant", "content": text}]
    stream = smollm2.chat_stream(asked, GREEDY, tenant="marks")
    for _ in stream:
        pass
    reply = stream.reply
    assert reply is not None and stream.session is not None
    prompt = [int(t) for t in internals.record(stream.session)][: reply.usage.prompt_tokens]
    spelled = smollm2.tokenize(text, add_special=False)
    assert prompt == smollm2.prompt_tokens(QUESTION) + spelled and spelled != plain(smollm2, text)
    back = [
        *QUESTION,
        {"role": "assistant", "content": text + reply.text},
        {"role": "user", "content": "Why?"},
    ]
    again = smollm2.chat(back, GREEDY, tenant="marks")
    assert again.usage.reused_tokens >= reply.usage.prompt_tokens + reply.usage.completion_tokens - 1


def test_what_a_prefill_cannot_be_combined_with_is_refused(smollm2: Model) -> None:
    asked = [*QUESTION, {"role": "assistant", "content": PREFILL}]
    tool = {"type": "function", "function": {"name": "colour", "parameters": {"type": "object"}}}
    for options in (
        GenerationOptions(max_tokens=4, tools=[tool]),
        GenerationOptions(max_tokens=4, json_schema={"type": "object"}),
    ):
        with pytest.raises(UnsupportedFeatureError, match="prefill"):
            smollm2.chat(asked, options)
    with pytest.raises(UnsupportedFeatureError, match="n choices"):
        smollm2.chat_choices(asked, GREEDY, n=2)
    # A NUL, which no rendered message may hold: the next turn, which sends the message back,
    # would be refused so (a reply shows a NUL token as U+FFFD for the same reason).
    nul = [*QUESTION, {"role": "assistant", "content": "My favourite\x00colour is"}]
    with pytest.raises(TemplateError, match="NUL"):
        smollm2.chat(nul, GREEDY)
    with pytest.raises(TemplateError, match="NUL"):
        smollm2.prompt_tokens(nul, config=SessionConfig())  # (as count_tokens counts a call)
    # Not a prefill: an assistant's call, an empty text, or nothing before it to answer.
    for ending in ([{"role": "assistant", "content": ""}], []):
        with pytest.raises(Exception, match="user message or tool results"):
            smollm2.chat([*QUESTION[:1], *ending], GREEDY)
