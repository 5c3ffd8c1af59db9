"""OpenAI Responses objects and stream events, as OpenAI writes them. Pure.

A response's output is a ``message`` item (one ``output_text`` part) when the reply has text or
no calls, then a ``function_call`` item per call (``call_id``, ``name``, ``arguments`` as JSON
text). A stream is ``response.created``, ``response.in_progress``, then an item at a time:
``response.output_item.added``; for a message ``response.content_part.added``,
``response.output_text.delta``..., ``response.output_text.done``, ``response.content_part.done``;
for a call ``response.function_call_arguments.delta``..., ``.done``; then
``response.output_item.done``; and last ``response.completed`` (``response.incomplete`` when
``max_output_tokens`` cut it, ``response.failed`` when it failed), every event with its
``sequence_number``. The items a stream announced are the ones its last event's response holds,
with the same ids (the SDK's ``responses.stream`` helper checks).

Asked for (``include``), the output text's tokens are scored as chat's ``logprobs`` are: each
``response.output_text.delta`` with its text's, and a message's part with all of its text's.
They are JSON text made token by token (``sse.entries_json``) and placed whole
(``rendering.Fragment``), never dicts rendered on the event loop: a part's list is sent in four
closing events and kept once more in the store. Scores that come after their text was streamed
(held back by a stop string that then did not match) go with the next delta, else with the
message they belong to, the reply's last.
"""

from __future__ import annotations

import json
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from llmsession.replies import Reply, Snapshot, Usage
from llmsession.serve.errors import ApiError
from llmsession.serve.rendering import rendered
from llmsession.serve.sse import entries_json, joined


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


CONVERSATION = re.compile(r"[0-9a-f]{32}")
REPLICA = re.compile(r"[A-Za-z0-9]{1,32}")


def response_id(conversation: str | None, replica: str | None = None) -> str:
    """A new response's id; in a cluster (a conversation key, 32 hex digits, and the replica's
    name, as the cluster names them to the app: ``cluster.keys``), the key first and the
    replica last, so a ``previous_response_id`` or a read of the stored response routes to the
    replica that stored it."""
    if conversation is None or not CONVERSATION.fullmatch(conversation):
        return new_id("resp")
    named = replica is not None and REPLICA.fullmatch(replica)
    return f"resp_{conversation}{secrets.token_hex(16)}" + (f"_{replica}" if named else "")


def usage(used: Usage | None) -> dict[str, Any]:
    used = used or Usage()
    return {
        "input_tokens": used.prompt_tokens,
        "input_tokens_details": {
            "cached_tokens": used.reused_tokens,
            "cache_write_tokens": 0,
        },  # (Messages' 0)
        "output_tokens": used.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": used.reasoning_tokens},
        "total_tokens": used.prompt_tokens + used.completion_tokens,
    }


def event(payload: dict[str, Any]) -> bytes:
    text = json.dumps(payload, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    return f"event: {payload['type']}\ndata: {text}\n\n".encode()


def scored_event(payload: dict[str, Any]) -> bytes:
    """``event``, for a payload that may hold scores already rendered (``Fragment``)."""
    kind: str = payload["type"]
    return b"event: " + kind.encode() + b"\ndata: " + rendered(payload) + b"\n\n"


KEEP_ALIVE = b": keep-alive\n\n"  # (an SSE comment: clients skip it)


@dataclass
class Items:
    """A stream's output items so far, in order; the last may be open."""

    items: list[dict[str, Any]] = field(default_factory=list)
    open: bool = False
    call: int | None = None  # the open function_call's index among the reply's calls
    scores: list[str] = field(default_factory=list)  # tokens' scores (JSON) not yet sent
    said: list[str] = field(default_factory=list)  # those the last message's deltas sent
    part: dict[str, Any] | None = None  # the last message's ``output_text`` part
    scored: int = 0  # the reply's tokens whose scores were taken (sent, or in ``scores``)


@dataclass
class ResponseObject:
    """One response's identity and what it echoes of its request: its body, or its events."""

    model: str
    echo: dict[str, Any]
    previous: str | None = None
    store: bool = True
    id: str = field(default_factory=lambda: new_id("resp"))
    created_at: int = field(default_factory=lambda: int(time.time()))
    sequence: int = 0
    logprobs: bool = False  # asked for (``include``): the output text's parts carry its tokens'

    def body(
        self, status: str, output: list[dict[str, Any]], used: Usage | None, **extra: Any
    ) -> dict[str, Any]:
        out = {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": None,
            "incomplete_details": None,
            "model": self.model,
            "output": output,
            "previous_response_id": self.previous,
            "store": self.store,
            "truncation": "disabled",
            "usage": None if used is None else usage(used),
            **self.echo,
        }
        return {**out, **extra}

    def whole(self, reply: Reply) -> dict[str, Any]:
        """The response to ``reply``, not streamed."""
        items = Items()
        if reply.reasoning:
            items.items.append(_reasoning(reply.reasoning))
        if reply.text or not (reply.tool_calls or reply.reasoning or _status(reply) != "completed"):
            items.items.append(_message(reply.text))
            if self.logprobs:
                items.items[-1]["content"][0]["logprobs"] = joined(entries_json(reply.logprobs or ()))
        for call in reply.tool_calls:
            items.items.append(_call(call.id, call.name, call.arguments))
        return self.final(reply, items)

    def final(self, reply: Reply, items: Items) -> dict[str, Any]:
        status = _status(reply)
        for item in items.items:
            item["status"] = "completed" if status == "completed" else "incomplete"  # (an item's)
        extra = {"incomplete_details": {"reason": "max_output_tokens"}} if status == "incomplete" else {}
        return self.body(status, items.items, reply.usage, **extra)

    # -- the stream --------------------------------------------------------------------------------
    def _event(self, kind: str, **fields: Any) -> bytes:
        self.sequence += 1
        payload = {"type": kind, "sequence_number": self.sequence - 1, **fields}
        return scored_event(payload) if self.logprobs else event(payload)

    def opening(self) -> list[bytes]:
        started = self.body("in_progress", [], None)
        return [
            self._event("response.created", response=started),
            self._event("response.in_progress", response=started),
        ]

    def pieces(self, snapshot: Snapshot, items: Items) -> list[bytes]:
        out: list[bytes] = []
        if snapshot.reasoning_delta:
            if not (items.open and items.items[-1]["type"] == "reasoning"):
                out += self._close(items) + self._open(items, _reasoning(""))
            item = items.items[-1]
            item["content"][0]["text"] += snapshot.reasoning_delta
            where = {"item_id": item["id"], "output_index": len(items.items) - 1, "content_index": 0}
            out.append(self._event("response.reasoning_text.delta", **where, delta=snapshot.reasoning_delta))
        if self.logprobs and snapshot.logprobs:  # (sent with the next text: their own may be sent)
            items.scores += entries_json(snapshot.logprobs)
            items.scored += len(snapshot.logprobs)
        if snapshot.delta:
            if not (items.open and items.items[-1]["type"] == "message"):
                out += self._close(items) + self._open(items, _message(""))
            item = items.items[-1]
            item["content"][0]["text"] += snapshot.delta
            scores, items.scores = items.scores, []
            items.said += scores
            where = {"item_id": item["id"], "output_index": len(items.items) - 1, "content_index": 0}
            out.append(
                self._event(
                    "response.output_text.delta",
                    **where,
                    delta=snapshot.delta,
                    logprobs=joined(scores) if self.logprobs else [],
                )
            )
        for piece in snapshot.tool_calls:
            if not (items.open and items.call == piece.index):
                out += self._close(items) + self._open(items, _call(piece.id or "", piece.name or "", ""))
                items.call = piece.index
            if piece.arguments:
                item = items.items[-1]
                item["arguments"] += piece.arguments
                where = {"item_id": item["id"], "output_index": len(items.items) - 1}
                out.append(
                    self._event("response.function_call_arguments.delta", **where, delta=piece.arguments)
                )
        return out

    def _open(self, items: Items, item: dict[str, Any]) -> list[bytes]:
        items.items.append(item)
        items.open, index = True, len(items.items) - 1
        shown = {**item, "status": "in_progress"}
        if item["type"] in ("message", "reasoning"):
            shown["content"] = []
        out = [self._event("response.output_item.added", output_index=index, item=shown)]
        if item["type"] == "message":
            items.said, items.part = [], item["content"][0]
        if item["type"] in ("message", "reasoning"):
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            if item["type"] == "reasoning":
                part = {"type": "reasoning_text", "text": ""}
            where = {"item_id": item["id"], "output_index": index, "content_index": 0}
            out.append(self._event("response.content_part.added", **where, part=part))
        return out

    def _close(self, items: Items, status: str = "completed") -> list[bytes]:
        if not items.open:
            return []
        items.open, items.call = False, None
        item, index = items.items[-1], len(items.items) - 1
        item["status"] = status
        out = []
        if item["type"] == "message":
            part = item["content"][0]
            self._settle(items)
            where = {"item_id": item["id"], "output_index": index, "content_index": 0}
            out.append(
                self._event(
                    "response.output_text.done", **where, text=part["text"], logprobs=part["logprobs"]
                )
            )
            out.append(self._event("response.content_part.done", **where, part=part))
        elif item["type"] == "reasoning":
            where = {"item_id": item["id"], "output_index": index, "content_index": 0}
            out.append(self._event("response.reasoning_text.done", **where, text=item["content"][0]["text"]))
            out.append(self._event("response.content_part.done", **where, part=item["content"][0]))
        else:
            where = {"item_id": item["id"], "output_index": index}
            out.append(
                self._event(
                    "response.function_call_arguments.done",
                    **where,
                    name=item["name"],
                    arguments=item["arguments"],
                )
            )
        out.append(self._event("response.output_item.done", output_index=index, item=item))
        return out

    def finish(
        self, reply: Reply, items: Items, stored: Callable[[dict[str, Any]], object] | None = None
    ) -> tuple[list[bytes], dict[str, Any]]:
        """The open item closed (an empty message if the reply said nothing), the last event;
        and the response it holds. A call the stream began that the reply does not make (cut
        short: ``Calling.conclude`` makes none of its calls then) closes ``incomplete``, and no
        such call is an output of the response, as the response not streamed has none: what is
        stored must be what a continuation can answer. (An earlier call of the same reply was
        streamed ``completed`` when the next one opened; it is left out all the same.) Left with
        no item, a completed response ends with an empty message, as the response not streamed
        does, given the next output index of the stream (the first of the response's); one cut
        short has none, as OpenAI's (an empty message under ``text.format`` failed the SDK's
        parse of its text before the ``response.incomplete`` came)."""
        status = _status(reply)
        if self.logprobs:  # (scores of text streamed before them: held back, then not stopped)
            items.scores += entries_json((reply.logprobs or ())[items.scored :])
        made = {call.id for call in reply.tool_calls}
        cut = items.open and items.call is not None and items.items[-1]["call_id"] not in made
        empty = status == "completed"  # (an answer that said nothing; one cut short has no item)
        out = [] if items.items or not empty else self._open(items, _message(""))
        closing = "completed" if status == "completed" else "incomplete"  # (an item's status)
        out += self._close(items, "incomplete" if cut else closing)
        kept = [item for item in items.items if item["type"] != "function_call" or item["call_id"] in made]
        if not kept and empty:
            out += self._open(items, _message("")) + self._close(items, closing)
            kept = items.items[-1:]
        if items.scores:  # (a call was open: they are the last message's, its text streamed)
            self._settle(items)
        final = self.final(reply, Items(kept))
        if stored is not None:  # (before the last event is written: it says whether it was)
            stored(final)
        ending = "incomplete" if status == "cancelled" else status  # (the SDK's events have none)
        return [*out, self._event(f"response.{ending}", response=final)], final

    def failed(self, error: ApiError, items: Items) -> bytes:
        """The stream's end after a failure: ``response.failed`` with the error (the item it
        was writing, ``incomplete``)."""
        if items.open:
            items.items[-1]["status"] = "incomplete"
        failure = {"code": error.code or error.kind, "message": error.message}
        return self._event("response.failed", response=self.body("failed", items.items, None, error=failure))

    def _settle(self, items: Items) -> None:
        """The last message's part given every score of its text (scores not yet sent are
        its text's last tokens')."""
        items.said += items.scores
        items.scores = []
        if items.part is not None and self.logprobs:
            items.part["logprobs"] = joined(items.said)


def _reasoning(text: str) -> dict[str, Any]:
    part = {"type": "reasoning_text", "text": text}
    return {"type": "reasoning", "id": new_id("rs"), "summary": [], "content": [part], "status": "completed"}


def _message(text: str) -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {
        "type": "message",
        "id": new_id("msg"),
        "status": "completed",
        "role": "assistant",
        "content": [part],
    }


def _call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": new_id("fc"),
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": "completed",
    }


def _status(reply: Reply) -> str:
    """A finished response's status: ``incomplete`` at its token limit, ``cancelled`` when its
    client went or the server stopped (never stored), else ``completed``."""
    return {"length": "incomplete", "cancelled": "cancelled"}.get(reply.finish_reason, "completed")
