"""What a stateless call's prompt counts, made as the call makes it but decoded by no session
(``Model.prompt_tokens(tenant=...)``, ``Model.prompt_size``: Anthropic's ``count_tokens``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from llmsession.config import SessionConfig
from llmsession.options import GenerationOptions
from llmsession.runtime.continuing import check_prefill, prefill_of, prefill_tokens
from llmsession.runtime.core import ModelCore
from llmsession.runtime.stateless_calls import check_stateless
from llmsession.text.splice import ReplyTokens
from llmsession.text.tools import Tools
from llmsession.text.transcript import Transcript

Record = Callable[[], ReplyTokens | None]  # the tenant's record of replies to splice, if kept apart


def call_tokens(
    model: ModelCore,
    messages: Sequence[Mapping[str, Any]],
    record: Record,
    config: SessionConfig,
    tools: Tools | None,
    tool_format: str | None,
) -> list[int]:
    """The tokens a stateless call with these messages would decode as its prompt, spliced
    from the replies its tenant's calls may splice (a text-only transcript)."""
    transcript, text = _checked(model, messages, config, tools)
    own = record()
    tokens = model.prompt_tokens(
        transcript,
        thinking=config.thinking,
        tools=tools,
        tool_format=tool_format,
        own=own,
        shared=own is None,
    )
    return tokens + ([] if text is None else prefill_tokens(model, text))


def call_size(
    model: ModelCore,
    messages: Sequence[Mapping[str, Any]],
    record: Record,
    config: SessionConfig,
    tools: Tools | None,
    tool_format: str | None,
) -> int:
    """``call_tokens``'s count, and an image's items as the projector makes them (each image
    read for it, not encoded): what the call's usage says its prompt is."""
    transcript, text = _checked(model, messages, config, tools)
    own = record()
    prompt = model.prompt(
        transcript,
        thinking=config.thinking,
        own=own,
        shared=own is None,
        tools=tools,
        tool_format=tool_format,
    )
    try:
        size = len(prompt.items)
    finally:
        prompt.close()  # (an image's chunks: native memory)
    return size + (0 if text is None else len(prefill_tokens(model, text)))


def _checked(
    model: ModelCore, messages: Sequence[Mapping[str, Any]], config: SessionConfig, tools: Tools | None
) -> tuple[Transcript, str | None]:
    """The transcript and the assistant's text it ends with (a prefill, counted only as a call
    could be made), checked as a call checks them."""
    check_stateless(config)
    transcript, text = prefill_of(Transcript(messages))
    if text is not None:
        check_prefill(model, text, GenerationOptions(), tools, config.thinking)
    return transcript, text
