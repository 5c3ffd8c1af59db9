"""How each model family writes tool calls in a reply: the exact text (so a call re-rendered by
the template spells what was generated, and the next prompt keeps its tokens), and the parser
that reads them back, whole or as they stream (the grammar is in ``tool_grammar``).

Detected from the chat template: Hermes / Qwen (``<tool_call>{json}</tool_call>``), Llama 3.1
(``{"name", "parameters"}``, one call), Mistral (``[TOOL_CALLS][...]``, 9-character ids), Gemma 4
(``<|tool_call>call:name{key:value}<tool_call|>``, ``gemma4_calls``; the template writes a reply's
text after its calls, so only a reply that is all calls keeps its tokens), and a generic JSON
format (``{"tool_calls": [...]}``) for templates that know no tools, described to the model in the
system message (as llama-server's "generic" handler does); gpt-oss's harmony format
(``<|start|>assistant to=functions.NAME<|channel|>commentary json<|message|>ARGS<|call|>``, one call
a reply; the other spelling its models write is read as this one, ``harmony``).
"""

from __future__ import annotations

import copy
import itertools
import json
import secrets
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from llmsession.replies import ToolCallDelta
from llmsession.text.gemma4_calls import body_from_json, read_body
from llmsession.text.gemma4_tools import QUOTE
from llmsession.text.harmony import FINAL, START, TEMPLATE_HEADER, TO, Opening, canonical
from llmsession.text.tools import ToolCall, Tools

ALPHANUMERIC = string.ascii_letters + string.digits


@dataclass(frozen=True)
class ToolFormat:
    """A family's call syntax: ``open``, then calls (``head`` name ``mid`` arguments ``tail``)
    joined by ``separator``, then ``close``; ``before`` sits between text and the calls, and
    ``trigger`` (a prefix of ``open + head``) is what starts them."""

    name: str
    trigger: str
    open: str
    head: str
    mid: str
    tail: str
    separator: str
    close: str
    before: str = ""
    single: bool = False  # the family takes one call per reply
    ids: bool = False  # each call carries its id (``, "id": "..."`` before ``tail``)
    anchored: bool = False  # calls only open the reply (their trigger is plain text, as prose may be)
    markers: tuple[str, ...] = ()  # what a vocabulary may hold as special tokens
    syntax: str = "json"  # how arguments are written: JSON, or "gemma4" (``gemma4_calls``)
    harmony: bool = False  # call headers in either of gpt-oss's spellings (``harmony``)
    text_header: str = ""  # what opens a reply's text where it makes no call (gpt-oss's final channel)

    def never_calls(self, opening: str) -> bool:
        """Whether a reply that opens so makes no call (calls open it or not at all: ``anchored``)."""
        return self.anchored and not opening.startswith(self.trigger[: len(opening)])

    def call_text(self, call: ToolCall) -> str:
        ident = f', "id": "{call.id}"' if self.ids else ""
        arguments = body_from_json(call.arguments) if self.syntax == "gemma4" else call.arguments
        return f"{self.head}{call.name}{self.mid}{arguments}{ident}{self.tail}"

    def reply_text(self, content: str, calls: Sequence[ToolCall]) -> str:
        """The reply as generated: text, then its calls."""
        if not calls:
            return content
        joined = self.separator.join(self.call_text(call) for call in calls)
        return f"{content}{self.before if content else ''}{self.open}{joined}{self.close}"


HERMES = ToolFormat(
    "hermes",
    trigger="<tool_call>",
    open="<tool_call>\n",
    head='{"name": "',
    mid='", "arguments": ',
    tail="}",
    separator="\n</tool_call>\n<tool_call>\n",
    close="\n</tool_call>",
    before="\n",
    markers=("<tool_call>", "</tool_call>"),
)
LLAMA3 = ToolFormat(
    "llama3", trigger='{"name": "', open="", head='{"name": "', mid='", "parameters": ', tail="}",
    separator="", close="", single=True, anchored=True,
)  # fmt: skip
MISTRAL = ToolFormat(
    "mistral", trigger="[TOOL_CALLS]", open="[TOOL_CALLS][", head='{"name": "', mid='", "arguments": ',
    tail="}", separator=", ", close="]", ids=True, anchored=True, markers=("[TOOL_CALLS]",),
)  # fmt: skip
GENERIC = ToolFormat(
    "generic", trigger='{"tool_calls": [', open='{"tool_calls": [', head='{"name": "', mid='", "arguments": ',
    tail="}", separator=", ", close="]}", anchored=True,
)  # fmt: skip
GEMMA4 = ToolFormat(
    "gemma4", trigger="<|tool_call>", open="", head="<|tool_call>call:", mid="{", tail="}<tool_call|>",
    separator="", close="", syntax="gemma4",  # (the model ends with <|tool_response>, an end of generation)
    markers=("<|tool_call>", "<tool_call|>", QUOTE),
)  # fmt: skip
HARMONY = ToolFormat(
    "harmony", trigger=TO, open="", head=TO, mid=TEMPLATE_HEADER, tail="",
    separator="", close="", single=True, anchored=True, harmony=True,  # (<|call|> ends generation)
    markers=("<|start|>", "<|channel|>", "<|message|>"), text_header=FINAL,
)  # fmt: skip
FORMATS = {f.name: f for f in (HERMES, LLAMA3, MISTRAL, GEMMA4, HARMONY, GENERIC)}


def detect(template: str | None) -> ToolFormat:
    """The family's format from its chat template's markers; generic when it knows none."""
    if template is None:
        return GENERIC
    if f"{START} to=" in template and "<|call|>" in template:
        return HARMONY
    if "<|tool_call>call:" in template:
        return GEMMA4
    if "<tool_call>" in template and '"arguments": ' in template and "<function=" not in template:
        return HERMES  # (Qwen3-Coder's <tool_call><function=...> is another format)
    if "[TOOL_CALLS][" in template and "[ARGS]" not in template:
        return MISTRAL  # (newer Mistrals write [TOOL_CALLS]name[ARGS]{...})
    if "<|start_header_id|>" in template and '"parameters": ' in template:
        return LLAMA3
    return GENERIC


# -- reading calls back -----------------------------------------------------------------------------
def parse(text: str, fmt: ToolFormat, tools: Tools, ids: CallIds) -> tuple[str, list[ToolCall]]:
    """A reply split into its text and its calls (named by ``ids`` where the format writes
    none); ValueError if what follows the trigger is not calls of declared tools."""
    text = canonical(text) if fmt.harmony else text
    at = text.find(fmt.trigger)
    if at < 0 or tools.mode == "none" or (fmt.anchored and at > 0):
        return text, []
    content = text[:at]
    if fmt.before and content.endswith(fmt.before):
        content = content[: -len(fmt.before)]
    calls: list[ToolCall] = []
    pos = _expect(text, at, fmt.open)
    while True:
        pos = _expect(text, pos, fmt.head)
        end = text.find(fmt.mid, pos)
        name = text[pos:end] if end >= 0 else ""
        tool = tools.by_name(name)
        if tool is None or tool not in tools.callable:
            raise ValueError(f"the reply calls {name!r}, which is not a tool it may call")
        arguments, pos = read_arguments(fmt, text, end + len(fmt.mid))
        ident = ids(len(calls))
        if fmt.ids:
            pos = _expect(text, pos, ', "id": "')
            ident, pos = text[pos : pos + 9], _expect(text, pos + 9, '"')
        calls.append(ToolCall(ident, name, arguments))
        pos = _expect(text, pos, fmt.tail)
        if text.startswith(fmt.close, pos) and (
            fmt.single or not text.startswith(fmt.separator + fmt.head, pos)
        ):
            break
        pos = _expect(text, pos, fmt.separator)
    _expect(text, pos, fmt.close)
    return content, calls


def read_arguments(fmt: ToolFormat, text: str, pos: int) -> tuple[str, int]:
    """A call's arguments at ``pos`` as JSON text, and where they end; ValueError if none."""
    if fmt.syntax == "gemma4":
        return read_body(text, pos)
    try:
        _, stop = json.JSONDecoder().raw_decode(text, pos)
    except RecursionError:
        raise ValueError("a call's arguments are nested too deep to read") from None
    return text[pos:stop], stop


def _expect(text: str, pos: int, literal: str) -> int:
    if not text.startswith(literal, pos):
        raise ValueError(f"expected {literal!r} at {pos} of the reply's calls, got {text[pos : pos + 20]!r}")
    return pos + len(literal)


class CallIds:
    """The ids of a reply's calls, made as they are needed: 9 letters and digits (what Mistral's
    template requires), after ``call_`` where the format carries none."""

    def __init__(self, fmt: ToolFormat) -> None:
        self.prefix = "" if fmt.ids else "call_"
        self.made: list[str] = []

    def __call__(self, index: int) -> str:
        while len(self.made) <= index:
            self.made.append(self.prefix + "".join(secrets.choice(ALPHANUMERIC) for _ in range(9)))
        return self.made[index]


class CallStream:
    """A reply split as it streams: its text, held back only where it may begin the calls, and
    pieces of its calls as OpenAI streams them (a call's id and name, then its arguments).

    A reply makes each call once: a call identical to an earlier one (the same name, and
    arguments that read as the same JSON) ends the reply's calls before it (``cut``: where its
    separator begins; the exchange stops there, and the reply is read up to it). So that no
    stream shows a call the reply then drops, a call that names a tool called earlier in the
    reply is held back, id, name and arguments, until its arguments are whole: then it is
    either dropped, with the reply ended, or streamed at once. (Arguments that match an earlier
    call's so far may yet differ, and arguments written otherwise, keys in another order, may
    yet be the same: only whole arguments tell.) Calls of tools not called before stream piece
    by piece."""

    def __init__(self, fmt: ToolFormat, ids: CallIds) -> None:
        self.fmt, self.ids = fmt, ids
        self.raw, self.sent = "", 0  # the reply so far; how much of it went out as text
        self.calls_at = -1  # where its calls begin, once they do
        self.searched = 0  # where the trigger may begin, at the earliest (searched before it)
        self.plain = False  # the reply did not open with the calls of a format whose calls must
        self.arguments: list[int] = []  # per call announced: how much of its arguments went out
        self.cut = -1  # where a repeated call's separator begins: the reply's calls end there
        self.opening = Opening() if fmt.harmony else None  # (gpt-oss's header, as its template spells it)
        self.done: tuple[int, int, list[tuple[str, str]]] = (0, -1, [])  # whole calls: (count, where
        # the next begins, their names and arguments), read once (each push read them all again)

    def push(self, delta: str) -> tuple[str, tuple[ToolCallDelta, ...]]:
        """The text and the call pieces ``delta`` completes (none once the calls are ``cut``)."""
        if self.cut >= 0:
            return "", ()
        self.raw += delta if self.opening is None else self.opening.push(delta)
        trigger = self.fmt.trigger
        self.plain = self.plain or self.fmt.never_calls(self.raw)
        if self.plain:
            return self._text(len(self.raw)), ()
        if self.calls_at < 0:
            at = self.raw.find(trigger, self.searched)  # (not from the start: no square)
            self.searched = max(0, len(self.raw) - len(trigger) + 1) if at < 0 else self.searched
            if at < 0:
                held = max(
                    _held(self.raw, self.fmt.before + self.fmt.trigger), _held(self.raw, self.fmt.trigger)
                )
                return self._text(len(self.raw) - held), ()
            self.calls_at = at
            before = self.fmt.before
            return self._text(
                at - len(before) if before and self.raw[:at].endswith(before) else at
            ), self._calls()
        return "", self._calls()

    @property
    def begun(self) -> bool:
        """Whether the reply's calls have begun (what it writes from here on is theirs)."""
        return self.calls_at >= 0 and not self.plain

    def begins(self, delta: str) -> bool:
        """Whether the calls will have begun once ``delta`` is pushed (nothing is pushed)."""
        if self.begun or self.plain or self.cut >= 0:
            return self.begun
        probe = copy.deepcopy(self.opening)
        opened = delta if probe is None else probe.push(delta)
        if probe is not None and probe.names_a_tool:  # (gpt-oss's header, held until it is whole)
            return True
        raw = self.raw + opened
        return not self.fmt.never_calls(raw) and self.fmt.trigger in raw

    def may_open(self, before: str, rest: str) -> bool:
        """Whether the calls may yet begin at or before where ``rest`` begins, after
        ``before`` (both text not pushed yet): what follows some point up to there is the start
        of the opening (``before`` and the trigger, or the trigger), not yet all of it."""
        if self.plain or self.cut >= 0 or self.fmt.never_calls(self.raw + before + rest):
            return False
        for opening in {self.fmt.trigger, self.fmt.before + self.fmt.trigger}:
            text = (self.raw + before)[-len(opening) :] + rest
            start = len(text) - len(rest)
            earliest = max(0, len(text) - len(opening) + 1)
            if any(opening.startswith(text[at:]) for at in range(earliest, start + 1)):
                return True
        return False

    def flush(self) -> str:
        """The text held back, at the end of a reply that made no call."""
        if self.opening is not None:
            self.raw += self.opening.flush()
            if not self.plain and self.calls_at < 0 and self.raw.startswith(self.fmt.trigger):
                self.calls_at = 0  # (a call cut short: none of it is text)
        return self._text(len(self.raw)) if self.calls_at < 0 or self.plain else ""

    def _text(self, upto: int) -> str:
        out = self.raw[self.sent : upto]
        self.sent = max(self.sent, upto)
        return out

    def _calls(self) -> tuple[ToolCallDelta, ...]:
        """The pieces of calls written since the last step (read from the first call not whole
        at the last step: a call of 10,000 tokens before another was read again each token,
        15 ms of Python a token for Gemma 4's)."""
        fmt, raw, deltas = self.fmt, self.raw, []
        first, pos, made = self.done
        pos, made = (pos, list(made)) if first else (self.calls_at + len(fmt.open), [])
        for index in itertools.count(first):
            if not raw.startswith(fmt.head, pos) or (end := raw.find(fmt.mid, pos + len(fmt.head))) < 0:
                break
            name = raw[pos + len(fmt.head) : end]
            arguments, stop = _arguments_so_far(fmt, raw, end + len(fmt.mid))
            if index == len(self.arguments):  # not announced yet
                repeats = _repeats(name, arguments if stop >= 0 else None, made)
                if repeats is not False:  # held (None: it may yet repeat one), or a repeat
                    self.cut = pos - len(fmt.separator) if repeats else -1
                    break
                self.arguments.append(0)
                deltas.append(ToolCallDelta(index, self.ids(index), name))
            if len(arguments) > self.arguments[index]:
                deltas.append(ToolCallDelta(index, arguments=arguments[self.arguments[index] :]))
                self.arguments[index] = len(arguments)
            if stop < 0:
                break
            made.append((name, arguments))
            pos = stop + (len(', "id": "') + 10 if fmt.ids else 0) + len(fmt.tail)
            if not raw.startswith(fmt.separator, pos):
                break
            pos += len(fmt.separator)
            self.done = (index + 1, pos, list(made))  # (whole, and another begins: read once)
        return tuple(deltas)


def _repeats(name: str, arguments: str | None, made: Sequence[tuple[str, str]]) -> bool | None:
    """Whether a call repeats one of ``made`` (the same name, arguments the same JSON value);
    None while that cannot be told (its ``arguments`` not whole yet, and its tool called before)."""
    earlier = [before for called, before in made if called == name]
    if not earlier:
        return False
    if arguments is None:
        return None
    return any(_same_json(arguments, before) for before in earlier)


def _same_json(a: str, b: str) -> bool:
    """Whether two JSON texts hold the same value (keys in any order; ``1`` is not ``1.0``)."""
    try:
        return json.dumps(json.loads(a), sort_keys=True) == json.dumps(json.loads(b), sort_keys=True)
    except (ValueError, RecursionError):
        return a == b


def _arguments_so_far(fmt: ToolFormat, raw: str, start: int) -> tuple[str, int]:
    """A streaming call's arguments as JSON text so far, and where they end (-1 while they go
    on). JSON arguments stream as written; Gemma's come whole, once read (not tried before its
    tail is written: a reply looping inside a call was read again from its start each token, in
    Python, 64 s over 8,000 tokens)."""
    if fmt.syntax == "gemma4" and raw.find(fmt.tail, start) < 0:
        return "", -1
    try:
        return read_arguments(fmt, raw, start)
    except (ValueError, RecursionError):
        return ("" if fmt.syntax == "gemma4" else raw[start:]), -1


def _held(text: str, opening: str) -> int:
    """How many of ``text``'s last characters may begin ``opening`` (held back, not yet text)."""
    for size in range(min(len(text), len(opening)), 0, -1):
        if opening.startswith(text[-size:]):
            return size
    return 0


def said_text(message: Mapping[str, Any], fmt: ToolFormat) -> str | None:
    """What an assistant message's reply generated (its text, then its calls as ``fmt`` writes
    them): the text a recorded reply is found by, to splice its tokens. None for others."""
    if message.get("role") != "assistant":
        return None
    content = message.get("content")
    if message.get("tool_calls"):
        return fmt.reply_text(content if isinstance(content, str) else "", calls_of(message))
    return content if isinstance(content, str) else None


def stand_in(message: Mapping[str, Any], text: str) -> dict[str, Any]:
    """The assistant message with ``text`` for all it said (its calls dropped)."""
    return {**{k: v for k, v in message.items() if k != "tool_calls"}, "content": text}


def calls_of(message: Mapping[str, Any]) -> list[ToolCall]:
    """An assistant message's ``tool_calls`` (OpenAI's shape) as ``ToolCall``s."""
    calls = []
    for call in message.get("tool_calls") or ():
        function = call.get("function", {})
        arguments = function.get("arguments", "{}")
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        calls.append(ToolCall(str(call.get("id", "")), str(function.get("name", "")), arguments))
    return calls
