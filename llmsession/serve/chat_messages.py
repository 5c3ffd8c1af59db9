"""A chat request's ``messages``, as OpenAI documents them, checked and turned into the library's
checked ``Transcript`` (``developer`` is a system message; an assistant's calls with their
arguments as JSON text; a user's ``data:`` images counted and checked by ``images``). Pure: no
model, no web framework.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, NoReturn

from llmsession.errors import TemplateError
from llmsession.serve.body import kind_of, optional, plain_text, string
from llmsession.serve.errors import ApiError
from llmsession.serve.images import ImageCount
from llmsession.text.transcript import Transcript

MAX_PARTS = 1024  # parts of one message's content
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


def transcript(raw: list[Any], images: ImageCount, kept: range = range(0)) -> Transcript:
    """The messages as the library's checked ``Transcript`` (its own check, made once), with
    something to answer, as a stateless call needs, or the assistant's text to continue after
    it (a prefill: ``Transcript.prefilled``). Those at ``kept`` are a stored response's, read
    and counted when it was asked: the library's check only."""
    for i in kept:
        images.kept(raw[i], f"messages[{i}]")
    try:
        checked = Transcript([m if i in kept else _message(i, m, images) for i, m in enumerate(raw)])
    except TemplateError as error:
        raise ApiError(str(error), "messages") from None
    _answered(checked)
    if not checked.ends_with_question() and checked.prefilled() is None:
        raise ApiError(
            "the last message must be a user message, tool results, or the assistant's text to continue",
            "messages",
        )
    return checked


def _answered(messages: Transcript) -> None:
    """An assistant turn's calls are each answered once before the next assistant turn, and a
    tool message answers a call of the last one (a call left unanswered, or a result of a call
    turns back, made a prompt no template renders sensibly). OpenAI's rule, but for a user's
    words among the results (Anthropic's clients send text beside results) and a turn in several
    assistant messages (a reasoning item between a Responses turn's calls begins another)."""
    calls: Counter[str] = Counter()  # the last assistant turn's calls not answered yet (counted: a list
    # was thousands of calls times thousands of results)
    said = 0  # where that turn began
    previous = None
    for i, message in enumerate(messages):
        role = message["role"]
        if role == "tool":
            ident = message.get("tool_call_id")
            if not isinstance(ident, str) or calls[ident] <= 0:
                where = f"messages[{i}]"
                problem = f"tool_call_id {ident!r:.80} answers no call of the last assistant turn"
                raise ApiError(f"{where}: {problem} (or one answered already)", where)
            calls[ident] -= 1
        elif role == "assistant" and previous == "assistant":
            calls.update(call["id"] for call in message.get("tool_calls") or ())
        elif role == "assistant":
            if calls.total() > 0:
                _unanswered(said, calls)
            calls, said = Counter(call["id"] for call in message.get("tool_calls") or ()), i
        previous = role
    if calls.total() > 0 and said != len(messages) - 1:  # (one ending with its calls is refused as such)
        _unanswered(said, calls)


def _unanswered(said: int, calls: Counter[str]) -> NoReturn:
    left = list(calls.elements())
    unanswered = ", ".join(f"{ident!r:.80}" for ident in left[:4]) + (", ..." if len(left) > 4 else "")
    where = f"messages[{said}]"
    raise ApiError(
        f"{where}: an assistant message's tool_calls must each be answered by a tool message after "
        f"it; not answered: {unanswered}",
        where,
    )


def _message(i: int, raw: object, images: ImageCount) -> dict[str, Any]:
    """One message in the library's shape (``developer`` is a system message)."""
    where = f"messages[{i}]"
    if not isinstance(raw, dict):
        raise ApiError(f"{where} must be an object, got {kind_of(raw)}", where)
    role = raw.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise ApiError(f"{where}.role must be one of {sorted(ROLES)}, got {role!r:.40}", f"{where}.role")
    message: dict[str, Any] = {"role": ROLES[role]}
    name = optional(raw, "name", str, f"{where}.name")
    if name is not None:
        message["name"] = plain_text(name, f"{where}.name")
    content = raw.get("content")
    if role == "assistant" and raw.get("tool_calls") is not None:
        message["tool_calls"] = _tool_calls(raw["tool_calls"], where)
        content = "" if content is None else content
    thought = raw.get("reasoning_content", raw.get("reasoning"))
    if role == "assistant" and thought is not None:  # (a thinking template renders it, or drops it)
        message["reasoning_content"] = plain_text(thought, f"{where}.reasoning_content")
    if role == "tool":
        message["tool_call_id"] = string(raw.get("tool_call_id"), f"{where}.tool_call_id")
    message["content"] = _content(content, f"{where}.content", images if role == "user" else None)
    return message


def check_parts(content: list[Any], where: str) -> None:
    """At most ``MAX_PARTS`` parts in one message (a body of 8 MiB held 290,000 empty ones: 56 MB
    as objects, kept with its transcript)."""
    if len(content) > MAX_PARTS:
        raise ApiError(f"{where}: at most {MAX_PARTS} parts in a message, got {len(content)}", where)


def _content(content: object, where: str, images: ImageCount | None) -> str | list[Any]:
    """A str, or a list of text parts (and ``data:`` image parts in a user message)."""
    if isinstance(content, str):
        return plain_text(content, where)
    if not isinstance(content, list):
        raise ApiError(f"{where} must be a string or a list of parts, got {kind_of(content)}", where)
    check_parts(content, where)
    parts: list[Any] = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            parts.append({"type": "text", "text": plain_text(part.get("text"), f"{at}.text")})
        elif kind == "image_url" and images is not None:
            url = part.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            images.check(url, at)
            parts.append({"type": "image_url", "image_url": {"url": url}})
        else:
            allowed = "text and image_url" if images is not None else "text"
            raise ApiError(f"{at}: only {allowed} parts are supported here, got {kind!r:.40}", at)
    return parts


def _tool_calls(calls: object, where: str) -> list[dict[str, Any]]:
    """An assistant message's calls, as OpenAI sends them back (arguments as JSON text)."""
    if not isinstance(calls, list):
        raise ApiError(f"{where}.tool_calls must be a list", f"{where}.tool_calls")
    out = []
    for j, call in enumerate(calls):
        at = f"{where}.tool_calls[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        ident = call.get("id") if isinstance(call, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        arguments = function.get("arguments", "{}") if isinstance(function, dict) else None
        if not (isinstance(ident, str) and isinstance(name, str) and isinstance(arguments, str)):
            raise ApiError(f"{at} needs an id, a function name and arguments as JSON text", at)
        function = {"name": plain_text(name, at), "arguments": plain_text(arguments, at)}
        out.append({"id": ident, "type": "function", "function": function})
    return out
