"""gpt-oss's tool calls (the harmony format) on its real template and vocabulary layout: both
spellings of a call's header are read, whole and streamed; a grammar lets the reply reason in
the analysis channel, then call in the template's spelling or answer in the final channel; a
budget closes the reasoning where only a call may follow; the result turn decodes only what it
adds. A JSON schema's, a regex's or a grammar's answer follows the reasoning, in the final
channel. The variants that must fail: the other spelling, and an answer without its header, are
refused by the mask."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import internals
import openai
import pytest
from hypothesis import given
from hypothesis import strategies as st
from scripted import scripted
from serve_helpers import KEY, running
from tool_helpers import TIME, WEATHER

from llmsession import GenerationOptions, Model, Reply, Session
from llmsession.replies import ToolCall
from llmsession.serve.app import create_app
from llmsession.text.harmony import Opening, canonical
from llmsession.text.reasoning import HARMONY as CHANNELS
from llmsession.text.reasoning import Splitter
from llmsession.text.tool_formats import HARMONY, CallIds, CallStream, detect, parse
from llmsession.text.tools import checked_tools

TEMPLATE_SPELLING = ' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}'
MODEL_SPELLINGS = [  # what gpt-oss models write, as llama-server's parser takes them (the content
    # reaches the reader without the <|start|>assistant that opens the message)
    '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}',
    ' to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>{"city": "Paris"}',
    ' to=functions.get_weather<|channel|>analysis json<|message|>{"city": "Paris"}',
    '<|channel|>analysis to=functions.get_weather<|message|>{"city": "Paris"}',
]
TOOLS = checked_tools([WEATHER, TIME])
ASK = "What's the weather in Paris?"


def test_the_real_template_is_detected(fixture_path: Any) -> None:
    with Model(fixture_path("smollm2-gpt-oss-special.gguf"), threads=1, use_jinja=True) as model:
        assert detect(model.template) is HARMONY
        assert internals.local(model).tool_format() is HARMONY
    assert detect("<|im_start|>{{ tools }}<tool_call>") is not HARMONY


@pytest.mark.parametrize("reply", [TEMPLATE_SPELLING, *MODEL_SPELLINGS])
def test_every_spelling_reads_as_the_call(reply: str) -> None:
    assert TOOLS is not None
    text, calls = parse(reply, HARMONY, TOOLS, CallIds(HARMONY))
    assert text == "" and [(c.name, c.parsed) for c in calls] == [("get_weather", {"city": "Paris"})]


PLAIN = [  # replies that make no call: each is its text as written, whole and streamed
    "Send it to=functions. as text",
    "<|channel|>commentary<|message|>A preamble.",
    "a <| b",
    "Checking." + MODEL_SPELLINGS[0],  # (quoting the model's spelling: no call, and not rewritten)
]


def test_a_recipient_it_may_not_call_is_refused() -> None:
    assert TOOLS is not None
    with pytest.raises(ValueError, match="not a tool"):
        parse(
            ' to=functions.rm_rf<|channel|>commentary json<|message|>{"path": "/"}',
            HARMONY,
            TOOLS,
            CallIds(HARMONY),
        )


def test_a_call_cut_short_is_no_text() -> None:
    for cut in (" to=functions.get_wea", TEMPLATE_SPELLING[:-5]):
        stream = CallStream(HARMONY, CallIds(HARMONY))
        out, _ = stream.push(cut)
        assert out + stream.flush() == "", cut


def test_after_the_analysis_channel_either_spelling_is_the_call() -> None:
    """The reasoning stage drops the new message's header after the analysis channel; what is
    left is read as a call, in either spelling."""
    assert TOOLS is not None
    for spelling in (TEMPLATE_SPELLING, *MODEL_SPELLINGS):
        splitter = Splitter(CHANNELS)
        reasoning, content = splitter.push(f"{CHANNELS.open}Look it up.<|end|><|start|>assistant{spelling}")
        more_reasoning, more_content = splitter.flush()
        assert reasoning + more_reasoning == "Look it up."
        text, (call,) = parse(content + more_content, HARMONY, TOOLS, CallIds(HARMONY))
        assert text == "" and call.parsed == {"city": "Paris"}


ARGUMENTS = ['{"city": "Paris"}', '{"city": "a <|> b"}', '{"city": "x to=functions.y<|message|>"}']


@given(st.sampled_from([TEMPLATE_SPELLING, *MODEL_SPELLINGS, *PLAIN]), st.sampled_from(ARGUMENTS), st.data())
def test_streamed_replies_equal_the_whole_reply_read_at_once(
    reply: str, arguments: str, data: st.DataObject
) -> None:
    """Streamed in any pieces, a reply's text and its call's arguments are what it reads as
    whole; only the header it opens with is rewritten, never its arguments or text."""
    assert TOOLS is not None
    text = reply.replace('{"city": "Paris"}', arguments)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=10)))
    opening, stream = Opening(), CallStream(HARMONY, CallIds(HARMONY))
    rewritten, said, pieces = "", "", []
    for start, end in zip([0, *cuts], [*cuts, len(text)], strict=True):
        rewritten += opening.push(text[start:end])
        out, got = stream.push(text[start:end])
        said, pieces = said + out, pieces + list(got)
    rewritten += opening.flush()
    said += stream.flush()
    assert rewritten == canonical(text)
    whole_text, calls = parse(text, HARMONY, TOOLS, CallIds(HARMONY))
    assert said == whole_text
    if reply in PLAIN:
        assert (whole_text, calls, pieces) == (text, [], [])
    else:
        (call,) = calls
        assert whole_text == "" and call.name == "get_weather" and call.arguments == arguments
        assert pieces[0].name == "get_weather" and "".join(p.arguments for p in pieces) == arguments


# -- on the model: gpt-oss's template and markers, through the real exchange and its grammar --------
@pytest.fixture(scope="module")
def model(fixture_path: Any) -> Iterator[Model]:
    path: Path = fixture_path("smollm2-gpt-oss-special.gguf")
    with Model(path, threads=2, use_jinja=True, anticipate=False) as loaded:
        yield loaded


def options(choice: str, budget: int | None = None) -> GenerationOptions:
    return GenerationOptions(
        max_tokens=64,
        temperature=0,
        tools=[WEATHER, TIME],
        tool_choice=choice,
        parallel_tool_calls=False,
        reasoning_budget=budget,
    )


@pytest.mark.parametrize("choice", ["required", "auto"])
def test_it_reasons_then_calls_and_the_result_turn_decodes_only_what_it_adds(
    model: Model, choice: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    said = f"{CHANNELS.open}The user wants the weather.<|end|><|start|>assistant{TEMPLATE_SPELLING}"
    session = model.session()
    with scripted(monkeypatch, model, said) as played:
        stream = session.stream(ASK, options(choice))
        snapshots = list(stream)
    reply = stream.reply
    assert reply is not None and not played.refused, played
    assert (reply.reasoning, reply.text, reply.finish_reason) == (
        "The user wants the weather.",
        "",
        "tool_calls",
    )
    (call,) = reply.tool_calls
    assert (call.name, call.parsed) == ("get_weather", {"city": "Paris"})
    assert "".join(s.reasoning_delta for s in snapshots) == reply.reasoning
    assert "".join(p.arguments for s in snapshots for p in s.tool_calls) == call.arguments
    assert not "".join(s.delta for s in snapshots)  # (no header leaks into the text)
    first = session.cached_tokens
    result = {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'}
    after = session.respond(result, GenerationOptions(max_tokens=4, temperature=0, tools=[WEATHER, TIME]))
    assert after.usage.decoded_prompt_tokens <= after.usage.prompt_tokens - first + 1, (after.usage, first)
    rendered = str(internals.local(model).render(session.messages[:-1], tools=TOOLS))  # (up to the result)
    said_again = (
        f"{CHANNELS.open}The user wants the weather.<|end|><|start|>assistant{TEMPLATE_SPELLING}<|call|>"
    )
    assert said_again in rendered


def test_the_same_call_made_twice_is_read_from_the_cache(model: Model) -> None:
    """An agent repeats a call (``ls`` again) and resends the whole transcript: both calls are
    the replies' own tokens in the next prompt, which decodes only what it adds (the calls'
    text is found twice in the prompt: once for each; the template takes no stand-ins for a
    call whose result follows). The grammar forced the call's header in tokens of its own, not
    as the tokenizer would split it: tokenized afresh, the prompt would part from the cache at
    the first call."""
    said: list[dict[str, Any]] = [{"role": "user", "content": ASK}]
    forced = {"type": "function", "function": {"name": "get_weather"}}
    added, before = [], 0
    for _ in range(3):
        options = GenerationOptions(max_tokens=48, temperature=0, tools=[WEATHER, TIME], tool_choice=forced)
        reply = model.chat(said, options, tenant="repeats")
        assert len(reply.tool_calls) == 1, reply
        added.append((reply.usage.decoded_prompt_tokens, reply.usage.prompt_tokens - before))
        before = reply.usage.prompt_tokens + reply.usage.completion_tokens
        (call,) = reply.tool_calls
        said.append({"role": "assistant", "content": "", "tool_calls": [call.message_part()]})
        said.append({"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'})
    assert len({c["tool_calls"][0]["function"]["arguments"] for c in said[1::2]}) == 1, said  # (the same)
    assert all(decoded <= new + 1 for decoded, new in added[1:]), added


def test_a_call_after_reasoning_is_read_from_the_cache_when_resent(
    model: Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reply that reasons, then calls with its arguments in tokens of its own ("Paris" as
    "Par" "is": the grammar lets any split through, and a model's sampling may take one), resent
    as a stateless call (Codex, an agent SDK): the turn decodes only what it adds. The reply was
    remembered only as its whole text, reasoning and all, which a resent turn never says apart
    (its content is what is looked up, the reasoning rendered by the template): the call was
    tokenized afresh and the prompt parted from the cache at "Par"."""
    native = internals.local(model).native
    thought = f"{CHANNELS.open}The user wants the weather.<|end|><|start|>assistant"
    head, tail = TEMPLATE_SPELLING.split("Paris")
    pieces = [thought + head, "Par", "is", tail]
    script = [t for piece in pieces for t in model.tokenize(piece, add_special=False)]
    assert script != model.tokenize("".join(pieces), add_special=False)  # (not as it tokenizes)
    said: list[dict[str, Any]] = [{"role": "user", "content": ASK}]
    with scripted(monkeypatch, model, "") as played:
        played.script[:0] = script  # (before the end of turn)
        first = model.chat(said, options("required"), tenant="reasoned")
    assert not played.refused and not played.off_script, played
    assert first.reasoning == "The user wants the weather." and len(first.tool_calls) == 1, first
    (call,) = first.tool_calls
    assert call.parsed == {"city": "Paris"} and native.n_vocab > max(script)
    turn = {"role": "assistant", "content": "", "reasoning_content": first.reasoning}
    said += [
        {**turn, "tool_calls": [call.message_part()]},
        {"role": "tool", "tool_call_id": call.id, "content": "21"},
    ]
    after = model.chat(
        said, GenerationOptions(max_tokens=4, temperature=0, tools=[WEATHER, TIME]), tenant="reasoned"
    )
    seen = first.usage.prompt_tokens + first.usage.completion_tokens
    assert after.usage.decoded_prompt_tokens <= after.usage.prompt_tokens - seen + 1, (
        first.usage,
        after.usage,
    )


def test_auto_answers_in_the_final_channel(model: Model, monkeypatch: pytest.MonkeyPatch) -> None:
    with scripted(
        monkeypatch, model, f"{CHANNELS.open}No tool.<|end|><|start|>assistant{CHANNELS.headers[1]}Hi!"
    ) as p:
        reply = model.session().respond("Say hi.", options("auto"))
    assert not p.refused and (reply.reasoning, reply.text, reply.tool_calls) == ("No tool.", "Hi!", ()), (
        p,
        reply,
    )


def none(budget: int | None = None) -> GenerationOptions:
    return GenerationOptions(
        max_tokens=24, temperature=0, tools=[WEATHER, TIME], tool_choice="none", reasoning_budget=budget
    )


@pytest.mark.parametrize("thought", ["", f"{CHANNELS.open}Hm.<|end|><|start|>assistant"])
def test_under_tool_choice_none_a_call_is_refused_and_the_reply_answers_as_text(
    model: Model, thought: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``tool_choice`` "none": the reply may reason, then answers in its final channel; a call
    (a message of its own here) is refused by the mask. The variant that must fail: free, the
    call's channel tags reached the text. The next turn renders it back."""
    session = model.session()
    with scripted(monkeypatch, model, f"{thought}{TEMPLATE_SPELLING}<|call|>") as played:
        reply = session.respond(ASK, none())
    assert (played.refused or played.off_script) and not reply.tool_calls, (played, reply)  # (or forced)
    assert "<|" not in reply.text + reply.reasoning and "to=functions" not in reply.text, reply
    assert reply.finish_reason in ("stop", "length"), reply  # (a plain reply's end, not "complete")
    after = session.respond("Thanks.", GenerationOptions(max_tokens=2, temperature=0, tools=[WEATHER, TIME]))
    assert after.usage.reused_tokens >= reply.usage.prompt_tokens, (after.usage, reply.usage)


def test_under_tool_choice_none_a_budget_closes_the_reasoning_before_the_answer(
    model: Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    with scripted(monkeypatch, model, f"{CHANNELS.open}one two three four five six seven") as played:
        reply = model.session().respond(ASK, none(budget=2))
    assert (reply.reasoning, reply.usage.reasoning_tokens) == ("one two", 2), (played, reply)
    assert "<|" not in reply.text and not reply.tool_calls, reply


def test_the_grammar_holds_the_templates_spelling(model: Model, monkeypatch: pytest.MonkeyPatch) -> None:
    """The variant that must fail: the channel-header spelling, read when free, cannot be
    written under the grammar: after ``<|channel|>`` it forces the analysis channel (a budget
    of 2 then closes it, and the reply calls as the template writes it)."""
    with scripted(monkeypatch, model, MODEL_SPELLINGS[0]) as played:
        reply = model.session().respond(ASK, options("required", budget=2))
    forced = model.tokenize("analysis<|message|>", add_special=False)
    assert played.off_script[: len(forced)] == forced, played  # (not "commentary to=...")
    assert reply.finish_reason == "tool_calls" and reply.usage.reasoning_tokens == 2, reply
    assert reply.tool_calls[0].name in ("get_weather", "get_time")


def test_a_budget_closes_the_reasoning_where_only_a_call_may_follow(
    model: Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    with scripted(monkeypatch, model, f"{CHANNELS.open}one two three four five six seven") as played:
        reply = model.session().respond(ASK, options("required", budget=2))
    assert reply.usage.reasoning_tokens == 2 and reply.reasoning, reply
    assert reply.finish_reason == "tool_calls" and len(reply.tool_calls) == 1, (played, reply)
    assert json.loads(reply.tool_calls[0].arguments) == reply.tool_calls[0].parsed


def test_the_reasoning_a_budget_cut_short_does_not_go_on_in_the_answer(
    model: Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A budget forces the final channel's header in place of the model's next token; a model
    that goes on to open another analysis message there ends its reply (the tags in the
    content made the template refuse every later turn)."""
    said = f"{CHANNELS.open}one two<|end|><|start|>assistant{CHANNELS.open}three four five<|end|>"
    session = model.session()
    with scripted(monkeypatch, model, said) as played:
        reply = session.respond(ASK, GenerationOptions(max_tokens=40, reasoning_budget=2))
    assert not played.refused, played
    assert (reply.reasoning, reply.text, reply.finish_reason) == ("one two", "", "stop"), reply
    assert reply.usage.reasoning_tokens == 2, reply.usage
    again = session.respond("Again.", GenerationOptions(max_tokens=2, temperature=0))
    assert again.usage.reused_tokens > reply.usage.prompt_tokens, again.usage


def test_drafts_never_carry_a_later_analysis_past_a_budget(
    model: Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first analysis closes itself at the budget (its end is counted); the second opens in
    a drafted step (its header drafted from the first's): the step stops before the opening,
    so the budget closes the second block at once, as without drafts (with them, ``three``
    went into the reasoning, and the next turn read another prompt)."""
    said = f"{CHANNELS.open}one two<|end|><|start|>assistant{CHANNELS.open}three four five six<|end|>"
    said += f"<|start|>assistant{CHANNELS.headers[1]}Done red green blue."
    seen = []
    for draft in (None, "prompt_lookup"):
        session = internals.without_look_ahead(model.session())
        with scripted(monkeypatch, model, said) as played:
            options = GenerationOptions(reasoning_budget=3, max_tokens=40, temperature=0, draft=draft)
            reply = session.respond("Hi", options)
        assert not played.refused, played
        again = session.respond("Again.", GenerationOptions(max_tokens=2, temperature=0))
        seen.append(
            (reply.reasoning, reply.text, reply.usage.reasoning_tokens, again.usage.decoded_prompt_tokens)
        )
    assert reply.usage.accepted_drafts > 0, reply.usage
    assert seen[1] == seen[0] and seen[0][:3] == ("one two", "four five six", 3), seen


def test_in_auto_a_budget_leaves_the_call_open(model: Model, monkeypatch: pytest.MonkeyPatch) -> None:
    """A budget closes the analysis channel with a new message's header only, so the reply may
    still call (with the final channel's header forced too, it could only answer)."""
    said = f"{CHANNELS.open}one two<|end|>{TEMPLATE_SPELLING}"  # (<|end|>: replaced by the close)
    with scripted(monkeypatch, model, said) as played:
        reply = model.session().respond(ASK, options("auto", budget=2))
    assert not played.off_script and not played.refused, played
    assert (reply.reasoning, reply.usage.reasoning_tokens, reply.finish_reason) == (
        "one two",
        2,
        "tool_calls",
    )


PREAMBLE = "<|channel|>commentary<|message|>"  # (gpt-oss's note before a call, no recipient)


@pytest.mark.parametrize("first", [CHANNELS.open, PREAMBLE])
@pytest.mark.parametrize("second", [CHANNELS.open, PREAMBLE])
def test_analysis_messages_one_after_another_are_the_reasoning_and_the_next_turn_renders(
    model: Model, first: str, second: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gpt-oss may write several analysis messages, or a commentary preamble, before its
    answer: all are the reasoning (in the content, its template refuses the channel tags: the
    next turn could not be rendered)."""
    said = f"{first}First.<|end|><|start|>assistant{second}Second.<|end|>"
    said += f"<|start|>assistant{CHANNELS.headers[1]}Hi!"
    session = model.session()
    with scripted(monkeypatch, model, said) as played:
        reply = session.respond("Say hi.", GenerationOptions(max_tokens=40))
    assert not played.refused and (reply.reasoning, reply.text) == ("First.\nSecond.", "Hi!"), reply
    again = session.respond("Again.", GenerationOptions(max_tokens=2, temperature=0))
    assert again.usage.prompt_tokens > reply.usage.prompt_tokens


MALFORMED = {  # what a model may write that the template would refuse to render back as it is
    "a second final message after the first's end": (
        f"{CHANNELS.open}A<|end|><|start|>assistant{CHANNELS.headers[1]}Hi.<|end|>"
        f"<|start|>assistant{CHANNELS.headers[1]}Hi again.",
        ("A", "Hi."),
    ),
    "the final channel without closing the analysis": (
        f"{CHANNELS.open}A{CHANNELS.headers[1]}Hi.",
        ("A", "Hi."),
    ),
    "a new message's final header without closing it": (
        f"{CHANNELS.open}A<|start|>assistant{CHANNELS.headers[1]}Hi.",
        ("A", "Hi."),
    ),
    "the analysis opened again inside it": (
        f"{CHANNELS.open}A{CHANNELS.open}B<|end|><|start|>assistant{CHANNELS.headers[1]}Hi.",
        ("A\nB", "Hi."),
    ),
    "a new message begun inside the final one": (
        f"{CHANNELS.open}A<|end|><|start|>assistant{CHANNELS.headers[1]}Hi.<|start|>assistant{CHANNELS.open}B",
        ("A", "Hi."),
    ),
    "a channel tag after a final header that closed the analysis": (
        f"{CHANNELS.open}A{CHANNELS.headers[1]}Hi.{CHANNELS.open}B",
        ("A", "Hi."),
    ),
    "a channel tag in content without a header": (f"Hi.{CHANNELS.open}B", ("", "Hi.")),
    "a channel tag inside the final message": (
        f"{CHANNELS.open}A<|end|><|start|>assistant{CHANNELS.headers[1]}Hi.{CHANNELS.open}B",
        ("A", "Hi."),
    ),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_channel_tags_out_of_place_stay_out_of_the_transcript(
    model: Model, case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The final message's end ends the reply (llama.cpp does not count ``<|end|>`` as an end of
    generation: it closes the analysis too), as does any other tag of the markup inside it (a
    new message's header, a channel's); a final header inside the analysis closes it; an
    analysis header inside it is markup. Otherwise the tags reach the content or the reasoning,
    and the template refuses every later turn."""
    said, (reasoning, text) = MALFORMED[case]
    session = model.session()
    with scripted(monkeypatch, model, said) as played:
        reply = session.respond("Say hi.", GenerationOptions(max_tokens=60))
    assert not played.refused and (reply.reasoning, reply.text) == (reasoning, text), reply
    assert (reply.finish_reason, reply.stop_sequence) == ("stop", None), reply  # (its own end)
    again = session.respond("Again.", GenerationOptions(max_tokens=2, temperature=0))
    assert again.usage.prompt_tokens > reply.usage.prompt_tokens


CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}
ANSWER = '{"city":"Paris"}'  # (compact: as the mask writes JSON)


@pytest.mark.parametrize("thought", ["", f"{CHANNELS.open}The user wants a city.<|end|><|start|>assistant"])
def test_a_schemas_answer_is_the_final_channel_after_the_reasoning(
    model: Model, thought: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under a JSON schema a reply may reason first, then answers in its final channel, as
    the template renders it back: the next turn decodes only what it adds."""
    session = model.session()
    with scripted(monkeypatch, model, f"{thought}{CHANNELS.headers[1]}{ANSWER}") as played:
        reply = session.respond(
            "Name a city.", GenerationOptions(max_tokens=48, temperature=0, json_schema=CITY)
        )
    assert not played.refused and not played.off_script, played
    assert (reply.text, reply.parsed, reply.finish_reason) == (ANSWER, {"city": "Paris"}, "complete"), reply
    assert reply.reasoning == ("The user wants a city." if thought else "")
    next_turn_reads_the_reply(session, reply, reasoned=bool(thought))


def next_turn_reads_the_reply(session: Session, reply: Reply, *, reasoned: bool) -> None:
    """The next turn decodes only what it adds, but where the reply reasoned: the template
    drops an earlier turn's analysis, so the reply is decoded again (its prompt still read)."""
    first = session.cached_tokens
    again = session.respond("Another.", GenerationOptions(max_tokens=2, temperature=0))
    if reasoned:
        assert again.usage.reused_tokens >= reply.usage.prompt_tokens, (again.usage, reply.usage)
    else:
        added = again.usage.prompt_tokens - first
        assert again.usage.decoded_prompt_tokens <= added + 1, (again.usage, first)


def test_a_schemas_answer_without_its_header_is_refused(
    model: Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The variant that must fail: JSON at once, without the final channel's header, is not
    what the template renders back; the mask refuses it."""
    with scripted(monkeypatch, model, ANSWER) as played:
        reply = model.session().respond("Name a city.", GenerationOptions(max_tokens=48, json_schema=CITY))
    assert played.refused, played
    assert reply.finish_reason != "complete" or isinstance(reply.parsed, dict), reply


ANSWERED_BY = {  # a regex and a grammar (GBNF, as llama.cpp spells them) that "42" matches
    "regex": GenerationOptions(max_tokens=24, temperature=0, regex="[0-9]{1,3}"),
    "grammar": GenerationOptions(max_tokens=24, temperature=0, grammar="root ::= [0-9] [0-9]? [0-9]?"),
}


@pytest.mark.parametrize("kind", sorted(ANSWERED_BY))
@pytest.mark.parametrize("thought", ["", f"{CHANNELS.open}A number.<|end|><|start|>assistant"])
def test_a_regexs_or_a_grammars_answer_is_the_final_channel_too(
    model: Model, kind: str, thought: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As a schema's: the reply may reason, then answers in its final channel under the regex
    or grammar, which the next turn reads from the cache."""
    session = model.session()
    with scripted(monkeypatch, model, f"{thought}{CHANNELS.headers[1]}42") as played:
        reply = session.respond("Pick a number.", ANSWERED_BY[kind])
    assert not played.refused and not played.off_script, played
    assert (reply.text, reply.finish_reason) == ("42", "complete"), reply
    assert reply.reasoning == ("A number." if thought else "")
    next_turn_reads_the_reply(session, reply, reasoned=bool(thought))


def test_the_answer_after_the_reasoning_keeps_the_whitespace_its_constraint_held(
    model: Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The constraint holds the answer after the reply's own analysis: its text is what the
    constraint held, leading space and all, as without the analysis (else it would no longer
    match its own constraint, nor the cache)."""
    options = GenerationOptions(max_tokens=24, temperature=0, regex=" [0-9]{1,3}")
    for thought in ["", f"{CHANNELS.open}A number.<|end|><|start|>assistant"]:
        with scripted(monkeypatch, model, f"{thought}{CHANNELS.headers[1]} 42") as played:
            reply = model.session().respond("Pick a number.", options)
        assert not played.refused and (reply.text, reply.finish_reason) == (" 42", "complete"), reply


@pytest.mark.parametrize("kind", sorted(ANSWERED_BY))
def test_a_regexs_or_a_grammars_answer_without_its_header_is_refused(
    model: Model, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The variant that must fail: the answer at once, without its header."""
    with scripted(monkeypatch, model, "42") as played:
        model.session().respond("Pick a number.", ANSWERED_BY[kind])
    assert played.refused, played


def test_a_budget_ends_the_reasoning_before_a_schemas_answer(
    model: Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    with scripted(monkeypatch, model, f"{CHANNELS.open}one two three four five six seven") as played:
        options = GenerationOptions(max_tokens=48, temperature=0, json_schema=CITY, reasoning_budget=2)
        reply = model.session().respond("Name a city.", options)
    assert reply.usage.reasoning_tokens == 2 and reply.finish_reason == "complete", (played, reply)
    assert isinstance(reply.parsed, dict) and isinstance(reply.parsed["city"], str), reply


def test_a_reasoning_effort_reaches_the_templates_system_message(
    model: Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gpt-oss's effort is its system message's ``Reasoning:`` line: a session's ``thinking``
    effort, and the APIs' ``reasoning_effort`` / ``reasoning.effort``, reach its template (a
    budget of reasoning tokens comes with them, as before)."""
    local, ask = internals.local(model), [{"role": "user", "content": "Hi"}]
    assert "Reasoning: medium" in local.render(ask, thinking=True)  # (the template's default)
    assert "Reasoning: low" in local.render(ask, thinking="low")
    from llmsession.text import templates

    asked: list[object] = []
    render = templates.render_jinja

    def spied(*args: Any, **variables: Any) -> str:
        asked.append(variables.get("reasoning_effort"))
        return render(*args, **variables)

    monkeypatch.setattr(templates, "render_jinja", spied)
    with running(create_app(model, api_key=KEY)) as url:
        client = openai.OpenAI(base_url=url, api_key=KEY, max_retries=0)
        for effort in ("minimal", "high", "none"):
            client.chat.completions.create(model="m", messages=ask, max_tokens=1, reasoning_effort=effort)  # type: ignore[arg-type]
        client.responses.create(model="m", input="Hi", max_output_tokens=16, reasoning={"effort": "low"})
    said = [effort for effort, _ in itertools.groupby(asked)]  # (a request may render more than once)
    assert said == ["low", "high", None, "low"], asked


def test_an_effort_its_template_does_not_read_shares_the_kept_sessions(
    model: Model, fixture_path: Any
) -> None:
    """Calls that differ only in an effort the template reads nothing from (Qwen3's) render
    the same prompt: the second continues the first's kept session. The variant that must
    differ: gpt-oss's system message says the effort, so its prompt differs there."""
    history = [{"role": "user", "content": "Tell me a long story about a cat. " * 8}]
    greedy = GenerationOptions(max_tokens=2, temperature=0)
    with Model(fixture_path("smollm2-qwen3-special.gguf"), threads=2, use_jinja=True) as qwen3:
        for chat in (qwen3, model):
            first = chat.chat(history, greedy, tenant="t", share_prefix=False, thinking="low")
            more = [
                *history,
                {"role": "assistant", "content": first.text},
                {"role": "user", "content": "More."},
            ]
            second = chat.chat(more, greedy, tenant="t", share_prefix=False, thinking="high")
            shared = second.usage.reused_tokens >= first.usage.prompt_tokens
            assert shared == (chat is qwen3), (chat.template is not None, first.usage, second.usage)


def test_a_template_call_written_by_the_template_reads_back() -> None:
    """What the template renders for a call (``reply_text``) is what ``parse`` reads."""
    assert TOOLS is not None
    ids = CallIds(HARMONY)
    made = ToolCall(ids(0), "get_time", '{"zone": "UTC"}')
    assert parse(HARMONY.reply_text("", [made]), HARMONY, TOOLS, ids) == ("", [made])


def test_codex_shaped_turns_through_responses_decode_only_what_they_add(
    model: Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over real HTTP with the official client, as Codex sends them (``store: false``, the
    whole exchange resent as items): the reasoning and the call come back as items, and the
    resent turn, its reasoning and call rendered by the template, is read from the cache."""
    tool = {"type": "function", **WEATHER["function"], "strict": False}
    said = f"{CHANNELS.open}The user wants the weather.<|end|><|start|>assistant{TEMPLATE_SPELLING}"
    with running(create_app(model, api_key=KEY)) as url:
        client = openai.OpenAI(base_url=url, api_key=KEY, max_retries=0)
        asked: dict[str, Any] = {"model": "m", "tools": [tool], "temperature": 0, "store": False}
        with scripted(monkeypatch, model, said) as played:
            first = client.responses.create(
                **asked, input=ASK, tool_choice="required", parallel_tool_calls=False, max_output_tokens=64
            )
        assert not played.refused and [item.type for item in first.output] == ["reasoning", "function_call"]
        thought, call = first.output
        assert thought.type == "reasoning" and thought.content is not None
        assert thought.content[0].text == "The user wants the weather."
        assert call.type == "function_call" and (call.name, json.loads(call.arguments)) == (
            "get_weather",
            {"city": "Paris"},
        )
        items = [
            {"role": "user", "content": ASK},
            *[item.model_dump(exclude_none=True) for item in first.output],
        ]
        items.append({"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"})
        second = client.responses.create(**asked, input=items, max_output_tokens=4)
    assert first.usage is not None and second.usage is not None
    seen = first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= seen - 1, (first.usage, second.usage)


OPENED = (Path(__file__).parent / "data" / "templates" / "openai-gpt-oss-120b.jinja").read_text()
OPENED = OPENED.replace(
    "{%- if add_generation_prompt -%}\n<|start|>assistant",
    "{%- if add_generation_prompt -%}\n<|start|>assistant<|channel|>analysis<|message|>",
)


@pytest.fixture(scope="module")
def opened(fixture_path: Any) -> Iterator[Model]:
    path: Path = fixture_path("smollm2-gpt-oss-special.gguf")
    with Model(path, threads=2, chat_template=OPENED, anticipate=False) as loaded:
        yield loaded


REASONED = "The user wants the weather."
OPENED_SCRIPTS = {  # what the model writes after the prompt's opening: (budget, its script)
    "closes it itself": (None, f"{REASONED}<|end|><|start|>assistant{TEMPLATE_SPELLING}"),
    "a budget of 0 closes it": (0, f"<|end|><|start|>assistant{TEMPLATE_SPELLING}"),
    "a budget of 2 closes it": (2, f"The user<|end|><|start|>assistant{TEMPLATE_SPELLING}"),
    "a budget closes it, and the model writes the header": (
        2,
        f"The user wants<|start|>assistant{TEMPLATE_SPELLING}",
    ),
}


@pytest.mark.parametrize("case", sorted(OPENED_SCRIPTS))
@pytest.mark.parametrize("choice", ["required", "auto"])
def test_a_prompt_that_opens_the_analysis_still_calls_after_a_break(
    opened: Model, choice: str, case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A template whose prompt opens the analysis: the reply reasons, closes it with a new
    message's header as the template writes it (a budget forces the closing marker alone, and
    the grammar the header: forced with the marker, the grammar never read it, and a model
    that wrote it again had its call come out as text), and calls. The call's channel tags
    end no answer: a reply that may call keeps them (the tools grammar keeps them out of an
    answer)."""
    assert OPENED.count("<|start|>assistant<|channel|>analysis<|message|>") >= 2  # (the edit took)
    budget, said = OPENED_SCRIPTS[case]
    session = opened.session()
    with scripted(monkeypatch, opened, said) as played:
        reply = session.respond(ASK, options(choice, budget))
    reasoned = {None: REASONED, 0: "", 2: "The user"}[budget]
    assert (reply.reasoning, reply.text, reply.finish_reason) == (reasoned, "", "tool_calls"), reply
    assert not played.refused and not played.off_script, played  # (the template's own spelling)
    (call,) = reply.tool_calls
    assert (call.name, call.parsed) == ("get_weather", {"city": "Paris"})


HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.mark.parametrize("budget", [None, 2])
@pytest.mark.parametrize("choice", ["required", "auto"])
def test_an_overridden_tool_format_calls_after_the_opened_analysis_in_its_own_markup(
    opened: Model, choice: str, budget: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same prompt with the tool format overridden to Hermes: the analysis closes with the
    marker alone (a budget forces no gpt-oss header, which Hermes's grammar would not read), and
    the call follows in Hermes's markup, every token of it the model's own."""
    said = f"{'The user' if budget else REASONED}<|end|>{HERMES_CALL}"
    session = opened.session()
    with scripted(monkeypatch, opened, said) as played:
        reply = session.respond(ASK, replace(options(choice, budget), tool_format="hermes"))
    reasoned = "The user" if budget else REASONED
    assert (reply.reasoning, reply.text, reply.finish_reason) == (reasoned, "", "tool_calls"), reply
    assert not played.refused and not played.off_script, played
    (call,) = reply.tool_calls
    assert (call.name, call.parsed) == ("get_weather", {"city": "Paris"})
    (start,) = opened.tokenize("<|start|>", add_special=False)
    assert start not in internals.record(session)[reply.usage.prompt_tokens :]  # (no header)
