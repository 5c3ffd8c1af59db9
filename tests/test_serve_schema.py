"""The server's pure parts: a request body checked into messages and options, OpenAI's bodies
and stream chunks, the error bodies, the counters and the admission queue. No model."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from llmsession import GrammarError, MemoryBudgetError, TemplateError
from llmsession.options import INT32_MAX
from llmsession.replies import Reply, Snapshot, Timings, ToolCall, ToolCallDelta, Usage
from llmsession.serve import sse
from llmsession.serve.errors import RequestError, from_library
from llmsession.serve.metrics import Metrics
from llmsession.serve.runner import Admission
from llmsession.serve.schema import chat_request, parse_json

HI = [{"role": "user", "content": "Hi"}]
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}},
}


def test_a_full_request_becomes_options_and_messages() -> None:
    body = {
        "model": "anything",
        "messages": [
            {"role": "developer", "content": "Be terse."},
            {"role": "user", "content": [{"type": "text", "text": "Hi"}], "name": "ann"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        ],
        "max_completion_tokens": 12,
        "max_tokens": 99,
        "temperature": 0,
        "top_p": 0.5,
        "stop": "END",
        "seed": 7,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "tools": [WEATHER],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "stream": True,
        "stream_options": {"include_usage": True},
        "user": "u1",
        "n": 3,
        "some_future_field": {"ignored": True},
    }
    asked = chat_request(body)
    options = asked.options
    assert (options.max_tokens, options.temperature, options.top_p, options.seed) == (12, 0.0, 0.5, 7)
    assert options.stop == ("END",) and options.tools == (WEATHER,) and options.tool_choice == "required"
    assert options.parallel_tool_calls is False
    assert (options.presence_penalty, options.frequency_penalty) == (0.5, -0.5)
    assert (asked.stream, asked.include_usage, asked.user, asked.n) == (True, True, "u1", 3)
    roles = [m["role"] for m in asked.messages]
    assert roles == ["system", "user", "assistant", "tool"]
    assert asked.messages[1] == {"role": "user", "name": "ann", "content": [{"type": "text", "text": "Hi"}]}
    assert asked.messages[2]["content"] == "" and asked.messages[2]["tool_calls"][0]["id"] == "c1"
    assert asked.messages[3]["tool_call_id"] == "c1"


def test_defaults_and_response_formats() -> None:
    asked = chat_request({"messages": HI}, default_max_tokens=INT32_MAX)
    assert asked.options.max_tokens == INT32_MAX and asked.n == 1 and not asked.stream
    assert asked.options.json_schema is None
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    formats: list[tuple[Any, Any]] = [
        ({"type": "text"}, None),
        ({"type": "json_object"}, {"type": "object"}),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}, schema),
    ]
    for given, expected in formats:
        assert chat_request({"messages": HI, "response_format": given}).options.json_schema == expected
    assert chat_request({"messages": HI, "max_tokens": 16.0}).options.max_tokens == 16


BAD = [
    ({"messages": "hi"}, "messages"),
    ({}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": ["hi"]}, "messages[0]"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "a\0b"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "audio"}]}]}, "messages[0].content[0]"),
    (
        {
            "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}
            ]
        },
        "messages[0].content[0]",
    ),
    (
        {
            "messages": [
                {"role": "system", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}
            ]
        },
        "messages[0].content[0]",
    ),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": 1}]}]}, "messages[0].tool_calls[0]"),
    ({"messages": HI, "temperature": "hot"}, "temperature"),
    ({"messages": HI, "temperature": 3}, "temperature"),
    ({"messages": HI, "temperature": True}, "temperature"),
    ({"messages": HI, "top_p": 0}, "top_p"),
    ({"messages": HI, "max_tokens": 0}, "max_tokens"),
    ({"messages": HI, "max_tokens": "8"}, "max_tokens"),
    ({"messages": HI, "max_completion_tokens": 1.5}, "max_completion_tokens"),
    ({"messages": HI, "seed": -1}, "seed"),
    ({"messages": HI, "stop": 5}, "stop"),
    ({"messages": HI, "stop": ["a", ""]}, "stop"),
    ({"messages": HI, "n": 9}, "n"),
    ({"messages": HI, "n": 0}, "n"),
    ({"messages": HI, "logprobs": True}, "logprobs"),
    ({"messages": HI, "top_logprobs": 2}, "logprobs"),
    ({"messages": HI, "stream": "yes"}, "stream"),
    ({"messages": HI, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
    ({"messages": HI, "response_format": {"type": "xml"}}, "response_format"),
    (
        {"messages": HI, "response_format": {"type": "json_schema", "json_schema": {"schema": 3}}},
        "response_format",
    ),
    ({"messages": HI, "tools": "all"}, "tools"),
    ({"messages": HI, "tools": ["x"]}, "tools"),
    ({"messages": HI, "tool_choice": 3}, "tool_choice"),
    ({"messages": HI, "parallel_tool_calls": "no"}, "parallel_tool_calls"),
    ({"messages": HI, "user": 12}, "user"),
    ({"messages": HI, "model": 12}, "model"),
]


@pytest.mark.parametrize(("body", "param"), BAD)
def test_a_bad_field_is_a_400_naming_it(body: dict[str, Any], param: str) -> None:
    with pytest.raises(RequestError) as caught:
        chat_request(body)
    error = caught.value
    assert error.status == 400 and error.param == param, error
    assert set(error.body()["error"]) == {"message", "type", "param", "code"}
    assert error.body()["error"]["type"] == "invalid_request_error"


def test_the_body_must_be_a_json_object() -> None:
    assert parse_json(b'{"a": 1}') == {"a": 1}
    for body in (b"{bad", b"[1, 2]", b'{"t": NaN}', b"\xff\xfe", b"[" * 100_000):
        with pytest.raises(RequestError):
            parse_json(body)


def test_library_errors_map_to_statuses() -> None:
    statuses = {
        TemplateError("no"): 400,
        GrammarError("bad schema"): 400,
        ValueError("bad option"): 400,
        MemoryBudgetError("full"): 503,
    }
    for error, status in statuses.items():
        mapped = from_library(error)
        assert mapped is not None and mapped.status == status, error
    busy = from_library(MemoryBudgetError("full"))
    assert busy is not None and busy.headers() == {"Retry-After": "1"}
    assert from_library(RuntimeError("a bug")) is None  # a logged 500, not the client's fault


def reply(text: str = "Hello", finish: Any = "stop", calls: tuple[ToolCall, ...] = ()) -> Reply:
    usage = Usage(prompt_tokens=10, reused_tokens=4, completion_tokens=3)
    return Reply(text, finish, usage, Timings(time_to_first_token_s=0.2), None, calls)


def test_a_body_and_chunks_are_openais() -> None:
    completion = sse.Completion("m", include_usage=True)
    body = completion.body([reply(), reply("Bye", "complete")])
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert [c["finish_reason"] for c in body["choices"]] == ["stop", "stop"]
    assert body["choices"][1]["message"] == {"role": "assistant", "content": "Bye", "refusal": None}
    assert body["usage"] == {
        "prompt_tokens": 10,
        "completion_tokens": 6,
        "total_tokens": 16,
        "prompt_tokens_details": {"cached_tokens": 4},
    }
    chunks = [
        completion.opening(0),
        *completion.pieces(0, Snapshot("Hel", "Hel")),
        *completion.pieces(0, Snapshot("", "Hel")),
        completion.finish(0, reply(finish="length")),
        completion.usage_chunk([reply()]),
    ]
    assert len({c["id"] for c in chunks}) == 1 and all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[1]["choices"][0]["delta"] == {"content": "Hel"} and chunks[1]["usage"] is None
    assert len(chunks) == 4  # the empty snapshot wrote nothing
    assert chunks[2]["choices"][0]["finish_reason"] == "length"
    assert chunks[3]["choices"] == [] and chunks[3]["usage"]["total_tokens"] == 13
    assert sse.event({"a": "é"}) == 'data: {"a":"é"}\n\n'.encode()
    assert "usage" not in sse.Completion("m").opening(0)


def test_tool_calls_in_a_body_and_as_deltas() -> None:
    call = ToolCall("call_1", "get_weather", '{"city":"Oslo"}')
    message = sse.message(reply("", "tool_calls", (call,)))
    assert message["content"] is None
    assert message["tool_calls"] == [
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'},
        }
    ]
    completion = sse.Completion("m")
    pieces = [ToolCallDelta(0, "call_1", "get_weather", ""), ToolCallDelta(0, arguments='{"city"')]
    (chunk,) = completion.pieces(0, Snapshot("", "", tuple(pieces)))
    first, second = chunk["choices"][0]["delta"]["tool_calls"]
    assert first == {
        "index": 0,
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": ""},
    }
    assert second == {"index": 0, "function": {"arguments": '{"city"'}}
    assert sse.FINISH["tool_calls"] == "tool_calls" and sse.FINISH["complete"] == "stop"


def test_metrics_render_prometheus_text() -> None:
    metrics = Metrics()
    metrics.request("/v1/chat/completions", 200)
    metrics.request("/v1/chat/completions", 400)
    metrics.reply(reply())
    metrics.reply(reply(finish="cancelled"))
    text = metrics.render(["live", "parked", "live"])
    assert 'llmsession_requests_total{path="/v1/chat/completions",status="400"} 1' in text
    assert "llmsession_prompt_tokens_total 20" in text and "llmsession_cached_prompt_tokens_total 8" in text
    assert "llmsession_completion_tokens_total 6" in text
    assert 'llmsession_replies_total{finish_reason="cancelled"} 1' in text
    assert 'llmsession_time_to_first_token_seconds_bucket{le="0.1"} 0' in text
    assert 'llmsession_time_to_first_token_seconds_bucket{le="0.25"} 2' in text
    assert "llmsession_time_to_first_token_seconds_count 2" in text
    assert 'llmsession_sessions{state="live"} 2' in text and 'llmsession_sessions{state="disk"} 0' in text
    for line in text.splitlines():  # every sample line is `name{labels} value`
        assert line.startswith("#") or float(line.rsplit(" ", 1)[1]) >= 0, line


def test_admission_queues_then_refuses() -> None:
    async def scenario() -> list[str]:
        admission = Admission(limit=2, queue=1)
        order: list[str] = []
        assert await admission.acquire(2) == 2

        async def waiter() -> None:
            weight = await admission.acquire(1)
            order.append("granted")
            admission.release(weight)

        task = asyncio.create_task(waiter())
        await asyncio.sleep(0)
        with pytest.raises(RequestError) as caught:  # one waits already: the queue is full
            await admission.acquire(1)
        assert caught.value.status == 503 and caught.value.headers() == {"Retry-After": "1"}
        order.append("released")
        admission.release(2)
        await task
        assert admission.used == 0
        assert await admission.acquire(8) == 2  # more than the limit waits for all of it
        return order

    assert asyncio.run(scenario()) == ["released", "granted"]


def test_error_bodies_are_json() -> None:
    error = RequestError("nope", "n", "bad", 400)
    assert json.loads(json.dumps(error.body())) == {
        "error": {"message": "nope", "type": "invalid_request_error", "param": "n", "code": "bad"}
    }
