"""What a session is told and keeps, as lists of messages (pure): a call's ``content`` as the
messages it says, and a session's ``messages`` as the list it keeps."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

from llmsession.replies import Message
from llmsession.text.transcript import Transcript


def said_messages(content: Any) -> list[Message]:
    """What ``stream`` sends: a message (a mapping with a ``role``: a tool result, say), a list of
    them, or else a user message's content."""
    if isinstance(content, Transcript):
        return cast(list[Message], content.messages())
    if isinstance(content, Mapping) and "role" in content:
        return [cast(Message, dict(content))]
    if (
        isinstance(content, list | tuple)
        and content
        and all(isinstance(m, Mapping) and "role" in m for m in content)
    ):
        return [cast(Message, dict(m)) for m in content]
    return [{"role": "user", "content": content}]


def editable(messages: Any) -> list[Message]:
    """A session's ``messages`` as the list it keeps (the reply is added to it): a Transcript or
    a tuple a caller set becomes one, anything else is a TypeError before any work."""
    if isinstance(messages, list):
        return messages
    if isinstance(messages, Transcript):
        return cast(list[Message], messages.messages())
    if isinstance(messages, tuple):
        return list(messages)
    raise TypeError(f"session.messages must be a list of messages, got {type(messages).__name__}")
