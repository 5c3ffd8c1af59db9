"""``llmsession serve`` end to end: a real uvicorn on a free port, real HTTP, the official
``openai`` client, the default SmolLM2 model. One model and one server for the module."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
import uvicorn

from llmsession import Model
from llmsession.serve.app import create_app

KEY, OTHER_KEY = "sk-alpha", "sk-beta"
BODY_LIMIT = 1 << 20
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 24}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


@dataclass
class Served:
    model: Model
    url: str  # .../v1
    name: str

    def client(self, key: str = KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url, api_key=key, max_retries=0, timeout=60)

    def http(self, key: str | None = KEY) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.url.removesuffix("/v1"), headers=headers, timeout=60)

    def metrics(self) -> str:
        with self.http() as http:
            response = http.get("/metrics")
        assert response.status_code == 200
        return response.text


def metric(text: str, name: str) -> float:
    """A sample's value (0 when absent)."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.fixture(scope="module")
def served(smollm2_path: Path) -> Iterator[Served]:
    with Model(smollm2_path, threads=1) as model:
        app = create_app(model, api_key=[KEY, OTHER_KEY], max_body_bytes=BODY_LIMIT)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        deadline = time.monotonic() + 30
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)
        yield Served(model, f"http://127.0.0.1:{port}/v1", app.state.server.model_name)
        server.should_exit = True
        thread.join(30)
        sock.close()


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
        assert http.get("/health").json() == {"status": "ok", "model": served.name}
    reply = ask(served, "Name a colour.", user="plain")
    choice = reply.choices[0]
    assert reply.object == "chat.completion" and reply.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    usage = reply.usage
    assert usage is not None and usage.prompt_tokens > 5 and 0 < usage.completion_tokens <= 8
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_a_stream_is_openais_and_says_what_the_plain_reply_says(served: Served) -> None:
    question = "Tell me about the sea."
    plain = ask(served, question, max_tokens=12, seed=3, user="plain-twin")
    chunks = list(
        ask(
            served,
            question,
            max_tokens=12,
            seed=3,
            user="stream-twin",
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [plain.choices[0].finish_reason]
    *body, last = chunks
    assert last.choices == [] and last.usage is not None and all(c.usage is None for c in body)
    assert last.usage.completion_tokens == plain.usage.completion_tokens
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


def test_concurrent_requests_decode_in_one_batch(served: Served) -> None:
    batcher = served.model.local.engine.batcher
    batches, steps = batcher.batches, batcher.steps
    replies: list[Any] = []
    threads = [
        threading.Thread(target=lambda i=i: replies.append(ask(served, f"Count to ten, {i}.", max_tokens=24)))
        for i in range(3)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(replies) == 3
    assert batcher.steps - steps > batcher.batches - batches > 0  # some batches held several streams


BAD_SCHEMA = {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}
BAD_REQUESTS: list[tuple[Any, int]] = [
    (b"{not json", 400),
    (b"[1, 2]", 400),
    ({"messages": "hi"}, 400),
    ({"messages": [{"role": "wizard", "content": "x"}]}, 400),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, 400),
    ({"messages": [{"role": "user", "content": "a\0b"}]}, 400),
    ({"messages": [{"role": "user", "content": "x"}], "n": 9}, 400),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True}, 400),
    ({"messages": [{"role": "assistant", "content": "x"}]}, 400),  # nothing to answer
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, 400),  # no tools
    ({"messages": [{"role": "user", "content": "x"}], "response_format": BAD_SCHEMA}, 400),
    ({"messages": [{"role": "user", "content": "word " * 6000}]}, 400),  # over the context
    ({"messages": [{"role": "user", "content": "x" * (BODY_LIMIT + 10)}]}, 413),
]


@pytest.mark.parametrize(("body", "status"), BAD_REQUESTS)
def test_a_bad_request_is_a_4xx_with_an_error_body(served: Served, body: Any, status: int) -> None:
    with served.http() as http:
        if isinstance(body, bytes):
            response = http.post("/v1/chat/completions", content=body)
        else:
            response = http.post("/v1/chat/completions", json=body)
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
        assert "Traceback" not in response.text
        if "word " in str(body)[:40]:
            assert "4096" in error["message"]  # the limit is named
        ok = http.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        )
        assert ok.status_code == 200  # the server answers normally after it


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
    with served.http() as http:
        missing = http.post("/v1/completions", json={"prompt": "x"})
        assert missing.status_code == 404 and "not supported" in missing.json()["error"]["message"]
        assert http.get("/v1/nowhere").json()["error"]["code"] == "not_found"


def wait_for(predicate: Any, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_client_that_goes_away_cancels_its_exchange(served: Served) -> None:
    before = served.metrics()
    cancelled = 'llmsession_replies_total{finish_reason="cancelled"}'
    body = {
        "messages": [{"role": "user", "content": "Write a very long story about a dragon."}],
        "max_tokens": 1000,
        "temperature": 0,
        "stream": True,
    }
    with served.http() as http, http.stream("POST", "/v1/chat/completions", json=body) as response:
        lines = response.iter_lines()
        received = [next(lines) for _ in range(12)]  # (6 events, their blank lines between)
    assert any('"content"' in line for line in received)
    wait_for(lambda: metric(served.metrics(), cancelled) > metric(before, cancelled))
    after = served.metrics()
    generated = metric(after, "llmsession_completion_tokens_total") - metric(
        before, "llmsession_completion_tokens_total"
    )
    assert generated < 100, generated  # stopped soon after the client left, not at 1000
    assert ask(served, "Hi").choices[0].message.content  # and the server goes on


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
    removed) and exits 0."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "llmsession", "serve", "--model", str(smollm2_path), "--port", str(port)]
    command += ["--threads", "1", "--max-live-sessions", "1", "--host-cache-bytes", "1"]
    command += ["--disk-cache-dir", str(tmp_path), "--shutdown-timeout", "1"]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return httpx.get(f"{url}/health", timeout=1).status_code == 200
        except httpx.TransportError:
            assert server.poll() is None, server.stdout.read() if server.stdout else ""
            return False

    try:
        wait_for(up, 60)
        for user in ("first", "second"):
            body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "user": user}
            assert httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).status_code == 200
        assert list(tmp_path.iterdir()), "nothing was spilled: the test proves nothing"
        body = {
            "messages": [{"role": "user", "content": "Write a long story."}],
            "max_tokens": 500,
            "stream": True,
        }
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as response:
            next(response.iter_lines())
            server.send_signal(signal.SIGTERM)
            assert server.wait(30) == 0
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    assert list(tmp_path.iterdir()) == []
