"""What a stateless call is before a kept session answers it (``stateless``): its checked
label and settings, the history and the messages it answers, and the parts it starts with.
Pure: no bindings."""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import cast

from llmsession.config import SessionConfig
from llmsession.errors import TemplateError
from llmsession.options import GenerationOptions
from llmsession.replies import Message
from llmsession.runtime.continuing import Prefill
from llmsession.runtime.keeping import owner
from llmsession.text.splice import ReplyTokens
from llmsession.text.tools import Tools
from llmsession.text.transcript import Transcript


@dataclass(frozen=True)
class Call:
    """What a stateless call answers: the history its caller sent, the messages it answers,
    its checked options and tools."""

    history: list[Message]
    said: list[Message]
    options: GenerationOptions
    tools: Tools | None
    looks_ahead: bool = True  # a chat's next turn may be anticipated; a raw completion's not
    conversation: str | None = None  # the label its session takes (``StatelessSessions.take``)
    prefill: Prefill | None = None  # the assistant's text its reply continues (``continuing``)


RECORDS = 64  # tenants whose kept-apart replies are remembered for splicing


class TenantReplies:
    """The replies each tenant's kept-apart calls generated, for splicing its next prompts (past
    ``RECORDS``, the least recently used of an owner's over its share, else of anyone's, is
    forgotten: ``keeping.owner``, so that a key naming a new user with every call no longer pushes
    every other key's record out). Not thread-safe: its owner's lock."""

    def __init__(self) -> None:
        self._records: OrderedDict[str, ReplyTokens] = OrderedDict()

    def of(self, tenant: str | None, peek: bool = False) -> ReplyTokens:
        """``tenant``'s record, most recently used now (none of anyone's without a tenant);
        ``peek`` (a count: no call made): as it is, its place unchanged, an empty one not kept if
        none (a tenant counting under many names pushed every other's record out)."""
        if tenant is None:
            return ReplyTokens(capacity=256)
        if peek:
            return self._records.get(tenant) or ReplyTokens(capacity=256)
        record = self._records.pop(tenant, None) or ReplyTokens(capacity=256)
        self._records[tenant] = record
        while len(self._records) > RECORDS:
            held = Counter(owner(name) for name in self._records)
            over = (name for name in self._records if held[owner(name)] > RECORDS / len(held))
            self._records.pop(next(over, next(iter(self._records))))
        return record

    def joined(self, tenant: str | None, own: ReplyTokens, apart: bool) -> ReplyTokens:
        """What a kept session of ``tenant`` splices from: where it is kept ``apart``, the
        tenant's record, with the session's ``own`` replies in it (one loaded from a file, a
        conversation moved here: its replies as generated, else its next prompt re-tokenized
        them and decoded again from the first the model split otherwise); else its own."""
        return self.of(tenant).absorb(own) if apart and tenant is not None else own

    def clear(self) -> None:
        self._records.clear()


def keeps(tenant: str | None, config: SessionConfig) -> bool:
    """Whether a call's session is kept for the next calls: not one kept apart without a
    tenant (nobody's to follow)."""
    return config.share_prefix or tenant is not None


MAX_LABEL = 256  # characters of a conversation's name


def check_tenant(tenant: object) -> None:
    """A call's ``tenant``: None or a str (TypeError)."""
    if tenant is not None and not isinstance(tenant, str):
        raise TypeError(f"tenant must be a str or None, got {type(tenant).__name__}")


def checked_label(conversation: object) -> str | None:
    """A call's ``conversation``: None, or a str of 1 to ``MAX_LABEL`` characters."""
    if conversation is None:
        return None
    if not isinstance(conversation, str):
        raise TypeError(f"conversation must be a str or None, got {type(conversation).__name__}")
    if not 0 < len(conversation) <= MAX_LABEL:
        raise ValueError(f"conversation must have 1 to {MAX_LABEL} characters, got {len(conversation)}")
    return conversation


def check_stateless(config: SessionConfig) -> None:
    """A stateless call's session settings: its system prompt comes in its messages."""
    if config.system is not None:
        raise ValueError(
            "a stateless call takes its system prompt as its first message, not SessionConfig.system"
        )


def check_answerable(transcript: Transcript) -> None:
    """A ``TemplateError`` unless a stateless call can answer ``transcript`` (without copying it)."""
    if not transcript.ends_with_question():
        raise TemplateError("a stateless chat needs messages that end with a user message or tool results")


def split(transcript: Transcript) -> tuple[list[Message], list[Message]]:
    """A stateless call's (checked) transcript as editable copies: the history, and what the
    call answers (the last user message, or the tool results that end the list)."""
    check_answerable(transcript)
    copied = cast(list[Message], transcript.messages())
    start = len(copied) - 1
    while copied[-1]["role"] == "tool" and start > 0 and copied[start - 1]["role"] == "tool":
        start -= 1
    return copied[:start], copied[start:]
