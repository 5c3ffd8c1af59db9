"""Chat completion bodies and stream chunks, exactly as OpenAI writes them. Pure.

A stream is one ``id`` for every chunk: each choice's first delta has ``role: "assistant"``, then
its content deltas and tool-call deltas (a call's index, id, type and name first, its arguments
appended after), then a chunk with its ``finish_reason``; with ``include_usage`` every chunk has
``usage: null`` and a last chunk has no choices and the usage; then ``data: [DONE]``. A whole
body's scores are JSON text already (``rendering``).
"""

from __future__ import annotations

import json
import math
import secrets
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from llmsession.replies import Alternative, FinishReason, Reply, Snapshot, TokenLogprob, ToolCallDelta, Usage
from llmsession.serve.rendering import Fragment

# "complete" (a constraint was satisfied) is a natural end; "cancelled" happens only when the
# client is gone or the server stops, so nobody reads it.
FINISH: dict[FinishReason, str] = {
    "stop": "stop",
    "complete": "stop",
    "length": "length",
    "tool_calls": "tool_calls",
    "cancelled": "stop",
}
DONE = b"data: [DONE]\n\n"


def event(payload: Mapping[str, Any]) -> bytes:
    """One server-sent event carrying ``payload`` as JSON."""
    text = json.dumps(payload, ensure_ascii=False, separators=(",", ":"), allow_nan=False)  # (as JSON is)
    return b"data: " + text.encode() + b"\n\n"


def usage(usages: Sequence[Usage], prompt: Usage | None = None) -> dict[str, Any]:
    """OpenAI's usage for the choices of one prompt: its tokens counted once (``prompt``'s, the
    exchange that decoded it for choices forked from it, else the first choice's), the
    completions summed; cached tokens are those the engine reused, not decoded."""
    first = prompt or (usages[0] if usages else Usage())
    completion = sum(u.completion_tokens for u in usages)
    return {
        "prompt_tokens": first.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": first.prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": first.reused_tokens},
        "completion_tokens_details": {"reasoning_tokens": sum(u.reasoning_tokens for u in usages)},
    }


def message(reply: Reply) -> dict[str, Any]:
    """A non-streamed choice's message (its reasoning as ``reasoning_content``, as llama-server
    and DeepSeek's API write it)."""
    out: dict[str, Any] = {"role": "assistant", "content": reply.text, "refusal": None}
    if reply.reasoning:
        out["reasoning_content"] = reply.reasoning
    if reply.tool_calls:
        out["content"] = reply.text or None
        out["tool_calls"] = [call.message_part() for call in reply.tool_calls]
    return out


def tool_delta(piece: ToolCallDelta) -> dict[str, Any]:
    """A streamed piece of a call: its id, type and name first, then arguments to append."""
    if piece.id is None and piece.name is None:
        return {"index": piece.index, "function": {"arguments": piece.arguments}}
    function = {"name": piece.name, "arguments": piece.arguments}
    return {"index": piece.index, "id": piece.id, "type": "function", "function": function}


def chat_logprobs(entries: Sequence[TokenLogprob]) -> dict[str, Any]:
    """A chat choice's ``logprobs``: an entry per token, its bytes as a list of ints."""
    content = [
        {
            "token": e.token,
            "logprob": e.logprob,
            "bytes": list(e.bytes),
            "top_logprobs": [{"token": a.token, "logprob": a.logprob, "bytes": list(a.bytes)} for a in e.top],
        }
        for e in entries
    ]
    return {"content": content, "refusal": None}


def _float(value: float) -> str:
    if not math.isfinite(value):  # (as ``json`` refuses it: never ``NaN`` in a body)
        raise ValueError(f"a score is not finite: {value}")
    return float.__repr__(value)


def _alternative_json(a: Alternative) -> str:
    token, score, spelled = (
        json.dumps(a.token, ensure_ascii=False),
        _float(a.logprob),
        ",".join(map(str, a.bytes)),
    )
    return f'{{"token":{token},"logprob":{score},"bytes":[{spelled}]}}'


def _entry_json(e: TokenLogprob) -> str:
    token, score, spelled = (
        json.dumps(e.token, ensure_ascii=False),
        _float(e.logprob),
        ",".join(map(str, e.bytes)),
    )
    top = ",".join(map(_alternative_json, e.top))
    return f'{{"token":{token},"logprob":{score},"bytes":[{spelled}],"top_logprobs":[{top}]}}'


def entries_json(entries: Sequence[TokenLogprob]) -> list[str]:
    """``chat_logprobs``' entries, each as its JSON text: written token by token in short calls
    and no dict each (4,096 tokens with 20 alternatives were 86,000 dicts: the garbage
    collector's passes over them stopped the event loop)."""
    return list(map(_entry_json, entries))


def joined(texts: Sequence[str]) -> Fragment:
    """JSON texts as one JSON list, placed as it is by ``rendering.rendered``."""
    return Fragment("[" + ",".join(texts) + "]")


def whole_chat_logprobs(entries: Sequence[TokenLogprob]) -> dict[str, Any]:
    """``chat_logprobs`` for a whole body: its entries as JSON text (``Fragment``)."""
    return {"content": joined(entries_json(entries)), "refusal": None}


def whole_text_logprobs(entries: Sequence[TokenLogprob], offset: int = 0) -> dict[str, Any]:
    """``text_logprobs`` for a whole body: its mappings as JSON text (``Fragment``)."""
    scores = text_logprobs(entries, offset, mappings=False)
    top = (
        json.dumps(_likeliest_by_text(e.top), ensure_ascii=False, allow_nan=False, separators=(",", ":"))
        for e in entries
    )
    return {**scores, "top_logprobs": Fragment("[" + ",".join(top) + "]")}


def text_logprobs(
    entries: Sequence[TokenLogprob], offset: int = 0, *, mappings: bool = True
) -> dict[str, Any]:
    """A raw completion's ``logprobs``, in the legacy shape: parallel lists, where each token's
    text starts (from ``offset``), and the likeliest tokens as a mapping."""
    starts, at = [], offset
    for e in entries:
        starts.append(at)
        at += len(e.token)
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [_likeliest_by_text(e.top) for e in entries] if mappings else None,
        "text_offset": starts,
    }


@dataclass
class Streamed:
    """How much of a choice's scores a stream has sent: entries, and the text they cover."""

    entries: int = 0
    chars: int = 0

    def add(self, entries: Sequence[TokenLogprob]) -> None:
        self.entries += len(entries)
        self.chars += sum(len(e.token) for e in entries)


@dataclass(frozen=True)
class Completion:
    """One completion's identity: every chunk of its stream, or its one body, carries it."""

    model: str
    include_usage: bool = False
    prompt: Usage | None = None  # the prompt's own exchange, when the choices were forked from it
    text: bool = False  # a raw completion's (``/v1/completions``): choices carry ``text``
    logprobs: bool = False  # scores were asked for: choices carry them
    id: str = ""  # (made at creation: ``chatcmpl-...``, or ``cmpl-...`` for a raw completion)
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        if not self.id:
            object.__setattr__(self, "id", f"{'cmpl' if self.text else 'chatcmpl'}-{secrets.token_hex(12)}")

    def body(self, replies: Sequence[Reply]) -> dict[str, Any]:
        """The non-streamed response: a choice per reply."""
        said = (lambda r: {"text": r.text}) if self.text else (lambda r: {"message": message(r)})
        choices = [
            {
                "index": i,
                **said(r),
                "logprobs": self._logprobs(r.logprobs, whole=True),
                "finish_reason": FINISH[r.finish_reason],
            }
            for i, r in enumerate(replies)
        ]
        return {
            "id": self.id,
            "object": "text_completion" if self.text else "chat.completion",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": choices,
            "usage": usage([r.usage for r in replies], self.prompt),
        }

    def chunk(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        out = {
            "id": self.id,
            "object": "text_completion" if self.text else "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": choices,
        }
        if self.include_usage:
            out["usage"] = None
        return {**out, **extra}

    def delta(
        self, index: int, delta: dict[str, Any], finish: str | None = None, scores: Any = None
    ) -> dict[str, Any]:
        said = {"text": delta.get("content", "")} if self.text else {"delta": delta}
        choice = {"index": index, **said, "logprobs": scores, "finish_reason": finish}
        return self.chunk([choice])

    def _logprobs(
        self, entries: Sequence[TokenLogprob] | None, streamed: Streamed | None = None, whole: bool = False
    ) -> Any:
        """A choice's ``logprobs`` for ``entries`` (None unless asked), sent after ``streamed``
        (``whole``: in a whole body, rendered by ``rendering.rendered``)."""
        if not self.logprobs:
            return None
        done, entries = streamed or Streamed(), entries or ()
        if self.text:
            scores = (whole_text_logprobs if whole else text_logprobs)(entries, done.chars)
        else:
            scores = (whole_chat_logprobs if whole else chat_logprobs)(entries)
        done.add(entries or ())
        return scores

    def openings(self, n: int) -> list[dict[str, Any]]:
        """Each choice's first chunk: its role (a raw completion's stream has none)."""
        return [] if self.text else [self.delta(i, {"role": "assistant", "content": ""}) for i in range(n)]

    def pieces(
        self, index: int, snapshot: Snapshot, streamed: Streamed | None = None
    ) -> list[dict[str, Any]]:
        """The chunks of one snapshot: its text (with its tokens' scores), then the pieces of
        calls it wrote."""
        out = []
        if snapshot.reasoning_delta and not self.text:
            out.append(self.delta(index, {"reasoning_content": snapshot.reasoning_delta}))
        if snapshot.delta or (self.logprobs and snapshot.logprobs):
            scores = self._logprobs(snapshot.logprobs, streamed)
            out.append(self.delta(index, {"content": snapshot.delta}, scores=scores))
        if snapshot.tool_calls:
            out.append(self.delta(index, {"tool_calls": [tool_delta(p) for p in snapshot.tool_calls]}))
        return out

    def finish(self, index: int, reply: Reply, streamed: Streamed | None = None) -> dict[str, Any]:
        """A choice's last chunk: its finish reason, and the scores of text already streamed
        whose tokens ended after it (held back by a stop string that then did not match)."""
        done = streamed or Streamed()
        rest = (reply.logprobs or ())[done.entries :]
        scores = self._logprobs(rest, done) if rest else None
        return self.delta(index, {}, FINISH[reply.finish_reason], scores=scores)

    def usage_chunk(self, replies: Sequence[Reply]) -> dict[str, Any]:
        """The last chunk with ``include_usage``: no choices, the usage."""
        return self.chunk([], usage=usage([r.usage for r in replies], self.prompt))


def _likeliest_by_text(top: Sequence[Alternative]) -> dict[str, float]:
    """The alternatives as the legacy mapping of text to score: where several read the same
    (``""`` inside a character), the likeliest's score, not the last one's."""
    mapping: dict[str, float] = {}
    for alternative in top:
        mapping.setdefault(alternative.token, alternative.logprob)
    return mapping
