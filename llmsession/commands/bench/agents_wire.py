"""The wire side of ``bench agents``' conversations: a streamed turn on ``/v1/messages`` or
``/v1/responses`` read as its client reads it (the first delta's time, the blocks or items it
sends back, its usage), and what each turn measured (``Turn``, ``summary``)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import httpx


@dataclass
class Turn:
    turn: int
    ttft_s: float
    total_s: float
    prompt_tokens: int  # as the server reports them: decoded + reused
    decoded_tokens: int
    cached_tokens: int
    output_tokens: int
    # What this turn adds to the last one's prompt and reply (a replayed one's: to its prompt);
    # None: the first, or one after a reply not sent back as it came (a call cut short).
    new_tokens: int | None
    tool_calls: int  # the calls the server made
    resent: bool = True  # this reply is sent back as it came
    replaced: bool = False  # this reply goes back as the script's (a replayed conversation)
    conversation: int = 0  # which of several at once


def sse(response: httpx.Response) -> Iterator[tuple[str, dict[str, Any]]]:
    """A streamed response's events, as (name, data)."""
    name = ""
    for line in response.iter_lines():
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: ") and line[6:].strip() != "[DONE]":
            data = json.loads(line[6:])
            yield name or data.get("type", ""), data


def messages_turn(
    client: httpx.Client, url: str, body: dict[str, Any], headers: dict[str, str], turn: int
) -> tuple[list[dict[str, Any]], dict[str, Any], float | None]:
    """One streamed Messages turn: its blocks as they grew, its usage, when its first delta came."""
    first = None
    blocks: list[dict[str, Any]] = []
    usage: dict[str, Any] = {}
    with client.stream("POST", url, json=body, headers=headers) as response:
        response.raise_for_status()
        for name, data in sse(response):
            if name == "message_start":
                usage |= data["message"].get("usage") or {}
            elif name == "content_block_start":
                blocks.append(dict(data["content_block"]))
            elif name == "content_block_delta":
                first = first or time.perf_counter()
                _grow(blocks[-1], data["delta"])
            elif name == "message_delta":
                usage |= {k: v for k, v in (data.get("usage") or {}).items() if v is not None}
            elif name == "error":
                raise RuntimeError(f"turn {turn + 1}: {data}")
    return blocks, usage, first


FIRST_EVENTS = (
    "response.output_text.delta",
    "response.function_call_arguments.delta",
    "response.reasoning_text.delta",
)


def responses_turn(
    client: httpx.Client, url: str, body: dict[str, Any], key: str, turn: int
) -> tuple[float | None, dict[str, Any]]:
    """One streamed response: when its first token came, and the response its last event holds."""
    first, final = None, None
    headers = {"Authorization": f"Bearer {key}"}
    with client.stream("POST", f"{url}/v1/responses", json=body, headers=headers) as response:
        response.raise_for_status()
        for name, data in sse(response):
            if name in FIRST_EVENTS:
                first = first or time.perf_counter()
            elif name in ("response.completed", "response.incomplete"):
                final = data["response"]
            elif name in ("response.failed", "error"):
                raise RuntimeError(f"turn {turn + 1}: {data}")
    if final is None:
        raise RuntimeError(f"turn {turn + 1}: the stream ended without its response")
    return first, final


def anthropic_usage(response: dict[str, Any]) -> dict[str, Any]:
    """A response's usage in Anthropic's terms (decoded, reused, output)."""
    used = response.get("usage") or {}
    cached = (used.get("input_tokens_details") or {}).get("cached_tokens", 0)
    decoded = used.get("input_tokens", 0) - cached
    return {
        "input_tokens": decoded,
        "cache_read_input_tokens": cached,
        "output_tokens": used.get("output_tokens", 0),
    }


def _grow(block: dict[str, Any], delta: dict[str, Any]) -> None:
    kind = delta.get("type")
    if kind == "text_delta":
        block["text"] = block.get("text", "") + delta["text"]
    elif kind == "input_json_delta":
        block["partial"] = block.get("partial", "") + delta["partial_json"]
    elif kind == "thinking_delta":
        block["thinking"] = block.get("thinking", "") + delta["thinking"]


def finished(block: dict[str, Any]) -> dict[str, Any] | None:
    """A streamed block as the client sends it back (a call cut off by ``max_tokens``: none)."""
    if block.get("type") == "tool_use":
        partial = block.pop("partial", "")
        try:
            block["input"] = json.loads(partial) if partial else {}
        except ValueError:
            return None
    return block


def input_item(item: dict[str, Any]) -> dict[str, Any] | None:
    """A response's output item as Codex sends it back (reasoning without text: dropped)."""
    if item.get("type") == "message":
        texts = [p.get("text", "") for p in item.get("content") or [] if p.get("type") == "output_text"]
        return {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "".join(texts)}],
        }
    if item.get("type") == "function_call":
        return {k: item[k] for k in ("type", "call_id", "name", "arguments")}
    return None


def turn_of(
    turn: int,
    began: float,
    first: float | None,
    total: float,
    usage: dict[str, Any],
    calls: int,
    before: list[Turn],
    resent: bool = True,
    replaced: bool = False,
) -> Turn:
    decoded, cached = int(usage.get("input_tokens") or 0), int(usage.get("cache_read_input_tokens") or 0)
    prompt = decoded + cached
    last, new = before[-1] if before else None, None
    if last is not None and last.replaced:
        new = prompt - last.prompt_tokens  # (the script's reply is new to the server too)
    elif last is not None and last.resent:
        new = prompt - (last.prompt_tokens + last.output_tokens)
    ttft = (first or began + total) - began
    return Turn(
        turn + 1,
        ttft,
        total,
        prompt,
        decoded,
        cached,
        int(usage.get("output_tokens") or 0),
        new,
        calls,
        resent,
        replaced,
    )


def summary(turns: list[Turn]) -> dict[str, Any]:
    """Every turn, and turns 2 and after: mean time to first token, decoded and new tokens."""
    later = [t for t in turns if t.turn > 1]  # (of every conversation)
    return {
        "turns": [asdict(t) for t in turns],
        "later_ttft_mean_s": sum(t.ttft_s for t in later) / len(later) if later else None,
        "later_decoded": sum(t.decoded_tokens for t in later),
        "later_new": sum(t.new_tokens or 0 for t in later),
        "tool_calls": sum(t.tool_calls for t in turns),
    }
