"""The llguidance grammar that holds a reply's tool calls to their tools' schemas.

A format's markers that the model's vocabulary holds as special tokens (Qwen's ``<tool_call>``,
Mistral's ``[TOOL_CALLS]``) are named by id (``<[id]>``): spelled as text, the model could only
write them byte by byte, which it never does.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence

from llmsession.text.ecma import masked
from llmsession.text.gemma4_calls import BodyGrammar
from llmsession.text.reasoning import BLANK, Markers
from llmsession.text.tool_formats import ToolFormat
from llmsession.text.tools import Tool, Tools

ARGUMENTS_LAYOUT = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
    "lenient": True,
}
"""Arguments are generated as ``json.dumps`` writes them: what templates' ``tojson`` renders."""


def _literal(text: str) -> str:
    return json.dumps(text)  # a lark string literal: JSON's escapes are lark's


def spelled(text: str, specials: Mapping[str, int]) -> str:
    """``text`` as a sequence of lark items: string literals, and ``<[id]>`` for each special
    token's spelling in it."""
    if not text:
        return ""
    if not specials:
        return _literal(text)
    pattern = "|".join(re.escape(m) for m in sorted(specials, key=len, reverse=True))
    items = []
    for i, piece in enumerate(re.split(f"({pattern})", text)):
        if i % 2:
            items.append(f"<[{specials[piece]}]>")
        elif piece:
            items.append(_literal(piece))
    return " ".join(items)


def _arguments(tool: Tool) -> str:
    """The mask of a call's arguments: an object (a schema without a ``type`` is checked as an
    object schema, and held to one here: else any JSON value would pass)."""
    schema = {**masked(dict(tool.parameters)), "type": "object", "x-guidance": ARGUMENTS_LAYOUT}
    return "%json " + json.dumps(schema)


def grammar(
    fmt: ToolFormat,
    tools: Tools,
    ids: Sequence[str] = (),
    specials: Mapping[str, int] | None = None,
    thought: Markers | None = None,
    *,
    after_block: bool = False,
    resume: str = "",
) -> str:
    """A Lark grammar for llguidance: the whole reply is calls ("required", "named"), or free
    text until ``fmt.trigger`` and calls from there on ("auto": the trigger is a lazy lexeme,
    so text costs no constraint until it appears). A format whose calls carry ids writes
    ``ids`` in order, one per call (so a stream names each call before its arguments).
    ``specials`` are the format's markers the vocabulary holds as special tokens, and their ids.
    ``thought``: reasoning markers the reply may open with, each beginning with a special token
    (in ``specials``: free text never spells them), so a thinking model reasons before it calls;
    ``after_block``: the grammar begins after a block the prompt opened. After a block, the
    blank line that follows it is no part of the reply (the reply's content is split from it
    without its leading whitespace), so an anchored format's text may not begin with whitespace:
    its calls are read only where they begin the content. ``resume``: what follows the block
    the prompt opened instead (gpt-oss: a new message's header, its calls or answer after it).

    How many calls: one where the family takes one, without ``parallel``, and for a named
    ``tool_choice`` (OpenAI's makes exactly one call of that function); else up to one per id.
    That a call does not repeat an earlier one (same name, same arguments) is no rule here: the
    grammar is fixed before the reply and cannot name what the reply generated, so the reply's
    stream ends it before such a call (``tool_formats.CallStream``)."""
    callable_tools, specials = tools.callable, specials or {}
    assert callable_tools, "a grammar needs a tool to call"
    one = fmt.single or not tools.parallel or tools.mode == "named"
    limit = 1 if one else len(ids)  # at most one call per id
    assert 1 <= limit <= len(ids), "a grammar needs an id per call"

    def say(text: str) -> str:
        return spelled(text, specials)

    lines = ["%llguidance {}"]
    gemma = BodyGrammar("gemma", say) if fmt.syntax == "gemma4" else None
    for i, tool in enumerate(callable_tools):
        arguments = _arguments(tool) if gemma is None else gemma.body(tool.parameters)
        lines.append(f"args_{i}: {say(tool.name + fmt.mid)} {arguments}")
    lines += gemma.lines() if gemma is not None else []
    names = " | ".join(f"args_{i}" for i in range(len(callable_tools)))
    rest = (fmt.open + fmt.head)[len(fmt.trigger) :]  # what follows the trigger, up to the name
    for k in range(limit):
        opening = rest if k == 0 else fmt.separator + fmt.head
        ident = say(f', "id": "{ids[k]}"') if fmt.ids else ""
        lines.append(f"call_{k}: {say(opening)} ({names}) {ident} {say(fmt.tail)}")
    chain = "call_0" + "".join(f" (call_{k}" for k in range(1, limit)) + ")?" * (limit - 1)  # c0 (c1 (c2)?)?
    lines.append(f"calls: {chain} {say(fmt.close)}")
    after = thought is not None or after_block
    return (
        "\n".join(
            lines + _start(thought, after_block, specials, resume) + _reply(fmt, tools.mode, specials, after)
        )
        + "\n"
    )


ANY_TEXT = r"/(.|\n)*/"  # (a Lark item: any text, no special token)


def answered(body: str, thought: Markers, specials: Mapping[str, int]) -> str:
    """A Lark grammar for a constrained answer (``body``, a Lark item such as ``%json {...}``)
    that a reply may reason before, where an answer opens with a header of its own (gpt-oss:
    its analysis channel, then its final channel's header, then the answer)."""
    assert thought.answer, "markers whose answer opens with a header"
    header = spelled(thought.answer, specials)
    return (
        "\n".join(
            [
                "%llguidance {}",
                *_start(thought, False, specials),
                f"reply: {header} answer",
                f"answer: {body}",
            ]
        )
        + "\n"
    )


_BLANK = "".join(json.dumps(c)[1:-1] for c in BLANK)  # (as a regex class's members)
GAP = f"GAP: /[{_BLANK}]{{0,4}}/"  # the blank line after a block (bounded: a small model may loop on it)


def _start(
    thought: Markers | None, after_block: bool, specials: Mapping[str, int], resume: str = ""
) -> list[str]:
    """What comes before the reply: nothing, the blank line after the block the prompt opened
    (or the new message's header, ``resume``, that follows it: a budget that closes the block
    forces the closing marker alone there, ``runtime.thinking``), or a block the reply may open
    (its text is anything but a special token, so the closing marker, one, ends it) and the
    blank line after it."""
    if thought is None:
        if after_block and begins_special(resume, specials):  # (its format's markup: gpt-oss's)
            return [f"start: {spelled(resume, specials)} reply"]
        return ["start: GAP reply", GAP] if after_block else ["start: reply"]
    assert begins_special(thought.open, specials) and begins_special(thought.close, specials), (
        "markers that begin with a special token"
    )
    block = f"thought: {spelled(thought.open, specials)} THOUGHT {spelled(thought.close, specials)}"
    closing = max((s for s in specials if thought.close.startswith(s)), key=len)  # (its special token)
    text = _text_without(closing, "THOUGHT")
    if thought.resume:  # (gpt-oss: a new message's header, no blank line)
        return ["start: thought? reply", f"{block} {spelled(thought.resume, specials)}", text]
    return ["start: (thought GAP)? reply", block, text, GAP]


def begins_special(marker: str, specials: Mapping[str, int]) -> bool:
    """Whether ``marker`` begins with a special token: free text cannot spell it (so a block's
    text ends at its closing marker)."""
    return any(marker.startswith(special) for special in specials)


def _text_without(marker: str, name: str = "TEXT") -> str:
    """Free text that never spells ``marker`` (a special token's text) in ordinary tokens: the
    reply's readers find calls and a block's end by their text, and a reply that wrote "wrap
    calls in <tool_call> tags" in prose had its stream cut there and ended in an error (no call
    parses); a thought that wrote "</think>" ended there for the reader, not the grammar."""
    return rf"{name}: /(.|\n)*/ & ~(/(.|\n)*/ {_literal(marker)} /(.|\n)*/)"


def _reply(fmt: ToolFormat, mode: str, specials: Mapping[str, int], after_block: bool) -> list[str]:
    """The reply's shape around its calls. A special-token trigger ends free text by itself
    (it is no text), so "auto" needs no lazy lexeme then. An anchored format's text may not
    begin as its calls do, nor, after a block, with whitespace (unless its trigger is a special
    token, which text never holds)."""
    trigger = spelled(fmt.trigger, specials)
    if mode != "auto":
        return [f"reply: {trigger} calls"]
    if fmt.text_header:  # (gpt-oss: text is a message of the final channel, calls are another)
        return [f"reply: {spelled(fmt.text_header, specials)} TEXT | {trigger} calls", r"TEXT: /(.|\n)*/"]
    if fmt.trigger in specials:  # (text never holds the trigger: whitespace may begin it)
        shape = f"TEXT | {trigger} calls" if fmt.anchored else f"TEXT ({trigger} calls)?"
        return [f"reply: {shape}", _text_without(fmt.trigger)]
    if fmt.anchored:  # text that does not open as the calls do, or calls
        shunned = "\\" + fmt.trigger[0] + (_BLANK if after_block else "")
        text = "TEXT: /([^" + shunned + "](.|\\n)*)?/"  # (its first character escaped)
        return [f"reply: TEXT | {trigger} calls", text]
    return ["reply: TEXT | trigger calls", r"TEXT: /(.|\n)*/", f"trigger[lazy]: TEXT {trigger}"]
