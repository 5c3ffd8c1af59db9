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


def check_messages(messages: Sequence[Message]) -> None:
    """Fail early, naming the message, rather than deep inside a renderer."""
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise TemplateError(f"message {i} must be a mapping, got {type(message).__name__}")
        role = message.get("role")
        if not isinstance(role, str):
            raise TemplateError(f"message {i}: role must be a str, got {role!r}")
        content = message.get("content")
        if not isinstance(content, str | list | tuple):
            raise TemplateError(
                f"message {i} ({role}): content must be a str or a list of parts, "
                f"got {type(content).__name__}"
            )


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
