"""A chat completion request, as OpenAI documents it, checked and turned into the library's
messages and ``GenerationOptions``. Pure: no model, no web framework.

Every check the library would make later is made here first (its own ``checked_options`` and
``options_tools``; the messages become its checked ``Transcript``, which the library then reads
without checking again), so a request's mistake is a 400 before anything runs, and an error that
comes out of a run is the server's. Unknown fields are ignored, as OpenAI's API
does; a known field of the wrong type or out of its range is a ``ApiError`` naming it
(``param``). Counts are bounded (messages, stop strings, tools, images, ``user``) so one request
cannot make the checks or the tenant records costly. Nothing in a request names a file or a URL the
server opens: an image is accepted only as a ``data:`` URL (``images``). A message quotes no more
of what was sent than a few characters (``body.shown``): a body may hold a 4,000-digit number.
The body itself is parsed by ``body.parse_json``.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from llmsession.config import EFFORTS as LEVELS
from llmsession.config import Effort
from llmsession.options import (
    INT32_MAX,
    LLAMA_DEFAULT_SEED,
    MAX_TOP_LOGPROBS,
    GenerationOptions,
    checked_options,
)
from llmsession.serve.body import kind_of, optional, plain_text, shown
from llmsession.serve.chat_messages import transcript
from llmsession.serve.errors import ApiError
from llmsession.serve.images import ImageCount
from llmsession.text.schemas import schema_document, validator_of
from llmsession.text.tools import MAX_TOOLS, options_tools, replaced_options
from llmsession.text.transcript import Transcript

MAX_CHOICES = 8
MAX_TEXT_LOGPROBS = 5  # the legacy completions field: OpenAI lists at most 5
MAX_MESSAGES = 1024
MAX_STOPS = 16
MAX_STOP_BYTES = 1024
MAX_USER = 256  # characters: ``user`` is part of a tenant's key


@dataclass(frozen=True)
class ChatRequest:
    """What a request asks for, in the library's terms."""

    messages: Transcript  # (checked once, here: the library reads it without checking again)
    options: GenerationOptions
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    user: str | None = None
    prompt: str | None = None  # a raw completion's (``/v1/completions``): no messages then
    thinking: bool | Effort | None = (
        None  # the template's thinking, or its effort, as asked (None: the server's)
    )
    model: str | None = None  # the model it names (a server of several answers with that one)
    keep_alive: float | None = None  # seconds its model stays loaded once idle (-1: keep)


def chat_request(
    body: Mapping[str, Any], default_max_tokens: int = INT32_MAX, kept: range = range(0)
) -> ChatRequest:
    """A ``/v1/chat/completions`` body, checked (``ApiError`` for the first bad field). The
    messages at ``kept`` are a stored response's, read and counted when it was asked: neither
    read again nor counted (a chain of responses is bounded by what the store keeps)."""
    model = optional(body, "model", str)
    keep_alive = keep_alive_of(body.get("keep_alive"))
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise ApiError("messages must be a non-empty list", "messages")
    if len(raw) - len(kept) > MAX_MESSAGES:
        raise ApiError(f"messages: at most {MAX_MESSAGES} messages, got {len(raw) - len(kept)}", "messages")
    images = ImageCount()
    messages = transcript(raw, images, kept)
    n = _integer(body, "n", 1, INT32_MAX)
    if n is not None and n > MAX_CHOICES:
        raise ApiError(f"n: at most {MAX_CHOICES} choices, got {n}", "n")
    if n is not None and n > 1 and messages.prefilled() is not None:  # (before it waits its turn)
        raise ApiError("n choices cannot continue the assistant's text (a prefill): ask for one", "n")
    stream = bool(optional(body, "stream", bool))
    stream_options = optional(body, "stream_options", dict) or {}
    include_usage = optional(stream_options, "include_usage", bool, "stream_options.include_usage")
    if stream_options and not stream:  # (OpenAI's answer too)
        raise ApiError("stream_options is only allowed when stream is true", "stream_options")
    user = optional(body, "user", str)
    if user is not None and len(user) > MAX_USER:
        raise ApiError(f"user: at most {MAX_USER} characters, got {len(user)}", "user")
    chosen = options(body, default_max_tokens, _chat_logprobs(body))
    thinking, budget = _reasoning(body)
    if budget is not None:
        chosen = replaced_options(chosen, reasoning_budget=budget)
    return ChatRequest(
        messages,
        chosen,
        n or 1,
        stream,
        bool(include_usage),
        user,
        thinking=thinking,
        model=model,
        keep_alive=keep_alive,
    )


DURATION = re.compile(r"(-?\d{1,9}(?:\.\d{1,6})?)(ms|s|m|h)?")
UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
MAX_KEEP_ALIVE = 10 * 365 * 86400.0


def keep_alive_of(value: object) -> float | None:
    """Ollama's ``keep_alive``: seconds (a number, or a string such as ``"5m"``), ``0`` to
    unload once idle, a negative one to keep loaded; None if absent."""
    if value is None:
        return None
    if isinstance(value, str) and (match := DURATION.fullmatch(value.strip())):
        value = float(match.group(1)) * UNITS[match.group(2) or "s"]
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ApiError('keep_alive must be seconds (a number, or a string like "5m")', "keep_alive")
    if value < 0:
        return -1.0
    return float(min(value, MAX_KEEP_ALIVE))


# ``reasoning_effort`` as the template's effort (``SessionConfig.thinking``: gpt-oss's are low,
# medium and high) and as a budget of reasoning tokens (None: unbounded).
TEMPLATE_EFFORTS: dict[str, Effort] = {"minimal": "low", **{e: e for e in LEVELS}, "xhigh": "high"}
EFFORTS: dict[str, int | None] = {"none": 0, "minimal": 256, "low": 1024, "medium": 4096}
EFFORTS |= {"high": None, "xhigh": None}


def _reasoning(body: Mapping[str, Any]) -> tuple[bool | Effort | None, int | None]:
    """Whether the request asks its template to think, and with which effort (``reasoning_effort``,
    which llama-server also hands the template; ``chat_template_kwargs.enable_thinking`` as
    llama-server and vLLM take it), and the budget its effort gives."""
    effort = optional(body, "reasoning_effort", str)
    if effort is not None and effort not in EFFORTS:
        raise ApiError(
            f"reasoning_effort must be one of {list(EFFORTS)}, got {effort!r:.40}", "reasoning_effort"
        )
    kwargs = optional(body, "chat_template_kwargs", dict) or {}
    enabled = optional(kwargs, "enable_thinking", bool, "chat_template_kwargs.enable_thinking")
    if effort is None:  # (thinking off is a budget of 0: a template with no switch thinks anyway)
        return enabled, 0 if enabled is False else None
    if effort == "none" or enabled is False:  # (enable_thinking true with no effort: a budget of 0;
        return bool(enabled), 0 if enabled is False else EFFORTS[effort]  # false: 0, whatever effort)
    return TEMPLATE_EFFORTS[effort], EFFORTS[effort]


def _chat_logprobs(body: Mapping[str, Any]) -> int | None:
    """How many likeliest tokens to list with each token's score (None: no scores)."""
    top = _integer(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if not optional(body, "logprobs", bool):
        if top:
            raise ApiError("top_logprobs needs logprobs set to true", "top_logprobs")
        return None
    return top or 0


COMPLETION_DEFAULT_TOKENS = 16  # OpenAI's default for /v1/completions
CHAT_ONLY = ("tools", "tool_choice", "parallel_tool_calls", "messages")  # (response_format holds too)


def completion_request(body: Mapping[str, Any]) -> ChatRequest:
    """A ``/v1/completions`` body, checked: one prompt (a string, or a list of one), the same
    sampling fields as a chat's; the chat-only ones are ignored, as unknown fields are."""
    optional(body, "model", str)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise ApiError("prompt must be a non-empty string (or a list of one)", "prompt")
    plain_text(prompt, "prompt")
    unsupported = {
        "echo": bool(body.get("echo")),
        "suffix": bool(body.get("suffix")),
        "best_of": body.get("best_of") not in (None, 1),
    }
    for name in (name for name, asked in unsupported.items() if asked):
        raise ApiError(f"{name} is not supported by this server", name, "unsupported")
    top = _integer(body, "logprobs", 0, MAX_TEXT_LOGPROBS)  # (the legacy field: a count)
    kept = {k: v for k, v in body.items() if k not in (*CHAT_ONLY, "logprobs", "top_logprobs")}
    asked = chat_request({**kept, "messages": [{"role": "user", "content": "-"}]}, COMPLETION_DEFAULT_TOKENS)
    scored = dataclasses.replace(asked.options, logprobs=top)
    return dataclasses.replace(asked, messages=Transcript(), prompt=prompt, options=scored)


UNSUPPORTED = {"logit_bias": "", "functions": ": use tools", "function_call": ": use tools"}


def options(
    body: Mapping[str, Any], default_max_tokens: int = INT32_MAX, logprobs: int | None = None
) -> GenerationOptions:
    """The sampling, stop, format and tool fields as ``GenerationOptions``, checked as the
    library checks them (its tools and tool choice compiled too)."""
    values: dict[str, Any] = {}
    for name, hint in UNSUPPORTED.items():  # (ignored, the reply would not be the one asked for)
        if body.get(name):
            raise ApiError(f"{name} is not supported by this server{hint}", name, "unsupported")
    tokens = _integer(body, "max_completion_tokens", 1, INT32_MAX)
    tokens = tokens if tokens is not None else _integer(body, "max_tokens", 1, INT32_MAX)
    values["max_tokens"] = default_max_tokens if tokens is None else tokens
    for name, low, high in (
        ("temperature", 0.0, 2.0),
        ("top_p", 0.0, 1.0),
        ("presence_penalty", -2.0, 2.0),
        ("frequency_penalty", -2.0, 2.0),
    ):
        value = _number(body, name, low, high)
        if value is not None:
            values[name] = value
    if values.get("top_p") == 0:
        raise ApiError("top_p must be greater than 0", "top_p")
    seed = _integer(body, "seed", -math.inf, math.inf)
    values["seed"] = None if seed is None else seed % LLAMA_DEFAULT_SEED  # (0xFFFFFFFF: random)
    values["stop"] = _stops(body.get("stop"))
    values["json_schema"] = _response_format(body.get("response_format"))
    values.update(_tool_fields(body), logprobs=logprobs)
    try:
        checked = checked_options(GenerationOptions(**values))
    except (ValueError, TypeError) as error:
        raise ApiError(str(error)) from None
    try:
        options_tools(checked)
    except (ValueError, TypeError) as error:  # (a GrammarError is a ValueError)
        raise ApiError(str(error), "tool_choice" if "tool_choice" in str(error) else "tools") from None
    if checked.json_schema is not None:  # (as the tools are: a 400 before the call waits or streams)
        try:
            _, document = schema_document(checked.json_schema)
            validator_of(document)  # (remembered for the call's compile)
        except (ValueError, TypeError) as error:
            raise ApiError(str(error), "response_format") from None
    return checked


def _tool_fields(body: Mapping[str, Any]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    tools = optional(body, "tools", list)
    if tools is not None:
        if not all(isinstance(tool, dict) for tool in tools):
            raise ApiError("tools must be a list of objects", "tools")
        if len(tools) > MAX_TOOLS:
            raise ApiError(f"tools: at most {MAX_TOOLS} tools, got {len(tools)}", "tools")
        values["tools"] = tuple(map(_read_of, tools))
    choice = optional(body, "tool_choice", (str, dict))
    if choice is not None:
        values["tool_choice"] = choice
    parallel = optional(body, "parallel_tool_calls", bool)
    if parallel is not None:
        values["parallel_tool_calls"] = parallel
    return values


def _read_of(tool: dict[str, Any]) -> dict[str, Any]:
    """What is read of a function tool (its other fields are not kept while the request waits
    and runs: a body of 8 MiB of them took twenty times that in objects); another as it is."""
    function = tool.get("function")
    if not isinstance(function, dict):
        return tool
    read = {
        k: function[k] for k in ("name", "description", "parameters", "strict", "return") if k in function
    }
    return {**({"type": tool["type"]} if "type" in tool else {}), "function": read}


def _response_format(value: object) -> Mapping[str, Any] | None:
    """The schema a ``response_format`` holds the reply to (None for text)."""
    if value is None:
        return None
    fields: dict[str, Any] = value if isinstance(value, dict) else {}
    kind = fields.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        spec = fields.get("json_schema")
        schema = spec.get("schema", {}) if isinstance(spec, dict) else None
        if isinstance(schema, dict):
            return schema
        raise ApiError("response_format.json_schema.schema must be an object", "response_format")
    raise ApiError('response_format.type must be "text", "json_object" or "json_schema"', "response_format")


def _stops(value: object) -> tuple[str, ...]:
    stops = [value] if isinstance(value, str) else value if value is not None else []
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise ApiError("stop must be a non-empty string or a list of them", "stop")
    if len(stops) > MAX_STOPS:
        raise ApiError(f"stop: at most {MAX_STOPS} sequences, got {len(stops)}", "stop")
    if any(len(s.encode()) > MAX_STOP_BYTES for s in stops):
        raise ApiError(f"stop: a sequence is at most {MAX_STOP_BYTES} bytes long", "stop")
    return tuple(plain_text(s, "stop") for s in stops)


def _integer(body: Mapping[str, Any], name: str, low: float, high: float) -> int | None:
    value = body.get(name)
    if isinstance(value, float) and value.is_integer():  # 16.0 is what some clients send
        value = int(value)
    value = optional({name: value}, name, int)
    if value is not None and not low <= value <= high:
        raise ApiError(f"{name} must be between {low} and {high}, got {shown(value)}", name)
    return value  # type: ignore[no-any-return]


def _number(body: Mapping[str, Any], name: str, low: float, high: float) -> float | None:
    """A float within ``[low, high]``; an int is compared as it is (float() of a 400-digit one
    overflows), and only one within the bounds is converted."""
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ApiError(f"{name} must be a number, got {kind_of(value)}", name)
    if not low <= value <= high:  # (NaN and the infinities fail it too)
        raise ApiError(f"{name} must be between {low:g} and {high:g}, got {shown(value)}", name)
    return float(value)
