"""What the other APIs' requests share as they become a chat request (``schema``), and what
every request's messages go through after: an error naming a field as that API spells it
(``renamed``), another API's tools in OpenAI's shape (``converted_tools``), and the system
prompt's text that changes every request removed (``Volatile``). Pure."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from llmsession.serve.errors import ApiError
from llmsession.text.tools import MAX_TOOLS
from llmsession.text.transcript import Transcript


def renamed(error: ApiError, names: Mapping[str, str]) -> ApiError:
    """A chat request's error, naming the field as another API spells it (``max_tokens`` is
    ``max_output_tokens`` there; a message's path is the whole ``input``'s)."""
    param = error.param or ""
    for old, new in names.items():
        if param == old or param.startswith((old + "[", old + ".")):
            message = (
                error.message.replace(param, new, 1) if error.message.startswith(param) else error.message
            )
            return dataclasses.replace(error, message=message, param=new)
    return error


def converted_tools(tools: object, convert: Callable[[object, str], dict[str, Any]]) -> list[dict[str, Any]]:
    """Another API's ``tools`` in OpenAI's shape, each by ``convert`` (given it and its path),
    the list bounded before any is read."""
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise ApiError(f"tools must be a list of at most {MAX_TOOLS} tools", "tools")
    return [convert(tool, f"tools[{i}]") for i, tool in enumerate(tools)]


class Volatile:
    """Text in system prompts that changes every request and carries nothing for the model:
    whatever one of ``patterns`` (regular expressions) matches is removed, so a resent
    conversation's prompt is the same as before and read from the cache."""

    def __init__(self, patterns: Sequence[str]) -> None:
        if isinstance(patterns, str) or not all(isinstance(p, str) and p for p in patterns):
            raise TypeError("volatile lines must be a sequence of non-empty regular expressions")
        self.patterns = [re.compile(p) for p in patterns]

    def dropped(self, messages: Transcript) -> Transcript:
        """The transcript with its system messages' volatile text removed (only those edited:
        ``Transcript.edited`` checks nothing else again)."""
        for i, message in enumerate(messages):
            edited = self._message(message) if self.patterns and message["role"] == "system" else None
            if edited is not None:
                messages = messages.edited(i, edited)
        return messages

    def _message(self, message: Mapping[str, Any]) -> dict[str, Any] | None:
        """The message with its volatile text removed; None if it has none."""
        content = message["content"]
        if isinstance(content, str):
            text = self._text(content)
            return None if text == content else {**message, "content": text}
        parts = [{**p, "text": self._text(p["text"])} if p.get("type") == "text" else p for p in content]
        return None if parts == list(content) else {**message, "content": parts}

    def _text(self, text: str) -> str:
        for pattern in self.patterns:
            text = pattern.sub("", text)
        return text
