"""A thinking template's reasoning, split from the reply's content as it streams, on SmolLM2's
weights with real templates: Qwen3's (the reply opens its own ``<think>`` block: a regex makes
the tiny model write one) and DeepSeek-R1's (the generation prompt opens it); a budget forces
the closing marker; the chat, Responses and Messages APIs carry it; and the splitter alone on
every split of its input."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from contextlib import closing
from dataclasses import replace
from pathlib import Path
from typing import Any

import anthropic
import internals
import pytest
from hypothesis import given
from hypothesis import strategies as st
from scripted import scripted
from serve_helpers import KEY, Served, running

from llmsession import GenerationOptions, Model, ReplyMismatchError
from llmsession.native.sampler import Sampler
from llmsession.serve.app import create_app
from llmsession.text.reasoning import GEMMA4, HARMONY, THINK, Markers, Splitter, markers_for, opened
from llmsession.text.tools import options_tools

TEMPLATES = Path(__file__).parent / "data" / "templates"
QWEN3 = (TEMPLATES / "Qwen-Qwen3-0.6B.jinja").read_text(encoding="utf-8")
R1 = (TEMPLATES / "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja").read_text(encoding="utf-8")
# What the constraint lets the model write: a block of lowercase words, then a sentence.
PATTERN = r"<think>\n[a-z]+( [a-z]+){2,5}\n</think>\n\n[A-Z][a-z]+( [a-z]+){1,4}\."


@pytest.fixture(scope="module")
def qwen3(smollm2_path: Path) -> Iterator[Model]:
    with Model(smollm2_path, chat_template=QWEN3, threads=2) as model:
        yield model


@pytest.fixture(scope="module")
def r1(smollm2_path: Path) -> Iterator[Model]:
    with Model(smollm2_path, chat_template=R1, threads=2) as model:
        yield model


def split(text: str, cuts: list[int], markers: Markers = THINK, inside: bool = False) -> tuple[str, str, str]:
    splitter = Splitter(markers, inside)
    reasoning = content = ""
    at = 0
    for cut in sorted(cuts):
        thought, said = splitter.push(text[at:cut])
        reasoning, content, at = reasoning + thought, content + said, cut
    for thought, said in (splitter.push(text[at:]), splitter.flush()):
        reasoning, content = reasoning + thought, content + said
    return reasoning, content, splitter.preamble


CASES = [
    ("<think>\nI think.\n</think>\n\nHello!", THINK, False, ("I think.", "Hello!")),
    ("Hello <think>x</think>", THINK, False, ("", "Hello <think>x</think>")),
    ("  <think>a b  </think>  c ", THINK, False, ("a b", "c ")),
    ("\nreason more\n</think>\n\nanswer", THINK, True, ("reason more", "answer")),
    ("unclosed <thi", THINK, True, ("unclosed <thi", "")),
    ("<|channel>thought\nhmm<channel|>Hi", GEMMA4, False, ("hmm", "Hi")),
    ("<b>bold", THINK, False, ("", "<b>bold")),
    ("  ", THINK, False, ("", "  ")),
    (f"{HARMONY.open}hmm, a greeting{HARMONY.forced}Hi!", HARMONY, False, ("hmm, a greeting", "Hi!")),
    ("<|channel|>final<|message|>Hi!", HARMONY, False, ("", "Hi!")),
    (f"{HARMONY.open}cut short", HARMONY, False, ("cut short", "")),
    (  # (a new message's header is no content; a commentary preamble is reasoning, as analysis)
        "<|start|>assistant<|channel|>commentary<|message|>x",
        HARMONY,
        False,
        ("x", ""),
    ),
    (
        "<|channel|>commentary<|message|>I will look.<|end|><|start|>assistant<|channel|>final<|message|>Hi",
        HARMONY,
        False,
        ("I will look.", "Hi"),
    ),
    (
        f"{HARMONY.open}A<|end|><|start|>assistant<|channel|>commentary<|message|>B{HARMONY.forced}Hi",
        HARMONY,
        False,
        ("A\nB", "Hi"),
    ),
    (  # (a call's header in the channel: no preamble, the call's to read)
        "<|channel|>commentary to=functions.f <|constrain|>json<|message|>{}",
        HARMONY,
        False,
        ("", "<|channel|>commentary to=functions.f <|constrain|>json<|message|>{}"),
    ),
    (f"{HARMONY.open}A<|end|><|start|>assistant<|channel|>comment", HARMONY, False, ("A", "")),
    (f"{HARMONY.open}A<|channel|>final<|message|>Hi", HARMONY, False, ("A", "Hi")),  # (a break)
    (f"{HARMONY.open}A<|start|>assistant<|channel|>final<|message|>Hi", HARMONY, False, ("A", "Hi")),
    (f"{HARMONY.open}A {HARMONY.open}B<|end|>", HARMONY, False, ("A\nB", "")),  # (opened again)
    (f"{HARMONY.open}A<|channel|>fin", HARMONY, False, ("A<|channel|>fin", "")),
    ("<think>A<think>B</think>Hi", THINK, False, ("A<think>B", "Hi")),  # (nested only where marked)
    (f"{HARMONY.open}A<|start|>assistant{HARMONY.open}B<|end|>", HARMONY, False, ("A\nB", "")),
    (  # (a new block after a close, its new message's header left out)
        f"{HARMONY.open}A<|end|><|channel|>commentary<|message|>I look.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>Hi",
        HARMONY,
        False,
        ("A\nI look.", "Hi"),
    ),
    (f"{HARMONY.open}A<|end|><|channel|>analysis<|message|>B", HARMONY, False, ("A\nB", "")),
    ("<|chan", HARMONY, False, ("", "<|chan")),
    (  # gpt-oss's analysis messages one after another: all reasoning
        f"{HARMONY.open}A <|end|><|start|>assistant{HARMONY.open} B{HARMONY.forced}Hi",
        HARMONY,
        False,
        ("A\nB", "Hi"),
    ),
    (
        f"{HARMONY.open}A<|end|><|start|>assistant<|channel|>analysi",
        HARMONY,
        False,
        ("A", ""),
    ),  # (markup cut)
    (f"{HARMONY.open}A<|end|><|start|>assistant<|channel|>fin", HARMONY, False, ("A", "")),
    (f"{HARMONY.open}A<|end|><|start|>assistant", HARMONY, False, ("A", "")),
    (
        f"{HARMONY.open} <|end|><|start|>assistant{HARMONY.open}B{HARMONY.forced}Hi",
        HARMONY,
        False,
        ("B", "Hi"),
    ),
    (f"<|start|>assistant{HARMONY.open}X", HARMONY, False, ("X", "")),
    (" \n \t ", THINK, False, ("", " \n \t ")),  # (whitespace alone: content)
    (" \n Hi <think>", THINK, False, ("", " \n Hi <think>")),
    ("\n \n<think> \n A \n \n B \n </think>\n Hi", THINK, False, ("A \n \n B", "Hi")),
    ("\n \n<|chan", GEMMA4, False, ("", "\n \n<|chan")),
]


@given(st.sampled_from(CASES), st.lists(st.integers(0, 90), max_size=12))
def test_every_split_of_a_reply_gives_the_same_reasoning_and_content(
    case: tuple[str, Markers, bool, tuple[str, str]], cuts: list[int]
) -> None:
    text, markers, inside, expected = case
    reasoning, content, preamble = split(text, [min(c, len(text)) for c in cuts], markers, inside)
    assert (reasoning, content) == expected
    assert preamble + content == text  # (the reply as generated, for splicing)


def test_long_whitespace_costs_its_length_not_its_square() -> None:
    """Whitespace before the block and inside it was held by joining every new piece to all
    held before (64,000 spaces a piece at a time: over 2 s); it is set aside as it comes."""
    began = time.monotonic()
    splitter = Splitter(THINK)
    parts = [splitter.push(" ") for _ in range(64_000)] + [splitter.push("<think>A")]
    twin = splitter.copy()
    parts += [splitter.push("\n") for _ in range(64_000)] + [splitter.push("B</think>Hi"), splitter.flush()]
    assert time.monotonic() - began < 1.2  # (about 0.45 s here, on the AVX2 EPYC)
    assert ("".join(r for r, _ in parts), "".join(c for _, c in parts)) == ("A" + "\n" * 64_000 + "B", "Hi")
    assert splitter.preamble == " " * 64_000 + "<think>A" + "\n" * 64_000 + "B</think>"
    assert twin.push(" \n") == ("", "") and twin.flush() == ("", "") and not splitter.holding


def test_markers_are_read_from_the_template() -> None:
    assert markers_for(QWEN3) == THINK and markers_for(R1) == THINK
    assert markers_for("{{ messages }}") is None and markers_for(None) is None
    assert markers_for(None, gemma4=True) == GEMMA4
    assert markers_for((TEMPLATES / "openai-gpt-oss-120b.jinja").read_text(encoding="utf-8")) == HARMONY
    assert opened("<|im_start|>assistant\n<think>\n", THINK)
    assert not opened("<|im_start|>assistant\n<think>\n\n</think>\n\n", THINK)
    assert not opened("<|im_start|>assistant\n", THINK)
    # a message that ends with the marker is not a block the generation prompt opened
    assert not opened("Say <think><|im_end|>\n<|im_start|>assistant\n", THINK)


def test_qwen3_reasoning_splits_as_its_template_marks_it(qwen3: Model) -> None:
    """The reply the constraint held: its block is the reasoning, the rest the content; the
    streamed pieces join up to each; the transcript keeps the reasoning for the template."""
    session = qwen3.session("You are helpful.", thinking=True)
    options = GenerationOptions(regex=PATTERN, max_tokens=80, temperature=0)
    stream = session.stream("Name a city.", options)
    deltas = [(s.reasoning_delta, s.delta) for s in stream]
    reply = stream.reply
    assert reply is not None and reply.finish_reason == "complete", reply
    assert reply.reasoning and reply.text and "<think>" not in reply.text + reply.reasoning
    assert "".join(r for r, _ in deltas) == reply.reasoning
    assert "".join(c for _, c in deltas) == reply.text
    assert reply.text[0].isupper() and reply.text.endswith(".")
    assert len(reply.reasoning.split()) >= 3 and reply.reasoning == reply.reasoning.strip()
    assert 0 < reply.usage.reasoning_tokens < reply.usage.completion_tokens
    assert session.messages[-1]["reasoning_content"] == reply.reasoning
    # the template (thinking on) renders no empty block: without the constraint the reply is content
    plain = qwen3.session("You are helpful.").respond("Hi", GenerationOptions(max_tokens=6, temperature=0))
    assert plain.reasoning == "" and plain.usage.reasoning_tokens == 0


def test_a_budget_closes_the_reasoning_at_its_tokens(r1: Model) -> None:
    """DeepSeek-R1's generation prompt opens the block (with thinking on): the reply begins in
    it, and at N reasoning tokens the closing marker is forced; without a budget the tiny model
    reasons on to its length."""
    closing = len(r1.tokenize("\n</think>\n\n", add_special=False))
    for budget in (0, 8):
        session = r1.session(thinking=True)
        reply = session.respond(
            "Why is the sky blue?", GenerationOptions(reasoning_budget=budget, max_tokens=40, temperature=0)
        )
        assert reply.usage.reasoning_tokens == budget, reply.usage  # (the forced end not counted)
        assert (reply.reasoning == "") == (budget == 0)
        assert reply.text and reply.usage.completion_tokens > budget + closing  # (then content)
    free = r1.session(thinking=True).respond(
        "Why is the sky blue?", GenerationOptions(max_tokens=20, temperature=0)
    )  # (greedy: a sampled reply may close the block, or open one unasked, at random)
    assert free.usage.reasoning_tokens == free.usage.completion_tokens and free.text == ""
    closed = r1.session().respond("Why?", GenerationOptions(max_tokens=6, temperature=0))  # (off: closed)
    assert closed.reasoning == "" and closed.usage.reasoning_tokens == 0


def test_raw_completions_and_replies_without_a_block_are_all_content(r1: Model) -> None:
    """A raw completion continues text as it is, whatever markers it holds; with thinking off the
    template closes the block, and a constraint holds the reply from its first token."""
    raw = r1.complete("<｜User｜>Hi<｜Assistant｜><think>\n", GenerationOptions(max_tokens=6))
    assert raw.reasoning == "" and raw.usage.reasoning_tokens == 0 and raw.text
    options = GenerationOptions(json_schema=CITY, max_tokens=40, temperature=0)
    held = r1.session().respond("Name a city.", options)
    assert held.reasoning == "" and held.text.startswith("{") and isinstance(held.parsed, dict)


CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}},
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def test_a_constraint_begins_where_the_prompted_block_closes(r1: Model) -> None:
    """DeepSeek-R1 thinking: the block its generation prompt opened is reasoning, free of the
    schema or the tools; the constraint holds what follows it, and a budget forces the close."""
    for budget in (0, 8):
        options = GenerationOptions(json_schema=CITY, reasoning_budget=budget, max_tokens=60, temperature=0)
        stream = r1.session(thinking=True).stream("Name a city.", options)
        deltas = [(s.reasoning_delta, s.delta) for s in stream]
        reply = stream.reply
        assert reply is not None and reply.finish_reason == "complete", reply
        assert reply.usage.reasoning_tokens == budget and (reply.reasoning == "") == (budget == 0)
        assert isinstance(reply.parsed, dict)
        assert reply.text == json.dumps(reply.parsed, separators=(",", ":"))
        assert "".join(r for r, _ in deltas) == reply.reasoning
        assert "".join(c for _, c in deltas) == reply.text
    called = r1.session(thinking=True).respond(
        "The weather in Paris?",
        GenerationOptions(
            tools=(WEATHER,),
            tool_choice="required",
            parallel_tool_calls=False,  # (on AVX2 the tiny model calls for four cities otherwise)
            reasoning_budget=4,
            max_tokens=60,
            temperature=0,
        ),
    )
    assert called.usage.reasoning_tokens == 4 and called.reasoning, called
    assert [c.name for c in called.tool_calls] == ["weather"] and called.finish_reason == "tool_calls"
    assert "city" in json.loads(called.tool_calls[0].arguments)
    # with no budget the tiny model reasons to its length: nothing is parsed, nothing leaks out
    unbounded = r1.session(thinking=True).respond(
        "Name a city.", GenerationOptions(json_schema=CITY, max_tokens=20, temperature=0)
    )
    assert unbounded.finish_reason == "length" and unbounded.parsed is None and unbounded.text == ""
    assert unbounded.usage.reasoning_tokens == unbounded.usage.completion_tokens == 20


def test_drafts_never_carry_a_reply_into_its_block_past_a_budget(
    qwen3: Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reply that copies its prompt, opening its own block (Qwen3), drafts from the prompt:
    under a budget, a drafted step stops before the token that opens the block (the budget counts
    each of its tokens and closes it at a sampled one), so the reply is cut where it is without
    drafts. A step's drafts went past the opening: ``red`` was reasoning under a budget of 1;
    and a step whose drafts ended with the opening let one token in under a budget of 0 (what
    ``reasoning_effort: "none"`` asks for)."""
    words = "red green blue yellow pink orange purple white black brown grey gold"
    script = f" <think>\n{words}\n</think>\n\nDone."
    for budget in (0, 1, 2, 3):
        replies = []
        for draft in (None, "prompt_lookup"):
            with scripted(monkeypatch, qwen3, script) as played:
                options = GenerationOptions(
                    reasoning_budget=budget, max_tokens=30, temperature=0, draft=draft
                )
                reply = qwen3.session(thinking=True).respond(f"Repeat after me: {script}", options)
            assert not played.refused and not played.off_script, played
            assert reply.usage.reasoning_tokens == budget, (draft, reply.usage)
            replies.append((reply.reasoning, reply.text))
        assert reply.usage.accepted_drafts > 4, reply.usage  # (drafted: the first steps copy the prompt)
        assert replies[1] == replies[0], budget


def test_a_budget_closes_a_block_the_constraint_holds_where_it_may(qwen3: Model) -> None:
    """Qwen3 opens its own block, here because the regex makes it: the closing marker the budget
    forces must pass the regex, so it comes at the first token the regex allows it (three
    words), never inside a word; the rest is still the regex's."""
    replies = {}
    for budget in (None, 0, 5):
        options = GenerationOptions(regex=PATTERN, reasoning_budget=budget, max_tokens=80, temperature=0)
        reply = qwen3.session("You are helpful.", thinking=True).respond("Name a city.", options)
        assert reply.finish_reason == "complete", reply
        assert re.fullmatch(PATTERN, f"<think>\n{reply.reasoning}\n</think>\n\n{reply.text}"), reply
        replies[budget] = reply
    free, at_once, five = replies[None], replies[0], replies[5]
    assert len(at_once.reasoning.split()) == 3 < len(free.reasoning.split())  # (the regex's least)
    assert free.reasoning.startswith(at_once.reasoning)  # (greedy: the same words, cut)
    assert at_once.usage.reasoning_tokens < five.usage.reasoning_tokens < free.usage.reasoning_tokens


@pytest.fixture(scope="module")
def served(r1: Model) -> Iterator[Served]:
    with running(create_app(r1, api_key=KEY)) as url:
        yield Served(r1, url, "r1", None)


def test_the_apis_carry_the_reasoning(served: Served) -> None:
    """Chat (``reasoning_content`` and its deltas), Responses (a ``reasoning`` item) and
    Messages (a ``thinking`` block): each asks for thinking its way and sets a budget."""
    client = served.client()
    said = [{"role": "user", "content": "Why is the sky blue?"}]
    chat = client.chat.completions.create(
        model="m", messages=said, max_tokens=30, reasoning_effort="low", extra_body={"seed": 1}
    )
    message = chat.choices[0].message
    reasoning = message.reasoning_content
    assert reasoning and chat.usage is not None
    stream = client.chat.completions.create(
        model="m", messages=said, max_tokens=30, reasoning_effort="low", stream=True, seed=1
    )
    pieces = [c.choices[0].delta for c in stream if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in pieces) == reasoning
    off = client.chat.completions.create(  # (greedy: sampled, the model may open a block unasked)
        model="m", messages=said, max_tokens=8, reasoning_effort="none", temperature=0
    )
    assert getattr(off.choices[0].message, "reasoning_content", None) is None  # (closed by the template)
    thinking_on = client.chat.completions.create(
        model="m",
        messages=said,
        max_tokens=30,
        extra_body={"chat_template_kwargs": {"enable_thinking": True}, "seed": 1},
    )
    assert getattr(thinking_on.choices[0].message, "reasoning_content", None)

    made = client.responses.create(
        model="m",
        input="Why is the sky blue?",
        max_output_tokens=30,
        reasoning={"effort": "low"},
        temperature=0,
    )
    kinds = [item.type for item in made.output]
    assert kinds[0] == "reasoning" and made.usage is not None
    assert made.usage.output_tokens_details.reasoning_tokens > 0
    with client.responses.stream(
        model="m",
        input="Why is the sky blue?",
        max_output_tokens=40,
        reasoning={"effort": "minimal"},
        temperature=0,
    ) as events:
        seen = list(events)
    names = [e.type for e in seen]
    assert "response.reasoning_text.delta" in names and "response.reasoning_text.done" in names
    # (a reasoning item's text is its content's part, added and done as a message's is)
    parts = [(e.type, e.part.type) for e in seen if e.type.startswith("response.content_part.")]
    assert parts[:2] == [
        ("response.content_part.added", "reasoning_text"),
        ("response.content_part.done", "reasoning_text"),
    ]

    claude = anthropic.Anthropic(base_url=served.url.removesuffix("/v1"), api_key=KEY, max_retries=0)
    thought = claude.messages.create(
        model="m",
        max_tokens=60,
        messages=said,
        thinking={"type": "enabled", "budget_tokens": 8},
        extra_body={"temperature": 0},
    )
    assert [b.type for b in thought.content][:2] == ["thinking", "text"]
    with claude.messages.stream(
        model="m",
        max_tokens=60,
        messages=said,
        thinking={"type": "enabled", "budget_tokens": 8},
        extra_body={"temperature": 0},
    ) as stream2:
        final = stream2.get_final_message()
    assert final.content[0].type == "thinking" and final.content[0].thinking == thought.content[0].thinking
    # sent back, the thinking is the reasoning of that turn (rendered as the template does)
    again = [
        *said,
        {"role": "assistant", "content": [b.model_dump() for b in final.content]},
        {"role": "user", "content": "And at night?"},
    ]
    resent = claude.messages.create(model="m", max_tokens=4, messages=again, thinking={"type": "disabled"})
    assert resent.usage.input_tokens > 0
    # Claude Code always sends tools: its budget holds with them (the calls follow the thinking)
    tool = WEATHER["function"]
    declared = {"name": tool["name"], "description": tool["description"], "input_schema": tool["parameters"]}
    acting = claude.messages.create(
        model="m",
        max_tokens=80,
        messages=[{"role": "user", "content": "The weather in Paris?"}],
        tools=[declared],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},  # (one call, within max_tokens)
        thinking={"type": "enabled", "budget_tokens": 4},
        extra_body={"temperature": 0},
    )
    kinds = [b.type for b in acting.content]
    assert kinds[0] == "thinking" and "tool_use" in kinds and acting.stop_reason == "tool_use", acting
    thought_tokens = served.model.tokenize(acting.content[0].thinking, add_special=False)
    assert 0 < len(thought_tokens) <= 4 + 1  # (its text tokenized again: within a token of the budget)


def test_a_waiting_constraint_lets_no_reply_end_and_then_catches_up(r1: Model) -> None:
    """The sampler under a constraint that has not begun, on a real context's logits: the end of
    generation is masked (the unmasked variant picks it); content written before the
    constraint began is fed to its matcher, and content it does not allow is a GrammarError."""
    session = r1.session()
    session.respond("Hi", GenerationOptions(max_tokens=1, temperature=0))
    internals.settle_others(internals.settled(session))
    context = internals.live_context(session)
    core = internals.local(r1)
    assert context is not None
    greedy = GenerationOptions(temperature=0)
    optional = core.constraint(replace(greedy, regex="(ab)?"))  # (complete at once: it may end)
    assert optional is not None
    logits = context.last_logits(core.native.n_vocab)  # (llama.cpp's buffer: samplers mask it)
    logits[list(optional.ends)] = 1e9  # (the end, by far)
    decoded, picks = logits.copy(), {}
    for waiting in (True, False):
        logits[:] = decoded
        chain = Sampler.from_options(greedy, n_vocab=core.native.n_vocab, last_n=0)
        with closing(optional.sampler(chain, core.native.n_vocab, lambda w=waiting: w)) as sampler:
            picks[waiting] = sampler.sample(context)
    assert core.native.is_eog(picks[False]) and not core.native.is_eog(picks[True])

    exact = core.constraint(replace(greedy, regex='\\{"a": 1\\}'))
    assert exact is not None
    chain = Sampler.from_options(greedy, n_vocab=core.native.n_vocab, last_n=0)
    with closing(exact.sampler(chain, core.native.n_vocab, lambda: False)) as sampler:
        sampler.catch_up(core.native.tokenize('{"', add_special=False, parse_special=False))
        rest = sampler.forced()  # (only one text is left: the matcher forces it)
        assert core.native.detokenize(rest, special=False).startswith('a": 1}')
    refusing = exact.sampler(chain, core.native.n_vocab, lambda: False)
    with closing(refusing) as sampler, pytest.raises(ReplyMismatchError, match="after its reasoning"):
        sampler.catch_up(core.native.tokenize("x", add_special=False, parse_special=False))


def test_a_tool_grammar_lets_a_real_vocabularys_model_reason_before_it_calls(fixture_path: Any) -> None:
    """Qwen3's vocabulary holds ``<think>`` and ``</think>`` as one special token each, which
    free text never spells: without the markers in the tools' grammar (the variant) a reply
    under tools could never open its block. With them it may reason, then write text or call
    ("auto"), or only call ("required"), and a budget's closing marker passes the grammar."""
    with Model(fixture_path("smollm2-qwen3-special.gguf"), threads=2) as model:
        core = internals.local(model)
        markup = core.reasoning
        assert markup is not None and markup.grammar_markers == THINK
        ends = [t for t in range(core.native.n_vocab) if core.native.is_eog(t)][:1]

        def taken(
            choice: str, text: str, thought: Markers | None, closing: bool = False, fmt: str | None = None
        ) -> bool:
            options = GenerationOptions(tools=(WEATHER,), tool_choice=choice, tool_format=fmt)
            ids = [f"call_{k}" for k in range(8)]
            constraint = core.constraint(options, options_tools(options), ids, thought)
            assert constraint is not None
            tokens = [*model.tokenize(text, add_special=False), *(() if closing else ends)]
            if closing:
                tokens += markup.closing
            return bool(constraint.matcher.deep_copy().validate_tokens(tokens) == len(tokens))

        call = '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>'
        for choice in ("auto", "required"):
            assert taken(choice, call, THINK) and taken(choice, call, None)
            assert taken(choice, f"<think>\nrain, maybe\n</think>\n\n{call}", THINK)
            assert not taken(choice, f"<think>\nrain, maybe\n</think>\n\n{call}", None)
            assert taken(choice, "<think>\nrain", THINK, closing=True)  # (a budget's close)
        assert taken("auto", "<think>\nrain\n</think>\n\nIt rains.", THINK)
        assert not taken("required", "<think>\nrain\n</think>\n\nIt rains.", THINK)
        # a thought never spells its closing marker in ordinary tokens: the reader ends the block
        # at its text (the rest was content for it, reasoning for the grammar)
        spelled = model.tokenize("<think>\nrain </", False) + model.tokenize("think>\n\nIt rains.", False)
        assert model.detokenize(spelled) == "<think>\nrain </think>\n\nIt rains."
        auto = GenerationOptions(tools=(WEATHER,))
        checker = core.constraint(auto, options_tools(auto), ["call_0"], THINK)
        assert checker is not None and checker.matcher.deep_copy().validate_tokens(spelled) < len(spelled)
        # an anchored format's calls after the block are the grammar's: its text may not begin
        # with the blank line (the content is split from it without: the calls would be read)
        generic = '{"tool_calls": [{"name": "%s", "arguments": {"city": "Paris"}}]}'
        for name, ok in (("weather", True), ("bogus", False)):
            text = f"<think>\nrain\n</think>\n\n{generic % name}"
            assert taken("auto", text, THINK, fmt="generic") is ok, name
        assert taken("auto", "<think>\nrain\n</think>\n\nIt rains.", THINK, fmt="generic")
        # on the session's path the tiny model opens its block; the budget closes it, then it calls
        cities = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]}
        weather = {"type": "function", "function": {**WEATHER["function"], "parameters": cities}}
        options = GenerationOptions(
            tools=(weather,), tool_choice="required", reasoning_budget=5, max_tokens=60, temperature=0
        )
        session = model.session(thinking=True)
        reply = session.respond("The weather in Paris?", options)
        assert reply.usage.reasoning_tokens == 5 and reply.reasoning, reply
        assert [c.name for c in reply.tool_calls] == ["weather"] and reply.finish_reason == "tool_calls"
        # the result sent back: the template keeps this turn's reasoning, and its tokens are reused
        result = {"role": "tool", "tool_call_id": reply.tool_calls[0].id, "content": '{"temp": 21}'}
        after = session.respond(result, replace(options, tool_choice="auto", max_tokens=4))
        block = model.tokenize(f"<think>\n{reply.reasoning}\n</think>\n\n", add_special=False)
        assert after.usage.reused_tokens >= reply.usage.prompt_tokens + len(block), after.usage
        plain = model.session().respond("The weather in Paris?", options)  # (thinking off: no block)
        assert plain.reasoning == "" and plain.usage.reasoning_tokens == 0 and plain.tool_calls


def test_after_a_prompted_block_the_constraint_holds_what_the_content_is(
    r1: Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Scripted replies after DeepSeek-R1's block, through the real masks: an anchored format's
    call after the blank line is checked by the grammar (a bogus one is never written, and a
    right one is a call); a regex sees the content as the reply keeps it (its leading blank line
    too); content written in the token that closed the block is fed to the matcher first."""
    tools = GenerationOptions(tools=(WEATHER,), tool_format="generic", max_tokens=60, temperature=0)
    bogus = 'I will call it.</think>\n\n{"tool_calls": [{"name": "bogus", "arguments": {}}]}'
    with scripted(monkeypatch, r1, bogus) as played:
        reply = r1.session(thinking=True).respond("The weather in Paris?", tools)  # (no GrammarError)
    assert played.refused or played.off_script, "the mask let a bogus call through"
    assert all(call.name == "weather" for call in reply.tool_calls)
    for blank in ("\x0c", "\xa0"):  # (other whitespace: text, which the content keeps, so not calls)
        with scripted(monkeypatch, r1, bogus.replace("\n\n", blank)) as played:
            reply = r1.session(thinking=True).respond("The weather in Paris?", tools)
        assert not reply.tool_calls and reply.text.startswith(blank), (played, reply)
    right = 'I will call it.</think>\n\n{"tool_calls": [{"name": "weather", "arguments": {"city": "Paris"}}]}'
    with scripted(monkeypatch, r1, right) as played:
        reply = r1.session(thinking=True).respond("The weather in Paris?", tools)
    assert not played.refused and reply.reasoning == "I will call it.", played
    assert [(c.name, json.loads(c.arguments)) for c in reply.tool_calls] == [("weather", {"city": "Paris"})]

    spaced = GenerationOptions(regex="\n\nAnswer: [a-z]+", max_tokens=30, temperature=0)
    with scripted(monkeypatch, r1, "ok</think>\n\nAnswer: paris") as played:
        reply = r1.session(thinking=True).respond("Capital of France?", spaced)
    assert not played.refused and reply.finish_reason == "complete", (played, reply)
    assert reply.reasoning == "ok" and reply.text == "\n\nAnswer: paris"  # (what the regex held)

    quoted = GenerationOptions(regex='"[a-z]+"', max_tokens=30, temperature=0)
    closing = 'Hmm ok.</think>"paris"'
    pieces = [r1.detokenize([t]) for t in r1.tokenize(closing, add_special=False)]
    assert any(p.startswith(">") and len(p) > 1 for p in pieces), pieces  # (the close goes on)
    with scripted(monkeypatch, r1, closing) as played:
        reply = r1.session(thinking=True).respond("Capital of France?", quoted)
    assert not played.refused and (reply.text, reply.finish_reason) == ('"paris"', "complete"), played


def test_gpt_oss_analysis_is_the_reasoning_and_its_final_channel_the_content(
    fixture_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gpt-oss's channels on its real template and vocabulary layout (``<|end|>`` a control
    token that ends no generation, the others printed): scripted replies, through the real
    exchange, give the analysis as the reasoning and the final channel's text, without its
    header, as the content; a budget forces the close and the final header; the reasoning sent
    back is the template's ``thinking``."""
    with Model(fixture_path("smollm2-gpt-oss-special.gguf"), threads=2) as model:
        assert internals.local(model).reasoning is not None
        said = f"{HARMONY.open}The user greets me.{HARMONY.forced}Hello there!"
        for script, reasoning in (
            (said, "The user greets me."),
            ("<|channel|>final<|message|>Hello there!", ""),
        ):
            with scripted(monkeypatch, model, script) as played:
                stream = model.session().stream("Hi", GenerationOptions(max_tokens=40))
                deltas = [(s.reasoning_delta, s.delta) for s in stream]
            reply = stream.reply
            assert reply is not None and not played.refused and not played.script, played
            assert (reply.reasoning, reply.text, reply.finish_reason) == (reasoning, "Hello there!", "stop")
            assert "".join(r for r, _ in deltas) == reasoning and "".join(c for _, c in deltas) == reply.text
        with scripted(monkeypatch, model, f"{HARMONY.open}one two three four five six") as played:
            cut = model.session().respond("Hi", GenerationOptions(max_tokens=24, reasoning_budget=2))
        assert cut.usage.reasoning_tokens == 2 and cut.reasoning and "<|" not in cut.text, cut
        assert cut.text.strip() and cut.text.split()[0] in ("three", "four"), cut.text  # (after the close)
        # the template renders a reply's ``thinking`` only as the last turn of a transcript
        # rendered for training (no generation prompt): the reasoning is passed there
        turns = [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!", "reasoning_content": "A greeting."},
        ]
        rendered = internals.local(model).render(turns, add_generation_prompt=False)
        text = str(rendered)
        assert f"{HARMONY.open}A greeting.<|end|><|start|>assistant{HARMONY.headers[1]}Hello!" in text, text


def test_thinking_off_closes_a_switchless_templates_block_at_once(
    fixture_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gpt-oss's template has no switch: asked not to think (Anthropic's ``thinking`` disabled,
    chat's ``enable_thinking`` false), it reasoned anyway, without a bound, and a client reading
    ``content[0].text`` found a thinking block. Off is a budget of 0: the block closes at once."""
    reply = f"{HARMONY.open}one two three four five six seven"
    with (
        Model(fixture_path("smollm2-gpt-oss-special.gguf"), threads=2) as model,
        running(create_app(model, api_key=KEY)) as url,
    ):
        claude = anthropic.Anthropic(base_url=url.removesuffix("/v1"), api_key=KEY, max_retries=0)
        said: Any = [{"role": "user", "content": "Hi"}]
        with scripted(monkeypatch, model, reply):
            off = claude.messages.create(
                model="m", max_tokens=24, messages=said, thinking={"type": "disabled"}
            )
        shown = [(b.type, getattr(b, "thinking", "")) for b in off.content if b.type != "text"]
        assert off.content[-1].type == "text" and all(not thought for _, thought in shown), off
        # (the forced close takes the place of a scripted token: as a budget's, above)
        assert off.content[-1].text.split()[0] in ("one", "two"), off  # type: ignore[union-attr]
        served = Served(model, url, "m", None)
        with scripted(monkeypatch, model, reply):
            chat = served.client().chat.completions.create(
                model="m",
                messages=said,
                max_tokens=24,
                extra_body={"chat_template_kwargs": {"enable_thinking": False}},
            )
        message: Any = chat.choices[0].message
        assert not getattr(message, "reasoning_content", None) and message.content.split()[0] in (
            "one",
            "two",
        )


def test_a_budget_counts_gemma4s_reasoning_not_its_channels_name(
    fixture_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Gemma 4's block opens with its channel's name (``thought``), then the reasoning: a budget
    of N closes it at N tokens of the block after the name (its newline one of them, as after
    Qwen3's ``<think>``)."""
    said = f"{GEMMA4.open}{GEMMA4.label}\none two three four five{GEMMA4.close}Done."
    with Model(fixture_path("smollm2-gemma4-special.gguf"), threads=2, anticipate=False) as model:
        for budget, reasoning in [(2, "one"), (3, "one two")]:
            with scripted(monkeypatch, model, said):
                options = GenerationOptions(max_tokens=30, temperature=0, reasoning_budget=budget)
                reply = model.session(thinking=True).respond("Hi", options)
            assert (reply.reasoning, reply.usage.reasoning_tokens) == (reasoning, budget), reply


@pytest.mark.parametrize(
    "said, options",
    [
        ("So the answer.</think>. Paris", GenerationOptions(max_tokens=30, regex=" ?[A-Z][a-z]+")),
        ('Ok.</think>, {"a":1}', GenerationOptions(max_tokens=30, json_schema={"type": "object"})),
    ],
)
def test_a_close_whose_token_goes_on_with_refused_text_gives_way_to_the_marker(
    r1: Model, said: str, options: GenerationOptions, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A text marker's last piece may carry more (SmolLM2 splits ``</think>.`` as ``</``,
    ``think``, ``>.``): where the constraint refuses what it carries, the marker alone is decoded
    in its place and the constraint begins at the content's start. Before, the reply ended in a
    GrammarError it could not have avoided."""
    pieces = [r1.detokenize([t]) for t in r1.tokenize(said, add_special=False)]
    assert any(p.startswith(">") and len(p) > 1 for p in pieces), pieces  # (the marker ends in a token)
    session = r1.session(thinking=True)
    with scripted(monkeypatch, r1, said):
        reply = session.respond("Capital of France?", replace(options, temperature=0))
    assert reply.finish_reason == "complete" and reply.reasoning == said.split("</think>")[0], reply
    assert "</think>" in internals.local(r1).native.detokenize(list(internals.record(session)), special=True)
    assert session.respond("Again?", GenerationOptions(max_tokens=2, temperature=0)).text is not None


@pytest.mark.parametrize(
    ("thinking", "script"),
    [
        (False, "\n\nHello 世界 there"),
        (False, "😀 first"),  # (a character's first bytes before the splitter knows where)
        (True, "<think>\nhmm, 世\n</think>\n\n世界 ok"),
        (True, "<think>\nhmm</think>x"),
    ],
)
def test_a_split_replys_logprobs_are_its_content_tokens_each_with_its_own_bytes(
    qwen3: Model, monkeypatch: pytest.MonkeyPatch, thinking: bool, script: str
) -> None:
    """Where a template has reasoning, a token was scored only if its text came out as content
    at once: one the splitter held (whitespace before the reply, which could still be ``<think>``)
    lost its score, and the next entry spelled both texts with its own bytes; a character's first
    bytes, held by the decoder, had no entry either, so the next one's bytes were not UTF-8. Every
    content token has its entry now, its own bytes and its share of the text; reasoning none."""
    with scripted(monkeypatch, qwen3, script) as played:
        options = GenerationOptions(logprobs=1, max_tokens=40, temperature=0)
        reply = qwen3.session(thinking=thinking).respond("Say it.", options)
    assert not played.refused and not played.off_script, played
    entries = reply.logprobs
    expected = script.rsplit("</think>", 1)[-1].lstrip("\n") if thinking else script
    assert entries is not None and reply.text == expected
    assert "".join(e.token for e in entries) == reply.text
    content = reply.text.encode() if thinking else script.encode()  # (thinking: the blank line is markup)
    assert b"".join(e.bytes for e in entries) == content
    if not thinking:
        assert len(entries) == len(qwen3.tokenize(script, add_special=False))


def test_a_reply_cut_inside_its_reasoning_streams_no_scores(
    qwen3: Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tokens held at a cut (``</th``, which may close the block) were reasoning: the end
    gave the last of them an entry of no text, streamed though the reply has no content."""
    script = "<think>\nabc def </think>\n\nok"
    with scripted(monkeypatch, qwen3, script) as played:
        cut = len(qwen3.tokenize("<think>\nabc def </th", add_special=False))
        stream = qwen3.session(thinking=True).stream("Say it.", GenerationOptions(logprobs=1, max_tokens=cut))
        streamed = [entry for snapshot in stream for entry in snapshot.logprobs]
    assert not played.refused and stream.reply is not None and stream.reply.text == "", stream.reply
    assert streamed == [] and stream.reply.logprobs == ()
