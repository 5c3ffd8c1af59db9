"""Chat messages and their parts, checked and flattened for the renderers.

Messages are mappings with a ``role`` (str) and a ``content``: a str or a list of parts. A
part is a str, a ``{"type": "text", "text": ...}`` dict, an image dict (``"image"`` or
``"image_url"``) or any other object, which is taken for an image (``llmsession.Image``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from llmsession.errors import TemplateError

Message = Mapping[str, Any]  # what renderers read: a ``replies.Message`` or any mapping like it

IMAGE_PART_TYPES = ("image", "image_url")


def check_messages(messages: Sequence[Message], *, answers: bool = True) -> None:
    """Fail early, naming the message, rather than deep inside a renderer. Tool calls and
    results are in OpenAI's shape; a result answers a call made earlier in the transcript
    (unless not ``answers``: a render with stand-ins for the calls, to splice them)."""
    calls: set[str] = set()
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise TemplateError(f"message {i} must be a mapping, got {type(message).__name__}")
        role = message.get("role")
        if not isinstance(role, str):
            raise TemplateError(f"message {i}: role must be a str, got {role!r}")
        content = message.get("content")
        if message.get("tool_calls") is not None:
            calls |= _checked_calls(i, message)
            content = "" if content is None else content
        if not isinstance(content, str | list | tuple):
            raise TemplateError(
                f"message {i} ({role}): content must be a str or a list of parts, "
                f"got {type(content).__name__}"
            )
        answered = message.get("tool_call_id")
        if role == "tool" and answers and (not isinstance(answered, str) or answered not in calls):
            raise TemplateError(
                f"message {i} (tool): tool_call_id {message.get('tool_call_id')!r} answers no earlier call"
            )


def _checked_calls(i: int, message: Message) -> set[str]:
    """The ids of an assistant message's ``tool_calls``."""
    calls = message["tool_calls"]
    if message.get("role") != "assistant" or not isinstance(calls, list | tuple):
        raise TemplateError(f"message {i}: tool_calls must be a list, on an assistant message")
    ids = set()
    for call in calls:
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise TemplateError(f"message {i}: a tool call needs a function with a name, got {call!r:.80}")
        if not isinstance(function.get("arguments", "{}"), str | Mapping):
            raise TemplateError(f"message {i}: a tool call's arguments must be JSON text or an object")
        ident = call.get("id")
        if not isinstance(ident, str):
            raise TemplateError(f"message {i}: a tool call's id must be a str, got {ident!r:.40}")
        ids.add(ident)
    return ids


def is_image_part(part: object) -> bool:
    """Image dicts, and any object that is neither str nor dict (``llmsession.Image``)."""
    if isinstance(part, Mapping):
        return part.get("type") in IMAGE_PART_TYPES
    return not isinstance(part, str)


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
