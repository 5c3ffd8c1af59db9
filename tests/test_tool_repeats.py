"""A reply makes each call once (issue 39, defect 4): a named ``tool_choice`` makes exactly one
call, as OpenAI's does, and under "required" (or "auto") with parallel calls a call identical to
an earlier one ends the reply before it, in the final reply and in the stream alike (a stream
never shows a call the reply then drops). The model is steered to repeat itself (a small model
does so by chance, at some temperatures), in the library and over the server, with and without
jinja."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import internals
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from serve_helpers import KEY, running
from tool_helpers import WEATHER, steered

from llmsession import GenerationOptions, Model
from llmsession.replies import ToolCall
from llmsession.runtime.calling import Calling
from llmsession.serve.app import create_app
from llmsession.text.tool_formats import FORMATS, CallIds
from llmsession.text.tools import checked_tools

CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 24}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TOOLS: list[Any] = [WEATHER, CLOCK]
NAMED = {"type": "function", "function": {"name": "get_time"}}
LIMA = '{"name": "get_time", "arguments": {"city": "Lima"}}'
QUITO = '{"name": "get_time", "arguments": {"city": "Quito"}}'
OSLO = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'


def generic(*calls: str) -> str:
    """The reply SmolLM2's ChatML template takes calls in (the generic format), with or without
    jinja: its template knows no tools."""
    return '{"tool_calls": [' + ", ".join(calls) + "]}"


# -- the rule, on written replies (pure) --------------------------------------------------------
few_arguments = st.fixed_dictionaries(
    {"city": st.sampled_from(["Lima", "Oslo"])}, optional={"days": st.sampled_from([1, 2])}
)
named = st.sampled_from(["get_weather", "get_time"])
calls = st.lists(st.tuples(named, few_arguments), min_size=1, max_size=5)
LOOSE = [{"type": "function", "function": {"name": name}} for name in ("get_weather", "get_time")]


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(sorted(n for n, f in FORMATS.items() if not f.single)), calls, st.data())
def test_a_repeated_call_ends_the_calls_and_never_streams(
    name: str, made: list[Any], data: st.DataObject
) -> None:
    fmt = FORMATS[name]
    tools = checked_tools(LOOSE, "required")
    assert tools is not None
    ids = CallIds(fmt)
    written = []
    for i, (tool, arguments) in enumerate(made):  # keys in any order: the same arguments
        keys = data.draw(st.permutations(sorted(arguments)))
        text = json.dumps({k: arguments[k] for k in keys})
        if fmt.syntax == "gemma4":
            text = json.dumps(dict(sorted(arguments.items())))  # (Gemma 4 writes its keys sorted)
        written.append(ToolCall(ids(i), tool, text))
    first = next((i for i, (t, a) in enumerate(made) if (t, a) in made[:i]), len(made))
    reply = fmt.reply_text("", written)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(reply)), max_size=12)))
    calling, pieces = Calling(tools, fmt, ids), list[Any]()
    for start, end in zip([0, *cuts], [*cuts, len(reply)], strict=True):
        if calling.ended:
            break  # (the exchange generates no more)
        pieces += calling.snapshot(reply[start:end]).tool_calls
    assert calling.ended == (first < len(made))
    text, got, finish, error = calling.conclude(reply, "length" if calling.ended else "complete")
    assert (text, got, finish, error) == ("", tuple(written[:first]), "tool_calls", None)
    assert {p.index for p in pieces} == set(range(first)), "nothing of the repeat streamed"
    for index, call in enumerate(got):
        mine = [p for p in pieces if p.index == index]
        assert (mine[0].id, mine[0].name) == (call.id, call.name)
        assert "".join(p.arguments for p in mine) == call.arguments


def test_the_same_json_is_a_repeat_and_another_number_is_not() -> None:
    fmt, tools = FORMATS["generic"], checked_tools(LOOSE, "required")
    assert tools is not None
    for second, repeats in (('{"b": 2, "a": 1}', True), ('{"a": 1.0, "b": 2}', False)):
        calling = Calling(tools, fmt, CallIds(fmt))
        calls = [ToolCall("x", "get_time", '{"a": 1, "b": 2}'), ToolCall("y", "get_time", second)]
        for char in fmt.reply_text("", calls):  # (a character at a time)
            calling.snapshot(char)
        assert calling.ended == repeats


# -- the real model, steered to repeat itself -------------------------------------------------------
@pytest.fixture(scope="module", params=[False, True], ids=["builtin", "jinja"])
def model(request: pytest.FixtureRequest, smollm2_path: Path) -> Iterator[Model]:
    with Model(smollm2_path, threads=1, use_jinja=request.param, anticipate=False) as loaded:
        assert internals.local(loaded).tool_format().name == "generic"
        yield loaded


def called(model: Model, choice: Any, prompt: str = "What time is it in Lima?") -> tuple[Any, list[Any]]:
    """The reply and its streamed call pieces."""
    options = GenerationOptions(max_tokens=120, temperature=0, tools=TOOLS, tool_choice=choice)
    stream = model.session().stream(prompt, options)
    pieces = [piece for snapshot in stream for piece in snapshot.tool_calls]
    assert stream.reply is not None
    return stream.reply, pieces


def joined(pieces: list[Any]) -> dict[int, tuple[str | None, str]]:
    """Each streamed call's name and arguments, as a client joins them."""
    calls: dict[int, tuple[str | None, str]] = {}
    for piece in pieces:
        name, arguments = calls.get(piece.index, (None, ""))
        calls[piece.index] = (name or piece.name, arguments + piece.arguments)
    return calls


def test_a_named_choice_makes_one_call(model: Model, monkeypatch: pytest.MonkeyPatch) -> None:
    steered(monkeypatch, model, generic(LIMA, LIMA, QUITO))
    reply, pieces = called(model, NAMED)
    assert reply.finish_reason == "tool_calls", reply
    assert [(c.name, c.parsed) for c in reply.tool_calls] == [("get_time", {"city": "Lima"})]
    assert joined(pieces) == {0: ("get_time", '{"city": "Lima"}')}


def test_required_ends_the_reply_at_a_repeated_call(model: Model, monkeypatch: pytest.MonkeyPatch) -> None:
    steered(monkeypatch, model, generic(LIMA, OSLO, LIMA, QUITO))
    reply, pieces = called(model, "required")
    assert reply.finish_reason == "tool_calls", reply
    wanted = [("get_time", {"city": "Lima"}), ("get_weather", {"city": "Oslo"})]
    assert [(c.name, c.parsed) for c in reply.tool_calls] == wanted
    assert joined(pieces) == {0: ("get_time", '{"city": "Lima"}'), 1: ("get_weather", '{"city": "Oslo"}')}
    assert [p.id for p in pieces if p.id] == [call.id for call in reply.tool_calls]


def test_the_same_tool_with_other_arguments_is_a_call_of_its_own(
    model: Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    steered(monkeypatch, model, generic(LIMA, QUITO))
    reply, pieces = called(model, "required", "What time is it in Lima and in Quito?")
    assert [(c.name, c.parsed) for c in reply.tool_calls][:2] == [
        ("get_time", {"city": "Lima"}),
        ("get_time", {"city": "Quito"}),
    ], reply
    streamed = joined(pieces)
    assert [streamed[i] for i in range(len(reply.tool_calls))] == [
        (c.name, c.arguments) for c in reply.tool_calls
    ]


# -- over the server, with the official client --------------------------------------------------
@pytest.fixture(scope="module", params=[False, True], ids=["builtin", "jinja"])
def served(request: pytest.FixtureRequest, smollm2_path: Path) -> Iterator[tuple[Any, str, Model]]:
    import openai

    with Model(smollm2_path, threads=1, use_jinja=request.param) as loaded:
        app = create_app(loaded, api_key=[KEY])
        with running(app) as url:
            client = openai.OpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=60)
            yield client, app.state.server.model_name, loaded


@pytest.mark.parametrize(
    ("choice", "target", "wanted"),
    [
        (NAMED, generic(LIMA, LIMA), {0: ("get_time", '{"city": "Lima"}')}),
        ("required", generic(LIMA, LIMA, OSLO), {0: ("get_time", '{"city": "Lima"}')}),
    ],
    ids=["named", "required"],
)
def test_a_streamed_reply_over_the_server_makes_each_call_once(
    served: tuple[Any, str, Model],
    monkeypatch: pytest.MonkeyPatch,
    choice: Any,
    target: str,
    wanted: dict[int, tuple[str, str]],
) -> None:
    client, name, model = served
    steered(monkeypatch, model, target)
    chunks = list(
        client.chat.completions.create(
            model=name,
            messages=[{"role": "user", "content": "What time is it in Lima?"}],
            max_tokens=120,
            temperature=0,
            tools=TOOLS,
            tool_choice=choice,
            stream=True,
        )
    )
    streamed: dict[int, tuple[str | None, str]] = {}
    for chunk in chunks:
        for piece in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            was, arguments = streamed.get(piece.index, (None, ""))
            function = piece.function
            streamed[piece.index] = (
                was or (function.name if function else None),
                arguments + ((function.arguments or "") if function else ""),
            )
    assert streamed == wanted
    assert json.loads(streamed[0][1]) == {"city": "Lima"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
