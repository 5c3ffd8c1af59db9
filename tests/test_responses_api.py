"""OpenAI's Responses API on ``llmsession serve``, through the official ``openai`` client over
real HTTP on the default SmolLM2 model: bodies and the ``responses.stream`` helper,
``previous_response_id`` and ``store: false`` resends read from the cache, function calls and
their outputs, ``text.format``, retrieval and deletion, 404s and tenants, and one run of the
OpenAI Agents SDK with a function tool."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from plain_http import HTTP
from serve_helpers import KEY, OTHER_KEY, WEATHER, Served, serving

from llmsession.replies import (
    Alternative,
    Reply,
    Snapshot,
    Timings,
    TokenLogprob,
    ToolCall,
    ToolCallDelta,
    Usage,
)
from llmsession.serve import images, responding
from llmsession.serve.doors import ResponsesDoor
from llmsession.serve.errors import ApiError
from llmsession.serve.rendering import rendered
from llmsession.serve.responses import responses_ask, responses_request
from llmsession.serve.responses_sse import Items, ResponseObject
from llmsession.serve.runner import Event

TOOL = {"type": "function", **WEATHER["function"], "strict": False}
FORCED = {"type": "function", "name": "get_weather"}
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def served(smollm2_path: Path) -> Iterator[Served]:
    with serving(smollm2_path) as served:
        yield served


def client(served: Served, key: str = KEY) -> openai.OpenAI:
    return served.client(key)


def test_a_response_answers_and_is_kept(served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    made = client(served).responses.create(
        model="m", instructions="Be brief.", input="Name a colour.", max_output_tokens=16, **GREEDY
    )
    assert made.id.startswith("resp_") and made.object == "response" and made.model == served.name
    assert made.status in ("completed", "incomplete") and made.output_text
    assert [item.type for item in made.output] == ["message"]
    usage = made.usage
    assert usage is not None and usage.input_tokens > 5 and 0 < usage.output_tokens <= 16
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.output_tokens_details.reasoning_tokens == 0
    assert usage.input_tokens_details.cache_write_tokens == 0  # (a field the SDK requires)
    rendering: list[object] = []  # (a kept body is answered as rendered when kept: never again)
    monkeypatch.setattr(responding, "JSONResponse", lambda *a: rendering.append(a))
    again = client(served).responses.retrieve(made.id)
    assert again.model_dump() == made.model_dump() and rendering == []
    monkeypatch.undo()
    with pytest.raises(openai.NotFoundError):
        client(served, OTHER_KEY).responses.retrieve(made.id)  # another key's: unknown
    with pytest.raises(openai.NotFoundError):
        client(served, OTHER_KEY).responses.delete(made.id)
    client(served).responses.delete(made.id)
    with pytest.raises(openai.NotFoundError):
        client(served).responses.retrieve(made.id)
    short = client(served).responses.create(model="m", input="Tell me a story.", max_output_tokens=2)
    assert short.status == "incomplete" and short.incomplete_details is not None
    assert short.incomplete_details.reason == "max_output_tokens"
    unkept = client(served).responses.create(model="m", input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client(served).responses.retrieve(unkept.id)


def test_the_stream_helper_joins_to_the_response(served: Served) -> None:
    asked: dict[str, Any] = {"model": "m", "input": "Say hello to Paris.", "max_output_tokens": 120, **GREEDY}
    # The two replies compared below both read this one's prompt from the cache (a fresh decode
    # and a cached one part at a near-tie here on AVX2).
    client(served).responses.create(**asked)
    with client(served).responses.stream(**asked) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"  # (the helper finishes on it only)
    opened = ["response.output_item.added", "response.content_part.added", "response.output_text.delta"]
    assert kinds[2:5] == opened
    closing = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[-4:-1] == closing
    whole = client(served).responses.create(**asked)
    assert final.output_text == whole.output_text and final.output_text
    assert final.usage is not None and whole.usage is not None
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert client(served).responses.retrieve(final.id).output_text == final.output_text


def test_a_continued_response_decodes_only_its_new_input(served: Served) -> None:
    """``previous_response_id``: the earlier turns are read from the cache; so are a
    ``store: false`` client's resent items (its transcript sent back whole, as Codex does)."""
    system = "You are a travel guide. " + "Answer in one short sentence. " * 20
    first = client(served).responses.create(
        model="m", instructions=system, input="Name a river in France.", max_output_tokens=12, **GREEDY
    )
    second = client(served).responses.create(
        model="m",
        instructions=system,
        previous_response_id=first.id,
        input="And one in Spain?",
        max_output_tokens=12,
        **GREEDY,
    )
    assert first.usage is not None and second.usage is not None
    seen = first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens > seen
    assert second.usage.input_tokens_details.cached_tokens >= seen - 1
    # (another key's, or none: OpenAI's 400 with the code clients read to resend the transcript)
    for key, ident in ((OTHER_KEY, first.id), (KEY, "resp_nothing")):
        with pytest.raises(openai.BadRequestError) as unknown:
            client(served, key).responses.create(model="m", previous_response_id=ident, input="Hi")
        assert unknown.value.code == "previous_response_not_found", unknown.value.body
        assert unknown.value.param == "previous_response_id" and ident in unknown.value.message
    # store: false, the whole transcript resent as items
    items: list[Any] = [{"role": "user", "content": "Name a lake in Italy."}]
    turn = client(served).responses.create(
        model="m", instructions=system, input=items, max_output_tokens=12, store=False, **GREEDY
    )
    items += [item.model_dump(exclude_none=True) for item in turn.output]
    items.append({"role": "user", "content": "And in Switzerland?"})
    resent = client(served).responses.create(
        model="m", instructions=system, input=items, max_output_tokens=12, store=False, **GREEDY
    )
    assert turn.usage is not None and resent.usage is not None
    kept = turn.usage.input_tokens + turn.usage.output_tokens
    assert resent.usage.input_tokens_details.cached_tokens >= kept - 1
    other = client(served, OTHER_KEY).responses.create(
        model="m", instructions=system, input=items, max_output_tokens=2, store=False
    )
    assert other.usage is not None and other.usage.input_tokens_details.cached_tokens == 0


def test_function_calls_stream_and_take_outputs(served: Served) -> None:
    asked: dict[str, Any] = {
        "model": "m",
        "input": "What is the weather in Paris?",
        "tools": [TOOL],
        "tool_choice": FORCED,
        "max_output_tokens": 60,
    }
    with client(served).responses.stream(**asked) as stream:
        deltas = [e.delta for e in stream if e.type == "response.function_call_arguments.delta"]
        final = stream.get_final_response()
    calls = [item for item in final.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id
    arguments = json.loads(calls[0].arguments)
    assert "".join(deltas) == calls[0].arguments and isinstance(arguments["city"], str)
    answer = client(served).responses.create(
        model="m",
        previous_response_id=final.id,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny, 21 C"}],
        tools=[TOOL],
        tool_choice="none",
        max_output_tokens=20,
    )
    assert answer.output_text and answer.usage is not None
    assert answer.usage.input_tokens_details.cached_tokens > 50
    # the same exchange resent whole, as items (store: false)
    items = [{"role": "user", "content": "What is the weather in Paris?"}]
    items += [item.model_dump(exclude_none=True) for item in final.output]
    items.append({"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny, 21 C"})
    resent = client(served).responses.create(
        model="m", input=items, tools=[TOOL], tool_choice="none", max_output_tokens=4, store=False
    )
    assert resent.status in ("completed", "incomplete")


def test_text_format_holds_the_reply_to_a_schema(served: Served) -> None:
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
        "additionalProperties": False,
    }
    fmt = {"format": {"type": "json_schema", "name": "city", "schema": schema, "strict": True}}
    made = client(served).responses.create(model="m", input="Name a city.", text=fmt, max_output_tokens=40)  # type: ignore[arg-type]
    jsonschema.validate(json.loads(made.output_text), schema)
    assert made.text.format.type == "json_schema"  # type: ignore[union-attr]


def test_bad_requests_are_400s_with_openai_bodies(served: Served) -> None:
    base = served.url.removesuffix("/v1")
    for body, param in (
        ({"model": "m", "input": 5}, "input"),
        ({"model": "m", "input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
        ({"model": "m", "input": "Hi", "tools": [{"type": "web_search"}]}, "tools[0]"),
        ({"model": "m", "input": "Hi", "text": {"format": {"type": "xml"}}}, "text.format"),
        (
            {"model": "m", "input": [{"role": "user", "content": [{"type": "input_file"}]}]},
            "input[0].content[0]",
        ),
        ({"model": "m", "input": "Hi", "store": "yes"}, "store"),
        ({"model": "m", "input": "Hi", "max_output_tokens": 0}, "max_output_tokens"),
        ({"model": "m", "input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
        ({"model": "m", "input": [{"role": ["user"], "content": "x"}]}, "input[0].role"),
        ({"model": "m", "input": [{"role": "assistant", "content": "x"}]}, "input"),
        (  # (no prefill on OpenAI's API: a stored response keeps its reply as a message of its own)
            {
                "model": "m",
                "input": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}],
            },
            "input",
        ),
        ({"model": "m", "input": "Hi", "safety_identifier": "s" * 300}, "safety_identifier"),
        ({"model": "m", "input": "Hi", "user": "u" * 300, "safety_identifier": "s"}, "user"),
    ):
        got = HTTP.post(f"{base}/v1/responses", json=body, headers={"Authorization": f"Bearer {KEY}"})
        assert got.status_code == 400, (body, got.text)
        assert got.json()["error"]["param"] == param, got.json()


def test_reasoning_items_are_the_next_turns_reasoning() -> None:
    """Pure: a reasoning item joins the assistant turn after it; with none after it, it is
    dropped; an empty assistant message the client sent is its own turn."""
    from llmsession.serve.responses import responses_ask

    thought = {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "hmm"}]}
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
    said = responses_ask({"model": "m", "input": [{"role": "user", "content": "Hi"}, thought, call]}).items
    assert said[1] == {
        "role": "assistant",
        "content": "",
        "reasoning_content": "hmm",
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
    }
    user = {"role": "user", "content": "Again"}
    assert responses_ask({"model": "m", "input": [user, thought, user]}).items == [
        {"role": "user", "content": "Again"},
        {"role": "user", "content": "Again"},
    ]
    empty = {"role": "assistant", "content": ""}
    items = responses_ask(
        {"model": "m", "input": [user, empty, {"role": "assistant", "content": "hi"}, user]}
    ).items
    assert [m["content"] for m in items] == ["Again", "", "hi", "Again"]
    # reasoning joined to an empty assistant message is that turn's, not a stand-in to drop,
    # nor is it taken for one after a reasoning item that adds none (encrypted, no summary)
    sealed = {"type": "reasoning", "summary": [], "encrypted_content": "gAAA"}
    for after in ([], [sealed]):
        assert responses_ask({"model": "m", "input": [user, thought, empty, *after, user]}).items == [
            user,
            {"role": "assistant", "content": "", "reasoning_content": "hmm"},
            user,
        ]


def test_an_agents_sdk_run_calls_a_function_tool(served: Served) -> None:
    """The OpenAI Agents SDK's loop on the Responses API: the model calls the tool (required on
    the first turn), the SDK runs it and sends its output back (the tiny model would call it
    again and again, so a hook asks for an answer then), and the run ends with the final text."""
    import agents

    called: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        called.append(city)
        return f"Sunny in {city}"

    class AnswerAfterTheTool(agents.AgentHooks):
        async def on_tool_end(self, context: Any, agent: Any, tool: Any, result: str) -> None:
            agent.model_settings = dataclasses.replace(agent.model_settings, tool_choice="none")

    aclient = openai.AsyncOpenAI(base_url=served.url, api_key=KEY, max_retries=0)
    agent = agents.Agent(
        name="guide",
        instructions="Call get_weather once, then answer in one sentence.",
        model=agents.OpenAIResponsesModel(model="m", openai_client=aclient),
        tools=[get_weather],
        model_settings=agents.ModelSettings(tool_choice="required", max_tokens=120, temperature=0),
        reset_tool_choice=False,
        hooks=AnswerAfterTheTool(),
    )
    agents.set_tracing_disabled(True)
    result = agents.Runner.run_sync(agent, "What is the weather in Paris?", max_turns=4)
    assert len(called) == 1 and called[0]
    assert isinstance(result.final_output, str) and result.final_output
    assert len(result.raw_responses) == 2  # the call, then the answer to its output


def events_of(text: str) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]


def test_a_call_cut_short_is_no_output_streamed_stored_or_not(served: Served) -> None:
    """``max_output_tokens`` cuts the reply inside a forced call: the reply makes no call
    (``Calling.conclude``). The stream showed the call begin, so its item closes
    ``incomplete``; the response it ends with, the one stored and the one not streamed hold no
    call, so nothing the client reads back is a call no continuation can answer; nor an empty
    message (OpenAI's has none: under ``text.format`` the SDK parses a message's text as JSON)."""
    asked = {"model": "m", "input": "Weather in Paris?", "tools": [TOOL], "tool_choice": "required", **GREEDY}
    auth = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=served.url.removesuffix("/v1"), headers=auth, timeout=120) as http:
        called = http.post("/v1/responses", json={**asked, "max_output_tokens": 64}).json()
        assert [item["type"] for item in called["output"]] == ["function_call"], called
        asked["max_output_tokens"] = called["usage"]["output_tokens"] - 2  # (its arguments or its end)
        events = events_of(http.post("/v1/responses", json={**asked, "stream": True}).text)
        done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
        assert [(i["type"], i["status"]) for i in done if i["type"] == "function_call"] == [
            ("function_call", "incomplete")
        ], done
        added = [e["output_index"] for e in events if e["type"] == "response.output_item.added"]
        assert added == list(range(len(added))), events  # (no index given twice)
        last = events[-1]
        assert last["type"] == "response.incomplete", last
        final = last["response"]
        assert final["output"] == [], final["output"]  # (as OpenAI's: no empty message either)
        stored = http.get(f"/v1/responses/{final['id']}").json()
        assert stored["output"] == final["output"] and stored["status"] == "incomplete"
        whole = http.post("/v1/responses", json=asked).json()
        assert whole["output"] == [] and whole["status"] == "incomplete", whole
    fields = {k: v for k, v in asked.items() if k != "temperature"}
    with client(served).responses.stream(**fields, extra_body=GREEDY) as stream:  # (the SDK reads it all)
        kinds = [event.type for event in stream]
    assert kinds[-1] == "response.incomplete" and "response.function_call_arguments.done" in kinds


@pytest.mark.parametrize("field", ["tools", "text"])
@pytest.mark.parametrize("stream", [False, True])
def test_what_a_response_echoes_nested_too_deep_is_a_400(served: Served, field: str, stream: bool) -> None:
    """A key nested ~980 levels deep parses (on a worker's stack) but could not be written back
    on the event loop's: it was a 500, or a stream cut off after its headers."""
    deep = "DEEP"  # (spelled below: the test's own stack would not write it either)
    body: dict[str, Any] = {"model": "m", "input": "Hi", "max_output_tokens": 2, "stream": stream}
    schema = {"type": "object", "properties": {"a": deep}}
    body |= {
        "tools": {"tools": [{**TOOL, "parameters": schema}]},
        "text": {"text": {"format": {"type": "json_schema", "name": "s", "schema": schema}}},
    }[field]
    text = json.dumps(body).replace('"DEEP"', '{"k": ' * 975 + '"x"' + "}" * 975)
    auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    answer = HTTP.post(f"{served.url}/responses", content=text, headers=auth, timeout=60)
    assert answer.status_code == 400, answer.text[:300]
    assert answer.json()["error"]["param"] == field


def test_a_response_echoes_only_what_was_read_of_its_request(served: Served) -> None:
    """A tool's, a tool choice's or a format's fields the engine has no use for are not kept
    with the response (an 8 MiB body of them took twenty times that in objects, kept with it)."""
    junk = {"junk": [{}] * 1000}
    tools = {"tools": [{**TOOL, **junk}], "tool_choice": {"type": "function", "name": "get_weather", **junk}}
    schema = {"type": "json_schema", "name": "s", "schema": {"type": "object"}}
    formatted = {"text": {"format": {**schema, **junk}}}  # (a reply takes tools or a format)
    with httpx.Client(base_url=served.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as http:
        for fields in (tools, formatted):
            answer = http.post(
                "/responses", json={"model": "m", "input": "Hi", "max_output_tokens": 2, **fields}
            )
            assert answer.status_code == 200, answer.text
            assert (
                "junk" not in answer.text and "junk" not in http.get(f"/responses/{answer.json()['id']}").text
            )
            echoed = answer.json()
            if fields is tools:
                assert echoed["tools"] == [TOOL] and echoed["tool_choice"] == FORCED
            else:
                assert echoed["text"]["format"] == schema
        # What it echoes is checked (a list as ``strict`` or a name, 8 MiB of it, was kept at
        # sixteen times its JSON), and a text format echoes no schema, name or strictness.
        for bad, param in (
            ({"tools": [{**TOOL, "strict": [[]] * 3}]}, "tools[0].strict"),
            ({"text": {"format": {**schema, "name": [[]]}}}, "text.format.name"),
            ({"text": {"format": {**schema, "name": "a b"}}}, "text.format.name"),
            ({"text": {"format": {**schema, "strict": "yes"}}}, "text.format.strict"),
            ({"text": {"format": {**schema, "description": [[]]}}}, "text.format.description"),
        ):
            answer = http.post(
                "/responses", json={"model": "m", "input": "Hi", "max_output_tokens": 2, **bad}
            )
            assert answer.status_code == 400 and answer.json()["error"]["param"] == param, answer.text
        plain = {"type": "text", "schema": [[]] * 3, "name": [[]], "strict": [[]]}
        answer = http.post(
            "/responses",
            json={"model": "m", "input": "Hi", "max_output_tokens": 2, "text": {"format": plain}},
        )
        assert answer.status_code == 200 and answer.json()["text"]["format"] == {"type": "text"}, answer.text


@pytest.mark.parametrize(
    "before",
    [[], [Snapshot("Sure.", "Sure.")], [Snapshot("", "", (ToolCallDelta(0, "call_a", "f", '{"x": 1}'),))]],
    ids=["alone", "after text", "after a whole call"],
)
def test_every_call_a_reply_cut_short_does_not_make_is_left_out(before: list[Snapshot]) -> None:
    """Pure logic of the stream's end: a reply cut short makes none of its calls, not even one
    whose item closed ``completed`` when the next opened; what is left (nothing: no empty
    message, which under ``text.format`` the SDK parsed and failed on) is the response, as the
    response not streamed is."""
    text = "".join(s.delta for s in before)
    cut = Reply(text, "length", Usage(), Timings())
    started, items, events = ResponseObject("m", {}), Items(), []
    for snapshot in [*before, Snapshot("", text, (ToolCallDelta(len(before), "call_b", "f", '{"x"'),))]:
        events += started.pieces(snapshot, items)
    out, final = started.finish(cut, items)
    read = [json.loads(e.decode().split("data: ", 1)[1]) for e in [*events, *out]]
    done = [e["item"] for e in read if e["type"] == "response.output_item.done"]
    assert [i["status"] for i in done if i.get("call_id") == "call_b"] == ["incomplete"]
    kept = [("message", "incomplete")] if text else []  # (as OpenAI's: no empty message when cut short)
    assert [(i["type"], i["status"]) for i in final["output"]] == kept, final
    shape = [(i["type"], i["status"], i.get("content")) for i in final["output"]]
    assert shape == [
        (i["type"], i["status"], i.get("content")) for i in ResponseObject("m", {}).whole(cut)["output"]
    ]


def test_a_failed_stream_leaves_the_item_it_was_writing_incomplete() -> None:
    """Pure: ``response.failed`` after part of a reply: the message it was writing is
    ``incomplete`` in the failed response, not ``completed``; an item closed before stays so."""
    from llmsession.serve.errors import ApiError

    started, items = ResponseObject("m", {}), Items()
    for snapshot in (Snapshot("", "", (ToolCallDelta(0, "call_a", "f", "{}"),)), Snapshot("par", "par")):
        started.pieces(snapshot, items)
    event = json.loads(started.failed(ApiError("boom", None), items).decode().split("data: ", 1)[1])
    assert event["type"] == "response.failed"
    output = event["response"]["output"]
    assert [(i["type"], i["status"]) for i in output] == [
        ("function_call", "completed"),
        ("message", "incomplete"),
    ]


def test_a_chain_of_responses_keeps_each_message_once(served: Served) -> None:
    """A continuation's stored transcript reuses its predecessor's messages (the same objects),
    as the store sizes it: a chain of N responses does not hold N copies of its history."""
    import hashlib

    made = client(served).responses.create(
        model="m", instructions="Be brief.", input="Name a colour.", max_output_tokens=2, **GREEDY
    )
    chain = [made.id]
    for question in ("And another?", "And a third?"):
        made = client(served).responses.create(
            model="m", previous_response_id=made.id, input=question, max_output_tokens=2, **GREEDY
        )
        chain.append(made.id)
    owner = hashlib.sha256(KEY.encode()).hexdigest()
    kept = [served.server.store.get(ident, owner) for ident in chain]
    assert all(stored is not None for stored in kept)
    transcripts = [stored.transcript for stored in kept if stored is not None]
    assert [len(t) for t in transcripts] == [2, 4, 6]  # (a question and its reply each: no system)
    for before, after in itertools.pairwise(transcripts):
        assert all(a is b for a, b in zip(before, after, strict=False)), (before, after)


class NoMore:
    """A stand-in for a door's choices whose events all came first (pure logic)."""

    def cancel(self) -> None:
        pass


@pytest.mark.parametrize("finish", ["stop", "length", "cancelled"])
def test_a_response_is_stored_before_its_client_reads_that_it_ended(finish: str) -> None:
    """Stored once its client read ``response.completed``, a response could be continued or
    fetched only after the server went on (a continuation got "still in progress" meanwhile,
    and a client gone at that moment left it unstored). One cut short by its client going or
    the server stopping (``cancelled``) is stored never, and says so in its status."""
    reply = Reply("Hi", finish, Usage(), Timings())  # type: ignore[arg-type]
    stored: list[dict[str, Any]] = []
    door = ResponsesDoor(ResponseObject("m", {}), lambda body, _, __: stored.append(body))

    async def read() -> list[str]:
        kinds: list[str] = []
        async for piece in door.stream(NoMore(), [Event(0, reply=reply)]):  # type: ignore[arg-type]
            said = json.loads(piece.decode().split("data: ", 1)[1])
            kind = said["type"]
            if kind in ("response.completed", "response.incomplete", "response.failed"):
                assert len(stored) == (finish != "cancelled"), kind  # (as its end is read)
                assert said["response"]["store"] is (finish != "cancelled"), said  # (and says so)
            kinds.append(kind)
        return kinds

    kinds = asyncio.run(read())
    status = {"stop": "completed", "length": "incomplete", "cancelled": "cancelled"}[finish]
    assert kinds[-1] == ("response.completed" if finish == "stop" else "response.incomplete")
    whole = door.whole([reply], None)  # (made off the event loop, then settled on it)
    door.settle(whole, [reply], rendered(whole))
    assert whole["status"] == status and whole["store"] is (finish != "cancelled")
    assert len(stored) == 2 * (finish != "cancelled")
    assert all(item["status"] in ("completed", "incomplete") for item in door.whole([reply], None)["output"])


def png_url() -> str:
    import base64
    import io

    from PIL import Image

    data = io.BytesIO()
    Image.new("RGB", (2, 2)).save(data, format="PNG")
    return "data:image/png;base64," + base64.b64encode(data.getvalue()).decode()


def test_a_chain_of_responses_is_bounded_by_its_new_input_not_its_whole_history() -> None:
    """A continuation's stored transcript was read again as part of the new request, so a chain
    hit one request's bounds: a third turn of three images each got "at most 8 images", an
    agent's 340th step "at most 1,024 messages". The stored turns are read once, when asked;
    the new input is bounded as any request is (pure: the requests as the route reads them)."""
    pictured = [{"type": "input_image", "image_url": png_url()}] * 3
    history: list[dict[str, Any]] = []
    for turn in range(3):
        asked = responses_request(
            responses_ask(
                {
                    "model": "m",
                    "input": [{"role": "user", "content": [*pictured, {"type": "input_text", "text": "?"}]}],
                }
            ),
            history,
        )
        history = [*asked.messages.messages(), {"role": "assistant", "content": f"Seen {turn}."}]
    long = [
        message
        for n in range(600)
        for message in ({"role": "user", "content": f"{n}"}, {"role": "assistant", "content": "ok"})
    ]
    asked = responses_request(responses_ask({"model": "m", "input": "And now?"}), long)
    assert len(asked.messages.messages()) == 1201
    for too_many in (  # (the new input's own bounds stand)
        {"model": "m", "input": [{"role": "user", "content": [*pictured, *pictured, *pictured]}]},
        {"model": "m", "input": [{"role": "user", "content": "a"}] * 1025},
    ):
        with pytest.raises(ApiError):
            responses_request(responses_ask(too_many), history)


def test_a_response_the_store_does_not_take_says_it_is_not_stored(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past what the store takes, a response is not kept: it said ``store: true`` and a later
    retrieval or continuation was a 404 with nothing to tell why. The response not streamed
    says ``store: false`` (a stream's last event is sent as it is)."""
    monkeypatch.setattr(served.server.store, "size", 100)  # (bytes: any response is larger)
    with served.http() as http:
        answer = http.post("/v1/responses", json={"model": "m", "input": "Hi", "max_output_tokens": 2})
        assert answer.status_code == 200 and answer.json()["store"] is False, answer.text
        assert http.get(f"/v1/responses/{answer.json()['id']}").status_code == 404
        asked = {"model": "m", "input": "Hi", "max_output_tokens": 2, "stream": True}
        with http.stream("POST", "/v1/responses", json=asked) as streamed:
            events = [json.loads(line[6:]) for line in streamed.iter_lines() if line.startswith("data: ")]
        assert events[-1]["response"]["store"] is False and events[0]["response"]["store"] is True


def test_a_continued_responses_images_count_with_its_stored_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each call decodes every image of the transcript it continues: a chain adding 8 a turn
    (each turn's input within the bound) made the 30th call decode 240 (an 8 MiB body holds
    8 of 4,096 x 4,096 pixels: 50 MB each, decoded at once). Their pixels count with the new
    ones' (here each image is as large as 2 pixels: 16 in all)."""
    monkeypatch.setattr(images, "MAX_TOTAL_PIXELS", 16 * 2 * 2)
    picture = {"type": "input_image", "image_url": png_url()}
    stored = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": png_url()}}] * 8}
    history = [stored, {"role": "assistant", "content": "Red."}]
    for more in (1, 8):  # (16 in all: within)
        asked = responses_ask({"model": "m", "input": [{"role": "user", "content": [picture] * more}]})
        assert responses_request(asked, history).messages
    asked = responses_ask({"model": "m", "input": [{"role": "user", "content": [picture]}]})
    with pytest.raises(ApiError, match="pixels of images in all") as refused:
        responses_request(asked, [*history, *history])
    assert refused.value.param is not None and refused.value.param.startswith("input")


def test_a_function_call_outputs_image_follows_the_outputs_or_is_a_line_of_text() -> None:
    """Codex's ``view_image`` (and an MCP tool's picture) comes back as an ``input_image`` part of
    a ``function_call_output``: it was a 400, and Codex resends the history every turn, so the
    whole session was stuck. On a model with images the picture follows the outputs as the user's
    (before what the user says next); on one without, a line says it was left out, as a file."""
    call = {"type": "function_call", "call_id": "c1", "name": "view_image", "arguments": "{}"}
    picture = {"type": "input_image", "image_url": png_url(), "detail": "auto"}
    output = {
        "type": "function_call_output",
        "call_id": "c1",
        "output": [{"type": "input_text", "text": "ok"}, picture, {"type": "input_file", "file_data": "x"}],
    }
    said = {"role": "user", "content": "What is in it?"}
    for after in ([said], []):
        body = {"model": "m", "input": [{"role": "user", "content": "Look."}, call, output, *after]}
        seeing = responses_request(responses_ask(body), []).messages.messages()
        assert [m["role"] for m in seeing] == ["user", "assistant", "tool", "user"]
        assert seeing[2]["content"] == "ok\n[image: below]\n[input_file part: not shown to this model]"
        shown = [p["type"] for p in seeing[3]["content"]]
        assert shown == (["image_url", "text"] if after else ["image_url"]), seeing[3]
        blind = responses_request(responses_ask(body, images=False), []).messages.messages()
        assert [m["role"] for m in blind] == ["user", "assistant", "tool", *(["user"] if after else [])]
        assert blind[2]["content"] == "ok\n[input_image part: not shown to this model]\n" + (
            "[input_file part: not shown to this model]"
        )
    for bad in ({"type": "input_image"}, {"type": "audio"}, "text"):
        broken = {**output, "output": [bad]}
        with pytest.raises(ApiError) as refused:
            responses_ask({"model": "m", "input": [call, broken]})
        assert refused.value.param == "input[1].output[0]", refused.value


def test_allowed_tools_narrow_the_calls_on_both_openai_doors(served: Served) -> None:
    """``tool_choice`` ``allowed_tools`` (a 400 before): a forced call names the one tool it
    lists, every tool still declared; as Responses spells it and as chat completions does."""
    clock = {
        "type": "function",
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    }
    listed = [{"type": "function", "name": "get_time"}]
    choice: Any = {"type": "allowed_tools", "mode": "required", "tools": listed}
    asked: Any = {"model": "m", "input": "What's the weather in Paris?", "max_output_tokens": 64, **GREEDY}
    made = client(served).responses.create(**asked, tools=[TOOL, clock], tool_choice=choice)
    assert [(o.type, getattr(o, "name", None)) for o in made.output] == [("function_call", "get_time")]
    assert made.tool_choice.type == "allowed_tools" and made.tool_choice.tools == listed  # type: ignore[union-attr]
    functions = [
        {"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in (TOOL, clock)
    ]
    chat = client(served).chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "What's the weather in Paris?"}],
        tools=functions,  # type: ignore[arg-type]
        tool_choice={  # type: ignore[arg-type]
            "type": "allowed_tools",
            "allowed_tools": {
                "mode": "required",
                "tools": [{"type": "function", "function": {"name": "get_time"}}],
            },
        },
        max_tokens=64,
        **GREEDY,
    )
    calls = chat.choices[0].message.tool_calls or []
    assert [c.function.name for c in calls] == ["get_time"], chat  # type: ignore[union-attr]
    with pytest.raises(openai.BadRequestError) as refused:
        client(served).responses.create(
            **asked, tools=[TOOL], tool_choice={"type": "allowed_tools", "mode": "auto", "tools": listed}
        )
    assert refused.value.param == "tool_choice", refused.value.body


def test_allowed_tools_of_another_kind_are_refused_not_taken_for_functions() -> None:
    """(A reviewer's read: any entry with a name became a function, and was echoed as one.)"""
    tools = [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}]
    for entry in ({"type": "custom", "name": "get_weather"}, {"type": "mcp", "name": "get_weather"}, "x"):
        choice = {"type": "allowed_tools", "mode": "auto", "tools": [entry]}
        with pytest.raises(ApiError) as refused:
            responses_request(
                responses_ask({"model": "m", "input": "Hi", "tools": tools, "tool_choice": choice}), []
            )
        assert refused.value.param == "tool_choice", refused.value
    good = {"type": "allowed_tools", "mode": "auto", "tools": [{"type": "function", "name": "get_weather"}]}
    assert responses_request(
        responses_ask({"model": "m", "input": "Hi", "tools": tools, "tool_choice": good}), []
    )


def test_logprobs_asked_by_include_score_the_output_text(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``include: ["message.output_text.logprobs"]`` with ``top_logprobs``: every part and delta
    sent ``logprobs: []`` whatever was asked. The text's tokens are scored as chat scores them,
    their bytes spell the text, and a stream's deltas join up to its final part's (the SDK's
    helper reads a stream to ``response.completed``: a reply that ends by itself). A stored
    response's body is made off the event loop (its scores were dicts made on it), and kept
    with its scores."""
    threads: dict[str, str] = {}
    made_whole, put = ResponseObject.whole, responding.ResponseStore.put

    def whole(self: ResponseObject, reply: Reply) -> dict[str, Any]:
        threads["whole"] = threading.current_thread().name
        return made_whole(self, reply)

    def kept(self: Any, *args: Any, **kwargs: Any) -> bool:
        threads["put"] = threading.current_thread().name
        return put(self, *args, **kwargs)

    from llmsession.serve import store

    rendered_here: list[str] = []
    render = store.rendered

    def counted(value: Any) -> bytes:
        rendered_here.append(threading.current_thread().name)
        return render(value)

    monkeypatch.setattr(ResponseObject, "whole", whole)
    monkeypatch.setattr(responding.ResponseStore, "put", kept)
    monkeypatch.setattr(store, "rendered", counted)
    asked: Any = {"model": "m", "input": "Say hello to Paris.", "max_output_tokens": 120, **GREEDY}
    scored = {**asked, "include": ["message.output_text.logprobs"], "top_logprobs": 2}
    made = client(served).responses.create(**scored)
    assert threads["whole"] != threads["put"], threads  # (the store is the loop's; the body not)
    assert rendered_here == []  # (kept as it was rendered off the loop: not again on it)
    (part,) = made.output[0].content  # type: ignore[union-attr]
    entries = part.logprobs or []  # type: ignore[union-attr]
    assert entries and b"".join(bytes(e.bytes) for e in entries).decode() == made.output_text
    assert all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in entries)
    again = client(served).responses.retrieve(made.id)
    assert again.output[0].content[0].logprobs == entries  # type: ignore[union-attr]
    chat = client(served).chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "Say hello to Paris."}],
        max_tokens=120,
        logprobs=True,
        top_logprobs=2,
        **GREEDY,
    )
    chatted = chat.choices[0].logprobs.content or []  # type: ignore[union-attr]
    if chat.choices[0].message.content == made.output_text:  # (a near-tie may part them: AVX2)
        assert [e.token for e in chatted] == [e.token for e in entries]
    with client(served).responses.stream(**scored) as stream:
        sent = [s for event in stream if event.type == "response.output_text.delta" for s in event.logprobs]
        final = stream.get_final_response()
    (streamed,) = final.output[0].content  # type: ignore[union-attr]
    assert [s.token for s in sent] == [s.token for s in streamed.logprobs or []]  # type: ignore[union-attr]
    assert b"".join(bytes(s.bytes) for s in sent).decode() == final.output_text
    plain = client(served).responses.create(**asked, include=["reasoning.encrypted_content"])
    assert plain.output[0].content[0].logprobs == []  # type: ignore[union-attr]  (not asked: none)
    with pytest.raises(openai.BadRequestError) as refused:
        client(served).responses.create(**asked, include="message.output_text.logprobs")  # type: ignore[arg-type]
    assert refused.value.param == "include"


def _scored(text: str) -> TokenLogprob:
    return TokenLogprob(text, text.encode(), -0.5, (Alternative(text, text.encode(), -0.5),))


def test_scores_go_with_their_message_when_a_call_follows_or_they_come_late() -> None:
    """Pure: a stream scored as asked (``include``), text then a call. A token's score that
    comes after its text was streamed (a stop string held it, then did not match) goes with the
    next delta, and one the reply alone holds (the call opened meanwhile) with the message, not
    lost with the call; every delta's, the done events' and the last response's scores are the
    message's text's, in order, and the same as the response not streamed says."""
    entries = tuple(map(_scored, ("Sure", ",", " here", ".")))
    call = ToolCall("call_a", "f", '{"x": 1}')
    reply = Reply("Sure, here.", "tool_calls", Usage(), Timings(), tool_calls=(call,), logprobs=entries)
    snapshots = [
        Snapshot("Sure", "Sure", logprobs=entries[:1]),
        Snapshot(",", "Sure,"),  # (its score held back: it comes with the next)
        Snapshot(" here.", "Sure, here.", logprobs=entries[1:3]),
        Snapshot("", "Sure, here.", (ToolCallDelta(0, "call_a", "f", '{"x": 1}'),)),
    ]  # (the last score, ".", only in the reply)
    started, items, events = ResponseObject("m", {}, logprobs=True), Items(), []
    for snapshot in snapshots:
        events += started.pieces(snapshot, items)
    out, final = started.finish(reply, items)
    read = [json.loads(e.decode().split("data: ", 1)[1]) for e in [*events, *out]]
    tokens = ["Sure", ",", " here", "."]
    deltas = [s["token"] for e in read if e["type"] == "response.output_text.delta" for s in e["logprobs"]]
    assert deltas == tokens[:3], read
    done = [e for e in read if e["type"] == "response.output_text.done"]
    parts = [e["part"] for e in read if e["type"] == "response.content_part.done"]
    assert [[s["token"] for s in e["logprobs"]] for e in done] == [tokens[:3]]  # (closed before ".")
    assert [[s["token"] for s in p["logprobs"]] for p in parts] == [tokens[:3]]
    message, made = final["output"][0], final["output"][1]
    assert made["type"] == "function_call" and made["call_id"] == "call_a"
    scores = json.loads(rendered(message["content"][0]["logprobs"]))
    assert [s["token"] for s in scores] == tokens, scores
    assert scores == json.loads(rendered(read[-1]["response"]["output"][0]["content"][0]["logprobs"]))
    whole = ResponseObject("m", {}, logprobs=True).whole(reply)
    assert json.loads(rendered(whole["output"][0]["content"][0]["logprobs"])) == scores
    assert scores[0]["top_logprobs"] == [{"token": "Sure", "logprob": -0.5, "bytes": list(b"Sure")}]
    unscored = ResponseObject("m", {}).whole(reply)
    assert unscored["output"][0]["content"][0]["logprobs"] == []  # (not asked: none)


def test_a_stored_responses_new_input_is_sized_off_the_event_loop(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store sized a response's new input (its images' base64: up to 8 MiB) as JSON on the
    event loop as it kept it; it is sized with the transcript, off the loop, and only the reply
    is sized on it."""
    from llmsession.serve import store

    sized: list[tuple[str, int]] = []
    size = store.json_size

    def counted(value: Any) -> int:
        sized.append((threading.current_thread().name, n := size(value)))
        return n

    put = store.ResponseStore.put
    loop: list[str] = []

    def kept(self: Any, *args: Any, **kwargs: Any) -> bool:
        loop.append(threading.current_thread().name)
        return put(self, *args, **kwargs)

    monkeypatch.setattr(store, "json_size", counted)
    monkeypatch.setattr(store.ResponseStore, "put", kept)
    words = "a long input, " * 400
    made = client(served).responses.create(model="m", input=words, max_output_tokens=2, **GREEDY)
    assert client(served).responses.retrieve(made.id).id == made.id
    (on_loop,) = set(loop)
    assert max(n for thread, n in sized if thread != on_loop) > len(words)  # (the input: off it)
    assert all(n < 1_000 for thread, n in sized if thread == on_loop), sized  # (the reply alone)
