"""Coding agents' conversations, driven over HTTP as their clients drive them (``bench agents``
and its test).

* Claude-Code-shaped, on ``/v1/messages`` (streamed, ``x-api-key``): a ~4K-token system prompt in
  two blocks, the first Claude Code's billing line whose hash changes every request; 8 tool
  schemas; the whole transcript resent every turn, the replies sent back as they came (their
  ``tool_use`` blocks answered by ``tool_result`` blocks in the next user turn).
* Codex-shaped, on ``/v1/responses`` with ``store: false``: the same prompt as ``instructions``,
  flat function tools, the whole item list resent every turn (the replies' output items, a
  ``function_call_output`` per call).

Every third turn forces a tool call (the tiny model calls few otherwise). A replayed
conversation sends the script's replies back (``scripted``), not the server's, so that every
server is sent the same prompts. Each turn reports its
time to the first token (a text, thinking or arguments delta), its whole time, the prompt tokens
the server reports decoding and reusing, and its reply's tokens; ``new`` is what the turn adds to
the last one's prompt and reply, the most a cache-perfect server has to decode.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import secrets
import time
from collections.abc import Iterator
from typing import Any

import httpx

from llmsession.commands.bench import agents_wire

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


def forced(turn: int) -> bool:
    return turn % 3 == 1  # (turns 2, 5, 8: a call, answered in the turn after)


def scripted(turn: int) -> tuple[str, str] | tuple[None, str]:
    """What a replayed transcript says the agent answered at ``turn``: a call (its tool and
    path) on a forced turn, else a short text (``None`` and the text)."""
    if forced(turn):
        return TOOL_NAMES[turn % len(TOOL_NAMES)], f"src/module_{turn + 1}.py"
    return None, f"Done with step {turn + 1}: the change is in place and its tests pass."


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
    replay: bool = False,
    conversations: int = 1,
) -> list[agents_wire.Turn]:
    """The Claude-Code-shaped conversation on ``url`` (a server's base); ``titles``: a title
    request under its session id before every turn after the first (not timed); ``replay``: the
    replies go back as the script says (``scripted``), not as they came, so that every server
    is sent the same prompts; ``conversations``: that many at once (each its own session id
    and questions, one system prompt), a turn of each in turn, their turns in the order they came."""
    runs = [
        _conversation(client, url, max_tokens, key, system_tokens, titles, replay, number, conversations)
        for number in range(conversations)
    ]
    return [next(run) for _ in range(turns) for run in runs]


def _conversation(
    client: httpx.Client,
    url: str,
    max_tokens: int,
    key: str,
    system_tokens: int,
    titles: bool,
    replay: bool,
    number: int,
    of: int,
) -> Iterator[agents_wire.Turn]:
    """Conversation ``number``'s turns (of ``of`` at once), one a ``next``."""
    system, tools = system_prompt(system_tokens), tool_schemas()
    said: list[dict[str, Any]] = []
    pending: list[dict[str, Any]] = []  # tool results for the next user turn
    out: list[agents_wire.Turn] = []
    session = "bench" if of == 1 else f"bench-{number + 1}-of-{of}"
    headers = {"x-api-key": key, "anthropic-version": "2023-06-01", "X-Claude-Code-Session-Id": session}
    for turn in itertools.count():
        question = QUESTIONS[(turn + number) % len(QUESTIONS)]
        said.append({"role": "user", "content": [*pending, {"type": "text", "text": question}]})
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
        if titles and turn:
            title_request(client, url, headers, question)
        began = time.perf_counter()
        blocks, usage, first = agents_wire.messages_turn(client, f"{url}/v1/messages", body, headers, turn)
        total = time.perf_counter() - began
        finished = [agents_wire.finished(b) for b in blocks if b.get("type") != "text" or b.get("text")]
        content = [b for b in finished if b is not None]
        resent = bool(content) and len(content) == len(finished)
        made = sum(b["type"] == "tool_use" for b in content)
        if replay:
            content, resent = _scripted_blocks(turn), False
        said.append({"role": "assistant", "content": content or [{"type": "text", "text": "(no answer)"}]})
        pending = [
            {
                "type": "tool_result",
                "tool_use_id": c["id"],
                "content": f"(contents of {c['input'].get('path', '?')})",
            }
            for c in content
            if c["type"] == "tool_use"
        ]
        measured = agents_wire.turn_of(turn, began, first, total, usage, made, out, resent, replay)
        out.append(dataclasses.replace(measured, conversation=number))
        yield out[-1]


def _scripted_blocks(turn: int) -> list[dict[str, Any]]:
    tool, said = scripted(turn)
    if tool is None:
        return [{"type": "text", "text": said}]
    return [{"type": "tool_use", "id": f"toolu_bench{turn + 1:02d}", "name": tool, "input": {"path": said}}]


def _scripted_items(turn: int) -> list[dict[str, Any]]:
    tool, said = scripted(turn)
    if tool is None:
        return [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": said}]}]
    call = {"type": "function_call", "call_id": f"call_bench{turn + 1:02d}", "name": tool}
    return [call | {"arguments": json.dumps({"path": said})}]


def codex(
    client: httpx.Client,
    url: str,
    turns: int,
    max_tokens: int,
    key: str,
    system_tokens: int = 4000,
    replay: bool = False,
) -> list[agents_wire.Turn]:
    """The Codex-shaped conversation on ``url``: Responses, ``store: false``, the items resent
    (``replay``: the script's, as ``claude_code``)."""
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
    out: list[agents_wire.Turn] = []
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
        first, final = agents_wire.responses_turn(client, url, body, key, turn)
        total = time.perf_counter() - began
        came = [agents_wire.input_item(item) for item in final.get("output") or []]
        output = _scripted_items(turn) if replay else [item for item in came if item is not None]
        made = sum(item is not None and item["type"] == "function_call" for item in came)
        calls = [item for item in output if item["type"] == "function_call"]
        items += output
        items += [
            {"type": "function_call_output", "call_id": c["call_id"], "output": "(done)"} for c in calls
        ]
        usage = agents_wire.anthropic_usage(final)
        out.append(agents_wire.turn_of(turn, began, first, total, usage, made, out, not replay, replay))
    return out
