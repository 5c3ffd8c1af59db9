"""An OpenAI Responses request (``POST /v1/responses``), as OpenAI documents it, checked and
turned into a chat request in OpenAI's chat shape (then checked as one: ``schema.chat_request``).
Pure: no model, no web framework.

What maps where: ``instructions`` is the system message (a previous response's is not carried
over, as OpenAI has it); ``input`` is a string (one user message) or items: ``message`` (roles
user, assistant, system, developer; ``input_text`` / ``output_text`` parts, ``input_image`` as a
base64 ``data:`` URL only), ``function_call`` (consecutive calls are one assistant message's
``tool_calls``), ``function_call_output`` (a ``tool`` message); a ``reasoning`` item sent back
is the reasoning of the assistant turn after it (its ``reasoning_text`` parts, else its summary;
an encrypted one alone is dropped), which the template renders or drops as it does (the items:
``responses_input``). ``tools`` are flat function tools; ``text.format`` is a
``response_format``; ``max_output_tokens`` is ``max_tokens``; ``reasoning.effort`` is
``reasoning_effort``; ``include`` naming the output text's logprobs, or ``top_logprobs``, are
chat's ``logprobs``; ``stop`` and ``seed`` are taken when a client sends them; ``truncation``
("auto" or "disabled": alike here, a prompt past the context is refused) is echoed. Fields the
engine has no use for (``reasoning.summary``, ``service_tier``, ...) are accepted and ignored,
as unknown ones; those without which the answer would be made otherwise than asked
(``UNSUPPORTED``) are refused.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from llmsession.serve.body import kind_of, nests_deeper, string
from llmsession.serve.errors import ApiError
from llmsession.serve.responses_input import input_messages
from llmsession.serve.schema import MAX_USER, ChatRequest, chat_request
from llmsession.serve.translation import converted_tools, renamed

MAX_METADATA = 16  # keys, as OpenAI bounds them
MAX_ID = 128  # characters of a previous_response_id
MAX_ECHOED_DEPTH = 128  # levels of what a response echoes (a tool's schema may nest 64: ``schemas``)


@dataclass(frozen=True)
class ResponsesAsk:
    """A Responses body, read: the chat body it asks the same of (its messages the new input
    only: ``previous`` is looked up by the route), and what the response echoes."""

    chat: dict[str, Any]
    items: list[dict[str, Any]]  # the new input, as chat messages
    instructions: str | None
    previous: str | None
    store: bool
    echo: dict[str, Any] = field(default_factory=dict)


def responses_ask(body: Mapping[str, Any], *, images: bool = True) -> ResponsesAsk:
    """A ``/v1/responses`` body, checked; ``ApiError`` names the first bad field. ``images``: the
    model takes images (else a function call output's image is a line of text that says so)."""
    model = string(body.get("model"), "model")
    _unsupported(body)
    instructions = _optional(body, "instructions", str)
    previous = _optional(body, "previous_response_id", str)
    if previous is not None and not 0 < len(previous) <= MAX_ID:
        raise ApiError("previous_response_id is not a response id", "previous_response_id")
    store = _optional(body, "store", bool)
    chat: dict[str, Any] = {"model": model}
    tokens = body.get("max_output_tokens")
    if tokens is not None:
        chat["max_tokens"] = tokens
    passed = ("temperature", "top_p", "stream", "stop", "seed", "parallel_tool_calls", "user", "keep_alive")
    for name in passed:
        if body.get(name) is not None:
            chat[name] = body[name]
    reasoning = body.get("reasoning") or {}
    if not isinstance(reasoning, dict):
        raise ApiError(f"reasoning must be an object, got {kind_of(reasoning)}", "reasoning")
    if reasoning.get("effort") is not None:
        chat["reasoning_effort"] = reasoning["effort"]
    named = "user" if chat.get("user") is not None else "safety_identifier"  # (the tenant's name)
    if named != "user" and isinstance(body.get(named), str):
        chat["user"] = body[named]
    if isinstance(chat.get("user"), str) and len(chat["user"]) > MAX_USER:
        raise ApiError(f"{named}: at most {MAX_USER} characters", named)
    chat.update(_tools(body), **_format(body), **_logprobs(body))
    metadata = _metadata(body)
    echo = {
        "instructions": instructions,
        "max_output_tokens": tokens,
        "metadata": metadata,
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "tool_choice": _echoed_choice(body.get("tool_choice", "auto")),
        "tools": [_echoed_tool(tool) for tool in body.get("tools") or []],
        "text": {"format": _echoed_format(body["text"].get("format") if body.get("text") else None)},
        "user": chat.get("user"),
        "reasoning": {"effort": reasoning.get("effort"), "summary": None},
        "top_logprobs": chat.get("top_logprobs"),
        "truncation": body.get("truncation") or "disabled",  # (a prompt past the context: a 400 either way)
    }
    for name in ("tools", "tool_choice", "text"):  # (the rest it echoes is flat, or checked flat)
        if nests_deeper(echo[name], MAX_ECHOED_DEPTH):
            raise ApiError(f"{name}: nested deeper than {MAX_ECHOED_DEPTH} levels", name)
    items = input_messages(body.get("input"), images)
    return ResponsesAsk(chat, items, instructions, previous, True if store is None else store, echo)


NAMES = {
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
    "messages": "input",
    "reasoning_effort": "reasoning.effort",
}


def responses_request(ask: ResponsesAsk, history: list[dict[str, Any]]) -> ChatRequest:
    """The chat request a read body asks for, after the transcript it continues: checked as a
    chat's (an error names the field as the Responses API spells it), the stored transcript by
    the library's check only (its images are not read again, nor counted with the input's).
    OpenAI's API has no prefill: an input that ends with the assistant's text is refused, as a
    stored response keeps its reply as a message of its own after the input."""
    system = [{"role": "system", "content": ask.instructions}] if ask.instructions else []
    stored = range(len(system), len(system) + len(history))  # (read when they were asked)
    try:
        asked = chat_request({**ask.chat, "messages": [*system, *history, *ask.items]}, kept=stored)
    except ApiError as error:
        raise renamed(error, NAMES) from None
    if not asked.messages.ends_with_question():
        raise ApiError("the input must end with a user message or function call outputs", "input")
    return asked


LOGPROBS = "message.output_text.logprobs"  # (what ``include`` names for them)


def _logprobs(body: Mapping[str, Any]) -> dict[str, Any]:
    """``include`` naming the output text's logprobs, or ``top_logprobs`` alternatives each (a
    chat's ``logprobs`` and ``top_logprobs``: checked as those are). Other ``include`` values
    name what this server has nothing of (tool results it never ran, encrypted reasoning)."""
    include, top = body.get("include"), body.get("top_logprobs")
    if include is not None and not (isinstance(include, list) and all(isinstance(i, str) for i in include)):
        raise ApiError("include must be a list of strings", "include")
    if LOGPROBS not in (include or ()) and top is None:  # (alternatives asked for: scores too)
        return {}
    return {"logprobs": True, **({"top_logprobs": top} if top is not None else {})}


def _tools(body: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    tools = body.get("tools")
    if tools is not None:
        out["tools"] = converted_tools(tools, _tool)
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools":
        listed = choice.get("tools")
        functions = [  # (the check is the library's: a name among the tools, a mode it knows)
            {"type": "function", "function": {"name": t.get("name")}}
            if isinstance(t, dict) and t.get("type") == "function"
            else t
            for t in (listed if isinstance(listed, list) else [])
        ]
        allowed = {"mode": choice.get("mode"), "tools": functions}
        out["tool_choice"] = {"type": "allowed_tools", "allowed_tools": allowed}
    elif isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise ApiError(
                'tool_choice must be "auto", "none", "required", a function by name or allowed_tools',
                "tool_choice",
            )
        out["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    elif choice is not None:
        out["tool_choice"] = choice
    return out


def _tool(tool: object, at: str) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else kind_of(tool)
        raise ApiError(f"{at}: only function tools are supported here, got {kind!r:.40}", at)
    if tool.get("strict") is not None and not isinstance(tool["strict"], bool):  # (echoed: checked)
        raise ApiError(f"{at}.strict must be a boolean, got {kind_of(tool['strict'])}", f"{at}.strict")
    function = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
    return {"type": "function", "function": function}


# What a response echoes of its request is what was read of it, and checked: a field the engine
# has no use for is not kept with the response (a body of 8 MiB of them took twenty times that in
# objects; a list echoed as ``strict`` or a text format's ``schema``, sixteen times its JSON).
def _echoed_tool(tool: Mapping[str, Any]) -> dict[str, Any]:
    return {k: tool[k] for k in ("type", "name", "description", "parameters", "strict") if k in tool}


def _echoed_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools":  # (checked when asked)
        listed = choice.get("tools")
        listed = listed if isinstance(listed, list) else []
        tools = [{"type": "function", "name": t.get("name")} for t in listed if isinstance(t, dict)]
        return {"type": "allowed_tools", "mode": choice.get("mode"), "tools": tools}
    return {"type": "function", "name": choice["name"]} if isinstance(choice, dict) else choice


def _echoed_format(fmt: Any) -> dict[str, Any]:
    if not isinstance(fmt, dict):
        return {"type": "text"}
    if fmt.get("type") != "json_schema":
        return {"type": fmt.get("type")}
    return {k: fmt[k] for k in ("type", "name", "description", "schema", "strict") if k in fmt}


def _format(body: Mapping[str, Any]) -> dict[str, Any]:
    """``text.format`` as a chat's ``response_format``."""
    text = body.get("text")
    if text is None:
        return {}
    if not isinstance(text, dict):
        raise ApiError(f"text must be an object, got {kind_of(text)}", "text")
    fmt = text.get("format")
    if fmt is None:
        return {}
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "json_schema":
        _check_named_format(fmt)
        return {"response_format": {"type": "json_schema", "json_schema": {"schema": fmt.get("schema")}}}
    if kind in ("json_object", "text"):
        return {"response_format": {"type": kind}}
    raise ApiError('text.format.type must be "text", "json_object" or "json_schema"', "text.format")


FORMAT_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # (OpenAI's rule for a format's name)


def _check_named_format(fmt: Mapping[str, Any]) -> None:
    """A ``json_schema`` format's echoed fields: ``name`` (OpenAI's rule), ``description``, ``strict``."""
    name = fmt.get("name")
    if name is not None and not (isinstance(name, str) and FORMAT_NAME.fullmatch(name)):
        raise ApiError("text.format.name must be 1-64 letters, digits, '_' or '-'", "text.format.name")
    if fmt.get("description") is not None and not isinstance(fmt["description"], str):
        raise ApiError("text.format.description must be a string", "text.format.description")
    if fmt.get("strict") is not None and not isinstance(fmt["strict"], bool):
        raise ApiError("text.format.strict must be a boolean", "text.format.strict")


def _metadata(body: Mapping[str, Any]) -> dict[str, str]:
    metadata = body.get("metadata") or {}
    if not isinstance(metadata, dict) or len(metadata) > MAX_METADATA:
        raise ApiError(f"metadata must be an object of at most {MAX_METADATA} keys", "metadata")
    if not all(
        isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512
        for k, v in metadata.items()
    ):
        raise ApiError("metadata holds strings: keys of at most 64 characters, values of 512", "metadata")
    return metadata


# What a response would be without, were these dropped: refused rather than answered unsaid.
UNSUPPORTED = {
    "conversation": "a stored conversation is not kept here: continue with previous_response_id",
    "prompt": "a stored prompt is not kept here: send its text as instructions",
    "background": "a response runs in the foreground here: stream it instead",
}


def _unsupported(body: Mapping[str, Any]) -> None:
    for name, why in UNSUPPORTED.items():
        if body.get(name) not in (None, False):
            raise ApiError(f"{name}: {why}", name)
    if body.get("truncation") not in (None, "disabled", "auto"):
        raise ApiError('truncation must be "auto" or "disabled"', "truncation")


def _optional(body: Mapping[str, Any], name: str, kind: type) -> Any:
    value = body.get(name)
    if value is not None and not isinstance(value, kind):
        raise ApiError(
            f"{name} must be {'a string' if kind is str else 'a boolean'}, got {kind_of(value)}", name
        )
    return value
