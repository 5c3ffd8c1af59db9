"""Chat messages and their parts, checked and flattened for the renderers.

Messages are mappings with a ``role`` (str) and a ``content``: a str or a list of parts (None
beside an assistant message's ``tool_calls``). A part is a str, a ``{"type": "text", "text": ...}``
dict, an image dict (``"image"`` or ``"image_url"``) or any other object but numbers, None and
collections, which is taken for an image (``llmsession.Image``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import Any

from llmsession.errors import TemplateError

Message = Mapping[str, Any]  # what renderers read: a ``replies.Message`` or any mapping like it

IMAGE_PART_TYPES = ("image", "image_url")


def check_messages(
    messages: Sequence[Message], *, answers: bool = True, calls: Iterable[str] = (), start: int = 0
) -> frozenset[str]:
    """Fail early, naming the message, rather than deep inside a renderer: a TemplateError for
    anything but OpenAI's shapes (below). Tool calls and results are in OpenAI's shape; a result
    answers a call made earlier in the transcript (unless not ``answers``: a render with
    stand-ins for the calls, to splice them).

    ``content`` is a str or a list of parts (``is_image_part``); None only beside
    ``tool_calls`` (an assistant message that only calls, as OpenAI's clients send it back: the
    renderers read it as empty, ``filled``). ``name``, ``tool_call_id`` and reasoning, where
    given, are str. ``calls``: the ids of calls made before ``messages`` (which results in them
    may answer); ``start``: the first message's index, as errors name it. Returns the ids of
    every call made, those included."""
    if not isinstance(messages, Sequence) or isinstance(messages, str | bytes | bytearray):
        raise TemplateError(f"messages must be a list of messages, got {type(messages).__name__}")
    made = set(calls)
    for i, message in enumerate(messages, start):
        if not isinstance(message, Mapping):
            raise TemplateError(f"message {i} must be a mapping, got {type(message).__name__}")
        role = message.get("role")
        if not isinstance(role, str):
            raise TemplateError(f"message {i}: role must be a str, got {role!r:.40}")
        _check_text(f"message {i}: role", role)
        where = f"message {i} ({role:.20})"
        said_calls = message.get("tool_calls") is not None
        if said_calls:
            made |= _checked_calls(where, message)
        _check_content(where, message.get("content"), may_be_none=said_calls)
        for key in TEXT_FIELDS:
            if not isinstance(message.get(key, ""), str | None):
                raise TemplateError(f"{where}: {key} must be a str, got {type(message[key]).__name__}")
            _check_text(f"{where}: {key}", message.get(key) or "")
        answered = message.get("tool_call_id")
        if role == "tool" and (not isinstance(answered, str) or (answers and answered not in made)):
            raise TemplateError(f"{where}: tool_call_id {answered!r:.40} answers no earlier call")
    return frozenset(made)


TEXT_FIELDS = ("name", "tool_call_id", "reasoning", "reasoning_content")
NOT_IMAGES = (bool, int, float, complex, list, tuple, set, frozenset)  # (nor None)


_SURROGATE = re.compile("[\ud800-\udfff]")


def _check_text(where: str, text: str) -> None:
    """Text UTF-8 can encode: a lone surrogate (``"\\ud800"``) could not be tokenized."""
    if lone_surrogate(text):
        raise TemplateError(f"{where}: the text holds a lone surrogate, which UTF-8 cannot encode")


def lone_surrogate(value: object) -> bool:
    """Whether JSON-like ``value`` holds a str with a lone surrogate, which UTF-8 cannot encode
    (JSON text's own ``\\ud800`` escapes count once it is parsed: templates parse it)."""
    if isinstance(value, str):
        return not value.isascii() and _SURROGATE.search(value) is not None
    if isinstance(value, Mapping):
        return any(lone_surrogate(key) or lone_surrogate(item) for key, item in value.items())
    if isinstance(value, list | tuple):
        return any(lone_surrogate(item) for item in value)
    return False


def unencodable(value: object) -> str | None:
    """What makes JSON-like ``value`` unfit for a prompt (a predicate: "holds a lone surrogate
    ...", ``lone_surrogate``; "is nested too deep" to walk), or None."""
    try:
        return "holds a lone surrogate, which UTF-8 cannot encode" if lone_surrogate(value) else None
    except RecursionError:
        return "is nested too deep"


def _parsed_if_escaped(text: str) -> object:
    """JSON text as the templates read it, where it may escape a surrogate (else itself)."""
    if "\\u" not in text:
        return text
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return text


def _check_content(where: str, content: object, *, may_be_none: bool) -> None:
    if isinstance(content, str):
        _check_text(where, content)
        return
    if content is None and may_be_none:
        return
    if not isinstance(content, list | tuple):
        raise TemplateError(
            f"{where}: content must be a str or a list of parts, got {type(content).__name__}"
        )
    for j, part in enumerate(content):
        if isinstance(part, Mapping):
            kind = part.get("type")
            if isinstance(kind, str) and kind in IMAGE_PART_TYPES:
                continue
            if not (isinstance(kind, str) and kind == "text"):
                raise TemplateError(
                    f"{where}, part {j}: unsupported content part type {kind!r:.40}: only text and images"
                )
            if not isinstance(part.get("text"), str):
                raise TemplateError(f"{where}, part {j}: a text part needs a str 'text'")
            _check_text(f"{where}, part {j}", part["text"])
        elif part is None or isinstance(part, NOT_IMAGES):
            raise TemplateError(
                f"{where}, part {j}: a part is a str, a text or image dict, or an image, "
                f"got {type(part).__name__}"
            )


def _checked_calls(where: str, message: Message) -> set[str]:
    """The ids of an assistant message's ``tool_calls``."""
    calls = message["tool_calls"]
    if message.get("role") != "assistant" or not isinstance(calls, list | tuple):
        raise TemplateError(f"{where}: tool_calls must be a list, on an assistant message")
    ids = set()
    for call in calls:
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise TemplateError(f"{where}: a tool call needs a function with a name, got {call!r:.80}")
        arguments = function.get("arguments", "{}")
        if not isinstance(arguments, str) and not _is_json_object(arguments):
            raise TemplateError(f"{where}: a tool call's arguments must be JSON text or a JSON object")
        ident = call.get("id")
        if not isinstance(ident, str):
            raise TemplateError(f"{where}: a tool call's id must be a str, got {ident!r:.40}")
        said = (
            function["name"],
            ident,
            _parsed_if_escaped(arguments) if isinstance(arguments, str) else arguments,
        )
        unfit = unencodable(said)
        if unfit is not None:
            raise TemplateError(f"{where}: a tool call {unfit}")
        ids.add(ident)
    return ids


def frozen(value: Any) -> Any:
    """JSON-like data made read-only, deeply: mappings as read-only views of copies, lists and
    tuples as tuples; anything else (text, numbers, an image object) as it is."""
    if isinstance(value, Mapping):
        return MappingProxyType({key: frozen(item) for key, item in value.items()})
    if isinstance(value, list | tuple):
        return tuple(frozen(item) for item in value)
    return value


def thawed(value: Any) -> Any:
    """A plain copy of (``frozen``) JSON-like data: mappings as dicts, lists and tuples as lists."""
    if isinstance(value, Mapping):
        return {key: thawed(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [thawed(item) for item in value]
    return value


def _is_json_object(value: object) -> bool:
    if not isinstance(value, Mapping):
        return False
    try:
        json.dumps(thawed(value))
    except (TypeError, ValueError, RecursionError):
        return False
    return True


def filled(messages: Sequence[Message]) -> list[Message]:
    """Checked messages as the renderers read them: an assistant message's ``"content": None``
    (beside its calls) is empty text, so it renders as what the session recorded for it."""
    return [m if m.get("content") is not None else {**m, "content": ""} for m in messages]


def is_image_part(part: object) -> bool:
    """Image dicts, and any object that is neither str nor dict (``llmsession.Image``)."""
    if isinstance(part, Mapping):
        return part.get("type") in IMAGE_PART_TYPES
    return not isinstance(part, str)


def image_parts(messages: Sequence[Mapping[str, Any]]) -> Iterator[object]:
    """Every image part of a transcript, in order, not decoded."""
    for message in messages:
        content = message.get("content")
        if isinstance(content, str) or content is None:
            continue
        yield from (part for part in content if is_image_part(part))


def part_text(part: str | Mapping[str, Any]) -> str:
    """The text of a non-image part; other part types (audio, video, ...) are refused."""
    if isinstance(part, str):
        return part
    if part.get("type") != "text":
        kind = part.get("type")
        raise TemplateError(f"unsupported content part type {kind!r}: only text and images")
    text = part.get("text")
    if not isinstance(text, str):
        raise TemplateError(f"a text part needs a str 'text', got {text!r}")
    return text


def _unchanged(text: str) -> str:
    return text


def flatten_content(
    content: str | Sequence[Any],
    media_marker: str,
    *,
    clean: Callable[[str], str] = _unchanged,
    separator: str = "\n",
) -> str:
    """One string for a message: images become ``media_marker``, texts pass through ``clean``.

    Text parts are joined with ``separator`` but never next to a marker, as llama.cpp's own
    server does (``common_chat_msg::to_json_oaicompat``); Gemma 4 passes ``separator=""``.
    A str content is one text part.
    """
    if isinstance(content, str):
        return clean(content)
    text = ""
    after_marker = False
    for part in content:
        if is_image_part(part):
            text += media_marker
            after_marker = True
            continue
        if text and not after_marker:
            text += separator
        text += clean(part_text(part))
        after_marker = False
    return text
