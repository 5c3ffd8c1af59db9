"""The server's pure parts: a request body checked into messages and options, OpenAI's bodies
and stream chunks, the error bodies, the counters and the admission queue. No model."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hmac
import json
import struct
import sys
import time
import zlib
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from starlette.requests import Request

from llmsession import (
    BackendError,
    ContextOverflowError,
    GenerationOptions,
    GrammarError,
    ImageError,
    LlmSessionError,
    MemoryBudgetError,
    ModelClosedError,
    ModelLoadError,
    NativeError,
    ReplyMismatchError,
    RequestError,
    SessionBusyError,
    TemplateError,
    UnavailableError,
    UnsupportedFeatureError,
)
from llmsession.options import INT32_MAX
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
from llmsession.serve import sse
from llmsession.serve.app import create_app
from llmsession.serve.body import nests_deeper, parse_json
from llmsession.serve.errors import ApiError, as_asked, from_library
from llmsession.serve.http import counted_path
from llmsession.serve.metrics import Metrics
from llmsession.serve.naming import tenant_name
from llmsession.serve.rendering import rendered
from llmsession.serve.runner import Admission
from llmsession.serve.schema import chat_request, completion_request
from llmsession.text.schemas import (
    MAX_SCHEMA_DEPTH,
    MAX_SCHEMA_LIST,
    MAX_SCHEMA_NODES,
    check_nodes,
    schema_document,
)
from llmsession.text.tools import checked_tools

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
        "tools": [{**WEATHER, "junk": [{}] * 9, "function": {**WEATHER["function"], "junk": 1}}],
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
    assert options.stop == ("END",) and options.tool_choice == "required"
    assert options.tools == (WEATHER,)  # (what is read of it: its other fields are not kept)
    assert options.parallel_tool_calls is False
    assert (options.presence_penalty, options.frequency_penalty) == (0.5, -0.5)
    assert (asked.stream, asked.include_usage, asked.user, asked.n) == (True, True, "u1", 3)
    roles = [m["role"] for m in asked.messages]
    assert roles == ["system", "user", "assistant", "tool"]
    assert asked.messages.messages()[1] == {
        "role": "user",
        "name": "ann",
        "content": [{"type": "text", "text": "Hi"}],
    }
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
        {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
        "messages[0].content[0].text",
    ),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0].text"),
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
    ({"messages": [{"role": "tool", "content": "x", "tool_call_id": 7}]}, "messages[0].tool_call_id"),
    (
        {"messages": [{"role": "assistant", "content": "x", "reasoning_content": []}]},
        "messages[0].reasoning_content",
    ),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": 1}]}]}, "messages[0].tool_calls[0]"),
    ({"messages": HI, "temperature": "hot"}, "temperature"),
    ({"messages": HI, "temperature": 3}, "temperature"),
    ({"messages": HI, "temperature": True}, "temperature"),
    ({"messages": HI, "top_p": 0}, "top_p"),
    ({"messages": HI, "max_tokens": 0}, "max_tokens"),
    ({"messages": HI, "max_tokens": "8"}, "max_tokens"),
    ({"messages": HI, "max_completion_tokens": 1.5}, "max_completion_tokens"),
    ({"messages": HI, "seed": "7"}, "seed"),
    ({"messages": HI, "stop": 5}, "stop"),
    ({"messages": HI, "stop": ["a", ""]}, "stop"),
    ({"messages": HI, "n": 9}, "n"),
    ({"messages": HI, "n": 0}, "n"),
    ({"messages": HI, "logprobs": "yes"}, "logprobs"),
    ({"messages": HI, "top_logprobs": 2}, "top_logprobs"),
    ({"messages": HI, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": HI, "stream": "yes"}, "stream"),
    ({"messages": HI, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
    ({"messages": HI, "stream_options": {"include_usage": True}}, "stream_options"),  # (not streamed)
    ({"messages": HI, "logit_bias": {"7042": -100}}, "logit_bias"),  # (was ignored: 200, " Paris")
    ({"messages": HI, "functions": [{"name": "f"}]}, "functions"),
    ({"messages": HI, "function_call": "auto"}, "function_call"),
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
    with pytest.raises(ApiError) as caught:
        chat_request(body)
    error = caught.value
    assert error.status == 400 and error.param == param, error
    if "must be a string" in error.message:  # (body.string: what it got, too)
        assert ", got " in error.message, error.message
    assert set(error.body()["error"]) == {"message", "type", "param", "code"}
    assert error.body()["error"]["type"] == "invalid_request_error"


def test_the_body_must_be_a_json_object() -> None:
    assert parse_json(b'{"a": 1}') == {"a": 1}
    for body in (b"{bad", b"[1, 2]", b'{"t": NaN}', b"\xff\xfe", b"[" * 100_000):
        with pytest.raises(ApiError):
            parse_json(body)


def test_library_errors_map_to_statuses_by_their_middle_base() -> None:
    """Every RequestError is a 400 with its message, every UnavailableError a 503 to retry;
    the mapping reads the two bases, not a list of classes."""
    statuses = {
        TemplateError("no"): 400,
        GrammarError("bad schema"): 400,
        ContextOverflowError("too long"): 400,
        ImageError("not an image"): 400,
        UnsupportedFeatureError("no projector"): 400,
        MemoryBudgetError("full"): 503,
        SessionBusyError("busy"): 503,
        ModelClosedError("closed"): 503,
        BackendError("worker gone"): 503,
    }
    for error, status in statuses.items():
        mapped = from_library(error)
        assert mapped is not None and mapped.status == status, error
        assert isinstance(error, RequestError if status == 400 else UnavailableError)
    busy = from_library(MemoryBudgetError("full"))
    assert busy is not None and busy.headers() == {"Retry-After": "1"}
    gone = from_library(BackendError("worker gone"))  # (closed for good: nothing to retry)
    assert gone is not None and gone.headers() == {} and gone.code == "model_unavailable"
    other = from_library(SessionBusyError("session 3 is busy"))
    assert other is not None and "session 3" not in other.message

    class NewRequestError(RequestError):
        """A request error added later: mapped by its base without touching the server."""

    assert (mapped := from_library(NewRequestError("later"))) is not None and mapped.status == 400
    # A reply that fails a valid constraint is a GrammarError, but the request was fine: a 500.
    mismatch = from_library(ReplyMismatchError("the reply does not match its schema: [1, 1]"))
    assert mismatch is not None and (mismatch.status, mismatch.kind) == (500, "server_error")
    assert mismatch.code == "reply_mismatch" and "[1, 1]" in mismatch.message
    # Requests are checked before they run: what comes out of a run unmapped is the server's
    # bug, a logged 500 whose text (paths, state) the client never sees.
    for bug in (
        RuntimeError("a bug"),
        ValueError("/srv/secret: bad state"),
        TypeError("x"),
        NativeError("x"),
    ):
        assert from_library(bug) is None, bug


def test_every_library_error_but_load_and_native_failures_has_a_middle_base() -> None:
    import llmsession.errors as errors

    classes = [c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, LlmSessionError)]
    alone = {LlmSessionError, RequestError, UnavailableError, ModelLoadError, NativeError}
    for cls in classes:  # (a native failure's kinds are its own: the model computed NaN)
        assert cls in alone or issubclass(cls, RequestError | UnavailableError | NativeError), cls
        assert not (issubclass(cls, RequestError) and issubclass(cls, UnavailableError)), cls


def test_a_full_budget_says_nothing_of_other_tenants() -> None:
    mapped = from_library(MemoryBudgetError("sessions 3, 7 hold 8100 of 8192 KV cells"))
    assert mapped is not None and mapped.status == 503
    assert "8100" not in mapped.message and "sessions" not in mapped.message


NOWHERE = {"name": "nowhere"}
TOOL_CALL = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
CHECKED_UP_FRONT = [  # each used to pass the schema and fail only inside the run
    ({"messages": HI, "tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ({"messages": HI, "tools": [WEATHER, WEATHER]}, "tools"),
    ({"messages": HI, "tools": [WEATHER] * 129}, "tools"),
    (
        {"messages": HI, "tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
        "tool_choice",
    ),
    ({"messages": HI, "tool_choice": "required"}, "tool_choice"),
    ({"messages": [{"role": "tool", "tool_call_id": "c9", "content": "x"}]}, "messages"),
    ({"messages": [*HI, {"role": "assistant", "content": ""}]}, "messages"),  # (text continues: a prefill)
    ({"messages": [*HI, {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]}]}, "messages"),
    ({"messages": HI * 1025}, "messages"),
    # Each call answered once before the next assistant message, each result answering a call of
    # the last assistant message.
    *[
        ({"messages": [*HI, {"role": "assistant", "content": None, "tool_calls": calls}, *after]}, param)
        for calls, after, param in (
            ([TOOL_CALL], HI, "messages[1]"),  # (never answered)
            ([TOOL_CALL], [*HI, {"role": "assistant", "content": "So"}], "messages[1]"),  # (nor by a prefill)
            (
                [TOOL_CALL],
                [
                    *HI,
                    {"role": "assistant", "content": "So"},
                    *HI,
                    {"role": "tool", "tool_call_id": "c1", "content": "x"},
                ],
                "messages[1]",
            ),  # (answered after the next reply)
            (
                [TOOL_CALL],
                [{"role": "tool", "tool_call_id": "c1", "content": "x"}] * 2,
                "messages[3]",
            ),  # (twice)
            (
                [TOOL_CALL, {**TOOL_CALL, "id": "c2"}],
                [{"role": "tool", "tool_call_id": "c2", "content": "x"}],
                "messages[1]",
            ),
        )
    ],
    ({"messages": HI, "stop": ["a"] * 17}, "stop"),
    ({"messages": HI, "stop": ["é" * 513]}, "stop"),
    ({"messages": HI, "user": "u" * 257}, "user"),
    ({"messages": [*HI, {"role": "assistant", "content": "Sure"}], "n": 2}, "n"),  # (it waited its turn)
    # A format's schema as the tools' are (it was refused as the call compiled it: after the
    # stream's 5 s wait, a 200 then an error event).
    *[
        ({"messages": HI, "response_format": {"type": "json_schema", "json_schema": {"schema": bad}}}, param)
        for bad, param in (
            ({"type": "nope"}, "response_format"),
            ({"$ref": "http://evil.example/x"}, "response_format"),
            ({"type": "string", "pattern": "(?=a)a"}, "response_format"),
        )
    ],
]


@pytest.mark.parametrize(("body", "param"), CHECKED_UP_FRONT)
def test_what_the_library_would_refuse_is_refused_before_anything_runs(
    body: dict[str, Any], param: str
) -> None:
    with pytest.raises(ApiError) as caught:
        chat_request(body)
    assert caught.value.status == 400 and caught.value.param == param, caught.value


def test_answered_calls_and_long_users_within_the_limits_pass() -> None:
    calls = [*HI, {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]}]
    asked = chat_request({"messages": [*calls, {"role": "tool", "tool_call_id": "c1", "content": "x"}]})
    assert asked.messages[-1]["role"] == "tool"
    among = chat_request({"messages": [*calls, *HI, {"role": "tool", "tool_call_id": "c1", "content": "x"}]})
    assert [m["role"] for m in among.messages] == [
        "user",
        "assistant",
        "user",
        "tool",
    ]  # (words among results)
    # One turn in two assistant messages (a Responses reasoning item between its calls).
    second = {
        "role": "assistant",
        "content": "",
        "reasoning_content": "Hm.",
        "tool_calls": [{**TOOL_CALL, "id": "c2"}],
    }
    results = [{"role": "tool", "tool_call_id": ident, "content": "x"} for ident in ("c1", "c2")]
    assert len(chat_request({"messages": [*calls, second, *results]}).messages) == 5
    assert chat_request({"messages": HI, "user": "u" * 256, "stop": ["é" * 512] * 16}).user == "u" * 256


def test_thousands_of_calls_and_results_are_paired_in_linear_time() -> None:
    """Calls were a list that each result searched: 50,000 calls in one message answered in
    reverse took 2.2 s through chat completions and 41 s through Messages. Chat completions'
    pairing counts ids now (timed below); a Messages body is refused by its converted count
    before pairing (what is timed for it: its pairing, counted too, meets at most 1,024)."""
    from llmsession.serve.messages import chat_body

    k = 50_000
    calls = [{**TOOL_CALL, "id": f"c{i}"} for i in range(k)]
    said = [*HI, {"role": "assistant", "content": None, "tool_calls": calls}]
    said += [{"role": "tool", "tool_call_id": f"c{k - 1 - i}", "content": "r"} for i in range(1021)]
    uses = [{"type": "tool_use", "id": f"a{i}", "name": "f", "input": {}} for i in range(k)]
    results = [{"type": "tool_result", "tool_use_id": f"a{k - 1 - i}", "content": "r"} for i in range(k)]
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": uses}]
    for call, refused in (
        (lambda: chat_request({"messages": said}), "not answered: 'c0', 'c1', 'c2', 'c3', ..."),
        (
            lambda: chat_body({"model": "m", "messages": [*turns, {"role": "user", "content": results}]}),
            "at most",
        ),
    ):
        began = time.monotonic()
        with pytest.raises(ApiError, match=refused):
            call()
        assert time.monotonic() - began < 1.4  # (0.6 s and 0.3 s here, on the AVX2 EPYC)
    twice = [{"type": "tool_use", "id": "a", "name": "f", "input": {}}] * 2  # (ids may repeat)
    answers = [{"type": "tool_result", "tool_use_id": "a", "content": "r"}] * 2
    body = {"model": "m", "max_tokens": 1, "messages": [turns[0], {"role": "assistant", "content": twice}]}
    paired, _ = chat_body({**body, "messages": [*body["messages"], {"role": "user", "content": answers}]})
    assert len(paired["messages"]) == 4
    with pytest.raises(ApiError, match="unexpected tool_use_id 'a'"):
        chat_body({**body, "messages": [*body["messages"], {"role": "user", "content": answers * 2}]})


def test_logprobs_off_and_any_seed_are_accepted() -> None:
    assert chat_request({"messages": HI, "logprobs": False, "top_logprobs": 0}).options.logprobs is None
    for seed in (-1, 2**32 - 1, 2**64 + 5, 1e20):
        options = chat_request({"messages": HI, "seed": seed}).options
        assert options.seed is not None and 0 <= options.seed < 0xFFFFFFFF, seed
    assert chat_request({"messages": HI, "seed": 7}).options.seed == 7


def test_a_lone_surrogate_is_a_400_naming_its_field() -> None:
    for body in (
        b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}',
        b'{"messages": [{"role": "user", "content": "a\xed\xa0\x80b"}]}',
    ):
        with pytest.raises(ApiError) as caught:
            parse_json(body)
        assert caught.value.param == "messages[0].content", caught.value
        assert "codec" not in caught.value.message and "messages[0].content" in caught.value.message
    with pytest.raises(ApiError) as caught:
        parse_json(b'{"tools": [{"\\udfff": 1}]}')
    assert caught.value.param == "a key of tools[0]"
    paired = parse_json(b'{"messages": [{"role": "user", "content": "\\ud83d\\ude00"}]}')
    assert chat_request(paired).messages[0]["content"] == "\U0001f600"


NUMERIC = ("temperature", "top_p", "presence_penalty", "frequency_penalty", "max_tokens", "n", "seed")
HUGE = "1" + "0" * 400
NO_DOUBLE = (HUGE, f"-{HUGE}", "7" * 5000, "1e400", "-1e400", "179769313486231580" + "0" * 291)


def test_a_number_no_double_holds_is_a_400_naming_where_it_is() -> None:
    """Issue 39: float() of a 400-digit integer overflowed inside the checks (a 500), int() of a
    5,000-digit one failed in json (a 400 naming nothing), and messages quoted them whole."""
    for name in (*NUMERIC, "top_logprobs", "some_future_field"):
        for number in NO_DOUBLE:
            for text in (
                f'{{"messages": [], "{name}": {number}}}',
                f'{{"prompt": "x", "{name}": [{number}]}}',
            ):
                with pytest.raises(ApiError) as caught:
                    parse_json(text.encode())
                where = name if text.startswith('{"m') else f"{name}[0]"
                assert caught.value.param == where, (text[:60], caught.value)
                assert len(caught.value.message) < 100 and "1.8e308" in caught.value.message
    largest = int(sys.float_info.max)  # (309 digits: the largest a double holds is read)
    assert parse_json(f'{{"top_p": {largest}, "a": [-{largest}, 1e308]}}'.encode())["top_p"] == largest
    schema = f'{{"type": "json_schema", "json_schema": {{"schema": {{"maximum": {HUGE}}}}}}}'
    with pytest.raises(ApiError) as caught:
        parse_json(f'{{"messages": [], "response_format": {schema}}}'.encode())
    assert caught.value.param == "response_format.json_schema.schema.maximum"


@pytest.mark.parametrize("name", NUMERIC)
def test_a_huge_integer_given_directly_is_refused_in_bounded_words(name: str) -> None:
    """The same numbers reaching the checks as Python values (``chat_request`` takes a mapping)."""
    for number in (10**400, -(10**400), 10**5000, 10**300, float("inf"), float("nan")):
        body = {"messages": HI, name: number}
        if name == "seed" and isinstance(number, int):
            assert chat_request(body).options.seed is not None  # (any integer, modulo 2**32 - 1)
            continue
        with pytest.raises(ApiError) as caught:
            chat_request(body)
        assert caught.value.param == name and len(caught.value.message) < 100, caught.value
    with pytest.raises(ApiError) as caught:
        chat_request({"messages": HI, "max_tokens": 10**300})
    assert caught.value.message.endswith("got an integer of 301 digits")


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-32-le", "utf-32-be"])
def test_a_body_in_utf16_or_utf32_is_read_and_checked_as_utf8(encoding: str) -> None:
    """json reads UTF-16 and UTF-32 (detected, BOM or not): such a body is answered as its UTF-8
    twin would be, and a lone surrogate in it (its own code unit, or an escape the UTF-8 byte
    patterns cannot see there) is a 400 naming its field, not a 500 from the tokenizer."""
    text = r'{"messages": [{"role": "user", "content": "Hi \u00e9 \ud83d\ude00 é"}], "stop": ["é"]}'
    assert parse_json(text.encode(encoding)) == parse_json(text.encode())
    lone = {
        r'{"messages": [{"role": "user", "content": "a\ud800b"}]}': "messages[0].content",
        r'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}]}': (
            "messages[0].content[0].text"
        ),
        r'{"prompt": "\ud800"}': "prompt",
        r'{"prompt": "x", "stop": "a\udfff"}': "stop",
        r'{"prompt": "x", "stop": ["a", "\ud800"]}': "stop[1]",
    }
    for body, where in lone.items():
        for decoded in (body, body.encode().decode("unicode_escape")):  # (an escape; the code unit)
            with pytest.raises(ApiError) as caught:
                parse_json(decoded.encode(encoding, "surrogatepass"))
            assert caught.value.param == where and "lone surrogate" in caught.value.message, caught.value


def test_what_a_message_quotes_is_bounded() -> None:
    key = "k" * 10_000
    with pytest.raises(ApiError) as caught:
        parse_json(f'{{"{key}": [{{"{key}": "\\ud800"}}]}}'.encode())
    param = caught.value.param
    assert param is not None and len(param) <= 123 and param.startswith("kkk") and "..." in param
    deep = "[" * 500 + "1e999" + "]" * 500
    with pytest.raises(ApiError) as caught:
        parse_json(f'{{"a": {deep}}}'.encode())
    assert len(caught.value.message) < 200
    assert len(ApiError("x" * 100_000).message) <= 1024  # (a library error may quote anything)


def png(width: int, height: int) -> str:
    """A data: URL of a PNG header that says ``width``×``height`` (no pixels: it is never decoded)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    data = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", b"") + chunk(b"IEND", b"")
    return "data:image/png;base64," + base64.b64encode(data).decode()


def images(*urls: str) -> dict[str, Any]:
    parts = [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return {"messages": [{"role": "user", "content": [{"type": "text", "text": "What is it?"}, *parts]}]}


def test_the_door_reads_the_formats_the_library_decodes() -> None:
    """The door reads an image's size with the library's formats only (no other PIL plugin
    parses hostile bytes there): a TIFF is refused at the door, not after admission."""
    import io

    import numpy as np
    import PIL.Image

    from llmsession import Image
    from llmsession.serve import images as door

    assert door.FORMATS == Image.FORMATS
    tiff = io.BytesIO()
    PIL.Image.fromarray(np.zeros((4, 4, 3), dtype=np.uint8)).save(tiff, format="TIFF")
    url = "data:image/tiff;base64," + base64.b64encode(tiff.getvalue()).decode()
    with pytest.raises(ApiError, match="not a readable image"):
        chat_request(images(url))


def test_images_are_bounded_in_number_and_size() -> None:
    assert len(chat_request(images(*[png(64, 64)] * 8)).messages[0]["content"]) == 9
    assert chat_request(images(png(4096, 4096))).messages  # 16.8 MP: the limit itself
    refused = [
        (images(*[png(64, 64)] * 9), "at most 8 images"),
        (images(png(5000, 4000)), "at most 16777216 pixels"),
        (images(png(60000, 60000)), "at most 16777216 pixels"),  # past PIL's own bomb limit
        (images("data:image/png;base64,bm90IGFuIGltYWdl"), "not a readable image"),
        (images("data:image/png,rawbytes"), "base64"),
        (images("file:///etc/passwd"), "data: URL"),
    ]
    for body, message in refused:
        with pytest.raises(ApiError) as caught:
            chat_request(body)
        assert message in caught.value.message and caught.value.param, caught.value


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
        "completion_tokens_details": {"reasoning_tokens": 0},
    }
    chunks = [
        *completion.openings(1),
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
    assert "usage" not in sse.Completion("m").openings(1)[0]


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
        with pytest.raises(ApiError) as caught:  # one waits already: the queue is full
            await admission.acquire(1)
        assert caught.value.status == 503 and caught.value.headers() == {"Retry-After": "1"}
        order.append("released")
        admission.release(2)
        await task
        assert admission.used == 0
        assert await admission.acquire(8) == 2  # more than the limit waits for all of it
        return order

    assert asyncio.run(scenario()) == ["released", "granted"]


def test_admission_is_shared_fairly_between_callers() -> None:
    """One key's flood held every place in the queue and the room in arrival order: another
    key waited behind it all, or was refused. A full queue takes the other's request by
    refusing the flood's newest, and room goes to the caller that runs the least now."""

    async def scenario() -> tuple[list[str], int]:
        admission = Admission(limit=1, queue=3)
        granted: list[str] = []
        assert await admission.acquire(1, caller="flood") == 1  # (running)

        async def ask(caller: str) -> None:
            weight = await admission.acquire(1, caller=caller)
            granted.append(caller)
            await asyncio.sleep(0)
            admission.release(weight, caller)

        flood = [asyncio.create_task(ask("flood")) for _ in range(3)]
        await asyncio.sleep(0)  # (the queue is full of the flood's)
        other = asyncio.create_task(ask("other"))
        await asyncio.sleep(0)
        with pytest.raises(ApiError):  # (the flood's own next request: no place of another's to take)
            await admission.acquire(1, caller="flood")
        admission.release(1, "flood")
        ended = await asyncio.gather(other, *flood, return_exceptions=True)
        return granted, sum(isinstance(e, ApiError) and e.status == 503 for e in ended)

    granted, refused = asyncio.run(scenario())
    assert refused == 1 and granted[:1] == ["other"] and granted.count("flood") == 2, granted


def test_the_bodies_waiting_for_room_are_bounded_in_bytes_too() -> None:
    """Each request waiting for room is held parsed (up to nine times its body: 64 bodies of
    8 MiB held 4.5 GB). Past ``max_bytes`` of bodies the queue is full: the flood's newest
    gives its place to another caller's, and its own next is refused."""

    async def scenario() -> tuple[list[str], int]:
        admission = Admission(limit=1, queue=64, max_bytes=100)
        granted: list[str] = []
        assert await admission.acquire(1, caller="flood") == 1  # (running)

        async def ask(caller: str, size: int) -> None:
            weight = await admission.acquire(1, caller=caller, size=size)
            granted.append(caller)
            await asyncio.sleep(0)
            admission.release(weight, caller)

        flood = [asyncio.create_task(ask("flood", 40)) for _ in range(2)]
        await asyncio.sleep(0)  # (80 bytes waiting: room for 20 more)
        with pytest.raises(ApiError, match="too many requests are waiting"):
            await admission.acquire(1, caller="flood", size=40)
        other = asyncio.create_task(ask("other", 40))  # (the flood's newest goes for it)
        await asyncio.sleep(0)
        small = asyncio.create_task(ask("small", 10))  # (fits beside them)
        await asyncio.sleep(0)
        admission.release(1, "flood")
        ended = await asyncio.gather(other, small, *flood, return_exceptions=True)
        return granted, sum(isinstance(e, ApiError) and e.status == 503 for e in ended)

    granted, refused = asyncio.run(scenario())
    assert refused == 1 and sorted(granted) == ["flood", "other", "small"], granted


def test_admission_counts_room_exactly_when_waiters_are_refused_or_cancelled() -> None:
    """A waiter refused for another caller's place and cancelled in the same turn was released
    though never granted (``used`` fell below what ran: more ran than the limit, then a retry
    waited for a release that never came); a cancelled waiter could be chosen to refuse
    (``InvalidStateError``, a 500); no queue at all was a ``ValueError``."""

    async def scenario() -> None:
        admission = Admission(limit=1, queue=2)
        assert await admission.acquire(1, caller="a") == 1
        b = [asyncio.create_task(admission.acquire(1, caller="b")) for _ in range(2)]
        await asyncio.sleep(0)
        c = asyncio.create_task(admission.acquire(1, caller="c"))
        await asyncio.sleep(0)  # (c took b's newest place: b's newest is refused...)
        b[1].cancel()  # (...and its client leaves in the same turn)
        b[0].cancel()  # (a cancelled waiter, not yet gone from the queue...)
        d = asyncio.create_task(admission.acquire(1, caller="d"))  # (...is no place to take back)
        await asyncio.sleep(0)
        await asyncio.gather(*b, return_exceptions=True)
        admission.release(1, "a")
        for waiter in (c, d):
            admission.release(await waiter, "c" if waiter is c else "d")
        assert admission.used == 0 and admission.waiting == 0

    asyncio.run(scenario())

    async def no_queue() -> None:
        admission = Admission(limit=1, queue=0)
        await admission.acquire(1)
        with pytest.raises(ApiError) as refused:
            await admission.acquire(1, caller="x")
        assert refused.value.status == 503

    asyncio.run(no_queue())

    async def turn_passes_on() -> None:  # (a reviewer's read of 9a7b305)
        admission = Admission(limit=4, queue=2)
        await admission.acquire(3, caller="a")
        big = asyncio.create_task(admission.acquire(4, caller="b"))  # (its turn: it does not fit)
        small = asyncio.create_task(admission.acquire(1, caller="c"))
        await asyncio.sleep(0)
        big.cancel()  # (gone, and before its task runs again another comes)
        late = asyncio.create_task(admission.acquire(1, caller="d"))
        await asyncio.gather(big, return_exceptions=True)
        assert await asyncio.wait_for(small, 5) == 1  # (the small one fits: not after a's release)
        late.cancel()

    asyncio.run(turn_passes_on())

    async def retry_waits_for_a_release() -> None:
        admission = Admission(limit=2, queue=4)
        await admission.acquire(1, caller="a")
        retry = asyncio.create_task(admission.acquire(1, behind=True, caller="r"))
        other = asyncio.create_task(admission.acquire(2, caller="o"))  # (waits: it does not fit)
        await asyncio.sleep(0)
        other.cancel()  # (a waiter gone is no release: the retry waits on)
        await asyncio.gather(other, return_exceptions=True)
        await asyncio.sleep(0)
        assert not retry.done()
        admission.release(1, "a")
        assert await asyncio.wait_for(retry, 5) == 1

    asyncio.run(retry_waits_for_a_release())

    async def a_newcomer_waits_its_turn() -> list[str]:
        admission, order = Admission(limit=1, queue=8), []

        async def ask(caller: str) -> None:
            await admission.acquire(1, caller=caller)
            order.append(caller)

        await admission.acquire(1, caller="a")  # (a runs, and asks again: served, it waits)
        waiting = [asyncio.create_task(ask(c)) for c in ("a", "b")]
        await asyncio.sleep(0)
        admission.release(1, "a")  # (b's turn: a was served last)
        await asyncio.sleep(0)
        waiting.append(asyncio.create_task(ask("c")))  # (c comes while b runs)
        await asyncio.sleep(0)
        admission.release(1, "b")  # (a has waited since before c came: a's turn)
        await asyncio.sleep(0)
        admission.release(1, "a")
        await asyncio.gather(*waiting)
        return order

    # (a newcomer counted as never served went first: callers taking turns starved a)
    assert asyncio.run(a_newcomer_waits_its_turn()) == ["b", "a", "c"]


def test_error_bodies_are_json() -> None:
    error = ApiError("nope", "n", "bad", 400)
    assert json.loads(json.dumps(error.body())) == {
        "error": {"message": "nope", "type": "invalid_request_error", "param": "n", "code": "bad"}
    }


def test_a_retry_waits_behind_the_requests_running() -> None:
    async def scenario() -> None:
        admission = Admission(limit=4, queue=2)
        with pytest.raises(ApiError) as caught:  # nobody runs: nothing will free memory
            await admission.acquire(1, behind=True)
        assert caught.value.status == 503
        assert await admission.acquire(1) == 1
        retry = asyncio.create_task(admission.acquire(1, behind=True))
        await asyncio.sleep(0)
        assert not retry.done() and admission.waiting == 1  # room in sequences is not enough
        admission.release(1)
        assert await retry == 1 and admission.used == 1 and admission.waiting == 0

    asyncio.run(scenario())

    async def a_newcomer_is_not_held_behind_it() -> None:
        """A request with room in sequences waited for the next release behind a retry's wait
        for memory (minutes, with a long stream running and places free)."""
        admission = Admission(limit=4, queue=2)
        await admission.acquire(1)
        retry = asyncio.create_task(admission.acquire(1, behind=True))
        await asyncio.sleep(0)
        assert await asyncio.wait_for(admission.acquire(2), 5) == 2 and admission.used == 3
        assert not retry.done()  # (still waiting for a release: memory, not places)
        too_many = asyncio.create_task(admission.acquire(2))  # (does not fit: waits)
        await asyncio.sleep(0)
        assert not too_many.done() and admission.waiting == 2
        admission.release(2)
        assert await retry == 1 and await too_many == 2 and admission.used == 4

    asyncio.run(a_newcomer_is_not_held_behind_it())

    async def nor_refused_for_its_place_in_the_queue() -> None:
        """(A reviewer's read: with the queue full of retries, one with places free was a 503.)"""
        admission = Admission(limit=4, queue=1)
        await admission.acquire(1)
        retry = asyncio.create_task(admission.acquire(1, behind=True))
        await asyncio.sleep(0)
        assert admission.waiting == 1 and await asyncio.wait_for(admission.acquire(1), 5) == 1
        admission.release(1)
        assert await retry == 1

    asyncio.run(nor_refused_for_its_place_in_the_queue())


def test_thinking_off_is_a_budget_of_0_whatever_the_effort() -> None:
    """``enable_thinking`` false: a template without a switch (gpt-oss) reasons anyway, and an
    effort beside it (``high``: no budget) left it without bound."""
    for effort in (None, "none", "low", "high"):
        body: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}
        body["chat_template_kwargs"] = {"enable_thinking": False}
        if effort is not None:
            body["reasoning_effort"] = effort
        asked = chat_request(body)
        assert (asked.thinking, asked.options.reasoning_budget) == (False, 0), (effort, asked.thinking)
    plain = chat_request(
        {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "reasoning_effort": "high"}
    )
    assert plain.options.reasoning_budget is None  # (thinking on: the effort's, none for high)


def fake_model(live: int = 2) -> Any:
    memory = SimpleNamespace(max_live_sessions=live)
    return SimpleNamespace(memory=lambda: memory, closed=False, path=Path("m.gguf"), mmproj_path=None)


def test_keys_are_compared_as_digests(monkeypatch: pytest.MonkeyPatch) -> None:
    """What is compared has one length whatever was sent, so the time says nothing of a key's
    length; the tenant is a digest of the key and the user."""
    server = create_app(fake_model(), api_key=["sk-short", "sk-" + "long" * 50]).state.server
    compared: list[tuple[int, int]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        compared.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)

    def request(token: str) -> Request:
        return Request({"type": "http", "headers": [(b"authorization", f"Bearer {token}".encode())]})

    key = server.authorize(request("sk-short"))
    assert key is not None and "sk-short" not in key
    for token in ("x", "sk-shor", "y" * 5000):
        with pytest.raises(ApiError):
            server.authorize(request(token))
    assert compared and set(compared) == {(32, 32)}
    assert tenant_name(key, "u" * 256) != tenant_name(key, "v") and len(tenant_name(key, "u" * 256)) == 97
    assert tenant_name(key, "u").split("/")[0] == tenant_name(key, "v").split("/")[0]  # (one owner: a key)
    assert tenant_name(key, "u").split("/")[0] != tenant_name("other", "u").split("/")[0]
    assert tenant_name(None, "u").split("/")[0] != tenant_name(None, "v").split("/")[0]  # (no keys: users)
    assert tenant_name(None, "a") != tenant_name("a", None)
    for unheard in ("sk-clé", " sk-padded", "sk-\x07", "sk two"):  # (no header or Bearer token carries it)
        with pytest.raises(ValueError, match="printable ASCII"):
            create_app(fake_model(), api_key=["sk-fine", unheard])


def test_a_raw_completions_body_and_chunks_are_openais_legacy_ones() -> None:
    asked = completion_request({"prompt": ["Once"], "max_tokens": 3, "tools": "ignored", "n": 2})
    assert asked.prompt == "Once" and asked.messages == [] and asked.n == 2
    assert asked.options.max_tokens == 3 and completion_request({"prompt": "x"}).options.max_tokens == 16
    completion = sse.Completion("m", text=True)
    assert completion.id.startswith("cmpl-") and completion.openings(2) == []
    reply = Reply("upon", "length", Usage(prompt_tokens=2, completion_tokens=1), Timings())
    body = completion.body([reply])
    assert body["object"] == "text_completion" and body["choices"][0]["text"] == "upon"
    chunk = completion.pieces(0, Snapshot("up", "up"))[0]
    assert chunk["object"] == "text_completion" and chunk["choices"][0] == {
        "index": 0,
        "text": "up",
        "logprobs": None,
        "finish_reason": None,
    }
    assert completion.finish(0, reply)["choices"][0]["finish_reason"] == "length"
    for bad in (
        {"prompt": ""},
        {"prompt": ["a", "b"]},
        {"prompt": "x", "suffix": "y"},
    ):
        with pytest.raises(ApiError):
            completion_request(bad)


def test_logprobs_become_the_count_of_alternatives() -> None:
    assert chat_request({"messages": HI, "logprobs": True}).options.logprobs == 0
    assert chat_request({"messages": HI, "logprobs": True, "top_logprobs": 3}).options.logprobs == 3
    assert completion_request({"prompt": "x", "logprobs": 2}).options.logprobs == 2
    assert completion_request({"prompt": "x"}).options.logprobs is None
    for bad in (6, -1, True, "2"):
        with pytest.raises(ApiError) as caught:
            completion_request({"prompt": "x", "logprobs": bad})
        assert caught.value.param == "logprobs", bad


def scored(text: str) -> TokenLogprob:
    return TokenLogprob(
        text, text.encode(), -0.5, (Alternative(text, text.encode(), -0.5), Alternative("x", b"x", -2.0))
    )


def whole(body: dict[str, Any]) -> Any:
    """A whole body as its client reads it (its scores are JSON text already)."""
    return json.loads(rendered(body))


def test_scores_stream_with_their_text_and_the_rest_come_with_the_finish() -> None:
    entries = (scored("He"), scored("llo"), scored("!"))
    reply = Reply("Hello!", "stop", Usage(), Timings(), logprobs=entries)
    chat = sse.Completion("m", logprobs=True)
    assert whole(chat.body([reply]))["choices"][0]["logprobs"] == sse.chat_logprobs(entries)
    first = sse.chat_logprobs(entries[:1])["content"][0]
    assert first == {
        "token": "He",
        "logprob": -0.5,
        "bytes": [72, 101],
        "top_logprobs": [
            {"token": "He", "logprob": -0.5, "bytes": [72, 101]},
            {"token": "x", "logprob": -2.0, "bytes": [120]},
        ],
    }
    streamed = sse.Streamed()
    chunk = chat.pieces(0, Snapshot("He", "He", logprobs=entries[:1]), streamed)[0]
    assert chunk["choices"][0]["logprobs"]["content"] == [first]
    silent = chat.pieces(0, Snapshot("", "He", logprobs=entries[1:2]), streamed)  # (held-back text)
    assert [c["choices"][0]["delta"]["content"] for c in silent] == [""]
    last = chat.finish(0, reply, streamed)["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in last] == ["!"]
    assert sse.Completion("m").pieces(0, Snapshot("", "He", logprobs=entries[:1])) == []  # not asked
    legacy = sse.Completion("m", text=True, logprobs=True)
    assert whole(legacy.body([reply]))["choices"][0]["logprobs"] == {
        "tokens": ["He", "llo", "!"],
        "token_logprobs": [-0.5, -0.5, -0.5],
        "top_logprobs": [{"He": -0.5, "x": -2.0}, {"llo": -0.5, "x": -2.0}, {"!": -0.5, "x": -2.0}],
        "text_offset": [0, 2, 5],
    }
    streamed = sse.Streamed()
    legacy.pieces(0, Snapshot("He", "He", logprobs=entries[:1]), streamed)
    offsets = legacy.finish(0, reply, streamed)["choices"][0]["logprobs"]["text_offset"]
    assert offsets == [2, 5]


def test_metrics_label_the_page_and_a_bounded_set_of_paths() -> None:
    assert counted_path("/") == "/" and counted_path("/v1/chat/completions") == "/v1/chat/completions"
    assert counted_path("/static/app.js") == counted_path("/static/../../etc/passwd") == "/static/"
    assert {counted_path(f"/v1/x{i}") for i in range(100)} == {"other"}
    for route in app_routes():  # (every route its own label: embeddings, operators' were "other")
        path = route.path.replace("{name:path}", "{name}")
        assert counted_path(route.path.replace("{id}", "x").replace("{name:path}", "a/b")) == path, path


def nested(levels: int) -> dict[str, Any]:
    """A schema (and a JSON value) whose objects and lists nest exactly ``levels`` deep."""
    node: dict[str, Any] = {"type": "integer"}
    for _ in range((levels - 1) // 2):
        node = {"type": "array", "prefixItems": [node]}  # (a dict in a list: two levels)
    return node if levels % 2 else {"not": node}


def test_one_walk_measures_nesting_for_the_schema_and_the_echo_limits() -> None:
    """``text.schemas.containers`` serves both: a schema's limit and the server's echo limit
    count the same levels, up to and including the limit, and no further."""
    assert not nests_deeper(nested(128), 128) and nests_deeper(nested(129), 128)
    assert not nests_deeper([[["a"], {"b": 1}]], 3) and nests_deeper([[["a"], {"b": [1]}]], 3)
    check_nodes(nested(MAX_SCHEMA_DEPTH))
    with pytest.raises(GrammarError, match="nested deeper"):
        check_nodes(nested(MAX_SCHEMA_DEPTH + 1))
    with pytest.raises(GrammarError, match="inside the schema"):
        check_nodes(nested(MAX_SCHEMA_DEPTH) | {"$ref": "https://example.com/s.json"})
    assert not nests_deeper("flat", 0) and nests_deeper([[1] * 3] * 100_000, 1)


def wide(nodes: int) -> dict[str, Any]:
    """A schema of about ``nodes`` values (itself, its ``properties``, their schemas and
    strings): at most ``nodes``, at least ``nodes - 1``."""
    return {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range((nodes - 3) // 2)}}


def test_a_call_s_schemas_are_bounded_before_any_is_checked() -> None:
    """Each value of a schema is checked against its draft in Python, holding the interpreter:
    a 1.4 MB schema of 50,000 objects took 16 s, and every other request waited; 5,000 ``true``
    subschemas 1.5 s; a ``type`` list of 3,000 mixed items 0.5 s (compared pairwise). Past
    ``MAX_SCHEMA_NODES`` values or ``MAX_SCHEMA_LIST`` items, in a format or in the tools all
    told, a call is refused at once."""
    check_nodes(wide(MAX_SCHEMA_NODES))
    with pytest.raises(GrammarError, match="values"):
        check_nodes(wide(MAX_SCHEMA_NODES + 2))
    with pytest.raises(GrammarError, match="values"):
        check_nodes({"allOf": [{"anyOf": [True] * 600} for _ in range(20)]})
    check_nodes({"type": "string", "enum": [f"v{i}" for i in range(MAX_SCHEMA_LIST)]})
    with pytest.raises(GrammarError, match="list of more than"):
        check_nodes({"properties": {"x": {"type": [None, *(f"a{i}" for i in range(MAX_SCHEMA_LIST))]}}})
    tool = {"type": "function", "function": {"name": "t", "parameters": wide(MAX_SCHEMA_NODES // 4)}}
    checked_tools([{**tool, "function": {**tool["function"], "name": f"t{i}"}} for i in range(3)])
    began = time.perf_counter()
    with pytest.raises(GrammarError, match="values"):  # (what a call's format compiles first)
        schema_document(wide(100_000))
    too_many = [{**tool, "function": {**tool["function"], "name": f"t{i}"}} for i in range(5)]
    with pytest.raises(ApiError, match="values") as refused:  # (a request's tools, read up front)
        chat_request({"messages": HI, "max_tokens": 1, "tools": too_many})
    assert refused.value.status == 400 and time.perf_counter() - began < 5.0  # (16 s against the draft)


def test_the_legacy_top_logprobs_keep_the_likeliest_of_alternatives_that_read_alike() -> None:
    """Inside a character several alternatives read ``""``: the mapping keeps the likeliest's
    score (the chosen one's), not the last one's."""
    top = (
        Alternative("", b"\xe3\x81", -0.1),
        Alternative("K", b"K", -1.5),
        Alternative("", b"\xe3\x82", -2.0),
    )
    entry = TokenLogprob("", b"\xe3\x81", -0.1, top)
    assert sse.text_logprobs([entry])["top_logprobs"] == [{"": -0.1, "K": -1.5}]


def test_a_reply_mismatch_is_final_only_where_another_try_decodes_the_same() -> None:
    mismatch = ReplyMismatchError("the reply fails uniqueItems")
    for options, final in (
        (GenerationOptions(temperature=0), True),
        (GenerationOptions(temperature=0.8, seed=3), True),
        (GenerationOptions(temperature=0.8), False),
    ):
        error = as_asked(from_library(mismatch) or ApiError("none"), options)
        assert (error.headers().get("x-should-retry") == "false") is final, options


def test_operator_keys_are_told_apart_from_tenants() -> None:
    """An operator key is a tenant of its own and an operator; a tenant's key is a tenant only
    (403 where operators act); without operator keys every caller is one (as before them); and
    a server of operator keys only lets anyone chat, as one anonymous tenant."""
    from llmsession.serve.access import Access

    def request(token: str | None) -> Request:
        headers = [(b"authorization", f"Bearer {token}".encode())] if token else []
        return Request({"type": "http", "headers": headers})

    both = Access(["t"], ["o"])
    tenant, operator = request("t"), request("o")
    assert both.authorize(tenant) not in (None, both.authorize(operator))
    assert not tenant.state.operator and operator.state.operator
    with pytest.raises(ApiError) as forbidden:
        both.authorize_operator(request("t"))
    assert forbidden.value.status == 403
    with pytest.raises(ApiError) as unknown:
        both.authorize(request(None))
    assert unknown.value.status == 401
    assert both.authorize_operator(request("o")) is not None
    alone, anonymous = Access(["t"]), request(None)
    assert alone.authorize(request("t")) is not None and alone.authorize_operator(request("t")) is not None
    operators_only = Access([], ["o"])
    assert operators_only.authorize(anonymous) is None and not anonymous.state.operator
    with pytest.raises(ValueError, match="operator key"):
        Access([], [""])


@pytest.mark.parametrize("door", ["chat", "messages", "responses"])
def test_a_door_that_cannot_write_an_event_ends_its_stream_with_an_error_event(
    door: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An error from the choices ends a stream with an error event in the API's words; one of
    the door's own (an event it cannot write: a NaN score, which JSON has not) cut the stream
    with none, and the official clients reported a broken connection."""
    from llmsession.serve import doors, messages_sse, responses_sse
    from llmsession.serve.runner import Event

    def broken(*_: Any) -> Any:
        raise ValueError("Out of range float values are not JSON compliant")

    writer = {"chat": (sse.Completion, "pieces"), "messages": (messages_sse.AnthropicMessage, "pieces")}
    cls, name = writer.get(door, (responses_sse.ResponseObject, "pieces"))
    monkeypatch.setattr(cls, name, broken)
    made = {
        "chat": lambda: doors.CompletionDoor(sse.Completion("m")),
        "messages": lambda: doors.MessagesDoor("m"),
        "responses": lambda: doors.ResponsesDoor(responses_sse.ResponseObject("m", {})),
    }[door]()
    choices = SimpleNamespace(n=1, forks=None, cancel=lambda: None)

    async def read() -> list[bytes]:
        first = [Event(0, snapshot=Snapshot("a", "a"))]
        return [piece async for piece in made.stream(choices, first)]  # type: ignore[arg-type]

    said = b"".join(asyncio.run(read())).decode()
    last = [line for line in said.splitlines() if line.startswith("data: ")]
    ending = {"chat": '"server_error"', "messages": '"api_error"', "responses": '"response.failed"'}[door]
    assert ending in (last[-2] if door == "chat" else last[-1]), said
    assert door != "chat" or last[-1] == "data: [DONE]"


def app_routes() -> list[Any]:
    """The routes of a server (its page's aside), as ``create_app`` makes them."""
    from starlette.routing import Route

    app = create_app(fake_model())
    return [r for r in app.routes if isinstance(r, Route) and not r.path.startswith(("/static", "/favicon"))]


def test_a_place_granted_as_its_caller_is_cancelled_is_given_back() -> None:
    """``race`` gave up only work still running: a place granted in the turns between its
    waiting task's end and the caller's resuming was lost with the caller's cancel (a replica's
    stopped request, a shutdown), and the server had one place fewer for good. Whatever turn
    the cancel comes in, the places add up; a hold on a model is given back the same way."""
    from llmsession.serve.chat import race

    async def scenario(turns: int) -> int:
        admission = Admission(limit=1, queue=2)
        running = await admission.acquire(1)
        gone: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        asking = asyncio.ensure_future(race(gone, admission.acquire(1), admission.release))
        for _ in range(3):
            await asyncio.sleep(0)  # (it waits in the queue)
        admission.release(running)
        for _ in range(turns):
            await asyncio.sleep(0)
        asking.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            admission.release(await asking)  # (it had its place before the cancel: its own to give)
        for _ in range(3):
            await asyncio.sleep(0)
        return admission.used

    assert [asyncio.run(scenario(turns)) for turns in range(6)] == [0] * 6


def test_what_an_answer_would_lack_and_parts_past_the_bound_are_refused() -> None:
    """A Responses ``conversation``, stored ``prompt`` or ``background``, and Anthropic's
    ``mcp_servers``, were dropped: answered without the context, instructions or tools they
    add. They are a 400 naming the field; ``truncation`` "auto" (alike here: a prompt past the
    context is refused) is echoed as asked, another value refused.
    A message of more than ``MAX_PARTS`` parts (an 8 MiB body held 290,000 empty ones, 56 MB as
    objects kept with its transcript) is refused on every door."""
    from llmsession.serve.chat_messages import MAX_PARTS
    from llmsession.serve.messages import chat_body
    from llmsession.serve.responses import responses_ask

    for name, value in (
        ("conversation", "conv_1"),
        ("prompt", {"id": "pmpt_1"}),
        ("background", True),
        ("truncation", "middle"),
    ):
        with pytest.raises(ApiError) as refused:
            responses_ask({"model": "m", "input": "Hi", name: value})
        assert refused.value.param == name and refused.value.status == 400, refused.value
    for quiet in ({"background": False}, {"truncation": "disabled"}, {"conversation": None}):
        assert responses_ask({"model": "m", "input": "Hi", **quiet}).items
    assert responses_ask({"model": "m", "input": "Hi", "truncation": "auto"}).echo["truncation"] == "auto"
    with pytest.raises(ApiError) as refused:
        chat_body(
            {
                "model": "m",
                "max_tokens": 8,
                "messages": [{"role": "user", "content": "Hi"}],
                "mcp_servers": [{}],
            }
        )
    assert refused.value.param == "mcp_servers"
    assert chat_body(
        {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}], "mcp_servers": []}
    )

    many = [{"type": "text", "text": ""}] * (MAX_PARTS + 1)
    for ask in (
        lambda: chat_request({"model": "m", "messages": [{"role": "user", "content": many}]}),
        lambda: responses_ask(
            {
                "model": "m",
                "input": [
                    {"role": "user", "content": [{"type": "input_text", "text": ""}] * (MAX_PARTS + 1)}
                ],
            }
        ),
        lambda: chat_body({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": many}]}),
    ):
        with pytest.raises(ApiError, match=f"at most {MAX_PARTS} parts"):
            ask()
    assert chat_request({"model": "m", "messages": [{"role": "user", "content": many[:MAX_PARTS]}]}).messages
