"""Anthropic Messages bodies and stream events, as Anthropic writes them. Pure.

A stream is ``message_start`` (with the prompt's usage: a stream begun before its prompt was
decoded counts 0 there), then a block at a time: ``content_block_start``, its deltas (``text_delta``,
or a tool call's ``input_json_delta`` pieces of its input as JSON text),
``content_block_stop``; then ``message_delta`` with the stop reason and the whole usage
(cumulative counts, which the SDK's ``messages.stream`` helper takes over the start's), and
``message_stop``. ``ping`` may come at any point after ``message_start``; an error is an
``error`` event with Anthropic's error body.

Usage means what Anthropic means by it: ``cache_read_input_tokens`` are the prompt tokens the
engine reused, ``input_tokens`` the ones it decoded, ``cache_creation_input_tokens`` 0 (every
decoded token is kept, but counting it again would break the sum Anthropic's clients take for
the prompt's length), ``output_tokens`` the reply's.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from llmsession.replies import Reply, Snapshot, ToolCall, Usage
from llmsession.serve.body import nests_deeper
from llmsession.serve.errors import ApiError

STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}  # else "end_turn"
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def event(name: str, payload: Mapping[str, Any]) -> bytes:
    text = json.dumps(payload, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    return f"event: {name}\ndata: {text}\n\n".encode()


def _delta(index: int, delta: dict[str, Any]) -> bytes:
    return event("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta})


def error_body(error: ApiError) -> dict[str, Any]:
    """Anthropic's error body for a refused request; an over-long prompt in Anthropic's words,
    which Claude Code reads to compact the conversation and try again."""
    kind = ERROR_TYPES.get(error.status, "invalid_request_error" if error.status < 500 else "api_error")
    message = error.message
    if error.sizes is not None:
        message = f"prompt is too long: {error.sizes[0]} tokens > {error.sizes[1]} maximum"
    return {"type": "error", "error": {"type": kind, "message": message}}


def usage(used: Usage | None) -> dict[str, Any]:
    used = used or Usage()
    return {
        "input_tokens": used.prompt_tokens - used.reused_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": used.reused_tokens,
        "output_tokens": used.completion_tokens,
    }


def stop_reason(reply: Reply) -> str:
    if reply.stop_sequence is not None:
        return "stop_sequence"
    if reply.context_full:  # (an agent that raised max_tokens would meet the same end)
        return "model_context_window_exceeded"
    return STOP_REASONS.get(reply.finish_reason, "end_turn")


MAX_INPUT_DEPTH = 128  # levels of a call's input written as an object (else as its JSON text)


def tool_input(call: ToolCall) -> dict[str, Any]:
    """A call's arguments as the object ``input`` is (any other JSON value kept under a key; one
    nested past ``MAX_INPUT_DEPTH``, which the event loop's stack may not read or write again,
    as its text: a schema of ``{"type": "object"}`` takes arguments 900 lists deep), and so one no
    response body can hold: a number past a double's range (``1e999`` is JSON, read as infinity)
    or a lone surrogate's escape (``"\\ud83d"``), which the body's encoding refuses: a 500, where
    the stream had sent the text."""
    try:
        value = json.loads(call.arguments)
    except (ValueError, RecursionError):
        return {"arguments": call.arguments}
    if nests_deeper(value, MAX_INPUT_DEPTH) or not _writable(value):
        return {"arguments": call.arguments}
    return value if isinstance(value, dict) else {"arguments": value}


def _writable(value: Any) -> bool:
    """Whether ``value`` is written as a response body writes it (``JSONResponse``'s rules)."""
    try:
        json.dumps(value, ensure_ascii=False, allow_nan=False).encode("utf-8")
    except (ValueError, UnicodeEncodeError):
        return False
    return True


@dataclass
class Blocks:
    """Where a stream is among its content blocks: the open one's index and kind."""

    index: int = -1
    kind: str | None = None  # "thinking", "text", "tool_use" or None (none open)


@dataclass(frozen=True)
class AnthropicMessage:
    """One message's identity: its body, or every event of its stream."""

    model: str
    id: str = field(default_factory=lambda: f"msg_{secrets.token_hex(12)}")

    def body(self, reply: Reply) -> dict[str, Any]:
        content: list[dict[str, Any]] = []
        if reply.reasoning:
            content.append({"type": "thinking", "thinking": reply.reasoning, "signature": ""})
        if reply.text or not (reply.tool_calls or reply.reasoning):  # (as the stream's blocks)
            content.append({"type": "text", "text": reply.text})
        for call in reply.tool_calls:
            content.append({"type": "tool_use", "id": call.id, "name": call.name, "input": tool_input(call)})
        return {**self._shell(content, stop_reason(reply), reply.stop_sequence), "usage": usage(reply.usage)}

    def _shell(self, content: list[Any], stop: str | None, sequence: str | None) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": stop,
            "stop_sequence": sequence,
        }

    def start(self, prompt: Usage | None = None) -> bytes:
        """The first event, with the prompt's usage if it is known by then (a stream begun
        before its prompt was decoded says 0 until ``message_delta``)."""
        message = {**self._shell([], None, None), "usage": usage(prompt)}
        return event("message_start", {"type": "message_start", "message": message})

    def pieces(self, snapshot: Snapshot, blocks: Blocks) -> list[bytes]:
        """A snapshot's events: its reasoning and text, each in its open block (one opened if
        need be). Its calls' pieces are not shown: each call is a block at the end (``finish``)."""
        out: list[bytes] = []
        if snapshot.reasoning_delta:
            if blocks.kind != "thinking":
                out += self._open(blocks, "thinking", {"type": "thinking", "thinking": "", "signature": ""})
            out.append(_delta(blocks.index, {"type": "thinking_delta", "thinking": snapshot.reasoning_delta}))
        if snapshot.delta:
            if blocks.kind != "text":
                out += self._open(blocks, "text", {"type": "text", "text": ""})
            out.append(_delta(blocks.index, {"type": "text_delta", "text": snapshot.delta}))
        return out

    def _open(self, blocks: Blocks, kind: str, block: dict[str, Any]) -> list[bytes]:
        out = self._close(blocks)
        blocks.index, blocks.kind = blocks.index + 1, kind
        payload = {"type": "content_block_start", "index": blocks.index, "content_block": block}
        out.append(event("content_block_start", payload))
        return out

    @staticmethod
    def _close(blocks: Blocks) -> list[bytes]:
        if blocks.kind is None:
            return []
        out = []
        if blocks.kind == "thinking":  # (a thinking block ends with its signature: none here)
            out.append(_delta(blocks.index, {"type": "signature_delta", "signature": ""}))
        blocks.kind = None
        return [*out, event("content_block_stop", {"type": "content_block_stop", "index": blocks.index})]

    def finish(self, reply: Reply, blocks: Blocks) -> list[bytes]:
        """The last block closed (an empty text block if the reply has none), a block for each
        call the reply made, its input in one ``input_json_delta`` (the body's ``input``, so a
        stream and a body agree: a call's pieces as they came were the model's text, which
        the SDK's partial parse refused where it held a lone surrogate's escape, and which held
        a call the reply cut short does not make), the stop reason and usage, the end."""
        out = (
            []
            if blocks.index >= 0 or reply.tool_calls
            else self._open(blocks, "text", {"type": "text", "text": ""})
        )
        for call in reply.tool_calls:
            out += self._open(
                blocks, "tool_use", {"type": "tool_use", "id": call.id, "name": call.name, "input": {}}
            )
            json_delta = {"type": "input_json_delta", "partial_json": json.dumps(tool_input(call))}
            out.append(_delta(blocks.index, json_delta))
        out += self._close(blocks)
        delta = {"stop_reason": stop_reason(reply), "stop_sequence": reply.stop_sequence}
        payload = {"type": "message_delta", "delta": delta, "usage": usage(reply.usage)}
        out.append(event("message_delta", payload))
        out.append(event("message_stop", {"type": "message_stop"}))
        return out

    @staticmethod
    def ping() -> bytes:
        return event("ping", {"type": "ping"})

    @staticmethod
    def error(error: ApiError) -> bytes:
        return event("error", error_body(error))
