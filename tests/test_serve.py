"""``llmsession serve`` end to end: a real uvicorn on a free port, real HTTP, the official
``openai`` client, the default SmolLM2 model. One model and one server for the module."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
import logging
import math
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import internals
import jsonschema
import openai
import pytest
from near_ties import assert_entries_within_noise
from plain_http import HTTP
from serve_helpers import KEY, OTHER_KEY, WEATHER, Served, metric, running
from test_reuse import batch_noise

from llmsession import GenerationOptions, MemoryBudgetError, Model, ModelClosedError
from llmsession.replies import Reply
from llmsession.serve import bodies, doors, sse
from llmsession.serve.app import create_app
from llmsession.serve.bodies import PARSERS

BODY_LIMIT = 1 << 20


@pytest.fixture(scope="module")
def served(smollm2_path: Path) -> Iterator[Served]:
    with Model(smollm2_path, threads=1) as model:
        app = create_app(model, api_key=[KEY, OTHER_KEY], max_body_bytes=BODY_LIMIT)
        with running(app) as url:
            yield Served(model, url, app.state.server.model_name, app.state.server)


@pytest.fixture(scope="module")
def narrow(smollm2_path: Path) -> Iterator[Served]:
    """One live session, one request may wait: a second request queues, a third is a 503."""
    with Model(smollm2_path, threads=1, max_live_sessions=1) as model:
        app = create_app(model, queue=1)
        with running(app) as url:
            yield Served(model, url, app.state.server.model_name, app.state.server, key=None)


@dataclass
class Faulty:
    """The served model, but for requests whose last message says so: HOLD waits for ``go``
    (holding its place), BUDGET finds the memory budget full (``budget`` times), BUG fails as a
    bug in the server would. Every stream it makes is kept, with its decoded count when it
    was first cancelled."""

    model: Model
    go: threading.Event = field(default_factory=threading.Event)
    holding: int = 0
    budget: int = 1
    late: float = 0.0  # how long a LATEBUDGET request's prompt takes before it finds the budget full
    streams: list[Any] = field(default_factory=list)
    cancelled_at: dict[int, int] = field(default_factory=dict)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)

    def chat_stream(self, messages: Any, options: Any = None, **args: Any) -> Any:
        text = str(messages[-1]["content"])
        if "HOLD" in text:
            self.holding += 1
            assert self.go.wait(60)
        if "BUDGET" in text and self.budget > 0:
            time.sleep(self.late if "LATEBUDGET" in text else 0)
            self.budget -= 1
            raise MemoryBudgetError("sessions 3 and 7 hold 8100 of 8192 KV cells")
        if "BUG" in text:
            raise ValueError("/srv/llmsession/secret-state.bin: the engine's state is 42")
        stream = self.model.chat_stream(messages, options, **args)
        cancel, index = stream.cancel, len(self.streams)

        def counted() -> None:
            self.cancelled_at.setdefault(index, len(stream.exchange.tokens))
            cancel()

        stream.cancel = counted
        self.streams.append(stream)
        return stream


@pytest.fixture
def faulty(served: Served, monkeypatch: pytest.MonkeyPatch) -> Iterator[Faulty]:
    fault = Faulty(served.model)
    monkeypatch.setattr(served.server.host, "model", fault)
    yield fault
    fault.go.set()


def ask(served: Served, text: str, **extra: Any) -> Any:
    messages = extra.pop("messages", [{"role": "user", "content": text}])
    return served.client(extra.pop("key", KEY)).chat.completions.create(
        model=served.name, messages=messages, **{"max_tokens": 8, "temperature": 0, **extra}
    )


def test_models_health_and_a_plain_chat(served: Served) -> None:
    models = served.client().models.list().data
    assert [m.id for m in models] == [served.name] == ["SmolLM2-135M-Instruct.Q4_1"]
    assert models[0].model_extra is not None and models[0].model_extra["capabilities"]["images"] is False
    with served.http(key=None) as http:
        assert http.get("/health").json() == {"status": "ok"}  # (which model: the keys' to read)
    reply = ask(served, "Name a colour.", user="plain")
    choice = reply.choices[0]
    assert reply.object == "chat.completion" and reply.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    usage = reply.usage
    assert usage is not None and usage.prompt_tokens > 5 and 0 < usage.completion_tokens <= 8
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_a_stream_is_openais_and_says_what_the_plain_reply_says(served: Served) -> None:
    question, scored = "Tell me about the sea.", {"logprobs": True, "top_logprobs": 5}
    plain = ask(served, question, max_tokens=12, seed=3, user="plain-twin", **scored)
    chunks = list(
        ask(
            served,
            question,
            max_tokens=12,
            seed=3,
            user="stream-twin",
            stream=True,
            stream_options={"include_usage": True},
            **scored,
        )
    )
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    scores = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    streamed = [entry for score in scores for entry in score.content or ()]
    assert "".join(e.token for e in streamed) == text
    # Their sessions' cells lie elsewhere in the cache: equal within the measured noise.
    assert_entries_within_noise(served.model, streamed, plain.choices[0].logprobs.content)
    alike = text == plain.choices[0].message.content  # (else they parted at a near tie)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishes) == 1 and (finishes == [plain.choices[0].finish_reason] or not alike)
    *body, last = chunks
    assert last.choices == [] and last.usage is not None and all(c.usage is None for c in body)
    assert last.usage.completion_tokens == len(streamed)
    assert last.usage.completion_tokens == plain.usage.completion_tokens or not alike
    assert (
        last.usage.prompt_tokens_details is not None and last.usage.prompt_tokens_details.cached_tokens == 0
    )


def test_the_raw_stream_ends_with_done(served: Served) -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": True}
    with served.http() as http, http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in events)
    assert events[-1] == "data: [DONE]"
    finish = json.loads(events[-2][6:])
    assert finish["choices"][0]["finish_reason"] in ("stop", "length") and "usage" not in finish


def test_a_resent_history_is_served_from_the_cache(served: Served) -> None:
    history: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a terse guide."},
        {"role": "user", "content": "Name a big city in France."},
    ]
    first = ask(served, "", messages=history, user="historian")
    history += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "What river flows through it?"},
    ]
    second = ask(served, "", messages=history, user="historian")
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens, (cached, first.usage.prompt_tokens)
    assert cached < second.usage.prompt_tokens


def test_tenants_never_share_cells(served: Served) -> None:
    """Another user, or another key, finds nothing of a prompt one tenant sent; the same
    tenant resending it finds it all."""
    question = "Which planet is the largest? Answer in one word, tenancy test."

    def cached(**who: Any) -> int:
        return ask(served, question, **who).usage.prompt_tokens_details.cached_tokens  # type: ignore[no-any-return]

    assert cached(user="alice") == 0
    assert cached(user="bob") == 0
    assert cached(user="alice", key=OTHER_KEY) == 0
    assert cached(user="alice") > 10


def test_a_json_schema_reply_validates(served: Served) -> None:
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 16}},
        "required": ["city"],
        "additionalProperties": False,
    }
    response_format: Any = {"type": "json_schema", "json_schema": {"name": "city", "schema": schema}}
    reply = ask(served, "Name a city in JSON.", max_tokens=24, response_format=response_format)
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reply.choices[0].message.content), schema)


def test_a_reply_that_fails_a_valid_schema_is_the_servers_500_not_the_clients_400(served: Served) -> None:
    """The mask holds items to 1 and two of them; ``uniqueItems``, checked after the reply, can
    then only fail: the request was valid, so the answer is a 500 saying why, not a 400, and
    one the official client does not send again (its default is two more tries of a 500)."""
    schema = {"type": "array", "items": {"enum": [1]}, "minItems": 2, "maxItems": 2, "uniqueItems": True}
    response_format: Any = {"type": "json_schema", "json_schema": {"name": "ones", "schema": schema}}
    path = 'llmsession_requests_total{path="/v1/chat/completions",status="500"}'
    before = metric(served.metrics(), path)
    client = openai.OpenAI(base_url=served.url, api_key=KEY, timeout=60)  # (retries as it comes)
    with pytest.raises(openai.InternalServerError) as failed:
        client.chat.completions.create(
            model=served.name,
            messages=[{"role": "user", "content": "Two ones, please."}],
            max_tokens=16,
            temperature=0,
            response_format=response_format,
        )
    assert failed.value.status_code == 500 and failed.value.code == "reply_mismatch"
    assert "uniqueItems" in failed.value.message
    assert failed.value.response.headers["x-should-retry"] == "false"
    assert metric(served.metrics(), path) == before + 1  # (asked once: no retry)
    # Sampled without a seed, another try may pass: the SDK's own rule stands.
    with pytest.raises(openai.InternalServerError) as sampled:
        ask(served, "Two ones, please.", max_tokens=16, temperature=0.8, response_format=response_format)
    assert sampled.value.code == "reply_mismatch" and "x-should-retry" not in sampled.value.response.headers
    with pytest.raises(openai.InternalServerError) as seeded:
        ask(served, "Two ones.", max_tokens=16, temperature=0.8, seed=7, response_format=response_format)
    assert seeded.value.response.headers["x-should-retry"] == "false"


def test_a_forced_tool_call_and_its_result(served: Served) -> None:
    question = [{"role": "user", "content": "What is the weather in Oslo?"}]
    reply = ask(
        served,
        "",
        messages=question,
        max_tokens=48,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,  # (else a greedy reply may begin a second call and be cut short)
        user="caller",
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])  # type: ignore[index]
    answered = [
        *question,
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 21}'},
    ]
    after = ask(served, "", messages=answered, max_tokens=8, tools=[WEATHER], user="caller")
    assert after.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert after.usage.prompt_tokens > reply.usage.prompt_tokens
    assert (
        after.usage.prompt_tokens_details.cached_tokens >= reply.usage.prompt_tokens
    )  # the call's turn kept


def test_a_streamed_tool_call_arrives_in_pieces(served: Served) -> None:
    chunks = list(
        ask(
            served,
            "Weather in Rome?",
            user="streamed-caller",
            max_tokens=40,
            tools=[WEATHER],
            tool_choice="required",
            parallel_tool_calls=False,
            stream=True,
        )
    )
    pieces = [p for c in chunks if c.choices for p in c.choices[0].delta.tool_calls or []]
    assert pieces and pieces[0].id and pieces[0].type == "function"
    assert pieces[0].function is not None and pieces[0].function.name == "get_weather"
    assert all(p.index == 0 for p in pieces) and all(p.id is None for p in pieces[1:])
    arguments = "".join((p.function.arguments or "") if p.function else "" for p in pieces)
    jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])  # type: ignore[index]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_n_choices(served: Served) -> None:
    reply = ask(served, "Name an animal.", n=2, temperature=0.9, seed=11, max_tokens=6)
    assert [c.index for c in reply.choices] == [0, 1]
    assert reply.usage.completion_tokens <= 12
    chunks = list(ask(served, "Name a tree.", n=2, max_tokens=4, stream=True))
    roles = [c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.role]
    finishes = [c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason]
    assert sorted(roles) == [0, 1] and sorted(finishes) == [0, 1]


def test_n_choices_fork_one_prefill_and_count_its_prompt_once(served: Served) -> None:
    """The prompt is decoded once, each choice from a fork of it (``test_choices``); the usage
    and ``/metrics`` count it once. Each fork's own usage counts the prompt as reused, and the
    metrics added them up: three prompts' tokens, all but three read from the cache, for one
    prompt decoded whole."""
    cached, prompts = "llmsession_cached_prompt_tokens_total", "llmsession_prompt_tokens_total"
    before = served.metrics()
    question = "You are a careful naturalist. List three animals of the Arctic and say why they thrive."
    reply = ask(served, question, n=3, temperature=0.9, seed=5, max_tokens=4, user="forks")
    after = served.metrics()
    prompt = reply.usage.prompt_tokens
    assert len(reply.choices) == 3 and prompt > 20
    assert reply.usage.prompt_tokens_details.cached_tokens == 0  # a new tenant: the prefill's
    assert metric(after, prompts) - metric(before, prompts) == prompt
    assert metric(after, cached) - metric(before, cached) == 0


def test_n_past_the_live_sessions_is_a_400_naming_the_limit(narrow: Served) -> None:
    with narrow.http(key=None) as http:
        body = {"messages": [{"role": "user", "content": "Hi"}], "n": 2, "max_tokens": 2}
        response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "n" and "at most 1" in error["message"]


def test_concurrent_requests_decode_in_one_batch(served: Served) -> None:
    batcher = internals.local(served.model).engine.batcher
    batches, steps = batcher.batches, batcher.steps
    replies: list[Any] = []
    start = threading.Barrier(3)

    def run(i: int) -> None:  # (started together: a reply could end before the others began)
        start.wait()
        replies.append(ask(served, f"Count to ten, {i}.", max_tokens=24))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(replies) == 3
    assert batcher.steps - steps > batcher.batches - batches > 0  # some batches held several streams


BAD_SCHEMA = {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}
CHAT, RAW = "/v1/chat/completions", "/v1/completions"
HUGE = "1" + "0" * 400  # an integer no double holds (float() of it overflows)


def raw_json(path: str, fields: str) -> bytes:
    """A body's JSON text, as written (a number JSON allows but Python's json would not write)."""
    start = '"prompt": "x"' if path == RAW else '"messages": [{"role": "user", "content": "x"}]'
    return f"{{{start}, {fields}}}".encode()


def encoded(text: str, encoding: str) -> bytes:
    """``text`` in ``encoding``, a lone surrogate included (json reads UTF-16 and UTF-32 too)."""
    return text.encode(encoding, "surrogatepass")


SCHEMA = '{"type": "json_schema", "json_schema": {"schema": {"type": "integer", "maximum": %s}}}'
TOOL = '{"type": "function", "function": {"name": "f", "parameters": {"properties": {"a": {"minimum": %s}}}}}'
LONE = "a\ud800b"  # (a lone surrogate itself, not an escape: its own code unit in UTF-16)
# (path, body, status, the error's param): every row must be a 4xx naming what is wrong
BAD_REQUESTS: list[tuple[str, Any, int, str | None]] = [
    (CHAT, b"{not json", 400, None),
    (CHAT, b"[1, 2]", 400, None),
    (CHAT, {"messages": "hi"}, 400, "messages"),
    (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    (CHAT, {"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, 400, "temperature"),
    (CHAT, {"messages": [{"role": "user", "content": "a\0b"}]}, 400, "messages[0].content"),
    (CHAT, {"messages": [{"role": "user", "content": "x"}], "n": 9}, 400, "n"),
    (CHAT, {"messages": [{"role": "user", "content": "x"}], "logprobs": "yes"}, 400, "logprobs"),
    (
        CHAT,
        {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
        400,
        "top_logprobs",
    ),
    (CHAT, {"messages": [{"role": "assistant", "content": "x"}]}, 400, "messages"),  # nothing to answer
    (CHAT, {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, 400, "tool_choice"),
    (
        CHAT,
        {"messages": [{"role": "user", "content": "x"}], "response_format": BAD_SCHEMA},
        400,
        "response_format",
    ),
    (CHAT, {"messages": [{"role": "user", "content": "word " * 10000}]}, 400, None),  # over the context
    # Numbers no double holds (issue 39: a 500), in every numeric field and anywhere else.
    (CHAT, raw_json(CHAT, f'"temperature": {HUGE}'), 400, "temperature"),
    (CHAT, raw_json(CHAT, f'"top_p": {HUGE}'), 400, "top_p"),
    (CHAT, raw_json(CHAT, f'"presence_penalty": -{HUGE}'), 400, "presence_penalty"),
    (CHAT, raw_json(CHAT, f'"frequency_penalty": {HUGE}'), 400, "frequency_penalty"),
    (CHAT, raw_json(CHAT, f'"max_tokens": {HUGE}'), 400, "max_tokens"),
    (CHAT, raw_json(CHAT, f'"n": -{HUGE}'), 400, "n"),
    (CHAT, raw_json(CHAT, f'"seed": {HUGE}'), 400, "seed"),
    (CHAT, raw_json(CHAT, '"logprobs": true, "top_logprobs": 1e400'), 400, "top_logprobs"),
    (CHAT, raw_json(CHAT, f'"temperature": {"9" * 5000}'), 400, "temperature"),  # past int()'s 4,300 digits
    (CHAT, raw_json(CHAT, '"temperature": 1e400'), 400, "temperature"),  # (json reads it as inf)
    (CHAT, raw_json(CHAT, '"top_p": -1e400'), 400, "top_p"),
    (
        CHAT,
        raw_json(CHAT, f'"response_format": {SCHEMA % HUGE}'),
        400,
        "response_format.json_schema.schema.maximum",
    ),
    (
        CHAT,
        raw_json(CHAT, f'"tools": [{TOOL % HUGE}]'),
        400,
        "tools[0].function.parameters.properties.a.minimum",
    ),
    (RAW, raw_json(RAW, f'"temperature": {HUGE}'), 400, "temperature"),
    (RAW, raw_json(RAW, f'"frequency_penalty": -{HUGE}'), 400, "frequency_penalty"),
    (RAW, raw_json(RAW, '"presence_penalty": 1e400'), 400, "presence_penalty"),
    (RAW, raw_json(RAW, f'"logprobs": {HUGE}'), 400, "logprobs"),
    # Bodies in UTF-16 or UTF-32 (json detects them, with or without a BOM) with a lone surrogate.
    (
        CHAT,
        encoded(f'{{"messages": [{{"role": "user", "content": "{LONE}"}}]}}', "utf-16"),
        400,
        "messages[0].content",
    ),
    (
        CHAT,
        encoded(f'{{"messages": [{{"role": "user", "content": "{LONE}"}}]}}', "utf-16-le"),
        400,
        "messages[0].content",
    ),
    (
        CHAT,
        encoded(f'{{"messages": [{{"role": "user", "content": "{LONE}"}}]}}', "utf-32-be"),
        400,
        "messages[0].content",
    ),
    (
        CHAT,
        encoded('{"messages": [{"role": "user", "content": "a\\udc00"}]}', "utf-16-be"),
        400,
        "messages[0].content",
    ),
    (
        CHAT,
        encoded(f'{{"messages": [{{"role": "user", "content": "x"}}], "stop": "{LONE}"}}', "utf-32"),
        400,
        "stop",
    ),
    (RAW, encoded(f'{{"prompt": "{LONE}"}}', "utf-32-le"), 400, "prompt"),
    (RAW, encoded(f'{{"prompt": "{LONE}"}}', "utf-16"), 400, "prompt"),
    (RAW, encoded(f'{{"prompt": "x", "stop": ["{LONE}"]}}', "utf-16-be"), 400, "stop[0]"),
    # A body over --max-body-bytes (issue 39: urllib, which sends Connection: close, got a reset).
    (CHAT, {"messages": [{"role": "user", "content": "x" * (20 << 20)}]}, 413, None),
    (RAW, {"prompt": "x" * (BODY_LIMIT + 10)}, 413, None),
]


def post_urllib(
    served: Served, path: str, data: Any, headers: dict[str, str] | None = None
) -> tuple[int, bytes]:
    """A POST through ``urllib`` (a client that sends its whole body before it reads, and asks
    the server to close the connection after): the status and body it read."""
    given = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json", **(headers or {})}
    url = served.url.removesuffix("/v1") + path
    request = urllib.request.Request(url, data=data, headers=given, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def row_id(index: int, path: str, status: int, param: str | None) -> str:
    return f"{index}-{'chat' if path == CHAT else 'raw'}-{status}-{param}"


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    BAD_REQUESTS,
    ids=[row_id(i, r[0], r[2], r[3]) for i, r in enumerate(BAD_REQUESTS)],
)
def test_a_bad_request_is_a_4xx_with_an_error_body(
    served: Served, path: str, body: Any, status: int, param: str | None
) -> None:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    got, text = post_urllib(served, path, data)
    assert got == status, text[:300]
    error = json.loads(text)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param, error
    assert b"Traceback" not in text
    assert len(text) < 1024 and b"0" * 40 not in text and b"9" * 40 not in text  # no number echoed whole
    if "word " in str(body)[:40]:
        assert "4096" in error["message"]  # the limit is named
    with served.http() as http:
        ok = http.post(CHAT, json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
        assert ok.status_code == 200  # the server answers normally after it


def test_a_utf16_or_utf32_body_is_answered_as_its_utf8_twin(served: Served) -> None:
    """Such bodies are read, not refused (``body.parse_json`` says why): only what they hold is
    checked, as in UTF-8."""
    for path, text in ((CHAT, '{"messages": [{"role": "user", "content": "Hi"}]'), (RAW, '{"prompt": "Hi"')):
        for encoding in ("utf-16", "utf-32-be"):
            status, answer = post_urllib(served, path, f'{text}, "max_tokens": 2}}'.encode(encoding))
            assert status == 200, answer[:300]


def test_an_oversized_body_is_a_413_the_client_reads(served: Served) -> None:
    """Issue 39: a body over the limit reset the connection of a client that sends its whole body
    before it reads (urllib asks for the connection to be closed after, and the server closed it
    with the body unread). The rest is read and dropped, so the 413 arrives, sent whole or chunked,
    and through the openai client; one that waits for 100 Continue is answered before it sends."""
    big = json.dumps({"messages": [{"role": "user", "content": "x" * (20 << 20)}]}).encode()
    pieces = iter([big[i : i + (1 << 16)] for i in range(0, len(big), 1 << 16)])
    for data in (big, pieces):
        status, text = post_urllib(served, CHAT, data)
        assert status == 413, text[:300]
        assert (
            json.loads(text)["error"]["message"]
            == f"the request body is over the limit of {BODY_LIMIT} bytes"
        )
    with pytest.raises(openai.APIStatusError) as caught:
        served.client().completions.create(model=served.name, prompt="x" * (20 << 20), max_tokens=1)
    assert caught.value.status_code == 413
    with socket.create_connection(("127.0.0.1", served.port), timeout=30) as sock:
        head = f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\nExpect: 100-continue\r\n"
        sock.sendall(f"{head}Content-Length: {len(big)}\r\n\r\n".encode())
        assert read_until_closed(sock, 30).startswith(b"HTTP/1.1 413 ")  # (no 100 Continue first)
    with socket.create_connection(("127.0.0.1", served.port), timeout=30) as sock:  # (chunked: asked)
        head = f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\nExpect: 100-continue\r\n"
        sock.sendall(f"{head}Transfer-Encoding: chunked\r\n\r\n".encode())
        assert sock.recv(1 << 16).startswith(b"HTTP/1.1 100 ")
        sock.sendall((b"10000\r\n" + b"x" * (1 << 16) + b"\r\n") * (2 * BODY_LIMIT >> 16) + b"0\r\n\r\n")
        sock.settimeout(30)
        assert sock.recv(1 << 16).startswith(b"HTTP/1.1 413 ")


def read_until_closed(sock: socket.socket, seconds: float) -> bytes:
    """What the server sends until it closes the connection (a reset ends it too)."""
    sock.settimeout(seconds)
    received = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(1 << 16):
            received += chunk
    return received


@pytest.mark.parametrize("pace", ["flood", "trickle"])
def test_a_refused_body_is_read_only_so_far(
    served: Served, monkeypatch: pytest.MonkeyPatch, pace: str
) -> None:
    """What is left of a refused body is read within bounds: a client that floods an endless
    chunked body, or trickles one, gets its 413 and the connection closed, not a server
    reading for as long as it sends (uvicorn drops the rest of a body forever on its own)."""
    monkeypatch.setattr("llmsession.serve.http.DRAIN_BYTES", 4 << 20)
    monkeypatch.setattr("llmsession.serve.http.DRAIN_SECONDS", 1.0)
    sent, stop = [0], threading.Event()
    with socket.create_connection(("127.0.0.1", served.port), timeout=30) as sock:
        head = f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
        sock.sendall(f"{head}Transfer-Encoding: chunked\r\n\r\n".encode())

        def send() -> None:
            chunk = b"10000\r\n" + b"x" * (1 << 16) + b"\r\n"
            with contextlib.suppress(OSError):
                sock.sendall(chunk * (BODY_LIMIT >> 16) + b"1\r\nx\r\n")  # (over the limit)
                while not stop.is_set():
                    sock.sendall(chunk if pace == "flood" else b"1\r\nx\r\n")
                    sent[0] += 1 << 16 if pace == "flood" else 1
                    if pace == "trickle":
                        time.sleep(0.05)

        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        started = time.monotonic()
        try:
            answer = read_until_closed(sock, 20)
        finally:
            stop.set()
            sender.join(30)
    assert answer.startswith(b"HTTP/1.1 413 "), answer[:200]
    assert b"connection: close" in answer.lower()
    assert time.monotonic() - started < 10
    assert sent[0] < 64 << 20


def test_keys_are_required_but_for_health(served: Served) -> None:
    with pytest.raises(openai.AuthenticationError):
        ask(served, "Hi", key="sk-wrong")
    with pytest.raises(openai.AuthenticationError):
        served.client("sk-wrong").models.list()
    for key in (None, "sk-wrong"):
        with served.http(key=key) as http:
            assert http.get("/metrics").status_code == 401
            response = http.post(
                "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}
            )
            assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
            assert http.get("/health").status_code == 200
    with served.http(key=None) as http:
        assert http.post("/v1/completions", json={"prompt": "x"}).status_code == 401
    with served.http() as http:
        assert http.get("/v1/nowhere").json()["error"]["code"] == "not_found"


def wait_for(predicate: Any, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_client_that_goes_away_cancels_its_exchange(served: Served, faulty: Faulty) -> None:
    """The server's decoded tokens stop growing once it sees the client gone: at most two
    past the count when it cancelled, and none more after."""
    before = served.metrics()
    cancelled = 'llmsession_replies_total{finish_reason="cancelled"}'
    body = {
        "messages": [{"role": "user", "content": "Write a very long story about a dragon."}],
        "max_tokens": 1000,
        "temperature": 0,
        "stream": True,
        "user": "dragon",
    }
    with served.http() as http, http.stream("POST", "/v1/chat/completions", json=body) as response:
        lines = response.iter_lines()
        received = [next(lines) for _ in range(12)]  # (6 events, their blank lines between)
    assert any('"content"' in line for line in received)
    (stream,) = faulty.streams
    wait_for(lambda: stream.reply is not None)
    decoded = len(stream.exchange.tokens)
    time.sleep(0.5)
    assert len(stream.exchange.tokens) == decoded and stream.reply.finish_reason == "cancelled"
    assert decoded <= faulty.cancelled_at[0] + 2, (decoded, faulty.cancelled_at)
    assert stream.reply.usage.completion_tokens == decoded < 1000
    wait_for(lambda: metric(served.metrics(), cancelled) > metric(before, cancelled))
    assert ask(served, "Hi").choices[0].message.content  # and the server goes on


def post_in_thread(served: Served, results: dict[str, Any], name: str, **body: Any) -> threading.Thread:
    def post() -> None:
        with served.http(served.key) as http:
            results[name] = http.post("/v1/chat/completions", json={"max_tokens": 2, **body})

    thread = threading.Thread(target=post)
    thread.start()
    return thread


def said(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def test_a_full_server_is_a_503_with_retry_after(narrow: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    fault = Faulty(narrow.model)
    monkeypatch.setattr(narrow.server.host, "model", fault)
    admission, results = narrow.server.admission, {}
    try:
        held = post_in_thread(narrow, results, "held", messages=said("HOLD: hi"), user="a")
        wait_for(lambda: fault.holding == 1)
        queued = post_in_thread(narrow, results, "queued", messages=said("Hi"), user="b")
        wait_for(lambda: admission.waiting == 1)
        with narrow.http(key=None) as http:
            refused = http.post("/v1/chat/completions", json={"messages": said("Hi"), "max_tokens": 2})
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "overloaded"
    finally:
        fault.go.set()
    held.join(60)
    queued.join(60)
    assert results["held"].status_code == 200 == results["queued"].status_code
    status = 'llmsession_requests_total{path="/v1/chat/completions",status="503"}'
    assert metric(narrow.metrics(), status) >= 1


def test_a_client_that_leaves_the_queue_gives_its_place_up(
    narrow: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    fault = Faulty(narrow.model)
    monkeypatch.setattr(narrow.server.host, "model", fault)
    admission, results = narrow.server.admission, {}
    try:
        held = post_in_thread(narrow, results, "held", messages=said("HOLD: hello"), user="a")
        wait_for(lambda: fault.holding == 1)
        body = json.dumps({"messages": said("Hi"), "max_tokens": 2}).encode()
        head = "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        with socket.create_connection(("127.0.0.1", narrow.port)) as client:
            client.sendall(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
            wait_for(lambda: admission.waiting == 1)
        wait_for(lambda: admission.waiting == 0, 10)  # while the request ahead still runs
        assert held.is_alive() and admission.used == 1
    finally:
        fault.go.set()
    held.join(60)
    assert results["held"].status_code == 200 and admission.used == 0


def test_a_full_memory_budget_is_retried_behind_the_running_requests(served: Served, faulty: Faulty) -> None:
    admission, results = served.server.admission, {}
    held = post_in_thread(served, results, "held", messages=said("HOLD: a haiku"), user="holder")
    wait_for(lambda: faulty.holding == 1)
    retried = post_in_thread(served, results, "retried", messages=said("BUDGET: a poem"), user="another")
    wait_for(lambda: admission.waiting == 1)  # it found the budget full and waits, not a 503
    assert faulty.budget == 0 and "retried" not in results
    faulty.go.set()
    held.join(60)
    retried.join(60)
    assert results["held"].status_code == 200 == results["retried"].status_code


def test_a_stream_that_finds_the_budget_full_after_it_began_runs_again_in_it(
    served: Served, faulty: Faulty, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A slow prompt's Messages stream opens (``message_start``, pings) before its first token;
    a full memory budget found after that is retried once behind the running requests, within
    the same stream: the client reads a whole message, not an error event."""
    monkeypatch.setattr(doors, "PING_SECONDS", 0.1)  # (the door's patience: the stream opens sooner)
    faulty.late = 0.6
    admission, results, events = served.server.admission, dict[str, Any](), list[str]()
    held = post_in_thread(served, results, "held", messages=said("HOLD: a haiku"), user="holder")
    wait_for(lambda: faulty.holding == 1)

    def stream() -> None:
        body = {"model": "m", "max_tokens": 4, "stream": True, "messages": said("LATEBUDGET: a poem")}
        with served.http(served.key) as http, http.stream("POST", "/v1/messages", json=body) as response:
            results["status"] = response.status_code
            events.extend(
                line.split(":", 1)[1].strip() for line in response.iter_lines() if line.startswith("event:")
            )

    reader = threading.Thread(target=stream)
    reader.start()
    wait_for(lambda: admission.waiting == 1)  # (it began, found the budget full, and waits behind)
    assert faulty.budget == 0 and results.get("status") == 200
    faulty.go.set()
    held.join(60)
    reader.join(60)
    assert events[0] == "message_start" and "error" not in events and events[-1] == "message_stop", events
    assert admission.used == 0 and admission.waiting == 0
    # with nothing running to wait behind, the stream ends with the overload it found
    faulty.budget = 1
    body = {"model": "m", "max_tokens": 4, "stream": True, "messages": said("LATEBUDGET: a poem")}
    with served.http(served.key) as http, http.stream("POST", "/v1/messages", json=body) as response:
        text = "".join(response.iter_text())
    assert "event: error" in text and "overloaded_error" in text and "message_stop" not in text, text
    assert admission.used == 0 and admission.waiting == 0 and faulty.budget == 0


@contextlib.contextmanager
def logged() -> Iterator[list[logging.LogRecord]]:
    """The records of the server's logger and of uvicorn's (which logs what a route raises)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    loggers = [logging.getLogger("llmsession.serve"), logging.getLogger("uvicorn.error")]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        yield records
    finally:
        for logger in loggers:
            logger.removeHandler(handler)


def test_an_internal_error_is_a_logged_500_that_tells_nothing(served: Served, faulty: Faulty) -> None:
    status = 'llmsession_requests_total{path="/v1/chat/completions",status="500"}'
    before = metric(served.metrics(), status)
    with logged() as records, served.http() as http:
        response = http.post("/v1/chat/completions", json={"messages": said("BUG: hi"), "max_tokens": 2})
    assert response.status_code == 500, response.text
    error = response.json()["error"]
    assert error["message"] == "the server failed to answer this request" and error["type"] == "server_error"
    assert "secret" not in response.text and "42" not in response.text
    (record,) = [r for r in records if r.levelno >= logging.ERROR]
    assert record.exc_info is not None and "secret-state" in str(record.exc_info[1])
    assert metric(served.metrics(), status) == before + 1


def test_a_route_error_is_counted_and_logged_as_the_client_sees_it(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Raised in the route itself, not in a run: the counters see the status the client got,
    and the traceback of a bug is logged once (uvicorn logs nothing of it)."""
    admission = served.server.admission

    async def closing(count: int, *, behind: bool = False, caller: str | None = None, size: int = 0) -> int:
        raise ModelClosedError("the model was closed")

    async def broken(count: int, *, behind: bool = False, caller: str | None = None, size: int = 0) -> int:
        raise RuntimeError("/srv/secret: a bug")

    chat = '"/v1/chat/completions",status="{}"'
    before = served.metrics()
    with logged() as records, served.http() as http:
        monkeypatch.setattr(admission, "acquire", closing)
        first = http.post("/v1/chat/completions", json={"messages": said("Hi")})
        monkeypatch.setattr(admission, "acquire", broken)
        second = http.post("/v1/chat/completions", json={"messages": said("Hi")})
    assert first.status_code == 503 and first.json()["error"]["code"] == "shutting_down"
    assert second.status_code == 500 and "secret" not in second.text
    after = served.metrics()
    for status, more in (("503", 1), ("500", 1)):
        name = "llmsession_requests_total{path=" + chat.format(status) + "}"
        assert metric(after, name) == metric(before, name) + more, status
    assert [r.name for r in records if r.levelno >= logging.ERROR] == ["llmsession.serve"]


def test_a_long_user_and_too_many_images_are_400s(served: Served) -> None:
    import PIL.Image

    encoded = io.BytesIO()
    PIL.Image.new("RGB", (8, 8)).save(encoded, "PNG")
    url = "data:image/png;base64," + base64.b64encode(encoded.getvalue()).decode()
    image = {"type": "image_url", "image_url": {"url": url}}
    bodies = [
        ({"messages": said("Hi"), "user": "u" * 257}, "user"),
        ({"messages": [{"role": "user", "content": [image] * 9}]}, "at most 8 images"),
    ]
    with served.http() as http:
        for body, named in bodies:
            response = http.post("/v1/chat/completions", json=body)
            assert response.status_code == 400, response.text
            assert named in response.json()["error"]["message"]


def test_bodies_are_checked_off_the_event_loop_a_few_at_a_time(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    server, real = served.server, served.server.checked
    lock, go = threading.Lock(), threading.Event()
    active, most, on_loop = [0], [0], []

    def checked(body: bytes) -> Any:
        try:
            asyncio.get_running_loop()
            on_loop.append(True)
        except RuntimeError:
            on_loop.append(False)
        with lock:
            active[0] += 1
            most[0] = max(most[0], active[0])
        try:
            assert go.wait(60)
            return real(body)
        finally:
            with lock:
                active[0] -= 1

    monkeypatch.setattr(server, "checked", checked)
    results: dict[str, Any] = {}
    threads = [
        post_in_thread(served, results, str(i), messages=said(f"Hi {i}"), max_tokens=1, user=f"p{i}")
        for i in range(PARSERS + 3)
    ]
    try:
        wait_for(lambda: active[0] == PARSERS)
        time.sleep(0.3)  # (more would have come in by now: the bound holds whatever the speed)
        assert most[0] == PARSERS
    finally:
        go.set()
    for thread in threads:
        thread.join(60)
    assert [r.status_code for r in results.values()] == [200] * (PARSERS + 3)
    assert on_loop == [False] * (PARSERS + 3)


def test_slow_bodies_hold_no_parser_and_are_refused_at_their_deadline(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    """More slow senders than parsers (headers, then a byte of a declared body): they held every
    parser's slot, and every other request waited as long as they sent; now a request is
    answered beside them, and each gets a 408 once its body is past the deadline (then, not
    after waiting for the rest of a body already late)."""
    monkeypatch.setattr(bodies, "BODY_SECONDS", 4)
    host, port = served.url.removeprefix("http://").removesuffix("/v1").split(":")
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {KEY}\r\nContent-Length: 1000\r\n\r\n{{"
    )
    slow = [socket.create_connection((host, int(port)), timeout=15) for _ in range(PARSERS + 1)]
    try:
        for connection in slow:
            connection.sendall(head.encode())
        time.sleep(0.5)  # (each is reading its body now)
        began = time.monotonic()
        reply = ask(served, "Hi", max_tokens=2, user="beside-slow-bodies")
        assert reply.choices[0].message.content is not None
        assert time.monotonic() - began < 3, "the request waited behind the slow bodies"
        for connection in slow:
            status = connection.recv(4096).split(b"\r\n", 1)[0]
            assert status.split(b" ")[1] == b"408", status
            # (at the deadline: it was 10 s later, spent waiting for the rest of the late body)
            assert time.monotonic() - began < 4 + 2, time.monotonic() - began
    finally:
        for connection in slow:
            connection.close()


def test_one_keys_slow_bodies_leave_room_for_another_keys(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One key's slow senders (headers, then a byte of a declared body) held every reader's
    place and every other key's bodies waited behind them (then behind the next ones, queued):
    one key reads at most ``READERS_PER_KEY`` bodies at once, a 503 past that, and another
    key's request is answered beside them."""
    from llmsession.serve import http

    monkeypatch.setattr(bodies, "BODY_SECONDS", 20)  # (the slow ones hold their places throughout)
    monkeypatch.setattr(http, "DRAIN_SECONDS", 0.5)  # (the 503 waits no longer for the body)
    monkeypatch.setattr(bodies, "READERS_PER_KEY", 2)
    server = served.server
    monkeypatch.setattr(server.bodies, "reading", asyncio.Semaphore(3))  # (READERS: 3, all taken)
    host, port = served.url.removeprefix("http://").removesuffix("/v1").split(":")
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {KEY}\r\nContent-Length: 1000\r\n\r\n{{"
    )
    slow = [socket.create_connection((host, int(port)), timeout=15) for _ in range(3)]
    try:
        for connection in slow:
            connection.sendall(head.encode())
            time.sleep(0.3)  # (each is reading its body before the next comes)
        began = time.monotonic()
        reply = ask(served, "Hi", max_tokens=2, key=OTHER_KEY, user="beside-a-keys-slow-bodies")
        assert reply.choices[0].message.content is not None
        assert time.monotonic() - began < 3, "another key's request waited behind the slow bodies"
        refused = slow[2].recv(4096).split(b"\r\n", 1)[0]
        assert refused.split(b" ")[1] == b"503", refused
    finally:
        for connection in slow:
            connection.close()
    deadline = time.monotonic() + 10
    while (
        server.bodies.reading_of.counts and time.monotonic() < deadline
    ):  # (the slow ones end as they close)
        time.sleep(0.1)
    assert not server.bodies.reading_of.counts, server.bodies.reading_of.counts


def test_metrics_count_requests_tokens_and_sessions(served: Served) -> None:
    ask(served, "Hello there.", user="metrics")
    with served.http(key="sk-wrong") as http:
        http.get("/v1/models")
    text = served.metrics()
    assert metric(text, 'llmsession_requests_total{path="/v1/chat/completions",status="200"}') >= 1
    assert metric(text, 'llmsession_requests_total{path="/v1/models",status="401"}') >= 1
    assert metric(text, "llmsession_prompt_tokens_total") > 0
    assert metric(text, "llmsession_completion_tokens_total") > 0
    assert metric(text, "llmsession_time_to_first_token_seconds_count") >= 1
    assert metric(text, 'llmsession_sessions{state="live"}') >= 1
    assert metric(text, "llmsession_requests_in_flight") == 0


def test_a_server_drafting_every_request_answers_as_a_plain_one(served: Served) -> None:
    """``create_app(draft=...)`` (``serve --draft``): a reply that copies its prompt is drafted
    and confirmed (the counters say so) and says what the plain server says, where the build has
    no split noise; a request with logprobs is not drafted (its scores need one row a step)."""
    text = (
        "The lighthouse keeper climbed the narrow stairs every evening at dusk. He cleaned the great "
        "lens, trimmed the wick and wound the clockwork that turned the light."
    )
    content = f"Copy this text exactly:\n{text}"
    messages: Any = [{"role": "user", "content": content}]
    plain = served.client().chat.completions.create(
        model=served.name, messages=messages, max_tokens=48, temperature=0, user="plain"
    )
    app = create_app(served.model, draft="prompt_lookup")
    with running(app) as url:
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60)
        drafted = client.chat.completions.create(model="m", messages=messages, max_tokens=48, temperature=0)
        with httpx.Client(base_url=url.removesuffix("/v1"), timeout=60) as http:
            after_copy = http.get("/metrics").text
            client.chat.completions.create(
                model="m", messages=messages, max_tokens=8, temperature=0, logprobs=True, user="scored"
            )
            after_scored = http.get("/metrics").text
    assert metric(after_copy, "llmsession_accepted_drafts_total") >= 10
    assert metric(after_copy, "llmsession_drafted_tokens_total") >= metric(
        after_copy, "llmsession_accepted_drafts_total"
    )
    assert metric(after_scored, "llmsession_drafted_tokens_total") == metric(
        after_copy, "llmsession_drafted_tokens_total"
    )
    assert drafted.choices[0].message.content and drafted.usage is not None
    if batch_noise(served.model) == 0:
        assert drafted.choices[0].message.content == plain.choices[0].message.content


def test_the_async_client(served: Served) -> None:
    import asyncio

    async def chat() -> Any:
        async with openai.AsyncOpenAI(base_url=served.url, api_key=KEY, max_retries=0) as client:
            return await client.chat.completions.create(
                model=served.name, messages=[{"role": "user", "content": "Hi"}], max_tokens=4
            )

    assert asyncio.run(chat()).choices[0].message.content


def test_sigterm_with_a_stream_open_exits_0_and_leaves_no_spill_folder(
    smollm2_path: Path, tmp_path: Path
) -> None:
    """One live session and no RAM for parked ones: a second tenant's request spills the
    first's state to disk; SIGTERM while a stream is open still closes the model (its folder
    removed) and exits 0. Its keys come from a file (``--api-key-file``): none on its command line."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    keys = tmp_path.parent / f"{tmp_path.name}-keys"
    keys.write_text("# the tenants' keys\n  sk-file-one  \n\nsk-file-two\n")
    command = [sys.executable, "-m", "llmsession", "serve", "--model", str(smollm2_path), "--port", str(port)]
    command += ["--threads", "1", "--max-live-sessions", "1", "--host-cache-bytes", "1"]
    command += ["--disk-cache-dir", str(tmp_path), "--shutdown-timeout", "1", "--flash-attention", "on"]
    command += ["--api-key-file", str(keys)]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return HTTP.get(f"{url}/health", timeout=1).status_code == 200
        except httpx.TransportError:
            assert server.poll() is None, server.stdout.read() if server.stdout else ""
            return False

    try:
        wait_for(up, 60)
        hi = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        assert HTTP.post(f"{url}/v1/chat/completions", json=hi, timeout=60).status_code == 401
        wrong = {"Authorization": "Bearer # the tenants' keys"}
        assert HTTP.post(f"{url}/v1/chat/completions", json=hi, headers=wrong, timeout=60).status_code == 401
        for key in ("sk-file-one", "sk-file-two"):  # (two tenants)
            auth = {"Authorization": f"Bearer {key}"}
            assert (
                HTTP.post(f"{url}/v1/chat/completions", json=hi, headers=auth, timeout=60).status_code == 200
            )
        assert list(tmp_path.iterdir()), "nothing was spilled: the test proves nothing"
        body = {
            "messages": [{"role": "user", "content": "Write a long story."}],
            "max_tokens": 500,
            "stream": True,
        }
        with HTTP.stream(
            "POST", f"{url}/v1/chat/completions", json=body, headers=auth, timeout=60
        ) as response:
            next(response.iter_lines())
            server.send_signal(signal.SIGTERM)
            assert server.wait(30) == 0
        said = server.stdout.read() if server.stdout else ""
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
        if server.stdout is not None:
            server.stdout.close()
    assert list(tmp_path.iterdir()) == []
    assert f"serving {smollm2_path.name} at http://127.0.0.1:{port}/v1" in said
    assert "up to 1 live sessions" in said and f"then on disk in {tmp_path}" in said
    assert "flash attention on" in said  # (asked: the default on the CPU is off)


def test_a_file_of_keys_that_would_not_be_the_server_meant_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--api-key-file``: a file with no key in it would leave the server open to anyone, one
    with a key no header can present would lock its holder out; both stop the command before
    it loads anything (argparse's exit 2), as an unreadable or oversized file does."""
    from llmsession.commands.cli import parser

    files = {
        "empty": "\n  \n",
        "comments": "# sk-not-a-key\n",
        "spaced": "sk-one\nsk two\n",
        "control": "sk-\x07bell\n",
        "accented": "sk-clé\n",
        "huge": "k" * (1 << 20) + "\n",
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    for name, said in [
        ("empty", "holds no key"),
        ("comments", "holds no key"),
        ("spaced", "key 2 has whitespace"),
        ("control", "key 1 has whitespace, a control character or a non-ASCII one"),
        ("accented", "key 1 has whitespace, a control character or a non-ASCII one"),
        ("huge", "larger than"),
        ("missing", "cannot read"),
    ]:
        with pytest.raises(SystemExit) as exited:
            parser().parse_args(["serve", "--api-key-file", str(tmp_path / name)])
        assert exited.value.code == 2 and said in capsys.readouterr().err, name
    for given in ("sk-clé", "sk two", ""):  # (on the command line too, before anything loads)
        with pytest.raises(SystemExit) as exited:
            parser().parse_args(["serve", "--api-key", given])
        assert exited.value.code == 2 and "printable ASCII" in capsys.readouterr().err
    (tmp_path / "keys").write_text("sk-a\n# sk-b\n\tsk-c \n")
    args = parser().parse_args(["serve", "--api-key", "sk-z", "--api-key-file", str(tmp_path / "keys")])
    assert args.api_key == ["sk-z"] and args.api_key_file == [["sk-a", "sk-c"]]  # (joined when it runs)


def test_raw_completions_continue_the_prompt_as_the_library_does(served: Served) -> None:
    """``/v1/completions``: the prompt without the chat template, the same text as
    ``Model.complete``, streamed as OpenAI's legacy chunks; a grown prompt reuses the cache."""
    client, prompt = served.client(), "The capital of France is"
    whole = client.completions.create(
        model=served.name, prompt=prompt, max_tokens=8, temperature=0, user="raw"
    )
    assert whole.object == "text_completion" and whole.choices[0].finish_reason in ("length", "stop")
    assert (
        whole.choices[0].text
        == served.model.complete(prompt, GenerationOptions(max_tokens=8, temperature=0)).text
    )
    assert whole.usage is not None and whole.usage.prompt_tokens == len(served.model.tokenize(prompt))
    chunks = list(
        client.completions.create(
            model=served.name, prompt=prompt, max_tokens=8, temperature=0, stream=True, user="raw2"
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    grown = prompt + whole.choices[0].text + " It is"
    again = client.completions.create(
        model=served.name, prompt=grown, max_tokens=4, temperature=0, user="raw"
    )
    details = again.usage.prompt_tokens_details if again.usage is not None else None
    assert details is not None and (details.cached_tokens or 0) >= whole.usage.prompt_tokens
    two = client.completions.create(
        model=served.name, prompt=prompt, max_tokens=4, temperature=0.8, seed=1, n=2, user="raw3"
    )
    assert [c.index for c in two.choices] == [0, 1] and all(c.text for c in two.choices)
    assert two.usage is not None and two.usage.prompt_tokens == whole.usage.prompt_tokens  # (counted once)
    with served.http() as http:
        for body in ({"prompt": ""}, {"prompt": ["a", "b"]}, {"prompt": "x", "echo": True}, {"prompt": 3}):
            response = http.post("/v1/completions", json=body)
            assert response.status_code == 400, (body, response.text)


def test_no_cors_unless_an_origin_is_allowed(served: Served) -> None:
    """By default a page elsewhere cannot read the API's answers (no CORS headers); with
    ``cors_origins`` only the named origin may."""
    asked = {"Origin": "http://evil.example", "Access-Control-Request-Method": "POST"}
    with served.http() as http:
        preflight = http.options("/v1/chat/completions", headers=asked)
        plain = http.get("/v1/models", headers={"Origin": "http://evil.example"})
    assert "access-control-allow-origin" not in preflight.headers
    assert "access-control-allow-origin" not in plain.headers
    app = create_app(served.model, api_key=KEY, cors_origins=["http://localhost:3000"])
    with running(app) as url, httpx.Client(base_url=url.removesuffix("/v1"), timeout=60) as http:
        allowed = {**asked, "Origin": "http://localhost:3000"}
        allowed["Access-Control-Request-Headers"] = "authorization"
        ok = http.options("/v1/chat/completions", headers=allowed)
        other = http.options("/v1/chat/completions", headers=asked)
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "http://localhost:3000"
    assert "access-control-allow-origin" not in other.headers


def scored(served: Served, question: str, max_tokens: int, top: int) -> dict[str, Any]:
    """A greedy chat request asking for each token's score and ``top`` alternatives."""
    return {
        "model": served.name,
        "messages": [{"role": "user", "content": question}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": top,
    }


def on_a_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def test_logprobs_join_up_to_the_text_whole_streamed_and_raw(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Scores in a whole body, as its stream sends them; the body made and rendered off the
    event loop (one of 4,096 tokens with 20 alternatives stopped every stream for 0.7 s)."""
    client = served.client()
    asked = scored(served, "Write a line about the sea, with an accent: café.", 20, 2)
    made, body = [], sse.Completion.body
    monkeypatch.setattr(sse.Completion, "body", lambda *a: made.append(on_a_loop()) or body(*a))
    whole = client.chat.completions.create(**asked)
    assert made == [False]
    monkeypatch.undo()
    scores = whole.choices[0].logprobs
    assert scores is not None and scores.content is not None
    assert "".join(e.token for e in scores.content) == whole.choices[0].message.content
    assert len(scores.content) == whole.usage.completion_tokens  # type: ignore[union-attr]
    for entry in scores.content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob == entry.logprob  # greedy: the likeliest
        assert entry.bytes is not None and bytes(entry.bytes).decode("utf-8", "replace")
    chunks = list(client.chat.completions.create(**asked, stream=True))
    streamed = [
        e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content or []
    ]
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in scores.content]
    raw = client.completions.create(
        model=served.name, prompt="The sea is", max_tokens=8, temperature=0, logprobs=2
    )
    legacy = raw.choices[0].logprobs
    assert legacy is not None and legacy.tokens is not None and legacy.text_offset is not None
    assert "".join(legacy.tokens) == raw.choices[0].text
    assert legacy.text_offset == [sum(len(t) for t in legacy.tokens[:i]) for i in range(len(legacy.tokens))]
    assert all(len(top) <= 2 for top in legacy.top_logprobs or [])
    plain = client.chat.completions.create(**{**asked, "logprobs": False, "top_logprobs": None})
    assert plain.choices[0].logprobs is None


def test_logprobs_under_a_schema_list_only_allowed_tokens_and_split_characters_join_up(
    served: Served,
) -> None:
    """A schema allows fewer tokens than ``top_logprobs`` asks for: the alternatives are the
    allowed ones only (no -inf, which is not JSON); "café" crosses a multi-byte character."""
    schema = {
        "type": "object",
        "properties": {"drink": {"enum": ["café crème", "thé"]}},
        "required": ["drink"],
        "additionalProperties": False,
    }
    asked = scored(served, "A drink, in JSON.", 200, 5)
    asked["response_format"] = {"type": "json_schema", "json_schema": {"name": "drink", "schema": schema}}
    client = served.client()
    whole = client.chat.completions.create(**asked)
    content, scores = whole.choices[0].message.content, whole.choices[0].logprobs
    assert whole.choices[0].finish_reason == "stop", content
    assert content is not None and json.loads(content)["drink"] in ("café crème", "thé")
    assert scores is not None and scores.content is not None
    assert "".join(e.token for e in scores.content) == content
    assert any(len(e.top_logprobs) < 5 for e in scores.content)  # (the mask left fewer than 5)
    assert all(math.isfinite(a.logprob) for e in scores.content for a in e.top_logprobs)
    chunks = list(client.chat.completions.create(**asked, stream=True))
    streamed = [
        e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content or []
    ]
    assert "".join(e.token for e in streamed) == content


def test_a_streams_queued_events_hold_no_copy_of_the_reply_so_far(smollm2: Model) -> None:
    """A stream's events wait in its request's queue until its client reads them; each
    snapshot held the whole text so far, so a client that read nothing (the decode goes on)
    left the reply's square in memory: about 0.5 GB at 16K tokens, per choice. What waits is
    as long as the reply (the doors read the deltas)."""
    from llmsession.serve.runner import Backlog, Event, Run

    async def unread() -> list[Event]:
        backlog, released = Backlog(1), asyncio.Event()
        asked = [{"role": "user", "content": "Count from 1 to 50, separated by commas."}]
        start = lambda: smollm2.chat_stream(asked, GenerationOptions(max_tokens=48, temperature=0))  # noqa: E731
        Run(0, start, backlog, lambda reply: None, released.set)
        await asyncio.wait_for(released.wait(), 120)  # (the run ended, nothing read)
        return [backlog.queue.get_nowait() for _ in range(backlog.queue.qsize())]

    events = asyncio.run(unread())
    snapshots = [event.snapshot for event in events if event.snapshot is not None]
    reply = events[-1].reply
    assert reply is not None and len(snapshots) > 10 and "".join(s.delta for s in snapshots) == reply.text
    assert sum(len(s.text) + len(s.delta) for s in snapshots) <= 2 * len(reply.text)


def test_a_stream_whose_client_reads_nothing_ends_at_its_backlog(
    smollm2: Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client that opens a stream and stops reading, its connection open (uvicorn's send has
    no deadline): the decode ran on to ``max_tokens`` and every event stayed queued for as long
    as the client stayed, ~5 KB a token with top logprobs. Past ``MAX_BACKLOG`` unread events a
    choice (of ``n``: their events share the queue) the request's choices are cut, and each ends
    in an error, not in a finish that reads as the reply's natural end."""
    from llmsession.serve import runner
    from llmsession.serve.errors import ApiError

    monkeypatch.setattr(runner, "MAX_BACKLOG", 8)

    async def unread(n: int) -> tuple[list[runner.Event], list[Reply]]:
        released, replies = asyncio.Event(), list[Reply]()
        asked = [{"role": "user", "content": "Count from 1 to 500, separated by commas."}]
        options = GenerationOptions(max_tokens=200, temperature=0)
        forks = smollm2.chat_choices(asked, options, n=n)
        choices = runner.Choices(n, forks.__getitem__, replies.append, released.set, forks)
        await asyncio.wait_for(released.wait(), 120)  # (the runs ended, nothing read)
        return [choices.queue.get_nowait() for _ in range(choices.queue.qsize())], replies

    for n in (1, 2):
        events, replies = asyncio.run(unread(n))
        ends = [e for e in events if e.last]
        assert len(ends) == n and all(isinstance(e.error, ApiError) for e in ends), ends
        assert all(e.error.code == "client_too_slow" for e in ends if isinstance(e.error, ApiError))
        assert len(events) <= 4 * n, events  # (the unread ones dropped: a few tokens after, the ends)
        assert all(r.finish_reason == "cancelled" and r.usage.completion_tokens < 40 for r in replies), (
            replies
        )


def test_a_relay_cut_for_its_backlog_ends_only_what_the_cut_ended(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stream's ``Relay`` cut for its unread backlog: a choice the cut ended ends in the
    client's error, but an error of the server's (a bug, a worker's failure) and a reply that
    had finished first go on as they are (they read as the client's fault before)."""
    from types import SimpleNamespace

    from llmsession.replies import Snapshot
    from llmsession.serve import runner
    from llmsession.serve.errors import ApiError

    monkeypatch.setattr(runner, "MAX_BACKLOG", 2)
    bug = RuntimeError("a real bug")

    class Fake:  # (the choices a Relay reads: their queue, n, forks, cancel)
        n, forks = 2, None

        def __init__(self) -> None:
            self.queue: asyncio.Queue[runner.Event] = asyncio.Queue()
            self.cancelled = 0

        def cancel(self) -> None:
            self.cancelled += 1

    async def relayed() -> tuple[int, list[runner.Event]]:
        fake = Fake()
        relay = runner.Relay(fake, None, lambda: None, lambda: None)  # type: ignore[arg-type]
        for _ in range(4):
            fake.queue.put_nowait(runner.Event(0, snapshot=Snapshot("a", "")))
        fake.queue.put_nowait(runner.Event(0, error=bug))
        fake.queue.put_nowait(runner.Event(1, reply=SimpleNamespace(finish_reason="stop")))  # type: ignore[arg-type]
        fake.queue.put_nowait(runner.Event(1, reply=SimpleNamespace(finish_reason="cancelled")))  # type: ignore[arg-type]
        await asyncio.sleep(0.1)
        got = [relay.queue.get_nowait() for _ in range(relay.queue.qsize())]
        relay.cancel()
        return fake.cancelled, got

    cancelled, got = asyncio.run(relayed())
    ends = [event for event in got if event.last]
    assert cancelled >= 1 and len(ends) == 3, got
    assert ends[0].error is bug and ends[1].reply is not None and ends[1].reply.finish_reason == "stop"
    assert isinstance(ends[2].error, ApiError) and ends[2].error.code == "client_too_slow", ends[2]


def test_a_stream_whose_client_reads_nothing_ends_past_its_send_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """uvicorn's send waits for a client that reads nothing for as long as its connection is
    open: the stream's generator, its exchanges' cancel, its model's hold and a stored
    response's entry stayed with it. One write that waits past ``SEND_SECONDS`` ends the stream
    (ASGI, a send that never returns: as uvicorn's does while the socket's buffers are full)."""
    from llmsession.serve import chat

    monkeypatch.setattr(chat, "SEND_SECONDS", 0.2)
    closed: list[str] = []

    async def events() -> Any:
        for i in range(10**6):
            yield f"data: {i}\n\n".encode()

    async def ended() -> float:
        sent: list[Any] = []

        async def send(message: Any) -> None:
            sent.append(message)
            if len(sent) > 3:  # (the socket's buffers are full: it waits for the client)
                await asyncio.Event().wait()

        async def receive() -> Any:
            await asyncio.Event().wait()  # (no disconnect: the connection stays open)

        stream = chat.EventStream(events(), lambda: closed.append("cancelled"))
        scope = {"type": "http", "asgi": {"spec_version": "2.3"}}
        began = time.monotonic()
        await asyncio.wait_for(stream(scope, receive, send), 10)
        return time.monotonic() - began

    assert asyncio.run(ended()) < 5 and closed == ["cancelled"]


def chat_scope(body: bytes, key: str | None = None) -> dict[str, Any]:
    """An ASGI scope of a chat request with ``body``, as uvicorn gives the app (HTTP/1.1)."""
    headers = [(b"host", b"localhost"), (b"content-type", b"application/json")]
    headers += [(b"authorization", f"Bearer {key}".encode())] if key else []
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/chat/completions",
        "raw_path": b"/v1/chat/completions",
        "query_string": b"",
        "root_path": "",
        "headers": [*headers, (b"content-length", str(len(body)).encode())],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8000),
    }


def test_a_client_gone_as_its_request_is_admitted_starts_nothing(
    smollm2: Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client that left while its request waited for a parser: once parsed, its admission
    (granted at once) and its disconnect were both seen in one turn of the loop, and the race
    took the admission: the prompt was rendered, tokenized and begun for nobody (ASGI, as
    uvicorn calls the app: the body, then a disconnect)."""
    from llmsession.serve import chat

    started: list[int] = []
    start = chat.Call._start
    monkeypatch.setattr(
        chat.Call, "_start", lambda call, weight: started.append(weight) or start(call, weight)
    )
    app = create_app(smollm2)
    body = json.dumps({"messages": [{"role": "user", "content": "Hi."}], "max_tokens": 4}).encode()
    scope = chat_scope(body)

    async def scenario() -> list[Any]:
        parsing = app.state.server.parsing
        for _ in range(PARSERS):  # (every parser busy: the request waits, its body read)
            await parsing.acquire()
        left, pending = asyncio.Event(), [{"type": "http.request", "body": body, "more_body": False}]

        async def receive() -> Any:
            if pending:
                return pending.pop()
            await left.wait()
            return {"type": "http.disconnect"}

        sent: list[Any] = []

        async def send(message: Any) -> None:
            sent.append(message)

        answered = asyncio.ensure_future(app(scope, receive, send))
        await asyncio.sleep(0.2)
        left.set()
        for _ in range(PARSERS):
            parsing.release()
        await asyncio.wait_for(answered, 30)
        return sent

    sent = asyncio.run(scenario())
    assert sent[0]["status"] == 499 and started == [], (sent[0], started)


def test_bodies_waiting_for_a_parser_count_in_their_keys_share(smollm2: Model) -> None:
    """A body read waited for one of the few parsers holding its bytes (up to 8 MiB), no longer
    counted anywhere: one key sending body after body kept any number of them in memory. Until
    a parser takes it, it counts among the bodies its key sends (a 503 past the share)."""
    from llmsession.serve.bodies import READERS_PER_KEY

    app = create_app(smollm2, api_key=KEY)
    body = json.dumps({"messages": [{"role": "user", "content": "Hi."}], "max_tokens": 1}).encode()
    scope = chat_scope(body, KEY)

    async def scenario() -> list[int]:
        parsing = app.state.server.parsing
        for _ in range(PARSERS):  # (every parser busy)
            await parsing.acquire()
        statuses: list[int] = []

        def post() -> asyncio.Future[None]:
            pending = [{"type": "http.request", "body": body, "more_body": False}]

            async def receive() -> Any:
                if pending:
                    return pending.pop()
                await asyncio.sleep(3600)

            async def send(message: Any) -> None:
                if message["type"] == "http.response.start":
                    statuses.append(message["status"])

            return asyncio.ensure_future(app(scope, receive, send))

        waiting = [post() for _ in range(READERS_PER_KEY)]
        await asyncio.sleep(0.3)  # (each body read, each waiting for a parser)
        waiting.append(post())
        await asyncio.sleep(0.3)
        refused = list(statuses)
        for task in waiting:
            task.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
        return refused

    assert asyncio.run(scenario()) == [503]


def test_a_cut_for_an_unread_backlog_keeps_a_choice_that_had_ended_whole() -> None:
    """Of ``n`` choices, one that had ended before the cut kept its end but lost its unread
    deltas: its client read a natural finish after a cut text. Its events stay; the others'
    unread deltas go (pure logic)."""
    from types import SimpleNamespace

    from llmsession.replies import Snapshot
    from llmsession.serve import runner

    async def cut() -> list[runner.Event]:
        queue: asyncio.Queue[runner.Event] = asyncio.Queue()
        for index, text in ((0, "a"), (1, "b"), (0, "c"), (1, "d")):
            queue.put_nowait(runner.Event(index, snapshot=Snapshot(text, "")))
        queue.put_nowait(runner.Event(0, reply=SimpleNamespace(finish_reason="stop")))  # type: ignore[arg-type]
        queue.put_nowait(runner.Event(1, snapshot=Snapshot("e", "")))
        runner.dropped_unread(queue)
        return [queue.get_nowait() for _ in range(queue.qsize())]

    kept = asyncio.run(cut())
    assert [(e.index, e.snapshot.delta if e.snapshot else "end") for e in kept] == [
        (0, "a"),
        (0, "c"),
        (0, "end"),
    ]


def test_a_choice_whose_events_a_cut_dropped_ends_in_the_cuts_error_though_it_had_ended() -> None:
    """A decode that ended on its own just as the cut came (its last event not yet queued): its
    unread deltas were dropped, and its reply, not cut short, was sent as a natural end after a
    text with a hole in it (stored whole by the Responses door, streamed cut). A choice whose
    events went ends in the cut's error, whatever its reply (pure logic)."""
    from types import SimpleNamespace

    from llmsession.replies import Snapshot
    from llmsession.serve import runner

    async def scenario() -> tuple[bool, bool, bool]:
        backlog = runner.Backlog(2)
        backlog.put(runner.Event(1, reply=SimpleNamespace(finish_reason="stop")))  # type: ignore[arg-type]
        for _ in range(runner.MAX_BACKLOG * 2):  # (choice 0's deltas, unread, to the cut)
            backlog.put(runner.Event(0, snapshot=Snapshot("a", "")))
        natural: Any = SimpleNamespace(finish_reason="stop")
        return backlog.cut, backlog.lost(0, natural), backlog.lost(1, natural)

    assert asyncio.run(scenario()) == (True, True, False)
