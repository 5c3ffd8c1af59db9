"""The generic tool format's prompt: a transcript with tools for a template that knows none,
the tools and the call format described in the system message (as llama-server's "generic"
handler does), calls as the JSON the reply generated, results as user messages."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from llmsession.errors import TemplateError
from llmsession.text.messages import flatten_content, is_image_part
from llmsession.text.tool_formats import GENERIC, calls_of
from llmsession.text.tools import Tools


def generic_messages(messages: Sequence[Mapping[str, Any]], tools: Tools | None) -> list[dict[str, Any]]:
    """A transcript with tools for a template that knows none: the tools and the call format in
    the system message, calls as the JSON the reply generated, results as user messages."""
    out = [_generic_message(i, m) for i, m in enumerate(messages)]
    if tools is not None:  # (declared with tool_choice "none" too: the prefix stays the same)
        described = "\n".join(json.dumps(tool.spec()["function"]) for tool in tools.tools)
        guide = (
            f"You can call these tools:\n{described}\nTo call tools, reply with only this JSON: "
            '{"tool_calls": [{"name": <tool name>, "arguments": <arguments object>}]}'
        )
        if out and out[0].get("role") == "system" and isinstance(out[0].get("content"), str):
            out[0]["content"] = f"{out[0]['content']}\n\n{guide}"
        else:
            out.insert(0, {"role": "system", "content": guide})
    return out


def _generic_message(i: int, message: Mapping[str, Any]) -> dict[str, Any]:
    """A (checked) message as the generic format writes it: calls as the JSON the reply
    generated after its text, a result as a user message holding it, others as they are."""
    if message.get("role") == "assistant" and message.get("tool_calls"):
        content = message.get("content")
        text = content if isinstance(content, str) else flatten_content(content or "", "")
        return {"role": "assistant", "content": GENERIC.reply_text(text, calls_of(message))}
    if message.get("role") != "tool":
        return dict(message)
    content = message.get("content")
    if not isinstance(content, str):  # (the parts' text: a result is JSON text here)
        if any(is_image_part(part) for part in content or ()):
            raise TemplateError(f"message {i} (tool): the generic tool format takes no images in results")
        content = flatten_content(content or "", "")
    result = {"tool_call_id": message.get("tool_call_id"), "content": content}
    return {"role": "user", "content": json.dumps({"tool_result": result})}
