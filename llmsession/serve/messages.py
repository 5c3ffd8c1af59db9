"""An Anthropic Messages request (``POST /v1/messages``, ``/v1/messages/count_tokens``), as
Anthropic documents it, checked and turned into a chat request in OpenAI's shape, then checked
as one (``schema.chat_request``). Pure: no model, no web framework.

What maps where: ``system`` (a string or text blocks, ``cache_control`` ignored) is the first
message; a user message's ``tool_result`` blocks are ``tool`` messages, in their order among
its text and image blocks (an ``is_error`` result's text begins "Error: "); an assistant's
``tool_use`` blocks are its ``tool_calls`` (``input`` as JSON text: each answered in the next
message, as Anthropic requires, or the request is refused); its ``thinking`` blocks
sent back are that turn's reasoning (``reasoning_content``: rendered as its template does, kept
or dropped), ``redacted_thinking`` ones are dropped (nothing here can read them); tools'
``input_schema`` is a function's ``parameters``; ``tool_choice`` ``any`` is ``required``;
``stop_sequences`` are stop strings; ``metadata.user_id`` names the tenant's user as ``user``
does; ``thinking`` turns the template's thinking on or off, with its budget;
``output_config.format`` (a JSON schema) holds the reply to it as ``response_format`` does. An image is a
base64 block only: a URL is never fetched. Fields the engine has no use for (``service_tier``,
``container``, ...) are accepted and ignored, as unknown ones; ``mcp_servers`` (tools the
answer would lack) is refused.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from typing import Any

from llmsession.options import INT32_MAX
from llmsession.serve.body import kind_of, string
from llmsession.serve.chat_messages import check_parts
from llmsession.serve.errors import ApiError
from llmsession.serve.messages_pairs import Pairs
from llmsession.serve.schema import MAX_MESSAGES, MAX_USER, ChatRequest, chat_request
from llmsession.serve.translation import converted_tools, renamed
from llmsession.text.tools import replaced_options

ROLES = ("user", "assistant")
NAMES = {"stop": "stop_sequences", "response_format": "output_config.format"}  # (a message's path: as it is)
MAX_STOP_SEQUENCES = 16
ERROR_PREFIX = "Error: "  # a tool result with ``is_error``


def messages_request(body: Mapping[str, Any], *, counting: bool = False, images: bool = True) -> ChatRequest:
    """A ``/v1/messages`` body (``counting``: a ``count_tokens`` one, which has no
    ``max_tokens``), checked; ``ApiError`` names the first bad field. ``images``: the model
    takes images (else a tool result's image is a line of text that says so)."""
    converted, origins = chat_body(body, counting=counting, images=images)
    try:
        asked = chat_request(converted)
    except ApiError as error:
        raise renamed(error, {**NAMES, **_origins(error, origins)}) from None
    top_k = _integer(body, "top_k", 0, INT32_MAX)
    if top_k is not None:
        asked = dataclasses.replace(asked, options=replaced_options(asked.options, top_k=top_k))
    thinking, budget = _thinking(body.get("thinking"))
    if budget is not None:
        asked = dataclasses.replace(asked, options=replaced_options(asked.options, reasoning_budget=budget))
    return dataclasses.replace(asked, thinking=thinking)


def _thinking(value: object) -> tuple[bool | None, int | None]:
    """``thinking``: whether the template thinks (None: the server's setting) and its budget.
    ``disabled`` is a budget of 0 as well: a template with no switch (gpt-oss, one whose prompt
    always opens the block) thinks anyway, and the budget closes its block at once."""
    if value is None:
        return None, None
    if not isinstance(value, dict):
        raise ApiError("thinking must be an object", "thinking")
    kind = value.get("type")
    if kind == "disabled":
        return False, 0
    if kind == "adaptive":
        return True, None
    if kind != "enabled":
        raise ApiError('thinking.type must be "enabled", "adaptive" or "disabled"', "thinking")
    budget = value.get("budget_tokens")
    if budget is not None and (
        isinstance(budget, bool) or not isinstance(budget, int) or not 0 <= budget <= INT32_MAX
    ):
        raise ApiError("thinking.budget_tokens must be a non-negative integer", "thinking.budget_tokens")
    return True, budget


def _origins(error: ApiError, origins: list[str]) -> dict[str, str]:
    """The converted message an error names, as the Anthropic message it came from."""
    found = re.match(r"messages\[(\d+)\]", error.param or "")
    if found is None or int(found[1]) >= len(origins):
        return {}
    return {found[0]: origins[int(found[1])]}


def chat_body(
    body: Mapping[str, Any], *, counting: bool = False, images: bool = True
) -> tuple[dict[str, Any], list[str]]:
    """The OpenAI chat body a Messages body asks the same of, and where each of its messages
    came from (``system``, ``messages[3]``)."""
    model = string(body.get("model"), "model")
    if body.get("mcp_servers"):  # (dropped, its tools were missing from the answer unsaid)
        raise ApiError(
            "mcp_servers: MCP servers are not supported here: send their tools as tools", "mcp_servers"
        )
    system = _system(body.get("system"))
    said, origins = _messages(body, images)
    if len(system) + len(said) > MAX_MESSAGES:
        raise ApiError(f"messages: at most {MAX_MESSAGES} messages and tool results in all", "messages")
    out: dict[str, Any] = {"model": model, "messages": [*system, *said]}
    if not counting:
        if body.get("max_tokens") is None:
            raise ApiError("max_tokens is required", "max_tokens")
        out["max_tokens"] = body["max_tokens"]
    for name in ("temperature", "top_p", "stream", "keep_alive"):  # (Ollama's keep_alive: as chat's)
        if body.get(name) is not None:
            out[name] = body[name]
    if isinstance(out.get("temperature"), int | float) and not 0 <= out["temperature"] <= 1:
        raise ApiError("temperature must be between 0 and 1", "temperature")
    stops = body.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list) or len(stops) > MAX_STOP_SEQUENCES:
            most = f"a list of at most {MAX_STOP_SEQUENCES} strings"
            raise ApiError(f"stop_sequences must be {most}", "stop_sequences")
        if not all(isinstance(stop, str) and stop and "\0" not in stop for stop in stops):
            raise ApiError("stop_sequences must be non-empty strings without NUL", "stop_sequences")
        if stops:
            out["stop"] = stops
    out.update(_tools(body))
    out.update(_output_format(body))
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise ApiError(f"metadata must be an object, got {kind_of(metadata)}", "metadata")
    user = (metadata or {}).get("user_id")
    if user is not None:
        if not isinstance(user, str) or len(user) > MAX_USER:
            most = f"a string of at most {MAX_USER} characters"
            raise ApiError(f"metadata.user_id must be {most}", "metadata.user_id")
        out["user"] = user
    return out, ["system"] * len(system) + origins


def _system(system: object) -> list[dict[str, Any]]:
    """The system prompt as one message: a string, or its text blocks joined by a line break."""
    if system is None:
        return []
    if isinstance(system, str):
        return [{"role": "system", "content": system}] if system else []
    if not isinstance(system, list):
        raise ApiError(f"system must be a string or a list of text blocks, got {kind_of(system)}", "system")
    texts = []
    for i, block in enumerate(system):
        if _kind(block, f"system[{i}]") != "text" or not isinstance(block.get("text"), str):
            raise ApiError(f"system[{i}] must be a text block", f"system[{i}]")
        texts.append(block["text"])
    joined = "\n".join(text for text in texts if text)
    return [{"role": "system", "content": joined}] if joined else []


def _messages(body: Mapping[str, Any], images: bool) -> tuple[list[dict[str, Any]], list[str]]:
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise ApiError("messages must be a non-empty list", "messages")
    if len(raw) > MAX_MESSAGES:
        raise ApiError(f"messages: at most {MAX_MESSAGES} messages, got {len(raw)}", "messages")
    out: list[dict[str, Any]] = []
    origins: list[str] = []
    pairs = Pairs()
    for i, message in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise ApiError(f"{where} must be an object, got {kind_of(message)}", where)
        role = message.get("role")
        if role not in ROLES:
            raise ApiError(f"{where}.role must be one of {list(ROLES)}, got {role!r:.40}", f"{where}.role")
        content = message.get("content")
        if isinstance(content, str):
            made = [{"role": role, "content": content}]
        elif isinstance(content, list):
            check_parts(content, f"{where}.content")
            made = _user(content, where, images) if role == "user" else [_assistant(content, where)]
        else:
            raise ApiError(f"{where}.content must be a string or a list of blocks", f"{where}.content")
        if len(out) + len(made) > MAX_MESSAGES:  # (before pairing: a message may hold thousands)
            raise ApiError(f"messages: at most {MAX_MESSAGES} messages and tool results in all", "messages")
        pairs.check(made, where, content if isinstance(content, list) else [], role)
        out += made
        origins += [where] * len(made)
    if pairs.role == "user":  # (one that ends with calls is refused as such, below)
        pairs.finish()
    return out, origins


def _user(blocks: list[Any], where: str, images: bool) -> list[dict[str, Any]]:
    """A user message's blocks, in order: runs of text and images as user messages, each tool
    result a ``tool`` message (the images a result holds after the results, as a user
    message's: a tool message holds text)."""
    out: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    shown: list[dict[str, Any]] = []  # the results' images
    for j, block in enumerate(blocks):
        at = f"{where}.content[{j}]"
        kind = _kind(block, at)
        if kind == "tool_result":
            if parts:
                out.append({"role": "user", "content": parts})
                parts = []
            result, pictures = _result(block, at, images)
            out.append(result)
            shown += pictures
            continue
        if shown:  # (a result's images, before what the user says after it)
            parts, shown = [*shown, *parts], []
        if kind == "text":
            parts.append(_text_part(block, at))
        elif kind == "image":
            parts.append(_image(block, at))
        else:
            allowed = "text, image and tool_result blocks"
            raise ApiError(f"{at}: a user message holds {allowed}, got {kind!r:.40}", at)
    if parts or shown:
        out.append({"role": "user", "content": [*shown, *parts]})
    return out


def _assistant(blocks: list[Any], where: str) -> dict[str, Any]:
    """An assistant message's text, its calls and its reasoning (its thinking blocks')."""
    texts: list[str] = []
    thoughts: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        at = f"{where}.content[{j}]"
        kind = _kind(block, at)
        if kind == "text":
            texts.append(_text_part(block, at)["text"])
        elif kind == "tool_use":
            ident, name, given = block.get("id"), block.get("name"), block.get("input", {})
            if not (isinstance(ident, str) and isinstance(name, str) and isinstance(given, dict)):
                raise ApiError(f"{at}: a tool_use block needs an id, a name and an input object", at)
            function = {"name": name, "arguments": json.dumps(given, ensure_ascii=False)}
            calls.append({"id": ident, "type": "function", "function": function})
        elif kind == "thinking":
            thoughts.append(string(block.get("thinking"), f"{at}.thinking"))
        elif kind != "redacted_thinking":
            allowed = "text, tool_use and thinking blocks"
            raise ApiError(f"{at}: an assistant message holds {allowed}, got {kind!r:.40}", at)
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if thoughts:
        message["reasoning_content"] = "\n".join(thoughts)
    if calls:
        message["tool_calls"] = calls
    return message


def _result(block: dict[str, Any], at: str, images: bool) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A tool result as a ``tool`` message, and the images it holds (a model without images
    reads a line that says one was left out; another kind of block, likewise)."""
    ident, failed = string(block.get("tool_use_id"), f"{at}.tool_use_id"), block.get("is_error", False)
    if not isinstance(failed, bool):
        raise ApiError(f"{at}.is_error must be a boolean", f"{at}.is_error")
    content, pictures = block.get("content", ""), []
    if isinstance(content, list):
        texts = []
        for k, part in enumerate(content):
            inner = f"{at}.content[{k}]"
            kind = _kind(part, inner)
            if kind == "text":
                texts.append(_text_part(part, inner)["text"])
            elif kind == "image" and images:
                pictures.append(_image(part, inner))
                texts.append("[image: below]")
            else:
                texts.append(f"[{kind:.40} block: not shown to this model]")
        content = "\n".join(texts)
    elif content is None:
        content = ""
    if not isinstance(content, str):
        raise ApiError(f"{at}.content must be a string or a list of blocks", f"{at}.content")
    if failed:
        content = ERROR_PREFIX + content
    return {"role": "tool", "tool_call_id": ident, "content": content}, pictures


def _kind(block: object, at: str) -> str:
    kind = block.get("type") if isinstance(block, dict) else None
    if not isinstance(kind, str):
        raise ApiError(f"{at} must be a block object with a type", at)
    return kind


def _text_part(block: dict[str, Any], at: str) -> dict[str, Any]:
    return {"type": "text", "text": string(block.get("text"), f"{at}.text")}


def _image(block: dict[str, Any], at: str) -> dict[str, Any]:
    """A base64 image block as a ``data:`` URL part (its bytes checked by ``schema``)."""
    source = block.get("source")
    if not isinstance(source, dict) or source.get("type") != "base64":
        raise ApiError(f"{at}: an image must be a base64 source (nothing is fetched)", f"{at}.source")
    media, data = source.get("media_type"), source.get("data")
    if not (isinstance(media, str) and media.startswith("image/") and isinstance(data, str)):
        raise ApiError(f"{at}.source needs an image media_type and base64 data", f"{at}.source")
    return {"type": "image_url", "image_url": {"url": f"data:{media[:64]};base64,{data}"}}


def _tools(body: Mapping[str, Any]) -> dict[str, Any]:
    """``tools`` and ``tool_choice`` in OpenAI's shape."""
    out: dict[str, Any] = {}
    tools = body.get("tools")
    if tools is not None:
        out["tools"] = converted_tools(tools, _tool)
    choice = body.get("tool_choice")
    if choice is None:
        return out
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind in ("any", "tool") and not tools:  # (in Anthropic's words, not the chat's "required")
        raise ApiError(f'tool_choice "{kind}" needs tools', "tool_choice")
    if kind == "tool":
        name = string(choice.get("name"), "tool_choice.name")
        out["tool_choice"] = {"type": "function", "function": {"name": name}}
    elif kind in ("auto", "any", "none"):
        out["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[kind]
    else:
        raise ApiError('tool_choice.type must be "auto", "any", "tool" or "none"', "tool_choice")
    if choice.get("disable_parallel_tool_use") is True:
        out["parallel_tool_calls"] = False
    return out


def _output_format(body: Mapping[str, Any]) -> dict[str, Any]:
    """``output_config.format`` (the beta's ``output_format`` too): a reply held to a JSON
    schema, as chat's ``response_format``; ``output_config.effort`` is accepted and ignored."""
    config = body.get("output_config")
    if config is not None and not isinstance(config, dict):
        raise ApiError(f"output_config must be an object, got {kind_of(config)}", "output_config")
    fmt = (config or {}).get("format")
    where = "output_config.format" if fmt is not None else "output_format"
    fmt = fmt if fmt is not None else body.get("output_format")
    if fmt is None:
        return {}
    if (
        not isinstance(fmt, dict)
        or fmt.get("type") != "json_schema"
        or not isinstance(fmt.get("schema"), dict)
    ):
        raise ApiError(f'{where} must be {{"type": "json_schema", "schema": {{...}}}}', where)
    return {
        "response_format": {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}
    }


def _tool(tool: object, at: str) -> dict[str, Any]:
    if not isinstance(tool, dict):
        raise ApiError(f"{at} must be an object", at)
    if tool.get("type") not in (None, "custom"):
        raise ApiError(f"{at}: only client tools are supported here, got type {tool['type']!r:.40}", at)
    name, schema = tool.get("name"), tool.get("input_schema", {"type": "object"})
    description = tool.get("description", "")
    if not (isinstance(name, str) and isinstance(schema, dict) and isinstance(description, str)):
        raise ApiError(f"{at} needs a name, an input_schema object and a description string", at)
    return {"type": "function", "function": {"name": name, "description": description, "parameters": schema}}


def _integer(body: Mapping[str, Any], name: str, low: int, high: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ApiError(f"{name} must be an integer between {low} and {high}", name)
    return value
