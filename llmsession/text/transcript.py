"""A transcript checked once: the messages a call answers, as every layer below takes them.

``Transcript(messages)`` checks the messages (``check_messages``: a TemplateError naming the
first bad one) and keeps a read-only copy, so the caller's later edits cannot reach it and the
layers it is handed to (the stateless routing, the prompt, the renderers) read it without
checking again. Extending it checks only what is added; a worker process takes the copy it is
sent as checked (it was, in the process that sent it).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, overload

from llmsession.errors import TemplateError
from llmsession.text.messages import Message, check_messages, frozen, thawed


class Transcript(Sequence[Message]):
    """Chat messages, checked and copied read-only (mappings as read-only views, lists as
    tuples). A ``Sequence`` of messages: pass one wherever messages go (``Model.chat``,
    ``render``, ``prompt_tokens``) and it is not checked again. ``messages()`` gives an
    editable copy."""

    __slots__ = ("_calls", "_messages")

    def __init__(self, messages: Sequence[Mapping[str, Any]] = ()) -> None:
        if isinstance(messages, Transcript):
            self._messages: tuple[Message, ...] = messages._messages
            self._calls: frozenset[str] = messages._calls
            return
        self._calls = check_messages(messages)
        self._messages = _frozen(messages)

    def extended(self, more: Sequence[Mapping[str, Any]]) -> Transcript:
        """This transcript and ``more`` after it; only ``more`` is checked (its tool results
        may answer calls made here)."""
        if isinstance(more, Transcript):
            more = more._messages
        calls = check_messages(more, calls=self._calls, start=len(self._messages))
        return _made(self._messages + _frozen(more), calls)

    def edited(self, index: int, message: Mapping[str, Any]) -> Transcript:
        """This transcript with the message at ``index`` replaced by ``message``, which is
        checked and must keep the replaced one's role, tool calls and the call it answers (so
        what answers what is unchanged: nothing else is checked again)."""
        index = range(len(self._messages))[index]  # (IndexError past either end; -1 is the last)
        old = self._messages[index]
        check_messages([message], answers=False, start=index)
        for key in ("role", "tool_calls", "tool_call_id"):
            if thawed(message.get(key)) != thawed(old.get(key)):
                raise TemplateError(f"message {index}: an edit must keep its {key}")
        (replacement,) = _frozen([message])
        return _made((*self._messages[:index], replacement, *self._messages[index + 1 :]), self._calls)

    def messages(self) -> list[dict[str, Any]]:
        """An editable copy (dicts and lists)."""
        return [thawed(message) for message in self._messages]

    def ends_with_question(self) -> bool:
        """Whether there is something to answer: it ends with a user message or tool results."""
        return bool(self._messages) and self._messages[-1].get("role") in ("user", "tool")

    def prefilled(self) -> tuple[Transcript, str] | None:
        """Where it ends with the assistant's text (no calls, no reasoning) after a user message
        or tool results: the transcript before that text, and the text, which the reply is to
        continue (a prefill, as Anthropic's API and llama-server take it); else None."""
        if len(self._messages) < 2 or set(self._messages[-1]) - {"role", "content", "name"}:
            return None
        last = self._messages[-1]
        content = last.get("content")
        if isinstance(content, tuple) and all(
            isinstance(p, Mapping) and p.get("type") == "text" for p in content
        ):
            content = "".join(str(part.get("text", "")) for part in content)
        if last.get("role") != "assistant" or not isinstance(content, str) or not content:
            return None
        before = _made(self._messages[:-1], self._calls)
        return (before, content) if before.ends_with_question() else None

    @overload
    def __getitem__(self, index: int) -> Message: ...
    @overload
    def __getitem__(self, index: slice) -> tuple[Message, ...]: ...
    def __getitem__(self, index: int | slice) -> Message | tuple[Message, ...]:
        return self._messages[index]

    def __len__(self) -> int:
        return len(self._messages)

    def __iter__(self) -> Iterator[Message]:
        return iter(self._messages)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Transcript):
            return self._messages == other._messages
        if isinstance(other, Sequence) and not isinstance(other, str | bytes):
            return bool(self.messages() == thawed(list(other)))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # (its messages may hold unhashable images)

    def __repr__(self) -> str:
        return f"Transcript({self.messages()!r})"

    def __reduce__(self) -> tuple[Any, tuple[list[dict[str, Any]], frozenset[str]]]:
        # Unpickled as checked (it was, here): a worker process reads it on its reader thread,
        # which must not fail on a message. Never unpickle data from an untrusted source.
        return _unpickled, (self.messages(), self._calls)


def _made(messages: tuple[Message, ...], calls: frozenset[str]) -> Transcript:
    """A transcript of messages known to be checked (and frozen), the calls they make."""
    made = Transcript.__new__(Transcript)
    made._messages, made._calls = messages, calls
    return made


def _unpickled(messages: list[dict[str, Any]], calls: frozenset[str]) -> Transcript:
    return _made(_frozen(messages), calls)


def _frozen(messages: Sequence[Mapping[str, Any]]) -> tuple[Message, ...]:
    """Checked messages, frozen; a TemplateError for data nested deeper than Python recurses
    (a field the check does not read)."""
    try:
        return tuple(frozen(message) for message in messages)
    except RecursionError:
        raise TemplateError("a message is nested too deep") from None
