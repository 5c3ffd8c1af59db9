"""Coding agents' conversations, driven over HTTP as their clients drive them (``bench agents``
and its test).

* Claude-Code-shaped, on ``/v1/messages`` (streamed, ``x-api-key``): a ~4K-token system prompt in
  two blocks, the first Claude Code's billing line whose hash changes every request; 8 tool
  schemas; the whole transcript resent every turn, the replies sent back as they came (their
  ``tool_use`` blocks answered by ``tool_result`` blocks in the next user turn).
* Codex-shaped, on ``/v1/responses`` with ``store: false``: the same prompt as ``instructions``,
  flat function tools, the whole item list resent every turn (the replies' output items, a
  ``function_call_output`` per call).

Every third turn forces a tool call (the tiny model calls few otherwise). Each turn reports its
time to the first token (a text, thinking or arguments delta), its whole time, the prompt tokens
the server reports decoding and reusing, and its reply's tokens; ``new`` is what the turn adds to
the last one's prompt and reply, the most a cache-perfect server has to decode.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import httpx

TOOL_NAMES = ("read_file", "write_file", "edit_file", "bash", "grep", "glob", "web_fetch", "todo_write")
QUESTIONS = (
    "List the files in the project.",
    "Open the README and tell me what it says.",
    "Which module parses the configuration?",
    "Run the tests and report what fails.",
    "Find where the cache is invalidated.",
    "Explain the retry logic in the client.",
    "Rename the helper to something clearer.",
    "Add a docstring to the main function.",
    "Check the changelog for the last release.",
    "Summarize what we changed today.",
)
RULES = (
    "Read a file before you edit it, and keep every edit as small as the task allows.",
    "Prefer the project's own helpers to new code; match its naming and its layout.",
    "Run the tests that cover what you changed, and say which ones you ran.",
    "Never commit secrets; never print a token or a key in a log or an answer.",
    "When a command fails, read its output before you try anything else.",
    "Ask before you delete a file or rewrite a module from scratch.",
    "Keep answers short: what you did, what you found, what is left.",
    "Quote paths exactly as they are in the repository, relative to its root.",
)


def system_prompt(tokens: int = 4000) -> str:
    """A coding agent's instructions, about ``tokens`` long (SmolLM2's tokenizer: ~4 characters a
    token), numbered so that no two lines are alike."""
    lines, size, n = ["You are a coding agent working in the user's repository."], 0, 0
    while size < tokens * 4:
        rule = f"{n + 1}. {RULES[n % len(RULES)]} (section {n // len(RULES) + 1})"
        lines.append(rule)
        size, n = size + len(rule), n + 1
    return "\n".join(lines)


def tool_schemas() -> list[dict[str, Any]]:
    """Eight tools, as Anthropic declares them (``input_schema``)."""
    return [
        {
            "name": name,
            "description": f"The {name.replace('_', ' ')} tool of the agent: use it on the repository.",
            "input_schema": {
                "type": "object",
                "properties": {
                    "path": {"type": "string", "maxLength": 20},
                    "detail": {"type": "string", "maxLength": 20},
                },
                "required": ["path"],
                "additionalProperties": False,
            },
        }
        for name in TOOL_NAMES
    ]


def billing_block() -> dict[str, Any]:
    """Claude Code's first system block, its hash new each request."""
    stamp = secrets.token_hex(3)[:5]
    text = f"x-anthropic-billing-header: cc_version=2.1.101.e51; cc_entrypoint=cli; cch={stamp};"
    return {"type": "text", "text": text}


@dataclass
class Turn:
    turn: int
    ttft_s: float
    total_s: float
    prompt_tokens: int  # as the server reports them: decoded + reused
    decoded_tokens: int
    cached_tokens: int
    output_tokens: int
    new_tokens: int | None  # what this turn adds to the last one's prompt and reply (None: the
    tool_calls: int  # first, or one after a reply not sent back as it came: a call cut short)
    resent: bool = True  # this reply is sent back as it came


def sse(response: httpx.Response) -> Iterator[tuple[str, dict[str, Any]]]:
    """A streamed response's events, as (name, data)."""
    name = ""
    for line in response.iter_lines():
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: ") and line[6:].strip() != "[DONE]":
            data = json.loads(line[6:])
            yield name or data.get("type", ""), data


def forced(turn: int) -> bool:
    return turn % 3 == 1  # (turns 2, 5, 8: a call, answered in the turn after)


TITLE_SYSTEM = "Write a 5-10 word title for the conversation below. Answer with the title only."


def title_request(client: httpx.Client, url: str, headers: dict[str, str], question: str) -> None:
    """A side request as Claude Code sends them between turns, under the conversation's session
    id: a title for it, on a system prompt of its own (nothing in common with the main one)."""
    body = {
        "model": "agent",
        "max_tokens": 12,
        "system": [billing_block(), {"type": "text", "text": TITLE_SYSTEM}],
        "messages": [{"role": "user", "content": question}],
        "temperature": 0,
    }
    client.post(f"{url}/v1/messages", json=body, headers=headers).raise_for_status()


def claude_code(
    client: httpx.Client,
    url: str,
    turns: int,
    max_tokens: int,
    key: str,
    system_tokens: int = 4000,
    titles: bool = False,
) -> list[Turn]:
    """The Claude-Code-shaped conversation on ``url`` (a server's base); ``titles``: a title
    request under its session id before every turn after the first (not timed)."""
    system, tools = system_prompt(system_tokens), tool_schemas()
    said: list[dict[str, Any]] = []
    pending: list[dict[str, Any]] = []  # tool results for the next user turn
    out: list[Turn] = []
    for turn in range(turns):
        said.append(
            {
                "role": "user",
                "content": [*pending, {"type": "text", "text": QUESTIONS[turn % len(QUESTIONS)]}],
            }
        )
        body: dict[str, Any] = {
            "model": "agent",
            "max_tokens": max_tokens,
            "system": [billing_block(), {"type": "text", "text": system}],
            "messages": said,
            "tools": tools,
            "stream": True,
            "temperature": 0,
        }
        if forced(turn):
            body["tool_choice"] = {"type": "tool", "name": TOOL_NAMES[turn % len(TOOL_NAMES)]}
        headers = {"x-api-key": key, "anthropic-version": "2023-06-01", "X-Claude-Code-Session-Id": "bench"}
        if titles and turn:
            title_request(client, url, headers, QUESTIONS[turn % len(QUESTIONS)])
        began = time.perf_counter()
        blocks, usage, first = _messages_turn(client, f"{url}/v1/messages", body, headers, turn)
        total = time.perf_counter() - began
        finished = [_finished(b) for b in blocks if b.get("type") != "text" or b.get("text")]
        content = [b for b in finished if b is not None]
        resent = bool(content) and len(content) == len(finished)
        said.append({"role": "assistant", "content": content or [{"type": "text", "text": "(no answer)"}]})
        calls = [b for b in content if b["type"] == "tool_use"]
        pending = [
            {
                "type": "tool_result",
                "tool_use_id": c["id"],
                "content": f"(contents of {c['input'].get('path', '?')})",
            }
            for c in calls
        ]
        out.append(_turn(turn, began, first, total, usage, len(calls), out, resent))
    return out


def _messages_turn(
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


def codex(
    client: httpx.Client, url: str, turns: int, max_tokens: int, key: str, system_tokens: int = 4000
) -> list[Turn]:
    """The Codex-shaped conversation on ``url``: Responses, ``store: false``, the items resent."""
    instructions = system_prompt(system_tokens)
    tools = [
        {
            "type": "function",
            "name": t["name"],
            "description": t["description"],
            "parameters": t["input_schema"],
        }
        for t in tool_schemas()
    ]
    items: list[dict[str, Any]] = []
    out: list[Turn] = []
    for turn in range(turns):
        text = {"type": "input_text", "text": QUESTIONS[turn % len(QUESTIONS)]}
        items.append({"type": "message", "role": "user", "content": [text]})
        body: dict[str, Any] = {
            "model": "agent",
            "instructions": instructions,
            "input": items,
            "tools": tools,
            "store": False,
            "stream": True,
            "max_output_tokens": max_tokens,
            "temperature": 0,
        }
        if forced(turn):
            body["tool_choice"] = {"type": "function", "name": TOOL_NAMES[turn % len(TOOL_NAMES)]}
        began = time.perf_counter()
        first, final = _responses_turn(client, url, body, key, turn)
        total = time.perf_counter() - began
        output = [_input_item(item) for item in final.get("output") or []]
        items += [item for item in output if item is not None]
        calls = [item for item in output if item is not None and item["type"] == "function_call"]
        items += [
            {"type": "function_call_output", "call_id": c["call_id"], "output": "(done)"} for c in calls
        ]
        out.append(_turn(turn, began, first, total, _anthropic_usage(final), len(calls), out))
    return out


FIRST_EVENTS = (
    "response.output_text.delta",
    "response.function_call_arguments.delta",
    "response.reasoning_text.delta",
)


def _responses_turn(
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


def _anthropic_usage(response: dict[str, Any]) -> dict[str, Any]:
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


def _finished(block: dict[str, Any]) -> dict[str, Any] | None:
    """A streamed block as the client sends it back (a call cut off by ``max_tokens``: none)."""
    if block.get("type") == "tool_use":
        partial = block.pop("partial", "")
        try:
            block["input"] = json.loads(partial) if partial else {}
        except ValueError:
            return None
    return block


def _input_item(item: dict[str, Any]) -> dict[str, Any] | None:
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


def _turn(
    turn: int,
    began: float,
    first: float | None,
    total: float,
    usage: dict[str, Any],
    calls: int,
    before: list[Turn],
    resent: bool = True,
) -> Turn:
    decoded, cached = int(usage.get("input_tokens") or 0), int(usage.get("cache_read_input_tokens") or 0)
    prompt = decoded + cached
    last = before[-1] if before else None
    new = None if last is None or not last.resent else prompt - (last.prompt_tokens + last.output_tokens)
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
    )


def summary(turns: list[Turn]) -> dict[str, Any]:
    """Every turn, and turns 2 and after: mean time to first token, decoded and new tokens."""
    later = turns[1:]
    return {
        "turns": [asdict(t) for t in turns],
        "later_ttft_mean_s": sum(t.ttft_s for t in later) / len(later) if later else None,
        "later_decoded": sum(t.decoded_tokens for t in later),
        "later_new": sum(t.new_tokens or 0 for t in later),
        "tool_calls": sum(t.tool_calls for t in turns),
    }
