"""Anthropic's Messages API on ``llmsession serve``, through the official ``anthropic`` client
over real HTTP on the default SmolLM2 model: bodies, the ``messages.stream`` helper, tools with
``input_json_delta``, stop sequences, ``count_tokens`` against usage, keys and error bodies, and
a resent Claude-Code-shaped conversation read from the cache despite its per-request billing
line."""

from __future__ import annotations

import base64
import json
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import anthropic
import openai
import pydantic
import pytest
from plain_http import HTTP
from serve_helpers import KEY, OTHER_KEY, WEATHER, Served, running, serving
from starlette.applications import Starlette
from starlette.routing import Mount

from llmsession import GenerationOptions, Model, SessionConfig, Transcript
from llmsession.commands.cli import parser
from llmsession.commands.serve import volatile_lines
from llmsession.serve import doors
from llmsession.serve.app import VOLATILE_LINES, create_app
from llmsession.serve.errors import ApiError
from llmsession.serve.messages import messages_request
from llmsession.serve.translation import Volatile

TOOL = {
    "name": WEATHER["function"]["name"],
    "description": WEATHER["function"]["description"],
    "input_schema": WEATHER["function"]["parameters"],
}
GREEDY = {"temperature": 0}  # (the SDK's own fields have no sampling settings any more)
SYSTEM = "You are a helpful assistant. Answer briefly."


@pytest.fixture(scope="module")
def served(smollm2_path: Path) -> Iterator[Served]:
    with serving(smollm2_path) as served:
        yield served


@pytest.fixture(scope="module")
def unfiltered(smollm2_path: Path) -> Iterator[Served]:
    """The same model with no volatile lines: the variant the billing-line test must fail on."""
    with Model(smollm2_path, threads=1) as model:
        app = create_app(model, api_key=KEY, volatile_lines=())
        with running(app) as url:
            yield Served(model, url, app.state.server.model_name, app.state.server)


def client(served: Served, key: str = KEY) -> anthropic.Anthropic:
    base = served.url.removesuffix("/v1")
    return anthropic.Anthropic(base_url=base, api_key=key, max_retries=0, timeout=120)


def user(*blocks: Any) -> dict[str, Any]:
    return {"role": "user", "content": list(blocks)}


PNG = base64.b64encode(
    bytes.fromhex(
        "89504e470d0a1a0a0000000d4948445200000001000000010806000000"
        "1f15c4890000000d49444154789c6360f8cfc0f01f0005000201a3e1f5a80000000049454e44ae426082"
    )
).decode()


def billing() -> dict[str, Any]:
    """Claude Code's first system block: its hash differs every request."""
    stamp = secrets.token_hex(3)[:5]
    text = f"x-anthropic-billing-header: cc_version=2.1.101.e51; cc_entrypoint=cli; cch={stamp};"
    return {"type": "text", "text": text}


def test_anthropics_client_lists_and_retrieves_the_models(served: Served) -> None:
    """``/v1/models`` is OpenAI's list and Anthropic's page at once: ``anthropic``'s
    ``models.list()`` read OpenAI's alone as models with no ``display_name`` (an AttributeError
    on reading it) and no ``has_more``."""
    page = client(served).models.list()
    assert [m.id for m in page.data] == [served.name] and page.has_more is False
    (model,) = page.data
    assert model.type == "model" and model.display_name == served.name and model.created_at.year >= 2026
    assert page.first_id == page.last_id == served.name
    assert client(served).models.retrieve(served.name).display_name == served.name
    with pytest.raises(anthropic.NotFoundError):
        client(served).models.retrieve("no-such-model")
    assert served.client().models.list().data[0].id == served.name  # (OpenAI's client, alike)


def test_a_message_answers_with_anthropic_fields(served: Served) -> None:
    said = [{"role": "user", "content": "Name a colour."}]
    message = client(served).messages.create(model="claude-x", max_tokens=12, system=SYSTEM, messages=said)
    assert message.id.startswith("msg_") and message.type == "message" and message.role == "assistant"
    assert message.model == served.name
    assert [block.type for block in message.content] == ["text"] and message.content[0].text
    assert message.stop_reason in ("end_turn", "max_tokens") and message.stop_sequence is None
    usage = message.usage
    assert usage.input_tokens + (usage.cache_read_input_tokens or 0) > 10
    assert usage.cache_creation_input_tokens == 0 and 0 < usage.output_tokens <= 12
    short = client(served).messages.create(model="m", max_tokens=1, system=SYSTEM, messages=said)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 1


def test_the_stream_helper_joins_to_the_message(served: Served) -> None:
    said = [{"role": "user", "content": "Say hello to Paris."}]
    with client(served).messages.stream(
        model="m", max_tokens=16, system=SYSTEM, messages=said, extra_body=GREEDY
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    text = "".join(block.text for block in final.content if block.type == "text")
    assert text and kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 1
    assert "text" in kinds and kinds[-2] == "message_delta"  # (the helper's text events)
    whole = client(served).messages.create(
        model="m", max_tokens=16, system=SYSTEM, messages=said, extra_body=GREEDY
    )
    assert whole.content[0].text == text
    assert final.usage.output_tokens == whole.usage.output_tokens
    prompt = final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0)
    assert prompt == whole.usage.input_tokens + (whole.usage.cache_read_input_tokens or 0)


def test_a_stop_sequence_is_named(served: Served) -> None:
    said = [{"role": "user", "content": "Count from one to ten in words."}]
    free = client(served).messages.create(model="m", max_tokens=30, messages=said, extra_body=GREEDY)
    words = free.content[0].text.split()
    assert len(words) >= 3, free
    stop = words[2]
    stopped = client(served).messages.create(
        model="m", max_tokens=30, messages=said, extra_body=GREEDY, stop_sequences=["zzzq", stop]
    )
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == stop
    text = stopped.content[0].text
    assert stop not in text and free.content[0].text.startswith(text)


def test_tools_stream_input_json_and_take_results(served: Served) -> None:
    said: list[dict[str, Any]] = [{"role": "user", "content": "What is the weather in Paris?"}]
    forced = {"type": "tool", "name": "get_weather"}
    with client(served).messages.stream(
        model="m", max_tokens=60, messages=said, tools=[TOOL], tool_choice=forced
    ) as stream:
        deltas = [e.delta for e in stream if e.type == "content_block_delta"]
        pieces = [d.partial_json for d in deltas if d.type == "input_json_delta"]
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    calls = [block for block in final.content if block.type == "tool_use"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    assert isinstance(calls[0].input, dict) and isinstance(calls[0].input.get("city"), str)
    assert json.loads("".join(pieces)) == calls[0].input
    whole = client(served).messages.create(
        model="m", max_tokens=60, messages=said, tools=[TOOL], tool_choice=forced
    )
    assert [b.type for b in whole.content] == ["tool_use"] and whole.stop_reason == "tool_use"
    said += [
        {"role": "assistant", "content": [block.model_dump() for block in final.content]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": calls[0].id, "content": "Sunny, 21 C"},
                {"type": "text", "text": "Thanks. Summarize it."},
            ],
        },
    ]
    before = client(served).messages.count_tokens(model="m", messages=said[:1], tools=[TOOL]).input_tokens
    counted = client(served).messages.count_tokens(model="m", messages=said, tools=[TOOL]).input_tokens
    answer = client(served).messages.create(model="m", max_tokens=20, messages=said, tools=[TOOL])
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert answer.usage.input_tokens + (answer.usage.cache_read_input_tokens or 0) == counted
    new = counted - before - final.usage.output_tokens  # (the call, as generated, is reused)
    assert answer.usage.input_tokens <= new + 1, (answer.usage, new)


def test_count_tokens_is_the_prompt_usage_adds_up_to(served: Served) -> None:
    system = [billing(), {"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}]
    said = [{"role": "user", "content": "Which is larger, 7 or 9?"}]
    counted = client(served).messages.count_tokens(model="m", system=system, messages=said, tools=[TOOL])
    used = (
        client(served, OTHER_KEY)
        .messages.create(model="m", max_tokens=4, system=system, messages=said, tools=[TOOL])
        .usage
    )
    assert counted.input_tokens == used.input_tokens + (used.cache_read_input_tokens or 0) > 100
    # with the reply sent back: counted as the exchange decodes it (its own tokens spliced)
    reply = client(served).messages.create(model="m", max_tokens=24, system=system, messages=said)
    said += [{"role": "assistant", "content": reply.content[0].text}, {"role": "user", "content": "Why?"}]
    counted = client(served).messages.count_tokens(model="m", system=system, messages=said)
    used = client(served).messages.create(model="m", max_tokens=4, system=system, messages=said).usage
    assert counted.input_tokens == used.input_tokens + (used.cache_read_input_tokens or 0)
    assert used.input_tokens <= 16  # (the reply's end and the new turn: the rest was reused)
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}}
    with pytest.raises(anthropic.BadRequestError, match="projector"):  # (as it is answered)
        client(served).messages.count_tokens(model="m", messages=[user(image)])
    with pytest.raises(anthropic.BadRequestError, match="projector"):
        client(served).messages.create(model="m", max_tokens=2, messages=[user(image)])
    # A tool's image result, which a model without images reads as a line of text: counted as
    # answered (count_tokens took it for an image, and refused the transcript).
    call = {"type": "tool_use", "id": "toolu_shot", "name": "get_weather", "input": {"city": "Paris"}}
    result = {"type": "tool_result", "tool_use_id": "toolu_shot", "content": [image]}
    asked = user({"type": "text", "text": "Show me."})
    said = [asked, {"role": "assistant", "content": [call]}, user(result)]
    counted = client(served).messages.count_tokens(model="m", messages=said, tools=[TOOL])
    used = client(served).messages.create(model="m", max_tokens=2, messages=said, tools=[TOOL]).usage
    assert counted.input_tokens == used.input_tokens + (used.cache_read_input_tokens or 0)


def test_a_resent_claude_code_conversation_decodes_only_its_new_turn(
    served: Served, unfiltered: Served
) -> None:
    """Its billing line's hash changes every request; dropped, each turn decodes at most its new
    tokens and one more. The variant that must fail: a server that keeps the line re-decodes
    everything after it."""
    tools = [TOOL, {**TOOL, "name": "read_file", "description": "Read a file from the project."}]
    body = "You are Claude Code, a coding agent. " + "Follow the project's conventions. " * 40
    for where, bound in ((served, "new"), (unfiltered, "everything")):
        said: list[dict[str, Any]] = []
        counted_before = 0
        for turn, question in enumerate(["List the files.", "Open the README.", "What does it say?"]):
            said.append({"role": "user", "content": question})
            system = [billing(), {"type": "text", "text": body}]
            with client(where).messages.stream(
                model="m", max_tokens=12, system=system, messages=said, tools=tools, extra_body=GREEDY
            ) as stream:
                final = stream.get_final_message()
            counting = client(where).messages.count_tokens
            counted = counting(model="m", system=system, messages=said, tools=tools).input_tokens
            usage = final.usage
            assert usage.input_tokens + (usage.cache_read_input_tokens or 0) == counted
            if turn > 0:
                new = counted - counted_before
                if bound == "new":
                    assert usage.input_tokens <= new + 1, (turn, usage, new)
                else:
                    assert usage.input_tokens > counted - 40, (turn, usage)
            content = [b.model_dump() for b in final.content if b.type == "text" and b.text]
            said.append({"role": "assistant", "content": content or "ok"})
            counted_before = counted + usage.output_tokens


def test_keys_errors_and_tenants(served: Served) -> None:
    said = [{"role": "user", "content": "Hi"}]
    with pytest.raises(anthropic.AuthenticationError) as refused:
        client(served, "sk-wrong").messages.create(model="m", max_tokens=2, messages=said)
    said_back = refused.value.body
    assert said_back["type"] == "error" and said_back["error"]["type"] == "authentication_error"
    assert set(said_back) == {"type", "error"} and set(said_back["error"]) == {"type", "message"}
    base = served.url.removesuffix("/v1")
    for headers in ({"Authorization": f"Bearer {KEY}"}, {"x-api-key": KEY}):
        headers = {**headers, "anthropic-version": "2023-06-01", "anthropic-beta": "x"}
        asked = {"model": "m", "max_tokens": 2, "messages": said}
        got = HTTP.post(f"{base}/v1/messages?beta=true", json=asked, headers=headers, timeout=60)
        assert got.status_code == 200 and got.json()["type"] == "message"
    with pytest.raises(anthropic.BadRequestError) as bad:
        client(served).messages.create(model="m", messages=said, max_tokens=None)
    assert bad.value.body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in bad.value.body["error"]["message"]
    for kind in ("any", "tool"):  # named as Anthropic names it, not as the chat's "required"
        with pytest.raises(anthropic.BadRequestError, match=f'tool_choice "{kind}" needs tools'):
            choice: Any = {"type": kind, "name": "get_weather"}
            client(served).messages.create(model="m", max_tokens=2, messages=said, tool_choice=choice)
    url_image = {"type": "image", "source": {"type": "url", "url": "http://169.254.169.254/"}}
    with pytest.raises(anthropic.BadRequestError, match="nothing is fetched"):
        client(served).messages.create(model="m", max_tokens=2, messages=[user(url_image)])
    with pytest.raises(anthropic.BadRequestError, match="content"):
        client(served).messages.create(model="m", max_tokens=2, messages=[{"role": "user", "content": 5}])
    # another key's identical conversation reads nothing of this one's cache
    system = "Tenant check: " + secrets.token_hex(8) + " Be brief." * 30
    first = client(served).messages.create(model="m", max_tokens=2, system=system, messages=said)
    again = client(served).messages.create(model="m", max_tokens=2, system=system, messages=said)
    other = client(served, OTHER_KEY).messages.create(model="m", max_tokens=2, system=system, messages=said)
    assert first.usage.cache_read_input_tokens == 0
    assert (again.usage.cache_read_input_tokens or 0) > 100
    assert other.usage.cache_read_input_tokens == 0


def test_an_over_long_prompt_is_refused_in_anthropics_words(served: Served) -> None:
    """``prompt is too long: N tokens > M maximum``, what Claude Code reads to compact the
    conversation and send it again; N is what ``count_tokens`` says, M one less than the context."""
    said = [{"role": "user", "content": "Summarize this. " + "lorem ipsum dolor " * 3000}]
    counted = client(served).messages.count_tokens(model="m", messages=said).input_tokens
    limit = served.model.session().context_size - 1
    assert counted > limit
    expected = f"prompt is too long: {counted} tokens > {limit} maximum"
    with pytest.raises(anthropic.BadRequestError) as refused:
        client(served).messages.create(model="m", max_tokens=2, messages=said)
    assert refused.value.body == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": expected},
    }
    with (
        pytest.raises(anthropic.APIError, match=expected),
        client(served).messages.stream(model="m", max_tokens=2, messages=said) as stream,
    ):
        stream.get_final_message()
    chat = HTTP.post(
        f"{served.url}/chat/completions",
        json={"model": "m", "max_tokens": 2, "messages": said},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=60,
    )
    assert chat.status_code == 400 and chat.json()["error"]["code"] == "context_length_exceeded"


def test_a_slow_prompt_streams_pings_then_its_answer_or_error(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past ``patience`` the stream begins before the prompt is decoded: ``message_start``, then
    ``ping``s, then the text (which the helper still joins); an error then is an ``error`` event
    with Anthropic's body, which the client raises."""
    monkeypatch.setattr(doors, "PING_SECONDS", 0.05)
    said = [{"role": "user", "content": "Tell me about rivers. " * 60}]
    base = served.url.removesuffix("/v1")
    body = {"model": "m", "max_tokens": 4, "messages": said, "stream": True}
    url, keyed = f"{base}/v1/messages", {"x-api-key": KEY}
    with HTTP.stream("POST", url, json=body, headers=keyed, timeout=60) as response:
        assert response.status_code == 200
        names = [line.removeprefix("event: ") for line in response.iter_lines() if line.startswith("event: ")]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    waiting = names[: names.index("content_block_start")]
    assert waiting.count("ping") >= 3, names  # (one after the start, then one per 0.05 s of prefill)
    # (greedy: a sampled reply may end before its fourth token)
    with client(served).messages.stream(model="m", max_tokens=4, messages=said, extra_body=GREEDY) as stream:
        assert stream.get_final_message().usage.output_tokens == 4
    monkeypatch.setattr(doors, "PING_SECONDS", 0.001)  # (begun at once: the error comes after)
    huge = [{"role": "user", "content": "word " * 9000}]
    body = {"model": "m", "max_tokens": 4, "messages": huge, "stream": True}
    with HTTP.stream("POST", url, json=body, headers=keyed, timeout=60) as response:
        assert response.status_code == 200  # (begun before the prompt was tried)
        lines = list(response.iter_lines())
    assert "event: error" in lines and "event: message_stop" not in lines
    with (
        pytest.raises(anthropic.APIStatusError) as failed,
        client(served).messages.stream(model="m", max_tokens=4, messages=huge) as stream,
    ):
        stream.get_final_message()
    assert failed.value.body["type"] == "error"
    assert failed.value.body["error"]["type"] == "invalid_request_error"


def test_volatile_lines_remove_only_the_billing_header() -> None:
    volatile = Volatile(VOLATILE_LINES)
    header = "x-anthropic-billing-header: cc_version=2.1; cch=ab12c;"
    flattened = {"role": "system", "content": f"{header}You are Claude Code."}  # (blocks joined bare)
    assert volatile.dropped(Transcript([flattened]))[0]["content"] == "You are Claude Code."
    system = {
        "role": "system",
        "content": f"{header}\nYou are an agent.\nSay x-anthropic-billing-header: no.",
    }
    user = {"role": "user", "content": header}
    kept = volatile.dropped(Transcript([system, user]))
    assert kept == [
        {"role": "system", "content": "You are an agent.\nSay x-anthropic-billing-header: no."},
        user,
    ]
    parts = {"role": "system", "content": [{"type": "text", "text": header}, {"type": "text", "text": "Hi"}]}
    assert volatile.dropped(Transcript([parts])).messages()[0]["content"] == [
        {"type": "text", "text": ""},
        {"type": "text", "text": "Hi"},
    ]
    inside = {"role": "system", "content": f"Quote: {header}"}  # (not where a line begins: kept)
    assert volatile.dropped(Transcript([inside])) == [inside]
    unchanged = Transcript([system, user])
    assert Volatile(()).dropped(unchanged) is unchanged and volatile.dropped(Transcript([user])) == [user]
    with pytest.raises(TypeError):
        Volatile("x-anthropic")


def test_volatile_lines_take_linear_time_on_hostile_text() -> None:
    """A system prompt of headers with no hash on one line, then on many: the default pattern
    scans each line's start once, at most 1,024 characters (it scanned to the text's end from
    every header: 256 KiB took about 17 s, a megabyte minutes, holding a parser all along)."""
    volatile = Volatile(VOLATILE_LINES)
    for glue in ("", "\n", "a" * 1000 + "\n"):
        text = ("x-anthropic-billing-header:" + glue) * (256 * 1024 // (27 + len(glue)))
        began = time.perf_counter()
        assert volatile.dropped(Transcript([{"role": "system", "content": text}]))[0]["content"] == text
        assert time.perf_counter() - began < 2.0, glue[:2]


def test_the_command_names_its_volatile_lines(capsys: pytest.CaptureFixture[str]) -> None:
    read = parser().parse_args
    assert volatile_lines(read(["serve"])) is None  # (create_app's default)
    assert volatile_lines(read(["serve", "--volatile-line", "a.*", "--volatile-line", "b"])) == ("a.*", "b")
    assert volatile_lines(read(["serve", "--volatile-line", ""])) == ()
    with pytest.raises(SystemExit):
        read(["serve", "--volatile-line", "(unclosed"])
    assert "not a regular expression" in capsys.readouterr().err


def test_anthropic_paths_and_tool_result_images() -> None:
    """An error names the Anthropic field, not the chat request's it became; a tool result's
    image goes after the results on a model with images, else a line says it was left out."""
    system = "Be brief."
    said = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "a\u0000b"},
    ]
    with pytest.raises(ApiError) as nul:
        messages_request({"model": "m", "max_tokens": 2, "system": system, "messages": said})
    assert nul.value.param == "messages[2]" and nul.value.message.startswith("messages[2]")
    with pytest.raises(ApiError) as stop:
        messages_request({"model": "m", "max_tokens": 2, "messages": said[:1], "stop_sequences": [""]})
    assert stop.value.param == "stop_sequences"
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}}
    call = {"type": "tool_use", "id": "t1", "name": "shot", "input": {}}
    result = {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "ok"}, image]}
    history = [
        said[0],
        {"role": "assistant", "content": [call]},
        user(result, {"type": "text", "text": "See?"}),
    ]
    body = {"model": "m", "max_tokens": 2, "messages": history}
    seeing = messages_request(body).messages
    assert [m["role"] for m in seeing] == ["user", "assistant", "tool", "user"]
    assert seeing[2]["content"] == "ok\n[image: below]"
    assert [p["type"] for p in seeing[3]["content"]] == ["image_url", "text"]
    blind = messages_request(body, images=False).messages
    assert blind[2]["content"] == "ok\n[image block: not shown to this model]" and blind.messages()[3][
        "content"
    ] == [{"type": "text", "text": "See?"}]
    with pytest.raises(ApiError, match="is_error"):
        messages_request({**body, "messages": [said[0], history[1], user({**result, "is_error": "yes"})]})


def test_calls_and_results_pair_up_as_anthropic_checks_them() -> None:
    """Each call is answered in the next message, each result answers a call of the message
    before it: a refusal names the Anthropic block, not the chat message it became. Ids may
    repeat (a model that writes its calls' ids may repeat one): each result takes one call."""
    call = {"type": "tool_use", "id": "t1", "name": "look", "input": {}}
    again = {**call, "input": {"at": 2}}
    answer = {"type": "tool_result", "tool_use_id": "t1", "content": "ok"}
    text = {"type": "text", "text": "Go on."}

    def refused(*said: dict[str, Any]) -> ApiError:
        with pytest.raises(ApiError) as error:
            messages_request(
                {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}, *said]}
            )
        return error.value

    fine = [{"role": "assistant", "content": [call, again]}, user(answer, answer, text)]
    fine += [{"role": "assistant", "content": [call]}, user(answer)]
    body = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}, *fine]}
    roles = ["user", "assistant", "tool", "tool", "user", "assistant", "tool"]
    assert [m["role"] for m in messages_request(body).messages] == roles
    # Consecutive messages of one role are one turn, as Anthropic merges them.
    other = {**call, "id": "t2"}
    split_up = [{"role": "assistant", "content": [call]}, {"role": "assistant", "content": [other]}]
    split_up += [user(answer), user({**answer, "tool_use_id": "t2"}, text)]
    body = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}, *split_up]}
    assert [m["role"] for m in messages_request(body).messages] == [
        "user",
        "assistant",
        "assistant",
        "tool",
        "tool",
        "user",
    ]
    once = refused({"role": "assistant", "content": [call, again]}, user(answer, text))
    assert once.param == "messages[1]" and "'t1'" in once.message
    stray = refused({"role": "assistant", "content": "No call."}, user(text, answer))
    assert stray.param == "messages[2].content[1].tool_use_id" and "turn before" in stray.message
    late = refused(
        {"role": "assistant", "content": [call]},
        user(text),
        {"role": "assistant", "content": "x"},
        user(answer),
    )
    assert late.param == "messages[1]" and "'t1'" in late.message
    answered_twice = refused({"role": "assistant", "content": [call]}, user(answer, answer))
    assert answered_twice.param == "messages[2].content[1].tool_use_id"
    ahead = refused(user(answer))
    assert ahead.param == "messages[1].content[0].tool_use_id"


class Shade(pydantic.BaseModel):
    """A reply the schema bounds (an enum and a bool: a short JSON text for a tiny model)."""

    colour: Literal["red", "green", "blue"]
    bright: bool


def test_output_config_holds_the_reply_to_its_schema(served: Served) -> None:
    """The SDK's ``parse`` and ``stream`` with ``output_format`` send ``output_config.format``:
    the reply is the schema's JSON, which the helpers parse (it was ignored: free text)."""
    said = [{"role": "user", "content": "Describe the sky at noon."}]
    parsed = client(served).messages.parse(
        model="m", max_tokens=40, messages=said, output_format=Shade, extra_body=GREEDY
    )
    assert isinstance(parsed.parsed_output, Shade) and parsed.stop_reason == "end_turn"
    with client(served).messages.stream(
        model="m", max_tokens=40, messages=said, output_format=Shade, extra_body=GREEDY
    ) as stream:
        streamed = stream.get_final_message()
    assert isinstance(streamed.parsed_output, Shade)  # (not compared: the second prompt is cached)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    body = {"model": "m", "max_tokens": 2, "messages": said}
    beta = messages_request({**body, "output_format": {"type": "json_schema", "schema": schema}})
    assert beta.options.json_schema == schema
    ignored = messages_request({**body, "output_config": {"effort": "low"}})
    assert ignored.options.json_schema is None
    for bad in (
        {"format": {"type": "json_schema"}},
        {"format": {"type": "xml", "schema": {}}},
        {"format": {}},
        "low",
    ):
        with pytest.raises(ApiError) as refused:
            messages_request({**body, "output_config": bad})
        assert (refused.value.param or "").startswith("output_config")
    broken = {"format": {"type": "json_schema", "schema": {"type": 3}}}
    with pytest.raises(anthropic.BadRequestError, match="schema"):
        client(served).messages.create(
            model="m", max_tokens=4, messages=said, extra_body={"output_config": broken}
        )


def test_a_last_assistant_message_is_continued(served: Served) -> None:
    """A prefill, as Anthropic's API takes one: the reply is what follows the assistant's text
    (its prompt that text's plain tokens after the generation prompt, ``count_tokens`` saying
    so), streamed as created; through chat completions too; refused (400) with a schema."""
    asked = [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "My favourite colour is"},
    ]
    made = client(served).messages.create(model=served.name, max_tokens=8, messages=asked, extra_body=GREEDY)
    text = "".join(block.text for block in made.content if block.type == "text")
    assert made.stop_reason in ("max_tokens", "end_turn") and text and not text.startswith("My favourite")
    prompt = served.model.prompt_tokens(asked[:1]) + served.model.tokenize(
        "My favourite colour is", add_special=False
    )
    counted = client(served).messages.count_tokens(model=served.name, messages=asked).input_tokens
    assert counted == len(prompt) == made.usage.input_tokens + made.usage.cache_read_input_tokens
    with client(served).messages.stream(
        model=served.name, max_tokens=8, messages=asked, extra_body=GREEDY
    ) as s:
        streamed = s.get_final_message()
    assert 0 < streamed.usage.output_tokens <= 8 and streamed.content[0].type == "text"
    assert not streamed.content[0].text.startswith("My favourite")
    chat = served.client().chat.completions.create(
        model=served.name, messages=asked, max_tokens=8, temperature=0
    )
    assert chat.choices[0].message.content and not chat.choices[0].message.content.startswith("My favourite")
    with pytest.raises(anthropic.BadRequestError, match="prefill"):
        client(served).messages.create(
            model=served.name,
            max_tokens=8,
            messages=asked,
            extra_body={"output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}},
        )


def test_message_start_carries_the_prompt_usage(served: Served) -> None:
    said = [{"role": "user", "content": "Name a fruit."}]
    body = {"model": "m", "max_tokens": 4, "messages": said, "stream": True, "system": SYSTEM}
    url = served.url.removesuffix("/v1") + "/v1/messages"
    with HTTP.stream("POST", url, json=body, headers={"x-api-key": KEY}, timeout=60) as response:
        data = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]
    start, delta = data[0], next(d for d in data if d["type"] == "message_delta")
    used = start["message"]["usage"]
    assert used["input_tokens"] + used["cache_read_input_tokens"] > 10
    final = delta["usage"]
    assert (used["input_tokens"], used["cache_read_input_tokens"]) == (
        final["input_tokens"],
        final["cache_read_input_tokens"],
    )


def test_what_no_route_answers_under_anthropics_paths_is_in_its_error_body(served: Served) -> None:
    """An unknown path under ``/v1/messages`` and a method its routes do not take come back in
    Anthropic's error body too (they came in OpenAI's: the SDK read no error type)."""
    with pytest.raises(anthropic.NotFoundError) as unknown:
        client(served).messages.batches.retrieve("msgbatch_1")
    assert unknown.value.body == {
        "type": "error",
        "error": {"type": "not_found_error", "message": "Not Found"},
    }
    base, auth = served.url.removesuffix("/v1"), {"x-api-key": KEY}
    for method, path in (
        ("GET", "/v1/messages"),
        ("PUT", "/v1/messages"),
        ("GET", "/v1/messages/count_tokens"),
    ):
        got = HTTP.request(method, f"{base}{path}", headers=auth, timeout=60)
        assert got.status_code == 405, (method, path)
        assert got.headers["allow"] == "POST", (method, path)  # (RFC 9110: a 405 says what is)
        assert got.json() == {
            "type": "error",
            "error": {"type": "invalid_request_error", "message": "Method Not Allowed"},
        }
    elsewhere = HTTP.get(f"{base}/v1/nowhere", headers=auth, timeout=60)  # (OpenAI's paths: its body)
    assert elsewhere.status_code == 404 and set(elsewhere.json()) == {"error"}
    outer = Starlette(
        routes=[Mount("/llm", app=create_app(served.model, api_key=KEY))]
    )  # (mounted in another)
    with running(outer) as url:
        mounted = HTTP.get(f"{url.removesuffix('/v1')}/llm/v1/messages", headers=auth, timeout=60)
    assert mounted.status_code == 405 and mounted.json()["type"] == "error", mounted.text


def test_a_call_nested_too_deep_for_the_event_loop_is_its_input_as_text() -> None:
    """A tool of schema ``{"type": "object"}`` takes arguments hundreds of lists deep (llguidance
    allows them): read as ``input`` on the event loop's stack, or written into the body, they
    raised RecursionError, a 500. Past ``MAX_INPUT_DEPTH`` the input is the call's JSON text."""
    from llmsession.replies import ToolCall
    from llmsession.serve.messages_sse import MAX_INPUT_DEPTH, tool_input

    for depth in (2000, MAX_INPUT_DEPTH + 1):
        deep = '{"a": ' + "[" * depth + "]" * depth + "}"
        assert tool_input(ToolCall("toolu_1", "f", deep)) == {"arguments": deep}
    fine = '{"a": ' + "[" * 100 + "]" * 100 + "}"
    assert json.dumps(tool_input(ToolCall("toolu_1", "f", fine))) == fine


def test_a_call_no_response_body_can_hold_is_its_input_as_text() -> None:
    """Arguments that are JSON but no body can write: ``1e999`` (read as infinity), ``NaN``, a
    lone surrogate's escape. Read into ``input``, the non-streamed body's encoding raised, a 500
    (the stream had sent the text). They are the call's JSON text; a large finite number is not."""
    from starlette.responses import JSONResponse

    from llmsession.replies import ToolCall
    from llmsession.serve.messages_sse import tool_input

    unwritable = ('{"x": 1e999}', '{"x": -1E+999}', '{"x": NaN}', '{"x": "\\ud83d smile"}', '{"\\udc00": 1}')
    for arguments in unwritable:
        value = tool_input(ToolCall("toolu_1", "f", arguments))
        assert value == {"arguments": arguments}, arguments
        JSONResponse({"input": value})  # (what the body's encoding does)
    finite = tool_input(ToolCall("toolu_1", "f", '{"x": 1e300, "y": "\\ud83d\\ude00"}'))
    assert finite == {"x": 1e300, "y": "😀"}


@pytest.mark.parametrize(
    ("pieces", "made"),
    [
        (['{"x": [1,', " 2]}"], '{"x": [1, 2]}'),
        (['{"x": "\\ud83d', ' smile"}'], '{"x": "\\ud83d smile"}'),  # (the SDK's parse raised)
        (['{"x": 1e9', "99}"], '{"x": 1e999}'),  # (infinity streamed, its text in the body)
        (["[1]"], "[1]"),  # (the value itself streamed, under a key in the body)
        (['{"x": "ab'], None),  # (cut short: no call made, one streamed)
    ],
)
def test_a_streamed_call_is_the_bodys_as_the_sdk_reads_it(pieces: list[str], made: str | None) -> None:
    """Pure: a call's pieces were streamed as the model wrote them, so a stream and a body of one
    reply could disagree (a value not an object, a number past a double, a call cut short) or
    the SDK's partial parse of a lone surrogate's escape raised mid-stream. Each call the reply
    makes is its block at the end, its input the body's."""
    from anthropic._streaming import SSEDecoder
    from anthropic.lib.streaming._messages import accumulate_event

    from llmsession.replies import Reply, Snapshot, Timings, ToolCall, ToolCallDelta, Usage
    from llmsession.serve.messages_sse import AnthropicMessage, Blocks

    used = Usage(prompt_tokens=5, completion_tokens=3)
    snapshots = [Snapshot("a", "a"), Snapshot("", "a", (ToolCallDelta(0, "toolu_1", "f"),))]
    snapshots += [Snapshot("", "a", (ToolCallDelta(0, arguments=piece),)) for piece in pieces]
    calls = () if made is None else (ToolCall("toolu_1", "f", made),)
    reply = Reply("a", "tool_calls" if calls else "length", used, Timings(), tool_calls=calls)
    message, blocks = AnthropicMessage("m"), Blocks()
    events = [message.start(used)]
    for snapshot in snapshots:
        events += message.pieces(snapshot, blocks)
    events += message.finish(reply, blocks)
    read: Any = None
    buffers: dict[str, Any] = {}  # (the SDK's own: each block's JSON so far)
    for sse in SSEDecoder().iter_bytes(iter([b"".join(events)])):
        read = accumulate_event(event=sse.json(), current_snapshot=read, json_bufs=buffers)
    assert [block.to_dict() for block in read.content] == message.body(reply)["content"]


def test_a_reply_the_context_ends_says_so(smollm2_path: Path) -> None:
    """A reply that filled its session's context said ``max_tokens`` (a ``length`` like any):
    an agent told so raises its limit and meets the same end. Anthropic's own stop reason for
    it, ``model_context_window_exceeded``, where it was the context (``Reply.context_full``);
    ``max_tokens`` where it was the limit; chat completions say ``length`` for both, as OpenAI's
    and llama-server's do."""
    said = [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]
    with Model(smollm2_path, threads=1) as model:
        long = model.session(context_size=64).respond(said[0]["content"], GenerationOptions(max_tokens=500))
        assert long.finish_reason == "length" and long.context_full
        short = model.session(context_size=64).respond(said[0]["content"], GenerationOptions(max_tokens=3))
        assert short.finish_reason == "length" and not short.context_full
        app = create_app(model, api_key=KEY, session=SessionConfig(context_size=64))
        with running(app) as url:
            claude = anthropic.Anthropic(base_url=url.removesuffix("/v1"), api_key=KEY, max_retries=0)
            full = claude.messages.create(model="m", max_tokens=500, messages=said, extra_body=GREEDY)
            assert full.stop_reason == "model_context_window_exceeded", full
            capped = claude.messages.create(model="m", max_tokens=3, messages=said, extra_body=GREEDY)
            assert capped.stop_reason == "max_tokens" and capped.usage.output_tokens == 3, capped
            with claude.messages.stream(
                model="m", max_tokens=500, messages=said, extra_body=GREEDY
            ) as stream:
                assert stream.get_final_message().stop_reason == "model_context_window_exceeded"
            chat = openai.OpenAI(base_url=url, api_key=KEY, max_retries=0).chat.completions.create(
                model="m",
                messages=said,
                max_tokens=500,
                temperature=0,  # type: ignore[arg-type]
            )
            assert chat.choices[0].finish_reason == "length"


def test_a_keys_token_counts_past_its_share_are_a_503_and_another_keys_wait(
    smollm2: Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Counts waited for their turn without a bound: one key's flood of large bodies, each held
    parsed, grew without end and took every turn. At most ``KEYS_COUNTING`` of a key's count or
    wait, ``MAX_COUNTING`` of all."""
    import threading

    from llmsession.serve import app as served_app

    release, real = threading.Event(), smollm2.prompt_size

    def held_up(*args: Any, **kwargs: Any) -> int:
        release.wait(60)
        return real(*args, **kwargs)

    monkeypatch.setattr(smollm2, "prompt_size", held_up)
    app = create_app(smollm2, api_key=[KEY, OTHER_KEY])
    statuses: list[int] = []
    with running(app) as url:

        def count(key: str = KEY) -> None:
            body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}
            headers = {"x-api-key": key, "anthropic-version": "2023-06-01"}
            answer = HTTP.post(f"{url}/messages/count_tokens", json=body, headers=headers, timeout=60)
            statuses.append(answer.status_code)

        def under_way(n: int) -> None:
            deadline = time.monotonic() + 30
            while app.state.server.waiting["count_tokens"] < n:
                assert time.monotonic() < deadline, app.state.server.waiting.counts
                time.sleep(0.01)

        threads = [threading.Thread(target=count) for _ in range(served_app.KEYS_COUNTING)]
        for thread in threads:
            thread.start()
        under_way(served_app.KEYS_COUNTING)
        count()  # (one more of the key's: past its share)
        assert statuses == [503]
        threads.append(threading.Thread(target=count, args=(OTHER_KEY,)))
        threads[-1].start()
        under_way(served_app.KEYS_COUNTING + 1)
        assert served_app.KEYS_COUNTING < served_app.MAX_COUNTING and statuses == [503]
        release.set()
        for thread in threads:
            thread.join(60)
    assert statuses == [503] + [200] * (1 + served_app.KEYS_COUNTING)
