"""Tool-calling replies on real templates: markers held as special tokens, Gemma 4 without
jinja, replies cut inside a call by length (never by a stop string), and parallel calls."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import internals
import jsonschema
import pytest
from tool_helpers import TIME, WEATHER, hf_render, scripted_start, steered

from llmsession import GenerationOptions, Model
from llmsession.replies import ToolCall
from llmsession.runtime.face import drain
from llmsession.text.tools import checked_tools


@pytest.mark.parametrize(
    ("name", "marker", "printed"),
    [
        ("smollm2-qwen25-special.gguf", "<tool_call>", b"<tool_call>"),  # user-defined: printed
        ("smollm2-mistral-special.gguf", "[TOOL_CALLS]", b""),  # control: printed only when asked
    ],
)
def test_markers_held_as_special_tokens_are_generated_as_those_tokens(
    fixture_path: Any, monkeypatch: pytest.MonkeyPatch, name: str, marker: str, printed: bytes
) -> None:
    """Spelled as text in the grammar, a special marker could only come byte by byte, which a
    real model never writes: the grammar names its id, and the reply's text spells it."""
    with Model(fixture_path(name), threads=2, use_jinja=True, anticipate=False) as model:
        fmt = internals.local(model).tool_format()
        (special,) = model.tokenize(marker, add_special=False)
        assert internals.local(model).special_markers(fmt)[marker] == special
        assert internals.local(model).native.piece(special) == printed and internals.local(
            model
        ).native.is_special(special)
        session = model.session()
        options = GenerationOptions(
            max_tokens=48, temperature=0, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False
        )
        stream = session.stream("Weather in Oslo?", options)
        reply = drain(stream)
        assert reply.finish_reason == "tool_calls", reply
        assert stream.exchange.tokens[0] == special  # the marker as its one token
        assert reply.tool_calls[0].name == "get_weather" and reply.text == ""
        # "auto": text, then the special trigger (scripted, not by luck), then the held call
        prefix = [] if fmt.anchored else model.tokenize("Let me check.\n", add_special=False)
        scripted_start(monkeypatch, [*prefix, special])
        auto = model.session().respond(
            "Weather in Oslo?",
            GenerationOptions(max_tokens=64, temperature=0, tools=[WEATHER], parallel_tool_calls=False),
        )
        assert auto.finish_reason == "tool_calls" and auto.text == (
            "" if fmt.anchored else "Let me check."
        ), auto
        jsonschema.validate(auto.tool_calls[0].parsed, WEATHER["function"]["parameters"])


def test_gemma4_without_jinja_renders_and_calls_in_its_own_syntax(fixture_path: Any) -> None:
    """The Python Gemma 4 renderer declares the tools and writes calls and results as the
    template does, and a forced call comes back in Gemma 4's syntax, read into JSON."""
    with Model(
        fixture_path("smollm2-gemma4-special.gguf"), threads=2, anticipate=False, use_jinja=False
    ) as model:
        assert not model.use_jinja and internals.local(model).tool_format().name == "gemma4"
        call = ToolCall("call_1", "get_weather", '{"city": "Paris", "days": 2}')
        messages = [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [call.message_part()]},
            {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'},
        ]
        ours = internals.local(model).render(messages, tools=checked_tools([WEATHER]))
        assert '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:2}<tool_call|>' in ours
        assert (
            hf_render(model, messages, [WEATHER])
            == internals.local(model).native.token_text(internals.local(model).native.bos()) + ours
        )
        options = GenerationOptions(
            max_tokens=48, temperature=0, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False
        )
        reply = model.session().respond("Weather in Oslo?", options)
        assert reply.finish_reason == "tool_calls", reply
        jsonschema.validate(reply.tool_calls[0].parsed, WEATHER["function"]["parameters"])


def test_a_reply_cut_mid_call_keeps_only_its_text(fixture_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """``length`` inside a call: no call, and the text is what streamed as text (the markup of
    the call it began is not passed off as the reply's words)."""
    with Model(fixture_path("smollm2-qwen25-template.gguf"), threads=2, use_jinja=True) as model:
        scripted_start(monkeypatch, model.tokenize("Let me check.\n<tool_call>", add_special=False))
        options = GenerationOptions(max_tokens=12, temperature=0, tools=[WEATHER])
        stream = model.session().stream("Weather in Oslo?", options)
        streamed = "".join(snapshot.delta for snapshot in stream)
        reply = stream.reply
    assert reply is not None and reply.finish_reason == "length" and not reply.tool_calls
    assert reply.text == streamed == "Let me check.", reply


def test_stop_strings_end_the_text_never_a_call(fixture_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A user's stop string found inside a call does not cut it (a stream would have shown a
    call its reply then dropped, its arguments broken): the call is whole, streamed and read
    back the same, and no stop is reported. One found in the text before the calls still ends
    the reply there, with no call."""
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    stops = ['"arguments"', "Oslo", "}}"]
    with Model(fixture_path("smollm2-qwen25-template.gguf"), threads=2, use_jinja=True) as model:
        steered(monkeypatch, model, f"Let me check.\n{call}")
        options = GenerationOptions(
            max_tokens=64, temperature=0, tools=[WEATHER], stop=stops, parallel_tool_calls=False
        )
        stream = model.session().stream("Weather in Oslo?", options)
        snapshots = list(stream)
        reply = stream.reply
        assert reply is not None and reply.finish_reason == "tool_calls", reply
        assert reply.stop_sequence is None
        assert reply.text == "".join(s.delta for s in snapshots) == "Let me check."
        assert [(c.name, c.parsed) for c in reply.tool_calls] == [("get_weather", {"city": "Oslo"})]
        pieces = [piece for snapshot in snapshots for piece in snapshot.tool_calls]
        assert "".join(p.arguments for p in pieces) == reply.tool_calls[0].arguments
        steered(monkeypatch, model, f"Let me check.\n{call}")
        before = model.session().respond("Weather in Oslo?", replace(options, stop=["check", *stops]))
    assert before.finish_reason == "stop" and before.stop_sequence == "check", before
    assert before.text == "Let me " and not before.tool_calls


def test_a_stop_string_inside_the_calls_opening_waits_to_see_it_whole(
    fixture_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stop string met inside what may yet be the calls' opening (``<tool`` in ``<tool_call>``;
    Hermes writes a line break before its calls, so ``\n`` too) cut the reply there: the call
    was lost, and the line break before it went out as text. The stop waits until the opening is
    whole (a call: the stop is let go) or cannot be (the stop stands where it was found)."""
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    with Model(fixture_path("smollm2-qwen25-template.gguf"), threads=2, use_jinja=True) as model:

        def reply(steer: str, stop: list[str]) -> Any:
            steered(monkeypatch, model, steer)
            options = GenerationOptions(
                max_tokens=64, temperature=0, tools=[WEATHER], stop=stop, parallel_tool_calls=False
            )
            stream = model.session().stream("Weather in Oslo?", options)
            snapshots = list(stream)
            assert stream.reply is not None and stream.reply.text == "".join(s.delta for s in snapshots)
            return stream.reply

        for stop in (["<tool"], ["\n"], ["_call>"]):
            made = reply(f"Let me check.\n{call}", stop)
            assert made.finish_reason == "tool_calls" and made.stop_sequence is None, (stop, made)
            assert made.text == "Let me check." and [c.name for c in made.tool_calls] == ["get_weather"]
        diverged = reply("Let me check.\n<toolbox> is empty.", ["<tool"])
        assert diverged.finish_reason == "stop" and diverged.stop_sequence == "<tool", diverged
        assert diverged.text == "Let me check.\n" and not diverged.tool_calls
        lines = reply("Line one.\nLine two.", ["\n"])
        assert (lines.text, lines.stop_sequence, lines.finish_reason) == ("Line one.", "\n", "stop")


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_call_is_never_cut_by_a_stop_string(
    fixture_path: Any, monkeypatch: pytest.MonkeyPatch, choice: Any
) -> None:
    """A reply that must call is all calls: a stop string met in the call's opening (before the
    calls had begun, as ``TextStops`` saw it) cut it there, the forced choice unmet and the
    markup's first characters returned as text. Stop strings do not apply to it."""
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    with Model(fixture_path("smollm2-qwen25-template.gguf"), threads=2, use_jinja=True) as model:
        steered(monkeypatch, model, call)
        options = GenerationOptions(
            max_tokens=64, temperature=0, tools=[WEATHER], tool_choice=choice, stop=["<tool", "Oslo"]
        )
        reply = model.session().respond("Weather in Oslo?", options)
    assert reply.finish_reason == "tool_calls" and reply.stop_sequence is None, reply
    assert reply.text == "" and [(c.name, c.parsed) for c in reply.tool_calls] == [
        ("get_weather", {"city": "Oslo"})
    ]


@pytest.mark.parametrize("parallel", [True, False])
def test_parallel_calls_come_as_two_calls_only_when_allowed(
    fixture_path: Any, monkeypatch: pytest.MonkeyPatch, parallel: bool
) -> None:
    """A reply steered to write two calls yields both, each streamed under its own index; with
    ``parallel_tool_calls=False`` the mask ends the reply after the first, whatever was wanted."""
    with Model(fixture_path("smollm2-qwen25-template.gguf"), threads=2, use_jinja=True) as model:
        one = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
        two = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
        steered(monkeypatch, model, f"{one}\n{two}")
        options = GenerationOptions(
            max_tokens=64,
            temperature=0,
            tools=[WEATHER, TIME],
            tool_choice="required",
            parallel_tool_calls=parallel,
        )
        stream = model.session().stream("Time in UTC and weather in Oslo?", options)
        pieces = [piece for snapshot in stream for piece in snapshot.tool_calls]
        reply = stream.reply
    assert reply is not None and reply.finish_reason == "tool_calls", reply
    wanted = [("get_time", {"zone": "UTC"}), ("get_weather", {"city": "Oslo"})]
    assert [(c.name, c.parsed) for c in reply.tool_calls] == wanted[: 2 if parallel else 1]
    assert {p.index for p in pieces} == set(range(len(reply.tool_calls)))
